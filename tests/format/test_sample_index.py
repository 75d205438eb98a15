"""The sample index searched in place (`shards.sample_index`) answers as the dicts it replaces: source -> (key, stamp)
with the last sample of a source in index order winning, key -> (row, position), per dataset and resolution, over a
snapshot's columns and the log's commits alike, with hash collisions forced, on an empty cache; and the writer's
membership (`listed`, `has_text`) holds the keys it buffered since it loaded the cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import shards.sample_index as sample_index
from shards import Field, ShardWriter, load
from shards.generations import compact
from shards.sample_index import SampleIndex, Strings, encode, hash_bytes, hash_strings

SCHEMA = {"x": Field(torch.int32)}
FINGERPRINT = {"bench": 1}


def sample(i: int) -> dict:
    return {"x": torch.tensor([i], dtype=torch.int32)}


def build(root, rows, snapshot_after: int | None = None):
    """Write `rows` ((key, source, stamp, dataset, resolution), in order), one shard per 3 samples of a slot; compact
    after `snapshot_after` samples so that the index is part snapshot, part log."""
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        for n, (key, source, stamp, dataset, resolution) in enumerate(rows):
            w.write(key, (8, 8), sample(n), source=source, stamp=stamp, dataset=dataset, resolution=resolution)
            if snapshot_after is not None and n + 1 == snapshot_after:
                w.flush()
                compact(root, w.manifest)
    return load(root)


def reference(manifest, dataset=None, resolution=None) -> dict:
    """The dict `Manifest.by_source` built before: the last sample of a source in index order wins."""
    return {source: (key, stamp) for key, source, stamp, _, _ in manifest.samples(dataset, resolution) if source}


def rows_with_repeats(n: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        source = f"img/{rng.randrange(n // 2)}é.jpg" if rng.random() < 0.3 else f"img/{i}.png"  # repeated sources
        if rng.random() < 0.05:
            source = ""  # recorded without a source
        out.append((f"k{i:06d}", source, rng.randrange(1, 2**62), rng.choice(["a", "b"]), rng.choice([0, 512])))
    return out


def test_hashes_of_a_column_are_those_of_each_string():
    rng = random.Random(1)
    strings = ["", "a", "x" * 8, "y" * 9, "caf\udce9.png"] + [
        "".join(rng.choice("ab/é\u4e2d") for _ in range(rng.randrange(40))) for _ in range(500)]
    packed = Strings.pack(strings)
    assert [int(h) for h in hash_strings(packed.data, packed.offsets)] == [hash_bytes(encode(s)) for s in strings]
    assert [int(h) for h in packed.hashes(3, 9)] == [hash_bytes(encode(s)) for s in strings[3:9]]


@pytest.mark.parametrize("snapshot_after", [None, 30])
@pytest.mark.parametrize("bits", [64, 2])  # 2: every lookup collides; the stored strings decide
def test_stamp_tables_agree_with_dicts(tmp_path, monkeypatch, snapshot_after, bits):
    rows = rows_with_repeats(60)
    manifest = build(tmp_path / "c", rows, snapshot_after)
    monkeypatch.setattr(sample_index, "HASH_MASK", (1 << bits) - 1)
    for dataset in (None, "a", "b", "absent"):
        for resolution in (None, 0, 512):
            table, expected = manifest.by_source(dataset, resolution), reference(manifest, dataset, resolution)
            assert table == expected and len(table) == len(expected)
            asked = sorted(expected) + ["img/nothing.jpg", ""]
            assert [table.get(s) for s in asked] == [expected.get(s) for s in asked]
            positions = table.find_all(asked)
            assert [table.at(int(p)) if p >= 0 else None for p in positions] == [expected.get(s) for s in asked]
            assert [int(g) for p in positions if p >= 0 for g in [table.entry(int(p))[2]]] == [
                next(g for g, (k, *_) in enumerate(manifest.samples()) if k == expected[s][0]) for s in asked if s in expected]
            assert "" not in table and table.get("") is None


@pytest.mark.parametrize("bits", [64, 3])
def test_the_key_index_finds_every_live_key_and_no_other(tmp_path, monkeypatch, bits):
    rows = rows_with_repeats(40)
    manifest = build(tmp_path / "c", rows, snapshot_after=20)
    monkeypatch.setattr(sample_index, "HASH_MASK", (1 << bits) - 1)
    expected = {k: (int(manifest.shards.rows[i]), r) for k, _, _, i, r in manifest.samples()}
    index = manifest.shards.key_index()
    assert {k: index[k] for k in expected} == expected and "nokey" not in index and set(index) == set(expected)
    every = manifest.shards.sample_index()
    assert every.find_every("sources", rows[0][1]).tolist() == [g for g, (_, s, *_) in enumerate(manifest.samples()) if s == rows[0][1]]


def test_an_empty_cache_and_an_empty_index(tmp_path):
    with ShardWriter(tmp_path / "c", FINGERPRINT, SCHEMA):
        pass
    manifest = load(tmp_path / "c")
    assert manifest.by_source() == {} and manifest.by_source("a", 512).get("x") is None
    assert "k" not in manifest.shards.key_index() and len(manifest.index()) == 0
    assert SampleIndex([]).find_all("sources", ["a", "b"]).tolist() == [-1, -1]


def test_the_writer_lists_the_keys_it_buffered_and_its_lookups_follow_its_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(sample_index, "HASH_MASK", 3)  # collisions everywhere
    build(tmp_path / "c", [(f"k{i}", f"s{i}", i + 1, "", 0) for i in range(7)], snapshot_after=6)
    with ShardWriter(tmp_path / "c", FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        assert w.listed("k0") and w.listed("k6") and not w.listed("new0")
        w.write("new0", (8, 8), sample(0))  # buffered: listed, not committed
        assert w.listed("new0") and "new0" not in w.manifest.shards.key_index()
        with pytest.raises(ValueError, match="already in the cache"):
            w.write("k3", (8, 8), sample(0))
        w.write("new1", (8, 8), sample(1))
        w.write("new2", (8, 8), sample(2))  # the shard is committed: the manifest lists them now
        assert "new2" in w.manifest.shards.key_index() and not w._listed and w.listed("new1")
        assert w.remove({"k1", "new0"}) == 2
        assert not w.listed("k1") and not w.listed("new0") and w.listed("k2") and w.listed("new1")
    manifest = load(tmp_path / "c")
    assert sorted(k for k, *_ in manifest.samples()) == sorted(["k0", "k2", "k3", "k4", "k5", "k6", "new1", "new2"])
    assert manifest.by_source()["s4"] == ("k4", 5)


def test_a_restamp_is_read_back_through_the_stamp_table(tmp_path):
    build(tmp_path / "c", [(f"k{i}", f"s{i}", i + 1, "", 0) for i in range(9)], snapshot_after=6)
    with ShardWriter(tmp_path / "c", FINGERPRINT, SCHEMA) as w:
        w.restamp({"k2": 99, "k8": 77})
    manifest = load(tmp_path / "c")
    table = manifest.by_source()
    assert table["s2"] == ("k2", 99) and table["s8"] == ("k8", 77) and table == reference(manifest)
    assert table.stamps_at(np.array([table.position("s2"), table.position("s1")])).tolist() == [99, 2]
