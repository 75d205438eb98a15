"""Generations: removal and repair, the commit log and its snapshots, compaction, concurrent writers (gc: test_shards_gc.py)."""

import json
import struct

import pytest
import torch
from conftest import FINGERPRINT, SCHEMA, make_sample, write_cache

from shards import (
    FORMAT_VERSION,
    Bucket,
    Cache,
    FormatError,
    ShardWriter,
    verify,
)
from shards.log import snapshots


def test_remove_commits_a_generation_and_readers_of_the_last_keep_reading(tmp_path):
    manifest = write_cache(tmp_path, range(24), max_shard_samples=4)
    untouched = {s.path for s in manifest.shards if s.bucket == Bucket(48, 80)}
    before = Cache(tmp_path)  # a training run mid-epoch
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove({"key00000", "key00003", "key00002", "nope"}) == 3
    cache = Cache(tmp_path)
    assert cache.generation == before.generation + 1
    assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(24) if i not in (0, 2, 3)]
    assert untouched <= {s.path for s in cache.shards}
    for key, i in cache.keys():
        assert torch.equal(cache[i]["latent_mean"], make_sample(int(key[3:]))[2]["latent_mean"])
    # the old generation's files are still there: the reader goes on, and so does a new reader of it
    for reader in (before, Cache(tmp_path, generation=before.generation)):
        assert [reader[i].key for i in range(len(reader))] == [k for k, _ in before.keys()]
    # keys 0 and 3 (64x64) and 2 (80x48) lie in two shards: both are retired, kept for readers, not orphans
    retired = {s.path for s in before.shards} - {s.path for s in cache.shards}
    assert len(retired) == 2
    report = verify(tmp_path)
    assert report.ok and report.retired == 2

    from shards import gc

    freed = gc(tmp_path)  # no registered reader: the retired shards and the old log go
    assert {p for p in freed.deleted if p.endswith(".safetensors") and "/" in p and not p.startswith("_")} == retired
    assert verify(tmp_path).ok and verify(tmp_path).retired == 0
    assert len(Cache(tmp_path)) == 21
    with pytest.raises(FormatError, match="no generation"):
        Cache(tmp_path, generation=before.generation)


def test_commits_cost_one_small_file_and_snapshots_replay_exactly(tmp_path, monkeypatch):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 8)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=1) as w:
        for i in range(30):
            before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "_log").glob("*.json")} if i else {}
            w.write(*make_sample(i))
            after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "_log").glob("*.json")}
            assert set(after) - set(before) == {f"{i:012d}.json"} and all(after[k] == v for k, v in before.items())
    assert snapshots(tmp_path), "the log was compacted"
    from_snapshot = Cache(tmp_path)
    shutil_rm = [p.unlink() for p in (tmp_path / "_snapshots").glob("*")]
    assert shutil_rm
    (tmp_path / "index.json").unlink()
    replayed = Cache(tmp_path)  # the whole log, no snapshot
    assert [s.to_json() for s in from_snapshot.shards] == [s.to_json() for s in replayed.shards]
    assert list(from_snapshot.manifest.samples()) == list(replayed.manifest.samples())


def test_readers_keep_a_bounded_number_of_shards_open(tmp_path):
    write_cache(tmp_path, range(40), max_shard_samples=1)
    cache = Cache(tmp_path, max_open=3)
    for i in range(len(cache)):
        cache[i]
        assert len(cache._readers) <= 3


def test_a_manifest_path_outside_the_cache_is_refused(tmp_path):
    write_cache(tmp_path, range(3))
    commit = {"format": "cachedit-shards", "format_version": FORMAT_VERSION, "generation": Cache(tmp_path).generation + 1,
              "rank": 0, "add": [{"path": "../outside.safetensors", "bucket": [64, 64], "samples": 1, "bytes": 1, "sha256": "00" * 32,
                                  "field_bytes": {}}]}
    (tmp_path / "_log" / f"{commit['generation']:012d}.json").write_text(json.dumps(commit))
    with pytest.raises(FormatError, match="outside the cache"):
        Cache(tmp_path)
    report = verify(tmp_path)
    assert not report.ok and "outside the cache" in report.problems[0][1]


def test_a_version_1_cache_is_refused_then_upgraded_in_place(tmp_path):
    """A version 1 cache: one index.json listing every shard, shapes per shard, no log."""
    from shards.upgrade import upgrade

    write_cache(tmp_path, range(12), max_shard_samples=4)
    current = Cache(tmp_path)
    v1 = {"format": "cachedit-shards", "format_version": 1, "fingerprint_sha256": current.manifest.fingerprint_sha256,
          "fingerprint": current.fingerprint, "fields": {n: f.to_json() for n, f in SCHEMA.items()},
          "shards": [{**s.to_json(), "shapes": current.manifest.shapes[s.bucket]} for s in current.shards], "files": {}, "extra": {}}
    for s in v1["shards"]:
        for k in ("keys", "sources", "stamps"):
            del s[k]
    import shutil

    shutil.rmtree(tmp_path / "_log")
    shutil.rmtree(tmp_path / "_snapshots", ignore_errors=True)
    (tmp_path / "index.json").write_text(json.dumps(v1))
    with pytest.raises(FormatError, match=f"version 1 cache.*python -m shards upgrade {tmp_path}"):
        Cache(tmp_path)
    with pytest.raises(FormatError, match="version 1 cache"):  # a writer must not take it for an empty directory
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    assert verify(tmp_path).problems and "shards upgrade" in verify(tmp_path).problems[0][1]
    def shard_files():  # not the snapshot the upgrade writes
        return {p: p.read_bytes() for p in tmp_path.glob("*/*.safetensors") if not p.parent.name.startswith("_")}

    files = shard_files()
    upgrade(tmp_path)
    assert shard_files() == files  # no shard rewritten (the new snapshot is not a shard)
    upgraded = Cache(tmp_path)
    assert [upgraded[i].key for i in range(12)] == [current[i].key for i in range(12)]
    assert verify(tmp_path).ok and (tmp_path / "index.v1.json").exists()


def test_prompts_are_stored_merged_and_verified(tmp_path):
    from shards import Prompt, prompt_key

    text_schema = {"text": SCHEMA["text"]}
    emb = lambda n: torch.full((n, 16), float(n), dtype=torch.bfloat16)  # noqa: E731
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(0))
        w.add_prompts({prompt_key(""): Prompt("", {"text": emb(1)})}, text_schema)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.add_prompts({prompt_key("a red circle"): Prompt("a red circle", {"text": emb(5)})}, text_schema)
    prompts = Cache(tmp_path).prompts()
    assert {p.text for p in prompts.values()} == {"", "a red circle"}
    assert torch.equal(prompts[prompt_key("a red circle")].fields["text"], emb(5))
    assert verify(tmp_path).ok
    path = tmp_path / Cache(tmp_path).manifest.files["prompts"]["path"]
    path.write_bytes(b"garbage")
    assert verify(tmp_path).bad_files == [str(path)]


def test_sample_index_by_source_without_opening_a_shard(tmp_path, monkeypatch):
    """An incremental run asks which inputs are cached, and with which stamp, without reading any shard, whether
    the index comes from the log or from a snapshot; odd file names (not UTF-8) survive the snapshot."""
    import shards.generations
    import shards.reader

    odd = "images/caf\udce9.png"  # os.fsdecode of a Latin-1 file name
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=2) as w:
        for i in range(6):
            w.write(*make_sample(i), source=odd if i == 5 else f"images/{i}.png", stamp=(1 << 62) + i)
        with pytest.raises(ValueError, match="63-bit"):
            w.write(*make_sample(6), stamp=1 << 63)
    expected = {f"images/{i}.png": (f"key{i:05d}", (1 << 62) + i) for i in range(5)}
    expected[odd] = ("key00005", (1 << 62) + 5)
    for snapshot in (False, True):
        if snapshot:
            shards.generations.compact(tmp_path, shards.load(tmp_path))
            assert snapshots(tmp_path)
        cache = Cache(tmp_path)
        monkeypatch.setattr(shards.reader, "open_file", lambda *a, **k: pytest.fail("a shard was opened"))
        assert cache.manifest.by_source() == expected
        assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(6)]
        assert sorted(s[:3] for s in cache.manifest.samples()) == sorted((k, src, t) for src, (k, t) in expected.items())
        monkeypatch.undo()


def test_an_old_generation_reads_repaired_copies_with_one_load(tmp_path, monkeypatch):
    import shards.reader

    write_cache(tmp_path, range(9), max_shard_samples=3)
    old = Cache(tmp_path).generation
    path = Cache(tmp_path).shards[1].path
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        keys = w.manifest.shards.samples_of(1)[0]
        copy = w.replace(path, [(k, make_sample(int(k[3:]))[2]) for k in keys])
        w.remove({"key00000"})  # and a later generation
    (tmp_path / path).unlink()  # the damaged original is gone: every generation must read the copy
    first = Cache(tmp_path, generation=old).path(0)
    first.rename(tmp_path / "elsewhere")
    with pytest.raises(FormatError, match="listed in generation .* but missing: Re-encode"):
        Cache(tmp_path, generation=old)[0]
    (tmp_path / "elsewhere").rename(first)
    loads = []
    real = shards.reader.load
    monkeypatch.setattr(shards.reader, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    cache = Cache(tmp_path, generation=old)
    assert len(loads) == 1 and cache.path(1) == tmp_path / copy
    assert [cache[i].key for i in range(len(cache))] == [f"key{i:05d}" for i in (0, 3, 6, 1, 4, 7, 2, 5, 8)]
    assert cache.check_files() == []


def test_concurrent_writers_commit_only_what_still_applies(tmp_path):
    from shards import CacheBusy

    write_cache(tmp_path, range(12), max_shard_samples=4)
    a = ShardWriter(tmp_path, FINGERPRINT, SCHEMA, rank=0)
    b = ShardWriter(tmp_path, FINGERPRINT, SCHEMA, rank=1)  # opened before a's removal
    assert a.remove({"key00000"}) == 1
    assert b.remove({"key00003"}) == 1  # same shard, already retired by a: b removes from a's new copy
    before = sorted((tmp_path / "_log").iterdir())
    with pytest.raises(CacheBusy, match="key00000"):
        b.restamp({"key00000": 5})  # removed meanwhile: refused, nothing committed
    assert sorted((tmp_path / "_log").iterdir()) == before
    a.finish()
    b.finish()
    assert sorted(k for k, _ in Cache(tmp_path).keys()) == [f"key{i:05d}" for i in range(12) if i not in (0, 3)]
    assert verify(tmp_path).ok


DAMAGED_COMMITS = {
    "add outside": {"add": [{"path": "../outside.safetensors", "bucket": [64, 64], "samples": 1, "bytes": 1, "sha256": "00" * 32,
                             "field_bytes": {}, "keys": ["x"]}]},
    "add absolute": {"add": [{"path": "/etc/x.safetensors", "bucket": [64, 64], "samples": 1, "bytes": 1, "sha256": "00" * 32,
                              "field_bytes": {}, "keys": ["x"]}]},
    "file outside": {"files": {"prompts": {"path": "../prompts.safetensors", "bytes": 1, "sha256": "00" * 32}}},
    "replace outside": "replace ../x.safetensors",
    "replace by itself": "replace itself",
    "add without keys": {"add": [{"path": "64x64/r00000-000009.safetensors", "bucket": [64, 64], "samples": 1, "bytes": 1,
                                  "sha256": "00" * 32, "field_bytes": {}}]},
}


@pytest.mark.parametrize("damage", list(DAMAGED_COMMITS))
def test_every_reader_refuses_a_damaged_commit(tmp_path, damage):
    from shards import gc

    write_cache(tmp_path, range(3))
    actions = DAMAGED_COMMITS[damage]
    if isinstance(actions, str):
        shard = {**Cache(tmp_path).shards[0].to_json(), "keys": Cache(tmp_path).shards.samples_of(0)[0]}
        new = "../x.safetensors" if "outside" in damage else shard["path"]
        actions = {"replace": [[shard["path"], {**shard, "path": new}]]}
    generation = Cache(tmp_path).generation + 1
    commit = {"format": "cachedit-shards", "format_version": FORMAT_VERSION, "generation": generation, "rank": 0, **actions}
    (tmp_path / "_log" / f"{generation:012d}.json").write_text(json.dumps(commit))
    message = "without keys" if damage == "add without keys" else "cannot replace" if damage == "replace by itself" else "outside the cache"
    with pytest.raises(FormatError, match=message):
        Cache(tmp_path)
    with pytest.raises(FormatError, match=message):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    with pytest.raises(FormatError, match=message):
        gc(tmp_path)
    report = verify(tmp_path)
    assert not report.ok and message in report.problems[0][1]


def test_a_snapshot_listing_a_path_outside_the_cache_is_refused(tmp_path):
    import shards.generations

    write_cache(tmp_path, range(3))
    manifest = shards.load(tmp_path)
    manifest.replaced["64x64/r00000-000000.safetensors"] = "../../elsewhere.safetensors"
    shards.generations.compact(tmp_path, manifest)
    with pytest.raises(FormatError, match="outside the cache"):
        Cache(tmp_path)
    assert "outside the cache" in verify(tmp_path).problems[0][1]


def test_auxiliary_files_stay_inside_the_cache(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(0))
        with pytest.raises(ValueError, match="outside the cache"):
            w.add_file("decoder", "vae/../../decoder.json", b"{}")
    assert verify(tmp_path).ok and not (tmp_path.parent / "decoder.json").exists()


def test_compaction_keeps_three_snapshots_and_every_generation_loads(tmp_path, monkeypatch):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=1) as w:
        for i in range(60):
            w.write(*make_sample(i))
    kept = snapshots(tmp_path)
    assert len(kept) == 3 and kept[0] == 3, kept  # the oldest and the two newest
    newest = Cache(tmp_path).generation
    for g in range(newest + 1):  # a reader of any generation still loads it (log + the oldest snapshot)
        assert len(Cache(tmp_path, generation=g)) == g + 1


def test_a_removal_never_launders_a_damaged_sample(tmp_path):
    from shards import CorruptSample

    write_cache(tmp_path, range(12), max_shard_samples=4)
    cache = Cache(tmp_path)
    j, row = cache.locate(next(i for k, i in cache.keys() if k == "key00006"))
    shard = tmp_path / cache.shards[j].path
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])["latent_mean"]["data_offsets"]
    raw[8 + n + begin + row * (end - begin) // 4 + 1] ^= 0x01  # one byte of key00006's latent, as a bad disk would
    shard.write_bytes(bytes(raw))
    damaged = not verify(tmp_path).ok
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w, pytest.raises(CorruptSample, match="--repair"):
        w.remove({"key00000"})  # key00000 shares that shard (bucket 64x64)
    assert damaged and not verify(tmp_path).ok and len(Cache(tmp_path)) == 12  # still damaged, still listed, nothing removed
