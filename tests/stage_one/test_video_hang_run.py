"""Stage one with a loader's worker whose decoder hangs inside a call on one video: that video is the named failure
`decode_timeout` in failures.jsonl, the others are cached, the run ends, and no helper process is left behind."""

import json
import os
import threading
from pathlib import Path

import pytest

from precompute.run import main as precompute
from precompute.sample_video import make_video, write_bad
from precompute.video_readers import AVReader
from shards import Cache

pytestmark = pytest.mark.model  # builds the tiny Wan VAE and umT5


def children() -> set[int]:
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.add(int(pid))
        except (OSError, IndexError):
            continue
    return out


def test_a_worker_whose_decoder_hangs_on_one_video_finishes_the_run(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "fine.mp4", "shapes", 48, 24.0, (64, 96))
    make_video(data / "hangs.mp4", "shapes", 48, 24.0, (64, 64))
    for name in ("fine", "hangs"):
        (data / f"{name}.txt").write_text(f"a {name} video", encoding="utf-8")
    real = AVReader.to_rgb
    pids = tmp_path / "helpers"

    def to_rgb(reader, frame):
        with open(pids, "a") as f:  # which processes decoded
            f.write(f"{os.getpid()}\n")
        if frame.width == frame.height:  # the square video: blocks inside the call, for good
            threading.Event().wait()
        return real(reader, frame)

    monkeypatch.setattr(AVReader, "to_rgb", to_rgb)  # in the worker and its helper, which fork from this process
    before = children()
    summary = precompute(str(data), "tiny-wan", tmp_path / "cache", workers=1, progress=False, check_disk=False,
                         frame_buckets="17,33", decode_timeout=1.0, max_failure_fraction=1.0)
    failures = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    assert [(f["source"], f["reason"]) for f in failures] == [("hangs.mp4", "decode_timeout")]
    assert "killed" in failures[0]["detail"]
    assert summary["failed_by_reason"] == {"decode_timeout": 1} and summary["new"] == 1
    assert len(Cache(tmp_path / "cache")) == 1
    assert children() == before  # the worker is gone, and reaped
    helpers = {int(line) for line in pids.read_text().split()}
    assert helpers and os.getpid() not in helpers  # decoded in helper processes
    assert not [pid for pid in helpers if Path(f"/proc/{pid}").exists()]  # ended, and reaped


def test_the_failure_share_counts_videos_not_clips(tmp_path):
    """One video of two fails: half the inputs, whatever number of clips the other gives (here four)."""
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "long.mp4", "shapes", 108, 24.0, (64, 96))  # 72 frames at 16 fps: four chunks of 17
    write_bad(data / "bad.mp4", "garbage")
    for name in ("long", "bad"):
        (data / f"{name}.txt").write_text("a video", encoding="utf-8")
    run = dict(workers=0, progress=False, check_disk=False, frame_buckets="17", clip_extraction="chunk", max_failure_fraction=1.0)
    summary = precompute(str(data), "tiny-wan", tmp_path / "cache", **run)
    assert summary["new"] == 4 and summary["failed"] == 1 and summary["failure_fraction"] == 0.5
    again = precompute(str(data), "tiny-wan", tmp_path / "cache", **run)  # its clips unchanged: still half
    assert again["unchanged"] == 4 and again["failure_fraction"] == 0.5
