"""Named datasets in one cache: every shard belongs to one, through commits, snapshots, removal and repair."""

import json

import torch
from conftest import FINGERPRINT, SCHEMA, make_sample

from shards import Cache, ShardWriter, load
from shards.generations import compact


def write_two(root, *, per_shard: int = 3):
    """Samples 0-11 into "photos", 12-17 into "art", interleaved as a run of two sources would write them."""
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=per_shard) as w:
        for i in range(18):
            w.write(*make_sample(i), source=f"img/{i}.jpg", stamp=i + 1, dataset="photos" if i < 12 else "art")
    return w.manifest


def by_dataset(cache: Cache) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for j, name in enumerate(cache.shards.datasets()):
        out.setdefault(name, set()).update(cache.manifest.shards.samples_of(int(cache.shards.rows[j]))[0])
    return out


def test_a_shard_holds_one_dataset_and_the_manifest_counts_each(tmp_path):
    write_two(tmp_path)
    cache = Cache(tmp_path)
    assert by_dataset(cache) == {"photos": {f"key{i:05d}" for i in range(12)}, "art": {f"key{i:05d}" for i in range(12, 18)}}
    totals = cache.manifest.datasets()
    assert {k: v["samples"] for k, v in totals.items()} == {"art": 6, "photos": 12}
    assert sum(v["shards"] for v in totals.values()) == len(cache.shards)
    assert sum(v["bytes"] for v in totals.values()) == cache.manifest.num_bytes
    assert set(cache.manifest.by_source("art")) == {f"img/{i}.jpg" for i in range(12, 18)}
    assert len(list(cache.manifest.samples("photos"))) == 12
    # an unnamed shard's commit entry carries no "dataset" key: logs of caches without datasets are unchanged
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(30))
    last = json.loads(sorted((tmp_path / "_log").glob("*.json"))[-1].read_text())
    assert "dataset" not in last["add"][0]
    assert Cache(tmp_path).manifest.datasets()[""]["samples"] == 1


def test_datasets_survive_a_snapshot(tmp_path):
    manifest = write_two(tmp_path)
    compact(tmp_path, manifest)
    again = load(tmp_path)
    assert again.shards.datasets() == manifest.shards.datasets()
    assert again.datasets() == manifest.datasets()


def test_removal_and_repair_keep_each_shards_dataset(tmp_path):
    write_two(tmp_path)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove({"key00000", "key00013"}) == 2  # the kept samples of both shards are copied
    cache = Cache(tmp_path)
    groups = by_dataset(cache)
    assert groups["photos"] == {f"key{i:05d}" for i in range(1, 12)}
    assert groups["art"] == {f"key{i:05d}" for i in range(12, 18)} - {"key00013"}
    j = cache.shards.datasets().index("art")
    path = cache.shards[j].path
    keys = cache.manifest.shards.samples_of(int(cache.shards.rows[j]))[0]
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        copy = w.replace(path, [(k, make_sample(int(k[3:]))[2]) for k in keys])
    assert Cache(tmp_path).shards.datasets()[j] == "art" and Cache(tmp_path).shards[j].path == copy


def test_a_dataset_is_removed_whole_and_renamed_in_one_commit(tmp_path):
    write_two(tmp_path)
    before = Cache(tmp_path)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove_dataset("art") == 6
        assert w.remove_dataset("nothing") == 0
        assert w.rename_dataset("photos", "people") == 12
    cache = Cache(tmp_path)
    assert cache.generation == before.generation + 2
    assert set(cache.manifest.datasets()) == {"people"} and len(cache) == 12
    # nothing was copied: the photos' shards are the same files
    assert {s.path for s in cache.shards} == {s.path for s, d in zip(before.shards, before.shards.datasets()) if d == "photos"}
    # the removed samples' keys may be written again (the source is added back)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(12), dataset="art")
    assert Cache(tmp_path).manifest.datasets()["art"]["samples"] == 1
    assert torch.equal(Cache(tmp_path)[12]["latent_mean"], make_sample(12)[2]["latent_mean"])


def test_a_shard_holds_one_resolution_through_commits_snapshots_removal_and_repair(tmp_path):
    """Samples of two resolutions can share a bucket: each shard records the resolution its samples belong to (0, the
    base resolution, is not written), and every copy of a shard keeps it."""
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=2) as w:
        for i in range(8):
            w.write(*make_sample(i, (64, 64)), source=f"img/{i % 4}.jpg", stamp=1, dataset="photos",
                    resolution=512 if i >= 4 else 0)
    cache = Cache(tmp_path)
    assert cache.manifest.resolutions() == {0: 4, 512: 4}
    assert [e.resolution for e in cache.shards] == [0, 0, 512, 512]
    assert {k for k, *_ in cache.manifest.samples("photos", 512)} == {f"key{i:05d}" for i in range(4, 8)}
    assert cache.manifest.by_source("photos", 0)["img/1.jpg"][0] == "key00001"
    assert cache.manifest.by_source("photos", 512)["img/1.jpg"][0] == "key00005"
    commits = [json.loads(p.read_text()) for p in sorted((tmp_path / "_log").glob("*.json"))]
    adds = [a for c in commits for a in c.get("add", [])]
    assert ["resolution" in a for a in adds] == [False, False, True, True]  # base-resolution entries are as before
    compact(tmp_path, load(tmp_path))
    again = load(tmp_path)
    assert list(again.shards.column("resolution")) == [0, 0, 512, 512] and again.resolutions() == {0: 4, 512: 4}
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove(["key00004"]) == 1
    cache = Cache(tmp_path)
    assert cache.manifest.resolutions() == {0: 4, 512: 3}
    j = int(cache.shards.rows[-1])
    keys = cache.manifest.shards.samples_of(j)[0]
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.replace(cache.shards[-1].path, [(k, make_sample(int(k[3:]), (64, 64))[2]) for k in keys])
    assert Cache(tmp_path).shards[-1].resolution == 512
    # a snapshot of a cache with one resolution holds no resolution column
    write_two(tmp_path / "one")
    assert "shards.resolution" not in load(tmp_path / "one").shards.to_tensors()
