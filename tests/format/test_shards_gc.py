"""gc: what it keeps for registered runs and their checkpoints, what it deletes, and where it stops: beside a
writer, on a read-only cache, at a symbolic link, at a damaged run registration or a lost snapshot a run needs."""

import builtins
import errno
import io
import json
import os
import re
from pathlib import Path

import pytest
from conftest import FINGERPRINT, SCHEMA, make_sample, write_cache
from shards_testing import cli, files

import shards
from shards import Cache, DamagedCache, FormatError, ShardWriter, gc, verify
from shards.log import snapshots


def test_gc_keeps_what_a_resumable_run_needs(tmp_path):
    from shards import gc, register_reader

    write_cache(tmp_path / "cache", range(12), max_shard_samples=4)
    cache = tmp_path / "cache"
    run = tmp_path / "run"
    generation = Cache(cache).generation
    keys = [k for k, _ in Cache(cache).keys()]  # in shard order: 0, 3, 6, 9, 1, 4, ...
    register_reader(cache, run, generation)
    ckpt = run / "checkpoints" / "step-00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 10, "cache_generation": generation}))
    (ckpt / "COMPLETE").write_text("ok\n")
    with ShardWriter(cache, FINGERPRINT, SCHEMA) as w:
        w.remove({"key00000"})
    assert gc(cache).generations == [generation]
    old = Cache(cache, generation=generation)
    assert [old[i].key for i in range(len(old))] == keys
    (ckpt / "COMPLETE").unlink()  # no resumable checkpoint recorded that generation any more
    import shutil

    shutil.rmtree(run)
    report = gc(cache)
    assert report.generations == [] and report.stale_readers and verify(cache).retired == 0


def test_gc_keeps_every_needed_generation_in_one_replay_and_the_log_loads_after_it(tmp_path, monkeypatch):
    import importlib
    import shutil

    from shards import gc, register_reader

    gc_module = importlib.import_module("shards.gc")  # `shards.gc` is the function

    root = tmp_path / "cache"
    write_cache(root, range(12), max_shard_samples=3)
    runs = {name: tmp_path / name for name in ("a", "b")}
    generations = {}
    for name, key in (("a", "key00000"), ("b", "key00001")):
        generations[name] = Cache(root).generation
        runs[name].mkdir()
        register_reader(root, runs[name], generations[name])  # an epoch in progress, no checkpoint yet
        with ShardWriter(root, FINGERPRINT, SCHEMA) as w:
            w.remove({key})
    expected = {name: [k for k, _ in Cache(root, generation=g).keys()] for name, g in generations.items()}
    loads = []
    real = gc_module.load
    monkeypatch.setattr(gc_module, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    assert gc(root).generations == sorted(generations.values())
    assert len(loads) == 2  # the newest and the oldest needed generation; the others are replayed from it
    for name, g in generations.items():
        reader = Cache(root, generation=g)
        assert [reader[i].key for i in range(len(reader))] == expected[name]

    shutil.rmtree(runs["a"])
    assert gc(root).generations == [generations["b"]]  # run a is gone, and so is its generation
    assert not (root / "_log" / "000000000000.json").exists()  # the log before the oldest generation needed too
    with pytest.raises(FormatError, match="no generation"):
        Cache(root, generation=generations["a"])
    register_reader(root, runs["b"], generations["a"])  # a registration of a generation collected already...
    assert gc(root).generations == []  # ...keeps nothing, and gc does not fail on it
    write_cache(root, range(12, 15))  # the log goes on from the snapshot
    assert len(Cache(root)) == 12 - 2 + 3 and verify(root).ok


def test_gc_and_writers_exclude_each_other(tmp_path):
    from typer.testing import CliRunner

    from shards import CacheBusy, gc
    from shards.cli import app
    from shards.gc import exclusive

    write_cache(tmp_path, range(3))
    w = ShardWriter(tmp_path, FINGERPRINT, SCHEMA, rank=3)  # a writer between two commits
    w.write(*make_sample(3))
    w.flush()
    with pytest.raises(CacheBusy, match="a writer is writing"):
        gc(tmp_path)
    result = CliRunner().invoke(app, ["gc", str(tmp_path)])
    assert result.exit_code == 3 and "writer" in result.output
    w.finish()
    locks = exclusive(tmp_path)  # gc at work: no writer starts
    with pytest.raises(CacheBusy, match="gc"):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    for lock in locks:
        lock.release()
    assert CliRunner().invoke(app, ["gc", str(tmp_path)]).exit_code == 0 and len(Cache(tmp_path)) == 4


def test_gc_after_compactions_keeps_a_checkpointed_generation_loadable(tmp_path, monkeypatch):
    import shards.generations
    from shards import gc, register_reader

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)
    cache, run = tmp_path / "cache", tmp_path / "run"
    with ShardWriter(cache, FINGERPRINT, SCHEMA, max_shard_samples=1) as w:
        for i in range(21):
            w.write(*make_sample(i))
    assert len(snapshots(cache)) == 3  # the oldest and the two newest, none at the checkpointed generation
    register_reader(cache, run, 9)
    ckpt = run / "checkpoints" / "step-00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 10, "cache_generation": 9, "cache_root": str(cache.resolve())}))
    (ckpt / "COMPLETE").write_text("ok\n")
    assert gc(cache).generations == [9]
    assert [Cache(cache, generation=9)[i].key for i in range(10)] == [f"key{i:05d}" for i in range(10)]
    assert len(Cache(cache)) == 21


def test_gc_and_writers_never_delete_through_a_symbolic_link(tmp_path):
    root, outside = tmp_path / "cache", tmp_path / "outside"
    write_cache(root, range(6), max_shard_samples=2)
    outside.mkdir()
    names = ["r00000-000000.safetensors", "r00000-000099.safetensors", ".r00000-000007.safetensors.123.tmp", ".x.1.tmp",
             "prompts-0123456789abcdef.safetensors"]
    for name in names:
        (outside / name).write_bytes(b"not the cache's")
    (root / "96x96").symlink_to(outside, target_is_directory=True)  # a folder named like a bucket
    (root / "elsewhere").symlink_to(outside, target_is_directory=True)
    (root / "64x64" / "r00000-000042.safetensors").symlink_to(outside / "r00000-000099.safetensors")
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=2) as w:  # clears its rank's leftovers at the start
        for i in range(6, 9):
            w.write(*make_sample(i))
        assert w.remove({"key00000"}) == 1  # retires a shard: gc deletes it
    report = gc(root)
    assert report.deleted and not [p for p in report.deleted if "96x96" in p or "elsewhere" in p or "000042" in p]
    assert sorted(p.name for p in outside.iterdir()) == sorted(names)
    assert (root / "64x64" / "r00000-000042.safetensors").is_symlink()
    assert {"96x96", "elsewhere", "64x64/r00000-000042.safetensors"} <= set(getattr(report, "links", []))
    result = cli("gc", root)
    assert result.exit_code == 0 and "96x96 is a symbolic link" in result.output
    assert sorted(p.name for p in outside.iterdir()) == sorted(names) and len(Cache(root)) == 8


@pytest.fixture
def read_only(monkeypatch):
    """Make the folders under a root read-only, as `chmod a-w` does for their owner: no file is created, renamed,
    linked or deleted there; files already there open for writing (a lock file the user owns)."""

    def apply(root: Path):
        top = str(root.resolve())

        def inside(path) -> bool:
            return isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)).startswith(top)

        def deny(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))

        real_open, real_os_open = builtins.open, os.open

        def fake_open(file, mode="r", *args, **kwargs):
            if inside(file) and any(c in mode for c in "wax+") and not os.path.exists(file):
                deny(file)
            return real_open(file, mode, *args, **kwargs)

        def fake_os_open(path, flags, *args, **kwargs):
            if inside(path) and flags & os.O_CREAT and not os.path.exists(path):
                deny(path)
            return real_os_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(os, "open", fake_os_open)
        real_access = os.access

        def fake_access(path, mode, *args, **kwargs):  # what it answers a user who is not root
            return False if inside(path) and mode & os.W_OK else real_access(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", fake_access)
        for name in ("unlink", "remove", "rename", "replace", "link", "mkdir", "rmdir"):
            def fake(src, *args, _real=getattr(os, name), **kwargs):
                if inside(src) or (args and inside(args[0])):
                    deny(src)
                return _real(src, *args, **kwargs)

            monkeypatch.setattr(os, name, fake)

    return apply


@pytest.mark.parametrize("lock_file", [False, True], ids=["no lock file", "a run's lock file"])
def test_gc_on_a_read_only_cache_names_it_and_deletes_nothing(tmp_path, read_only, lock_file):
    write_cache(tmp_path, range(6), max_shard_samples=2)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.remove({"key00000"})  # a retired shard for gc to delete
    if lock_file:
        (tmp_path / ".lock").touch()
    before = files(tmp_path)
    read_only(tmp_path)
    result = cli("gc", tmp_path)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Permission denied" in result.output and str(tmp_path) in result.output and "nothing was deleted" in result.output
    assert files(tmp_path) == before
    dry = cli("gc", tmp_path, "--dry-run")  # reading needs no write: the dry run still says what would go
    assert dry.exit_code == (0 if lock_file else 2) and files(tmp_path) == before


@pytest.mark.parametrize("damage", ["not JSON", "no run", "no generation", "checkpoint not JSON"])
def test_gc_refuses_a_damaged_run_registration_naming_it(tmp_path, damage):
    root, run = tmp_path / "cache", tmp_path / "run"
    write_cache(root, range(6), max_shard_samples=2)
    with ShardWriter(root, FINGERPRINT, SCHEMA) as w:
        w.remove({"key00000"})  # a retired shard: gc would delete it unless a run still reads generation 2
    run.mkdir()
    shards.register_reader(root, run, 2)
    (registered,) = (root / "_readers").glob("*.json")
    bad = registered
    if damage == "checkpoint not JSON":
        bad = run / "checkpoints" / "step-1" / "state.json"
        bad.parent.mkdir(parents=True)
        bad.write_text('{"cache_generation": 2')
        (bad.parent / "COMPLETE").touch()
    else:
        reg = json.loads(registered.read_text())
        reg.pop({"no run": "run", "no generation": "generation"}.get(damage, "time"))
        registered.write_text(json.dumps(reg)[: -1 if damage == "not JSON" else None])
    before = files(tmp_path)
    with pytest.raises(DamagedCache, match=re.escape(str(bad))):
        gc(root)
    result = cli("gc", root)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert str(bad) in result.output and "deletes nothing" in result.output
    if bad == registered:
        assert "delete " + str(bad) in result.output and not verify(root).ok and str(bad) in verify(root).bad_files
    assert files(tmp_path) == before
    bad.unlink()  # the run is gone: gc goes on
    assert gc(root).deleted


def test_gc_refuses_when_the_snapshot_kept_for_a_run_is_lost(tmp_path, monkeypatch):
    from shards import register_reader

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 3)
    root, run = tmp_path / "cache", tmp_path / "run"
    run.mkdir()
    write_cache(root, range(2), max_shard_samples=1)  # generations 0, 1
    register_reader(root, run, 1)
    with ShardWriter(root, FINGERPRINT, SCHEMA) as w:
        w.remove({"key00001"})
    write_cache(root, range(2, 7), max_shard_samples=1)
    gc(root)  # keeps snapshot 1 for the run, collects the log before it
    snapshot = root / "_snapshots" / "000000000001.safetensors"
    kept = snapshot.read_bytes()
    snapshot.unlink()
    before = files(root)
    with pytest.raises(DamagedCache, match=rf"{re.escape(str(snapshot))} is missing.*Restore 000000000001\.safetensors"):
        gc(root)
    assert files(root) == before  # nothing deleted: the commits after generation 1 and its shards are all there
    with pytest.raises(DamagedCache, match=rf"{re.escape(str(snapshot))} is missing"):  # lost, not collected
        Cache(root, generation=1)
    snapshot.write_bytes(kept)
    assert [s.key for s in Cache(root, generation=1)] == ["key00000", "key00001"]


def test_gc_creates_no_file_to_learn_it_may_write(tmp_path, monkeypatch):
    write_cache(tmp_path, range(6), max_shard_samples=2)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.remove({"key00000"})
    created = []
    real_os_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            created.append(os.fsdecode(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    gc(tmp_path)  # a gc killed after such a file was made would leave it for verify to report
    assert not [p for p in created if ".gc-" in p]


def test_verify_takes_a_probe_file_of_an_interrupted_gc_for_a_harmless_leftover(tmp_path):
    manifest = write_cache(tmp_path, range(2))
    probe = (tmp_path / manifest.shards[0].path).parent / ".gc-k2j4x9.tmp"
    probe.touch()
    report = verify(tmp_path)
    assert report.ok and [w for p, w in report.warnings if p == str(probe) and "the next `python -m shards gc`" in w]
    gc(tmp_path)
    assert not probe.exists()
