"""A cache of clips: buckets with a frame count, kept through commits, snapshots, readers and `shards inspect`; a
cache of images writes what it always wrote."""

import json

import torch
from conftest import FINGERPRINT

from shards import Bucket, Cache, Field, LatentSpec, ShardWriter, verify

SCHEMA = {"latent_mean": Field(torch.float16), "latent_std": Field(torch.float16)}


def clip_sample(i: int, frames: int) -> tuple[str, Bucket, dict]:
    t = (frames - 1) // 4 + 1  # latent frames of a 4x temporal VAE
    g = torch.Generator().manual_seed(i)
    latent = torch.randn(4, t, 2, 3, generator=g).half()
    return f"clip{i:03d}", Bucket(16, 24, frames), {"latent_mean": latent, "latent_std": latent.abs()}


def test_clip_buckets_of_one_size_are_buckets_of_their_own_through_commits_and_snapshots(tmp_path, monkeypatch):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)  # a snapshot is written, the table read back from it
    samples = [clip_sample(i, frames) for i, frames in enumerate([1, 17, 33, 17, 1, 33, 17, 1, 17, 33])]
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=1) as w:
        for key, bucket, fields in samples:
            w.write(key, bucket, fields)
    for cache in (Cache(tmp_path),):
        assert set(cache.manifest.buckets()) == {Bucket(16, 24, 1), Bucket(16, 24, 17), Bucket(16, 24, 33)}
        assert {b: sum(len(r) for r in rs) for b, rs in cache.ranges_by_bucket().items()} == {
            Bucket(16, 24, 1): 3, Bucket(16, 24, 17): 4, Bucket(16, 24, 33): 3}
        by_key = dict(cache.keys())
        for key, bucket, fields in samples:
            i = by_key[key]
            assert cache.bucket_of(i) == bucket and torch.equal(cache[i]["latent_mean"], fields["latent_mean"])
        assert {s.bucket.name for s in cache.shards} == {"1x16x24", "17x16x24", "33x16x24"}
        assert {p.parent.name for p in tmp_path.glob("*/*.safetensors") if not p.parent.name.startswith("_")} >= {
            "1x16x24", "17x16x24", "33x16x24"}
    assert verify(tmp_path).ok
    # the log lists a clip's bucket with its frames
    commits = [json.loads(p.read_text()) for p in sorted((tmp_path / "_log").glob("*.json"))]
    assert [a["bucket"] for c in commits for a in c.get("add", [])][:2] == [[16, 24, 1], [16, 24, 17]]


def test_an_image_cache_lists_buckets_and_snapshots_without_frames(tmp_path):
    from conftest import write_cache

    write_cache(tmp_path, range(6), max_shard_samples=2)
    commits = [json.loads(p.read_text()) for p in sorted((tmp_path / "_log").glob("*.json"))]
    assert all(len(a["bucket"]) == 2 for c in commits for a in c.get("add", []))
    assert all(b.frames == 0 for b in Cache(tmp_path).manifest.buckets())
    tensors = Cache(tmp_path).manifest.shards.to_tensors()
    assert "shards.frames" not in tensors


def test_a_video_latent_spec_has_a_frame_axis_and_an_image_one_has_none():
    video = LatentSpec(16, 8, 1.0, 0.0, "mean_std", temporal_downsample=4)
    assert video.shape(480, 832, 81) == (16, 21, 60, 104) and video.shape(480, 832, 1) == (16, 1, 60, 104)
    assert LatentSpec.from_fingerprint(video.fingerprint()) == video
    image = LatentSpec(16, 8, 1.0, 0.0, "mean_std")
    assert image.shape(480, 832) == (16, 60, 104) and "temporal_downsample" not in image.fingerprint()


def test_the_padded_text_layout_is_read_back_from_its_fingerprint():
    from shards import TextSpec

    spec = TextSpec("padded", 4096, 512)
    assert TextSpec.from_fingerprint(spec.fingerprint()) == spec and spec.tokens == 512
