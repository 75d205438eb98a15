"""A folder's video is read where it lies: hashed in chunks for its keys (the same keys as its bytes held whole give)
and decoded from the file, so a head clip of a large file holds a little of it in memory, in the caller and in the
decoding process, never the whole file."""

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from precompute import video, video_helper
from precompute.clips import prepare_clips
from precompute.folders import list_folder, read_folder_entry
from precompute.images import ImagePolicy, Record, prepare
from precompute.sample_video import make_video
from precompute.video import ClipPolicy
from shards import Bucket

MiB = 1 << 20
POLICY = ImagePolicy(buckets=(Bucket(64, 96), Bucket(64, 64)), max_upscale=2.0, allow_upscale=False,
                     extreme_aspect="clamp", max_pixels=10**8, clip=ClipPolicy(16.0, (1, 17, 33), "uniform", 2))


def items(record: Record) -> list[dict]:
    return list(prepare_clips(record, POLICY, frozenset()))


def test_a_folder_video_is_named_not_read_and_keeps_the_keys_of_its_bytes(tmp_path):
    make_video(tmp_path / "v.mp4", "shapes", 96, 24.0, (64, 96))
    (tmp_path / "v.txt").write_text("a moving shape", encoding="utf-8")
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "empty.txt").write_text("nothing", encoding="utf-8")
    entries = {e.source: e for e in list_folder(tmp_path).entries}
    record = read_folder_entry(entries["v.mp4"])
    assert record.image is None and record.path == str(tmp_path / "v.mp4") and record.video
    from_file = items(record)
    held = items(Record("v.mp4", (tmp_path / "v.mp4").read_bytes(), ["a moving shape"], video=True))  # as a tar's
    assert [it["status"] for it in from_file] == ["ok", "ok"]
    for a, b in zip(from_file, held):
        assert (a["key"], a["latent_key"], a["clip"], a["bucket"]) == (b["key"], b["latent_key"], b["clip"], b["bucket"])
        assert np.array_equal(a["pixels"].numpy(), b["pixels"].numpy())
    # an empty one, and one given to an image model, are what they were
    assert items(read_folder_entry(entries["empty.mp4"]))[0]["reason"] == "empty_file"
    image_policy = ImagePolicy(buckets=(Bucket(64, 96),), max_upscale=2.0, allow_upscale=False, extreme_aspect="clamp",
                               max_pixels=10**8)
    assert prepare(record, image_policy)["reason"] == "video_input"
    assert prepare(read_folder_entry(entries["empty.mp4"]), image_policy)["reason"] == "empty_file"


def test_a_file_that_vanishes_or_changes_while_read_is_a_named_failure(tmp_path, monkeypatch):
    make_video(tmp_path / "v.mp4", "shapes", 96, 24.0, (64, 96))
    record = Record("v.mp4", None, ["a caption"], video=True, path=str(tmp_path / "v.mp4"))
    real = video_helper.read_clips

    def edited_meanwhile(data, *args, **kw):
        out = real(data, *args, **kw)
        with open(tmp_path / "v.mp4", "ab") as f:  # appended to while its clips were decoded
            f.write(b"\0" * 10)
        return out

    monkeypatch.setattr(video_helper, "read_clips", edited_meanwhile)
    (failed,) = items(record)
    assert failed["reason"] == "unreadable" and "changed while it was read" in failed["detail"]
    (tmp_path / "v.mp4").unlink()
    (missing,) = items(record)
    assert missing["reason"] == "missing_file"


def rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak(record: Record, warm: bytes) -> tuple[int, int, list[dict]]:
    """(peak bytes this process allocated, the decoding process's peak resident growth, the items) of reading a
    record's clips, after the helper read `warm` (its decoder's code is paged in)."""
    video.read_clips(warm, POLICY.clip, 10**8, {})
    helper = video_helper._local.helper.pid
    Path(f"/proc/{helper}/clear_refs").write_text("5")  # its peak resident size starts again from here
    resident = rss(helper, "VmRSS")
    tracemalloc.start()
    try:
        got = items(record)
        ours = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return ours, rss(helper, "VmHWM") - resident, got


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak resident size is read from Linux's /proc")
def test_a_head_clip_of_a_large_file_holds_a_little_of_it(tmp_path):
    """A 4 s video followed by 192 MiB (sparse: the file is large, not the disk it takes): its head clip is read from
    its first seconds, the rest is only hashed, a MiB at a time. Read as bytes (as before), it is held whole."""
    path = tmp_path / "long.mp4"
    make_video(path, "shapes", 96, 24.0, (64, 96), faststart=True)
    warm = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(192 * MiB)
    video_helper.stop()
    try:
        ours, theirs, got = peak(Record("long.mp4", None, ["a caption"], video=True, path=str(path)), warm)
        assert [it["status"] for it in got] == ["ok", "ok"] and got[0]["clip"] == (0, 0, 33)
        print(f"file read where it lies: this process peak {ours / MiB:.1f} MiB, decoding process {theirs / MiB:.1f} MiB")
        assert ours < 8 * MiB and theirs < 24 * MiB, (ours, theirs)
        # the measure sees a file held whole: its bytes, in this process and in the decoding one
        ours, theirs, got = peak(Record("long.mp4", path.read_bytes(), ["a caption"], video=True), warm)
        assert [it["status"] for it in got] == ["ok", "ok"]
        print(f"bytes held whole: decoding process {theirs / MiB:.1f} MiB")
        assert theirs > 192 * MiB
    finally:
        video_helper.stop()
