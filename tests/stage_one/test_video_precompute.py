"""Stage one with a video model (tiny-wan): videos from every kind of source become clips in the cache, each clip a
sample; an image is a one-frame clip; re-runs decode nothing unchanged; bad videos are counted failures; an image
model counts a video as one."""

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from precompute import folders, video
from precompute.run import main as precompute
from precompute.sample_video import BAD_VIDEOS, make_video, make_video_folder, write_bad
from shards import Bucket, Cache, verify

pytestmark = pytest.mark.model  # builds the tiny Wan VAE and umT5

RUN = dict(workers=0, progress=False, check_disk=False)


def run(data, cache, model="tiny-wan", **kw):
    return precompute(str(data), model, Path(cache), **{**RUN, **kw})


@pytest.fixture
def decodes(monkeypatch):
    """How many inputs the run decodes as videos (workers=0: in this process)."""
    calls = []
    real = video.read_clips

    def counting(data, *args, **kw):
        calls.append(len(data))
        return real(data, *args, **kw)

    monkeypatch.setattr(video, "read_clips", counting)
    return calls


def clips_of(cache) -> dict[str, set[tuple[int, int, int]]]:
    """input -> its cached clips as (index, first frame, frames)."""
    c, out = Cache(cache), {}
    for i in range(len(c)):
        s = c[i]
        out.setdefault(bytes(s["source"].tolist()).decode(), set()).add(tuple(s["clip"].tolist()))
    return out


def clips_by_source(cache) -> dict[str, set[tuple[int, int, int]]]:
    """source name -> its cached clips as (index, first frame, frames)."""
    c = Cache(cache)
    index = dict(c.keys())
    return {name: {tuple(c[index[key]]["clip"].tolist()) for key, *_ in c.manifest.samples(name)} for name in c.manifest.datasets()}


def video_folder(root: Path, count: int = 3) -> Path:
    make_video_folder(root, count=count, seconds=(1.2, 2.2))  # 24 fps: 19 to 35 frames at 16 fps
    Image.new("RGB", (96, 64), (200, 30, 30)).save(root / "still.png")
    (root / "still.txt").write_text("a red picture", encoding="utf-8")
    return root


def test_videos_and_an_image_become_clips_as_the_stock_encoders_encode_them(tmp_path):
    data = video_folder(tmp_path / "data")
    for seed in (5, 6):  # two more clips of one bucket: a batch of the VAE
        (data / f"same{seed}.txt").write_text(make_video(data / f"same{seed}.mp4", "shapes", 30, 24.0, (64, 64), seed=seed))
    summary = run(data, tmp_path / "cache", workers=2, batch_size=4, storage_dtype="fp32")
    assert summary["new"] == 6 and summary["failed"] == 0 and summary["buckets"]["17x64x64"] >= 2
    cache = Cache(tmp_path / "cache")
    assert verify(tmp_path / "cache").ok
    spec = cache.manifest.fingerprint["buckets"]["clips"]
    assert spec["frame_rate"] == 16.0 and spec["frame_buckets"] == [1, 17, 33, 49, 81]
    by_input = {}
    for i in range(len(cache)):
        s = cache[i]
        by_input[bytes(s["source"].tolist()).decode()] = s
        frames = s.bucket.frames
        assert s["latent_mean"].shape == (16, (frames - 1) // 4 + 1, s.bucket.height // 8, s.bucket.width // 8)
        assert tuple(s["clip"].tolist()) == (0, 0, frames)
    assert by_input["still.png"].bucket == Bucket(48, 80, 1)  # an image: a one-frame clip
    # a clip's latent is the VAE's of its frames fitted to the bucket as an image is, alone or in a batch of its bucket
    from precompute.encode import Encoders
    from precompute.presets import get_preset
    from precompute.video import ClipPolicy, fit_frames, read_clips

    enc = Encoders(get_preset("tiny-wan"), torch.device("cpu"))
    for name in ("00000.mp4", "00001.mp4", "00002.mp4", "same5.mp4", "same6.mp4"):
        s = by_input[name]
        clips, reason, _ = read_clips((data / name).read_bytes(), ClipPolicy(16.0, (1, 17, 33, 49, 81)), 10**9)
        assert reason is None and len(clips) == 1
        expected = enc.encode_videos(fit_frames(clips[0].frames, s.bucket.height, s.bucket.width)[None])
        for name in ("latent_mean", "latent_std"):
            torch.testing.assert_close(s[name], expected[name][0], rtol=0, atol=1e-5)


def test_each_extraction_mode_and_a_change_of_mode(tmp_path, decodes):
    """One 40-frame video (at 16 fps) in four sources, each cut its own way; then one source's mode changes."""
    for name in ("head", "uniform", "chunk", "full"):
        (tmp_path / name).mkdir()
        make_video(tmp_path / name / "v.mp4", "index", 40, 16.0, (64, 64))
        (tmp_path / name / "v.txt").write_text("frames counting up", encoding="utf-8")
    toml = tmp_path / "data.toml"

    def write(head_mode: str):
        toml.write_text(f'[[source]]\npath = "head"\n{head_mode}\nframes = 17\n'
                        '[[source]]\npath = "uniform"\nclip_extraction = "uniform"\nclips = 3\nframes = 17\n'
                        '[[source]]\npath = "chunk"\nclip_extraction = "chunk"\nframe_buckets = [1, 17]\n'
                        '[[source]]\npath = "full"\nclip_extraction = "full"\n', encoding="utf-8")

    write('clip_extraction = "head"')
    summary = run(toml, tmp_path / "cache", frame_buckets="1,17,33")
    assert summary["failed"] == 0 and summary["new"] == 1 + 3 + 2 + 1
    assert clips_by_source(tmp_path / "cache") == {"head": {(0, 0, 17)}, "uniform": {(0, 0, 17), (1, 11, 17), (2, 23, 17)},
                   "chunk": {(0, 0, 17), (1, 17, 17)}, "full": {(0, 0, 33)}}
    decodes.clear()
    write('clip_extraction = "uniform"\nclips = 2')  # the head source's videos are cut again; nothing else is read
    summary = run(toml, tmp_path / "cache", frame_buckets="1,17,33")
    assert summary["sources"]["head"]["changed"] == 2 and summary["sources"]["head"]["unchanged"] == 0
    assert summary["unchanged"] == 3 + 2 + 1 and summary["removed"] == 0 and len(decodes) == 1
    assert clips_by_source(tmp_path / "cache")["head"] == {(0, 0, 17), (1, 23, 17)}


def test_a_rerun_decodes_nothing_and_edits_touch_only_their_clips(tmp_path, decodes, monkeypatch):
    data = video_folder(tmp_path / "data")
    CUT = dict(clip_extraction="uniform", clips=2, frames=17)  # two clips of every video
    first = run(data, tmp_path / "cache", **CUT)
    before = clips_of(tmp_path / "cache")
    assert first["new"] == sum(map(len, before.values())) == 7
    decodes.clear()
    again = run(data, tmp_path / "cache", **CUT)
    assert again["unchanged"] == first["new"] and again["new"] + again["changed"] + again["removed"] == 0 and not decodes

    # touched, not changed: no video is decoded, and the next run reads no file at all
    os.utime(data / "00001.mp4", ns=(1, 1))
    assert run(data, tmp_path / "cache", **CUT)["unchanged"] == first["new"] and not decodes
    reads = []
    real_read = folders.read_folder_entry
    monkeypatch.setattr(folders, "read_folder_entry", lambda e: reads.append(e.source) or real_read(e))
    assert run(data, tmp_path / "cache", **CUT)["unchanged"] == first["new"] and not reads

    # an edited video: its clips alone are encoded again, the old ones replaced
    make_video(data / "00001.mp4", "shapes", 40, 24.0, (64, 64), seed=7)
    edited = run(data, tmp_path / "cache", **CUT)
    after = clips_of(tmp_path / "cache")
    assert edited["changed"] == len(after["00001.mp4"]) and edited["removed"] == 0 and reads == ["00001.mp4"]
    assert edited["unchanged"] == first["new"] - len(before["00001.mp4"]) and len(decodes) == 1
    # a removed video: every clip of it leaves the cache
    (data / "00002.mp4").unlink()
    removed = run(data, tmp_path / "cache", **CUT)
    assert removed["removed"] == len(after["00002.mp4"]) and "00002.mp4" not in clips_of(tmp_path / "cache")
    # a new caption: the video's clips are new samples whose latents are copied from its old clips, not encoded
    (data / "00000.txt").write_text("a new caption", encoding="utf-8")
    recaptioned = run(data, tmp_path / "cache", **CUT)
    assert recaptioned["changed"] == recaptioned["latents_reused"] == len(after["00000.mp4"]) == 2


def test_a_run_killed_between_an_inputs_clips_encodes_the_missing_ones(tmp_path, decodes):
    """Clips of one video land in different buckets' shards: a run that committed some of them leaves the input
    incomplete, which the next run finds by the clips' stamps and keys, and completes."""
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "v.mp4", "shapes", 60, 16.0, (64, 64))  # three clips of 33 frames, from frames 0, 13 and 27
    (data / "v.txt").write_text("a moving shape", encoding="utf-8")
    run(data, tmp_path / "cache", clip_extraction="uniform", clips=3, frames=33, max_shard_mb=0)
    keys = [k for k, _ in Cache(tmp_path / "cache").keys()]
    assert len(keys) == 3
    from shards import ShardWriter

    manifest = Cache(tmp_path / "cache").manifest
    with ShardWriter(tmp_path / "cache", manifest.fingerprint, manifest.schema, text_schema=manifest.text_schema) as w:
        w.remove({keys[1]})  # as if the run had died before that clip's shard was committed
    decodes.clear()
    summary = run(data, tmp_path / "cache", clip_extraction="uniform", clips=3, frames=33)
    assert len(decodes) == 1 and summary["new"] + summary["changed"] == 1 and summary["unchanged"] == 2
    assert sorted(k for k, _ in Cache(tmp_path / "cache").keys()) == sorted(keys)
    decodes.clear()
    assert run(data, tmp_path / "cache", clip_extraction="uniform", clips=3, frames=33)["unchanged"] == 3 and not decodes


def test_videos_from_a_metadata_file_a_tar_and_a_hugging_face_dataset(tmp_path, decodes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = tmp_path / "meta"
    (meta / "clips").mkdir(parents=True)
    captions = [make_video(meta / "clips" / f"{i}.mp4", "shapes", 30, 24.0, (64, 96), seed=i) for i in range(2)]
    (meta / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"clips/{i}.mp4", "text": c}) + "\n"
                                                 for i, c in enumerate(captions)), encoding="utf-8")
    (tmp_path / "tars").mkdir()
    with tarfile.open(tmp_path / "tars" / "data-0000.tar", "w") as tar:
        for i in range(2):
            make_video(tmp_path / f"t{i}.webm", "shapes", 30, 24.0, (64, 64), seed=10 + i)
            for name, blob in ((f"{i:04d}.webm", (tmp_path / f"t{i}.webm").read_bytes()), (f"{i:04d}.txt", b"a shape in a tar")):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    (tmp_path / "hf").mkdir()
    videos = []
    for i in range(2):
        make_video(tmp_path / f"h{i}.mp4", "shapes", 30, 24.0, (96, 64), seed=20 + i)
        videos.append((tmp_path / f"h{i}.mp4").read_bytes())
    pq.write_table(pa.table({"video": videos, "text": ["a shape in a dataset"] * 2}), tmp_path / "hf" / "train.parquet")
    toml = tmp_path / "data.toml"
    toml.write_text('[[source]]\npath = "meta"\n[[source]]\npath = "tars/data-0000.tar"\nname = "tars"\n'
                    '[[source]]\npath = "hf"\n', encoding="utf-8")
    summary = run(toml, tmp_path / "cache")
    assert summary["failed"] == 0 and {n: s["new"] for n, s in summary["sources"].items()} == {"meta": 2, "tars": 2, "hf": 2}
    assert all(b.startswith("17x") for b in summary["buckets"])
    assert set(clips_of(tmp_path / "cache")) == {"clips/0.mp4", "clips/1.mp4", "data-0000.tar/0000", "data-0000.tar/0001",
                                                 "train.parquet:0", "train.parquet:1"}
    decodes.clear()
    again = run(toml, tmp_path / "cache")  # a tar is read again, its videos not decoded: their clips' keys are known
    assert again["unchanged"] == 6 and not decodes


def test_every_bad_video_is_a_counted_failure(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "good.mp4", "shapes", 30, 24.0, (64, 64))
    for kind in BAD_VIDEOS:
        write_bad(data / f"{kind}.mp4", kind)
    for path in data.iterdir():
        path.with_suffix(".txt").write_text("a caption", encoding="utf-8")
    summary = run(data, tmp_path / "cache", frame_buckets="17,33", max_failure_fraction=1.0)
    failures = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    assert {f["source"]: f["reason"] for f in failures} == {f"{kind}.mp4": reason for kind, reason in BAD_VIDEOS.items()}
    assert summary["failed"] == len(BAD_VIDEOS) and summary["new"] == 1
    assert summary["failed_by_reason"] == {r: list(BAD_VIDEOS.values()).count(r) for r in set(BAD_VIDEOS.values())}
    # a decoder that takes too long, and frames over the pixel limit, in runs of their own
    only = tmp_path / "one"
    only.mkdir()
    shutil.copy(data / "good.mp4", only / "v.mp4")
    (only / "v.txt").write_text("a caption", encoding="utf-8")
    assert run(only, tmp_path / "c2", decode_timeout=1e-9)["failed_by_reason"] == {"decode_timeout": 1}
    assert run(only, tmp_path / "c3", max_pixels=1000)["failed_by_reason"] == {"too_many_pixels": 1}


def test_an_image_model_counts_a_video_as_a_named_failure(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.fromarray(np.full((256, 256, 3), 90, np.uint8)).save(data / "a.png")
    make_video(data / "b.mp4", "shapes", 20, 24.0, (64, 64))
    for stem in ("a", "b"):
        (data / f"{stem}.txt").write_text("a caption", encoding="utf-8")
    summary = run(data, tmp_path / "cache", "tiny-sana", max_failure_fraction=1.0)
    assert summary["new"] == 1 and summary["failed_by_reason"] == {"video_input": 1}
    (failure,) = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    assert failure["source"] == "b.mp4" and "tiny-wan" in failure["detail"]


def test_an_image_to_video_preset_caches_the_first_frame_fields(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    make_video(data / "v.mp4", "shapes", 30, 24.0, (64, 64))
    (data / "v.txt").write_text("a moving shape", encoding="utf-8")
    assert run(data, tmp_path / "cache", "tiny-wan-i2v")["new"] == 1
    s = Cache(tmp_path / "cache")[0]
    assert s.bucket == Bucket(64, 64, 17) and s["condition"].shape == (4 + 16, 5, 8, 8) and "image_embeds" in s.fields


def test_repair_re_encodes_the_clips_of_a_damaged_shard(tmp_path):
    data = tmp_path / "data"
    make_video_folder(data, count=2, seconds=(1.2, 1.5))
    cut = dict(clip_extraction="uniform", clips=2, frames=17, max_shard_mb=0)  # a shard per clip
    run(data, tmp_path / "cache", **cut)
    before = clips_of(tmp_path / "cache")
    shard = Cache(tmp_path / "cache").path(0)  # the first clip's shard
    shard.write_bytes(shard.read_bytes()[:-10])
    assert not verify(tmp_path / "cache").ok
    repaired = run(data, tmp_path / "cache", repair=True, **cut)
    assert repaired["repaired_shards"] == 1 and repaired["unrepairable"] == [] and verify(tmp_path / "cache").ok
    assert clips_of(tmp_path / "cache") == before
