"""What is lost when things go wrong around the cache: re-runs over missing or broken inputs, removals while
a run trains, damaged shards, two writers, resumed metrics, checkpoint durability."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from precompute.removal import RemovalRefused
from precompute.run import main as precompute
from precompute.sample_data import make_folder, make_tars
from shards import Cache, CacheLock, CorruptSample, gc, verify
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.loop import train

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


def run(data, cache, **kw):
    return precompute(str(data), "tiny-sana", Path(cache), workers=0, progress=False, **kw)


def cli(*args, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300, **kw)


def cfg(cache, run_dir, **kw):
    base = dict(model="tiny-sana", cache=cache, run=run_dir, steps=2, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=1000, caption_dropout=0.0, lr=1e-3, validate=False)
    return TrainConfig(**{**base, **kw})


def keys(cache) -> list[str]:
    return sorted(k for k, _ in Cache(cache).keys())


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Eight images and their cache, copied by each test that changes them."""
    root = tmp_path_factory.mktemp("built")
    data = make_folder(root / "data", count=8)
    run(data, root / "cache")
    return data, root / "cache"


@pytest.fixture
def copy(built, tmp_path):
    data, cache = built
    shutil.copytree(data, tmp_path / "data")
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "data", tmp_path / "cache"


def test_an_empty_or_unmounted_folder_removes_nothing(copy, tmp_path):
    data, cache = copy
    before = keys(cache)
    empty = tmp_path / "mnt" / data.name  # the same source, its mount gone: an empty mount point
    empty.mkdir(parents=True)
    with pytest.raises(RemovalRefused, match="lists no input.*--allow-removal"):
        run(empty, cache)
    assert keys(cache) == before
    other = tmp_path / "other"  # another (empty) source: the cache's source is not in its scope
    other.mkdir()
    assert run(other, cache)["other_sources"] == {data.name: 8} and keys(cache) == before
    out = cli("-m", "precompute", str(empty), "--model", "tiny-sana", "--cache", str(cache), "--workers", "0", "--no-progress")
    assert out.returncode == 4 and "lists no input" in out.stderr and keys(cache) == before
    for p in list(data.glob("0000[0-5].*")):  # 6 of 8 gone: over the default share
        p.unlink()
    with pytest.raises(RemovalRefused, match="6 of the 8 cached samples of source 'data' are no longer in DATA"):
        run(data, cache)
    assert keys(cache) == before
    assert run(data, cache, allow_removal=True)["removed"] == 6 and len(keys(cache)) == 2


def test_inputs_that_fail_to_read_are_kept_and_gone_ones_removed(copy):
    data, cache = copy
    (data / "00001.png").write_bytes(b"not a png any more")  # changed, and its new content does not decode
    (data / "00002.png").unlink()  # gone
    (data / "00002.txt").unlink()
    s = run(data, cache, max_removal_fraction=1.0)
    assert s["failed_by_reason"] == {"not_an_image": 1}
    assert (s["removed"], s["kept_unreadable"], s["unchanged"]) == (1, 1, 6)
    assert len(keys(cache)) == 7  # the unreadable input's sample is still there


def test_a_partial_tar_download_removes_nothing(tmp_path):
    tars = make_tars(tmp_path / "tars", count=24, per_tar=8)
    run(tmp_path / "tars", tmp_path / "cache")
    before = keys(tmp_path / "cache")
    data = tars[1].read_bytes()
    tars[1].write_bytes(data[: len(data) // 2 + 100])  # cut inside a member, as an interrupted download
    s = run(tmp_path / "tars", tmp_path / "cache")
    assert s["failed_by_reason"] == {"corrupt_tar": 1} and s["removed"] == 0
    assert keys(tmp_path / "cache") == before


def test_a_tar_cut_between_members_removes_nothing(tmp_path):
    """tarfile reads a tar cut at a member boundary as complete: its last samples would look deleted."""
    import tarfile

    tars = make_tars(tmp_path / "tars", count=24, per_tar=8)
    run(tmp_path / "tars", tmp_path / "cache")
    before = keys(tmp_path / "cache")
    with tarfile.open(tars[2]) as tar:
        cut = tar.getmembers()[8].offset  # the header of the fifth sample's first member
    tars[2].write_bytes(tars[2].read_bytes()[:cut])
    s = run(tmp_path / "tars", tmp_path / "cache")
    assert s["failed_by_reason"] == {"corrupt_tar": 1} and s["removed"] == 0
    assert keys(tmp_path / "cache") == before


def test_a_run_keeps_reading_its_generation_and_resumes_after_a_removal(copy, tmp_path):
    data, cache = copy
    straight = tmp_path / "straight"
    train(cfg(cache, straight, steps=2))
    resumed = tmp_path / "resumed"
    train(cfg(cache, resumed, steps=1, checkpoint_every=1))
    for p in data.glob("00003.*"):  # the user deletes an image and re-runs stage one mid-epoch
        p.unlink()
    assert run(data, cache)["removed"] == 1
    assert gc(cache).generations  # the run's checkpoint still needs the old generation: nothing of it goes
    train(cfg(cache, resumed, steps=2))
    assert losses(resumed) == pytest.approx(losses(straight), rel=1e-6)  # exactly the batches it would have seen
    state = json.loads((complete_checkpoints(resumed)[-1] / "state.json").read_text())
    assert state["cache_generation"] < Cache(cache).generation and state["cache_root"] == str(cache.resolve())


def test_a_missing_shard_stops_training_before_step_one(copy, tmp_path):
    _, cache = copy
    victim = cache / Cache(cache).shards[0].path
    victim.unlink()
    out = cli("-m", "train", "--model", "tiny-sana", "--cache", str(cache), "--run-dir", str(tmp_path / "run"), "--steps", "2",
              "--no-validate", "--no-progress")
    assert out.returncode == 3, out.stderr[-2000:]
    assert str(victim) in out.stderr and "missing" in out.stderr and "--repair" in out.stderr
    assert not complete_checkpoints(tmp_path / "run")


def flip_byte(shard: Path, field: str) -> None:
    """Change one byte in the middle of `field`'s first sample, as a bad disk or a bad copy would."""
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[field]["data_offsets"]
    at = 8 + n + begin + 1  # the high byte of the first bf16 value
    raw[at] ^= 0x01  # an exponent bit: the value is 4x larger or smaller
    shard.write_bytes(bytes(raw))


def digests(cache) -> dict[str, bytes]:
    c = Cache(cache)
    return {k: c.shard(c.locate(i)[0]).digest(c.locate(i)[1]) for k, i in c.keys()}


def test_a_flipped_byte_stops_training_after_a_checkpoint_and_repair_resumes_it(copy, tmp_path):
    data, cache = copy
    intact = digests(cache)
    train(cfg(cache, tmp_path / "straight", steps=4))
    shard = cache / Cache(cache).shards[0].path
    flip_byte(shard, "latent")
    assert train(cfg(cache, tmp_path / "unchecked", steps=2, check_digests=False))["step"] == 2  # told not to check
    with pytest.raises(CorruptSample, match=f"{shard}.*--repair"):
        train(cfg(cache, tmp_path / "run", steps=4))
    assert complete_checkpoints(tmp_path / "run")  # the run stopped where a resume picks it up
    assert not verify(cache).ok
    s = run(data, cache, repair=True)
    assert (s["repaired_shards"], s["unrepairable"]) == (1, [])
    assert verify(cache).ok and digests(cache) == intact
    train(cfg(cache, tmp_path / "run", steps=4))
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "straight"), rel=1e-6)


def test_repair_restores_a_missing_shard(copy):
    data, cache = copy
    intact = digests(cache)
    (cache / Cache(cache).shards[-1].path).unlink()
    assert not verify(cache).ok
    plain = cli("-m", "precompute", str(data), "--model", "tiny-sana", "--cache", str(cache), "--workers", "0", "--no-progress")
    assert plain.returncode == 0 and "1 shard(s)" in plain.stderr and "missing or truncated" in plain.stderr and "--repair" in plain.stderr
    out = cli("-m", "precompute", str(data), "--model", "tiny-sana", "--cache", str(cache), "--workers", "0", "--no-progress",
              "--repair")
    assert out.returncode == 0 and "repaired 1 of 1 damaged shard(s)" in out.stderr, out.stderr[-2000:]
    assert verify(cache).ok and digests(cache) == intact


def test_a_second_writer_gets_its_own_exit_code(copy):
    data, cache = copy
    lock = CacheLock(cache)
    try:
        out = cli("-m", "precompute", str(data), "--model", "tiny-sana", "--cache", str(cache), "--workers", "0", "--no-progress")
    finally:
        lock.release()
    assert out.returncode == 3 and "is being written by pid" in out.stderr and "Traceback" not in out.stderr


def test_resumed_metrics_restart_at_the_checkpoint(copy, tmp_path):
    _, cache = copy
    run_dir = tmp_path / "run"
    train(cfg(cache, run_dir, steps=4, checkpoint_every=2))
    shutil.rmtree(complete_checkpoints(run_dir)[-1])  # killed after logging steps 3 and 4, before their checkpoint
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # and a line torn by the kill
    train(cfg(cache, run_dir, steps=5, checkpoint_every=2))
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert steps == [1, 2, 3, 4, 5]


def test_every_checkpoint_file_is_on_disk_before_it_is_marked_complete(copy, tmp_path, monkeypatch):
    _, cache = copy
    synced, real = [], os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, any(Path(p).name == "COMPLETE" for p, _ in synced)))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    train(cfg(cache, tmp_path / "run", steps=1))
    ckpt = complete_checkpoints(tmp_path / "run")[-1]
    before_marker = {Path(p).name for p, marked in synced if not marked and ".tmp-step" in p}
    files = {p.name for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE"}
    assert files and files <= before_marker, files - before_marker


def test_a_foreign_fingerprint_is_a_message_not_a_traceback(tmp_path):
    from conftest import SCHEMA, make_sample

    from shards import ShardWriter

    with ShardWriter(tmp_path / "cache", {"made_by": "someone else"}, SCHEMA) as w:
        w.write(*make_sample(0, (256, 256)))
    out = cli("-m", "train", "--model", "tiny-sana", "--cache", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run"),
              "--steps", "1", "--no-validate", "--no-progress")
    assert out.returncode == 2 and "fingerprint has no vae, text_encoder" in out.stderr and "Traceback" not in out.stderr


def test_a_full_disk_names_the_path_and_what_is_kept(tmp_path, monkeypatch):
    import errno

    from conftest import FINGERPRINT, SCHEMA, make_sample

    import precompute.report
    import shards.shard_files
    from precompute.report import check_disk_space
    from shards import ShardWriter

    monkeypatch.setattr(precompute.report.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 20, 9 << 20, 1 << 20))
    with pytest.raises(OSError, match=r"needs about 3\.0 MiB more at .* but 1\.0 MiB are free"):  # not "0.0 GiB"
        check_disk_space(tmp_path, 3 << 20)
    monkeypatch.undo()
    with ShardWriter(tmp_path / "cache", FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(0))

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards.shard_files, "atomic_write_bytes", full)
    w = ShardWriter(tmp_path / "cache", FINGERPRINT, SCHEMA)
    w.write(*make_sample(1))
    with pytest.raises(OSError, match=f"no space left on the device of {tmp_path / 'cache'}/.*everything committed so far is kept"):
        w.finish()
    w.close()
    monkeypatch.undo()
    assert keys(tmp_path / "cache") == ["key00000"]


def test_a_file_name_that_is_not_utf8_is_cached_like_any_other(copy):
    data, cache = copy
    raw = os.fsencode(data)
    os.rename(os.path.join(raw, b"00004.png"), os.path.join(raw, b"caf\xe9.png"))
    os.rename(os.path.join(raw, b"00004.txt"), os.path.join(raw, b"caf\xe9.txt"))
    s = run(data, cache)
    assert s["failed"] == 0 and s["unchanged"] == 8 and len(keys(cache)) == 8  # same content: the same sample
    shutil.rmtree(cache)
    s = run(data, cache)
    assert s["new"] == 8 and verify(cache).ok
    assert "caf\udce9.png" in {source for _, source, *_ in Cache(cache).manifest.samples()}
