"""A video shorter than the shortest clip a video gives is too_short with the default frame buckets (the one-frame
bucket is for still images), whatever the extraction, through `read_clips` and through stage one."""

import json
from pathlib import Path

import pytest
from PIL import Image

from precompute.run import main as precompute
from precompute.sample_video import make_video, write_bad
from precompute.video import ClipPolicy, read_clips

pytestmark = pytest.mark.model  # stage one builds the tiny Wan VAE and umT5

WAN = (1, 17, 33, 49, 81)


@pytest.mark.parametrize("extraction", ["head", "uniform", "chunk", "full"])
def test_a_too_short_video_is_too_short_with_the_one_frame_bucket(tmp_path, extraction):
    data = write_bad(tmp_path / "short.mp4", "too_short").read_bytes()  # 6 frames at 24 fps: 4 at 16 fps
    clips, reason, detail = read_clips(data, ClipPolicy(16.0, WAN, extraction=extraction), 10**8)
    assert (clips, reason) == ([], "too_short"), detail
    assert "shortest clip a video gives is 17 frames" in detail


def test_one_frame_is_the_only_bucket_still_takes_a_videos_first_frame(tmp_path):
    data = write_bad(tmp_path / "short.mp4", "too_short").read_bytes()
    clips, reason, _ = read_clips(data, ClipPolicy(16.0, (1,)), 10**8)
    assert reason is None and [c.frames.shape[0] for c in clips] == [1]


def test_stage_one_counts_a_too_short_video_with_the_default_buckets(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "good.mp4", "shapes", 30, 24.0, (64, 64))
    write_bad(data / "short.mp4", "too_short")
    Image.new("RGB", (64, 64), (200, 30, 30)).save(data / "still.png")  # an image: a one-frame clip all the same
    for stem in ("good", "short", "still"):
        (data / f"{stem}.txt").write_text("a caption", encoding="utf-8")
    summary = precompute(str(data), "tiny-wan", Path(tmp_path / "cache"), workers=0, progress=False, check_disk=False,
                         max_failure_fraction=1.0)
    assert summary["new"] == 2 and summary["failed_by_reason"] == {"too_short": 1}
    (failure,) = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    assert failure["source"] == "short.mp4" and failure["reason"] == "too_short"


def test_a_clip_cache_bound_by_decoding_is_told_of_clips_and_one_of_reused_latents_is_told_nothing(tmp_path, capsys):
    from collections import Counter

    from precompute.report import BOUND_ADVICE, CLIP_ADVICE, report

    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "v.mp4", "shapes", 30, 24.0, (64, 64))
    (data / "v.txt").write_text("a moving shape", encoding="utf-8")
    cache = tmp_path / "cache"
    precompute(str(data), "tiny-wan", cache, workers=0, progress=False, check_disk=False)
    capsys.readouterr()
    shares = {"encoder_s": 0.4, "encoder_busy_fraction": 0.4, "data_wait_fraction": 0.55, "writer_wait_fraction": 0.01,
              "writer_busy_fraction": 0.01}
    summary = report(cache, Counter(new=4), [], 10.0, 9.0, None, shares)
    err = capsys.readouterr().err
    assert summary["bound_by"] == "decoding" and f"  {CLIP_ADVICE['decoding']}\n" in err
    assert "decoded clips" in err and "photos a second" not in err and BOUND_ADVICE["decoding"] != CLIP_ADVICE["decoding"]
    summary = report(cache, Counter(changed=4, latents_reused=3), [], 10.0, 9.0, None, shares)
    err = capsys.readouterr().err
    assert summary["bound_by"] is None and "raise --workers" not in err
    assert "no bound to tell: 3 of the 4 samples encoded took their cached latents" in err


RUN = dict(workers=0, progress=False, check_disk=False, frame_buckets="1,17")


def uniform_cache(tmp_path):
    """A folder of one 40-frame video (two 17-frame clips at 16 fps) cached with uniform, 2 clips: (folder, cache)."""
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "v.mp4", "shapes", 60, 24.0, (64, 64))
    (data / "v.txt").write_text("a moving shape", encoding="utf-8")
    cache = tmp_path / "cache"
    assert precompute(str(data), "tiny-wan", cache, clip_extraction="uniform", clips=2, **RUN)["new"] == 2
    return data, cache


def test_a_plain_rerun_keeps_the_clips_the_cache_records_and_an_explicit_mode_cuts_again(tmp_path, capsys):
    data, cache = uniform_cache(tmp_path)
    capsys.readouterr()
    summary = precompute(str(data), "tiny-wan", cache, **RUN)
    assert (summary["unchanged"], summary["changed"], summary["cache_samples"]) == (2, 0, 2)
    assert ("source 'data' keeps the settings the cache records for it, which this run does not give: "
            "--clip-extraction uniform --clips 2 (to change them, give them; to drop them, --clip-extraction head)"
            ) in capsys.readouterr().err
    summary = precompute(str(data), "tiny-wan", cache, clip_extraction="head", **RUN)
    assert summary["changed"] == 1 and summary["cache_samples"] == 1
    assert ("warning: source 'data': its 2 cached clips were cut with clip_extraction = 'uniform', clips = 2; this "
            "run's options say otherwise (clip_extraction = 'head')") in capsys.readouterr().err


def test_a_dataset_file_that_drops_a_sources_clip_choice_warns_before_cutting_again(tmp_path, capsys):
    data, cache = uniform_cache(tmp_path)
    toml = tmp_path / "data.toml"
    toml.write_text(f'[[source]]\npath = "{data}"\n', encoding="utf-8")
    capsys.readouterr()
    summary = precompute(str(toml), "tiny-wan", cache, **RUN)
    assert summary["cache_samples"] == 1
    err = capsys.readouterr().err
    assert "warning: source 'data': its 2 cached clips were cut with clip_extraction = 'uniform', clips = 2" in err
    assert f"its [[source]] in {toml} says otherwise (clip_extraction = 'head')" in err
