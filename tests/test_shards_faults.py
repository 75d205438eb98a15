"""Faults of the cache's own files: a commit lost from the middle of the log, damaged commits and snapshots,
symbolic links out of the cache, a read-only cache, a missing shard, and verify beside a running writer. Each
stops with a message naming the file and what to do; nothing is deleted on the way."""

import builtins
import errno
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import FINGERPRINT, SCHEMA, make_sample, write_cache
from typer.testing import CliRunner

import shards
from shards import Cache, FormatError, ShardWriter, gc, open_cache, verify
from shards.cli import app


class _NeverRaised(Exception):
    pass


DamagedCache = getattr(shards, "DamagedCache", _NeverRaised)  # the error of a damaged cache file (stage two exits 3)
HERE = Path(__file__).resolve().parent
REPAIR_HINT = "Re-encode the damaged samples"  # the start of the shard repair the reader recommends


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (not following links) and its bytes, lock files aside."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and not p.name.startswith(".lock")}


def commit_path(root: Path, generation: int) -> Path:
    return root / "_log" / f"{generation:012d}.json"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_a_commit_missing_mid_log_is_damage_and_nothing_is_deleted(tmp_path):
    root = tmp_path / "cache"
    write_cache(root, range(12), max_shard_samples=1)  # one shard and one commit per sample: generations 0..11
    lost = commit_path(root, 5)
    backup = lost.read_bytes()
    lost.unlink()
    before = files(root)
    for open_it in (lambda: Cache(root), lambda: Cache(root, generation=2), lambda: open_cache(f"file://{root}")):
        with pytest.raises(DamagedCache, match=r"000000000005\.json is missing, but 6 later commit\(s\) are there "
                                               r"\(000000000006\.json.* 000000000011\.json\).*backup"):
            open_it()
    with pytest.raises(DamagedCache, match="000000000005.json is missing"):
        ShardWriter(root, FINGERPRINT, SCHEMA)  # would delete the shards of commits 5..11 as never committed
    with pytest.raises(DamagedCache, match="000000000005.json is missing"):
        gc(root)
    assert files(root) == before  # nothing deleted, nothing re-published under the names the later commits list
    report = verify(root)
    assert not report.ok and report.bad_files == [str(lost)]
    for command in ("verify", "ls", "inspect", "gc"):
        result = cli(command, root)
        assert result.exit_code == 1 and str(lost) in result.output, (command, result.output)
        assert isinstance(result.exception, SystemExit) and REPAIR_HINT not in result.output
    assert files(root) == before
    lost.write_bytes(backup)  # restored from a backup: the cache is whole again
    assert len(Cache(root)) == 12 and verify(root).ok


def test_a_commit_missing_before_the_newest_snapshot_is_reported(tmp_path, monkeypatch):
    import shards.manifest as m

    monkeypatch.setattr(m, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    assert m.snapshots(tmp_path)[-1] == 11
    commit_path(tmp_path, 5).unlink()
    assert len(Cache(tmp_path)) == 12  # the newest generation comes from its snapshot
    report = verify(tmp_path)  # generations 5..10 cannot be read any more
    assert report.bad_files == [str(commit_path(tmp_path, 5))] and "backup" in report.problems[0][1]


def flip_in_snapshot(path: Path, tensor: str) -> None:
    """Flip one byte of a tensor of a snapshot, as a bad disk would: the file still opens."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    raw[8 + n + begin] ^= 0x01
    path.write_bytes(bytes(raw))


SNAPSHOT_TENSOR = {"flipped digest": "shards.sha256", "flipped size": "shards.bytes",  # the shard table
                   "flipped sample index": "samples.shard", "flipped key": "samples.key"}  # the sample index


@pytest.mark.parametrize("damage", [*SNAPSHOT_TENSOR, "truncated"])
def test_a_damaged_snapshot_is_named_and_healthy_shards_are_not_blamed(tmp_path, monkeypatch, damage):
    import shards.manifest as m

    monkeypatch.setattr(m, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    newest = tmp_path / "_snapshots" / "000000000011.safetensors"
    expected = [k for k, _ in Cache(tmp_path).keys()]
    if damage == "truncated":
        os.truncate(newest, newest.stat().st_size - 40)
    else:
        flip_in_snapshot(newest, SNAPSHOT_TENSOR[damage])
    before = files(tmp_path)
    report = verify(tmp_path)
    assert report.bad_files == [str(newest)]
    assert "restore it from a backup" in report.problems[0][1].lower() and REPAIR_HINT not in report.problems[0][1]
    in_index = SNAPSHOT_TENSOR.get(damage, "").startswith("samples.")
    if in_index:  # opening the cache does not read the sample index: what reads it finds the damage
        assert len(Cache(tmp_path)) == 12
    uses = [lambda: list(Cache(tmp_path).keys()), lambda: Cache(tmp_path).manifest.by_source(),
            lambda: ShardWriter(tmp_path, FINGERPRINT, SCHEMA), lambda: gc(tmp_path)]
    for use in uses if in_index else [lambda: Cache(tmp_path), *uses]:
        with pytest.raises(DamagedCache, match=r"000000000011\.safetensors is damaged.*move it out of the cache"):
            use()
    assert files(tmp_path) == before  # gc and the writer deleted nothing: the log is the way back
    for command in ("verify", "ls") if in_index else ("verify", "ls", "inspect"):
        result = cli(command, tmp_path)
        assert result.exit_code == 1 and str(newest) in result.output, (command, result.output)
        assert isinstance(result.exception, SystemExit) and REPAIR_HINT not in result.output
    newest.rename(tmp_path.parent / "aside.safetensors")  # what the message offers: the log replays it exactly
    assert [k for k, _ in Cache(tmp_path).keys()] == expected and verify(tmp_path).ok


def test_opening_a_cache_does_not_read_its_sample_index(tmp_path, monkeypatch):
    """At 10M samples the sample index is most of a snapshot's gigabytes: opening hashes the shard table alone, and
    the index is checked where it is read."""
    import hashlib
    import re

    import shards.manifest as m

    monkeypatch.setattr(m, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    assert m.snapshots(tmp_path)[-1] == 11  # the newest generation is its snapshot alone, no commit after it
    hashed, real = [], hashlib.sha256

    class Spy:
        def __init__(self, data=b"", **kwargs):
            self.h = real(**kwargs)
            self.update(data)

        def update(self, data):
            hashed.append(bytes(data))
            self.h.update(data)

        def __getattr__(self, name):
            return getattr(self.h, name)

    monkeypatch.setattr(hashlib, "sha256", Spy)
    keys_tensor = re.compile(rb"key\d{5}key\d{5}")  # the snapshot's samples.key bytes: keys back to back
    cache = Cache(tmp_path)
    assert len(cache) == 12 and hashed  # the shard table is checked
    assert not [chunk for chunk in hashed if keys_tensor.search(chunk)]
    assert len(list(cache.keys())) == 12
    assert [chunk for chunk in hashed if keys_tensor.search(chunk)]  # checked when read


@pytest.mark.parametrize("damage", ["truncated", "flipped digest"])
def test_a_damaged_commit_is_a_damaged_cache_naming_the_commit(tmp_path, damage):
    write_cache(tmp_path, range(6), max_shard_samples=1)
    last = commit_path(tmp_path, 5)
    text = last.read_text()
    if damage == "truncated":
        last.write_text(text[: len(text) // 2])
    else:  # still valid JSON: the shard's listed sha256 differs in one digit
        commit = json.loads(text)
        digest = commit["add"][0]["sha256"]
        last.write_text(text.replace(digest, ("1" if digest[0] == "0" else "0") + digest[1:]))
    for open_it in (lambda: Cache(tmp_path), lambda: ShardWriter(tmp_path, FINGERPRINT, SCHEMA), lambda: gc(tmp_path)):
        with pytest.raises(DamagedCache, match=r"000000000005\.json is damaged.*backup"):
            open_it()
    report = verify(tmp_path)
    assert report.bad_files == [str(last)] and REPAIR_HINT not in report.problems[0][1]
    result = cli("verify", tmp_path)
    assert result.exit_code == 1 and f"BAD {last}" in result.output


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


def test_ls_on_a_missing_shard_names_it_and_the_repair(tmp_path):
    manifest = write_cache(tmp_path, range(6), max_shard_samples=2)
    missing = tmp_path / manifest.shards[1].path
    missing.unlink()
    result = cli("ls", tmp_path)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{missing} is listed" in result.output and "--repair" in result.output


# A writer that stops twice (at its first shard) and says so: with a shard's temp file written (before its rename), and with the shard
# renamed but not committed yet (before the link of its commit); a line on stdin lets it go on.
WRITER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from conftest import FINGERPRINT, SCHEMA, make_sample
    import shards.atomic
    from shards import ShardWriter

    real_publish, real_link = shards.atomic.publish, os.link
    paused = set()

    def pause(what):
        if what not in paused:
            paused.add(what)
            print(what, flush=True)
            sys.stdin.readline()

    def publish(tmp, path):
        if Path(path).suffix == ".safetensors":
            pause("temp")
        real_publish(tmp, path)

    def link(tmp, path, **kwargs):
        if Path(path).parent.name == "_log":
            pause("uncommitted")
        real_link(tmp, path, **kwargs)

    shards.atomic.publish, os.link = publish, link
    with ShardWriter(sys.argv[1], FINGERPRINT, SCHEMA, max_shard_samples=2) as w:
        for i in range(6, 8):
            w.write(*make_sample(i))
    print("done", flush=True)
    """
)


def test_verify_beside_a_running_writer_finds_no_damage(tmp_path):
    write_cache(tmp_path, range(6), max_shard_samples=2)
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for moment in ("temp", "uncommitted"):
            assert child.stdout.readline().strip() == moment, child.stderr.read()
            if moment == "temp":
                assert list(tmp_path.glob("*/.r00000-*.tmp"))
            report = verify(tmp_path)
            assert report.ok and report.problems == [], (moment, report.problems)
            result = cli("verify", tmp_path)
            assert result.exit_code == 0 and "BAD" not in result.output, result.output
            child.stdin.write("go\n")
            child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
    finally:
        child.stdin.close()
        child.wait(timeout=120)
    assert child.returncode == 0 and verify(tmp_path).ok and len(Cache(tmp_path)) == 8


def test_a_writer_refuses_a_log_whose_first_commit_is_lost(tmp_path):
    write_cache(tmp_path, range(6), max_shard_samples=1)
    commit_path(tmp_path, 0).unlink()
    before = files(tmp_path)
    with pytest.raises((DamagedCache, FileNotFoundError, FormatError)) as caught:
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    assert isinstance(caught.value, DamagedCache) and "000000000000.json is missing" in str(caught.value)
    assert files(tmp_path) == before


def test_a_snapshot_of_an_empty_cache_loads(tmp_path, monkeypatch):
    import shards.manifest as m

    monkeypatch.setattr(m, "COMPACT_MIN", 1)  # a snapshot after every commit
    write_cache(tmp_path, range(3))
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove({"key00000", "key00001", "key00002"}) == 3
    assert m.snapshots(tmp_path)[-1] == Cache(tmp_path).generation and len(Cache(tmp_path)) == 0
    assert verify(tmp_path).ok


def test_a_remote_cache_evicts_nothing_through_a_symbolic_link(tmp_path):
    bucket, local, outside = tmp_path / "bucket", tmp_path / "local", tmp_path / "outside"
    write_cache(bucket, range(6), max_shard_samples=1)
    outside.mkdir()
    victim = outside / "r00000-000000.safetensors"
    victim.write_bytes(b"not the cache's" * 1000)
    os.utime(victim, (1, 1))  # the least recently used of all
    local.mkdir()
    (local / "96x96").symlink_to(outside, target_is_directory=True)
    remote = open_cache(f"file://{bucket}", local_dir=local, limit_bytes=1)  # evicts all it may after each fetch
    for j in range(len(remote.shards)):
        remote.fetch(j)
    assert victim.exists() and (local / "96x96").is_symlink()


def test_a_log_whose_end_was_lost_is_refused_when_the_pointer_says_so(tmp_path, monkeypatch):
    import shards.manifest as m

    monkeypatch.setattr(m, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    assert m.snapshots(tmp_path)[-1] == json.loads((tmp_path / "index.json").read_text())["snapshot_generation"] == 11
    for g in (10, 11):  # the newest commits and the snapshot index.json names are lost
        commit_path(tmp_path, g).unlink()
    (tmp_path / "_snapshots" / "000000000011.safetensors").unlink()
    before = files(tmp_path)
    with pytest.raises(DamagedCache, match=r"names snapshot .*000000000011\.safetensors, but the log and snapshots end at "
                                           r"generation 9"):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)  # would delete the shards of commits 10 and 11 as never committed
    assert files(tmp_path) == before and not verify(tmp_path).ok


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


def test_an_index_json_that_is_not_utf8_is_a_format_error_naming_it(tmp_path):
    write_cache(tmp_path, range(1))
    pointer = tmp_path / "index.json"
    data = bytearray(pointer.read_bytes())
    data[20] = 0xE9
    pointer.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"index\.json is not valid JSON.*the log under _log/ is the truth"):
        Cache(tmp_path)


@pytest.mark.parametrize("tensor", ["text.offsets", "__key__.offsets", "__key__", "__digest__", "latent_mean"])
def test_a_shard_whose_header_renames_a_tensor_is_a_corrupt_sample_naming_it(tmp_path, tensor):
    manifest = write_cache(tmp_path, range(1))
    shard = tmp_path / manifest.shards[0].path
    data = shard.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    quoted = f'"{tensor}"'.encode()
    assert data.count(quoted, 0, header) == 1
    shard.write_bytes(data.replace(quoted, quoted[:-2] + b'X"', 1))  # same length: only the name changes
    with pytest.raises(shards.CorruptSample, match=rf"{re.escape(str(shard))}.*{re.escape(repr(tensor))} is missing.*--repair"):
        Cache(tmp_path, check_digests=True)[0]


def _cache_with_prompts(root: Path):
    from shards import Prompt, prompt_key

    with ShardWriter(root, FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(1))
        w.add_prompts({prompt_key(t): Prompt(t, {"text": make_sample(i + 3)[2]["text"]}) for i, t in enumerate(["", "a cat"])},
                      {"text": SCHEMA["text"]})
    return root / w.manifest.files["prompts"]["path"]


def test_a_damaged_prompts_file_is_refused_naming_it_and_how_to_rebuild_it(tmp_path):
    path = _cache_with_prompts(tmp_path)
    good = path.read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")
    for at in (len(good) - 1, 12, header - 40):  # a stored embedding, the header's JSON, a tensor name or offset
        path.write_bytes(good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1:])
        with pytest.raises(DamagedCache, match=rf"{re.escape(str(path))} does not match the size and sha256.*"
                                               rf"python -m precompute prompts {re.escape(str(tmp_path))} --prompt"):
            Cache(tmp_path).prompts()
    path.write_bytes(good)
    assert sorted(p.text for p in Cache(tmp_path).prompts().values()) == ["", "a cat"]


def test_a_prompts_file_damaged_past_reading_is_a_format_error_naming_it(tmp_path):
    from shards.prompts import read_prompts

    path = _cache_with_prompts(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"__prompt__"', b'"__prompt_X"', 1))
    with pytest.raises(FormatError, match=re.escape(str(path))):
        read_prompts(path)


def test_gc_refuses_when_the_snapshot_kept_for_a_run_is_lost(tmp_path, monkeypatch):
    from shards import register_reader

    monkeypatch.setattr(shards.manifest, "COMPACT_MIN", 3)
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


def test_prompts_read_once_stay_as_checked_when_the_file_changes_later(tmp_path):
    path = _cache_with_prompts(tmp_path)
    before = {k: p.fields["text"].clone() for k, p in Cache(tmp_path).prompts().items()}
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    path.write_bytes(data[:header] + bytes(len(data) - header))  # in place: a map of the file would see it
    after = Cache(tmp_path).prompts()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k].fields["text"]) for k in before)


def test_a_snapshot_whose_replaced_map_cannot_be_read_is_named(tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    monkeypatch.setattr(shards.manifest, "COMPACT_MIN", 3)
    write_cache(tmp_path, range(8), max_shard_samples=1)  # a commit a shard, snapshots every few
    path = max((tmp_path / "_snapshots").glob("*.safetensors"))  # an older generation reads its repairs here
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    del meta["replaced"]  # as a flipped byte in its name would leave it; its digest (whose name may be hit too) gone
    meta.pop("sha256", None)
    save_file(tensors, path, meta)
    with pytest.raises(DamagedCache, match=re.escape(str(path))):
        Cache(tmp_path, generation=0)



def test_a_commit_written_while_the_log_is_listed_is_read_not_taken_for_a_gap(tmp_path, monkeypatch):
    write_cache(tmp_path, range(4), max_shard_samples=1)  # a commit a shard
    log = tmp_path / "_log"
    held = {p.name: p.read_bytes() for p in sorted(log.glob("*.json"))[2:]}
    for name in held:
        (log / name).unlink()
    real = shards.manifest.read_commit

    def racing(path):  # a writer commits the rest right after a reader found the next commit missing
        commit = real(path)
        if commit is None and held:
            for name, data in held.items():
                (log / name).write_bytes(data)
            held.clear()
        return commit

    monkeypatch.setattr(shards.manifest, "read_commit", racing)
    assert sorted(k for k, _ in Cache(tmp_path).keys()) == [f"key{i:05d}" for i in range(4)]
