"""Texts stored once (`shards.texts`): one text row per distinct caption, samples referring to it by key; what a
read resolves is what the per-sample layout stores; removals, gc, verify, repair, several writers and snapshots
keep every reference whole."""

import json
import struct

import pytest
import torch
from typer.testing import CliRunner

from shards import Cache, CacheBusy, CorruptSample, Field, ShardWriter, gc, verify
from shards.cli import app
from shards.generations import compact
from shards.texts import TEXT_KEYS, key_rows, text_key

FINGERPRINT = {"vae": {"id": "tiny"}, "text_encoder": {"id": "tiny-t5", "max_length": 64}}
TEXT_SCHEMA = {"text": Field(torch.bfloat16, ragged=True)}
STORED_ONCE = {"latent": Field(torch.bfloat16), "source": Field(torch.uint8, ragged=True), TEXT_KEYS: Field(torch.uint8, ragged=True)}
INLINE = {"latent": Field(torch.bfloat16), "source": Field(torch.uint8, ragged=True), "text": Field(torch.bfloat16, ragged=True),
          "text_lengths": Field(torch.int32, ragged=True)}
PROMPT = "a photo of sks dog"


def embedding(caption: str, width: int = 64) -> torch.Tensor:
    """A caption's deterministic 'text encoder' output: one row per word, `width` wide. (L, D)"""
    g = torch.Generator().manual_seed(int(text_key(caption)[:8], 16))
    return torch.randn(len(caption.split()), width, generator=g).bfloat16()


def latent(i: int) -> torch.Tensor:
    return torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(i)).bfloat16()


def source(i: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(f"img{i:05d}.png".encode()), dtype=torch.uint8)


def write_stored_once(root, captions: dict[int, list[str]], rank: int = 0, **kwargs) -> Cache:
    with ShardWriter(root, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, rank=rank, **kwargs) as w:
        for i, caps in captions.items():
            keys = [w.write_text(c, {"text": embedding(c)}) for c in caps]
            w.write(f"k{i:05d}", (64, 64), {"latent": latent(i), "source": source(i), TEXT_KEYS: key_rows(keys)}, source=f"img{i}")
    return Cache(root)


def write_inline(root, captions: dict[int, list[str]], **kwargs) -> Cache:
    with ShardWriter(root, FINGERPRINT, INLINE, **kwargs) as w:
        for i, caps in captions.items():
            texts = [embedding(c) for c in caps]
            w.write(f"k{i:05d}", (64, 64), {"latent": latent(i), "source": source(i), "text": torch.cat(texts),
                                            "text_lengths": torch.tensor([len(t) for t in texts], dtype=torch.int32)}, source=f"img{i}")
    return Cache(root)


def files_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors") if "_snapshots" not in p.parts)


def assert_same_samples(a: Cache, b: Cache) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.key == y.key and set(x.fields) == set(y.fields)
        for name in x.fields:
            assert x.fields[name].dtype == y.fields[name].dtype and torch.equal(x.fields[name], y.fields[name]), (x.key, name)


def test_a_thousand_samples_of_one_prompt_store_it_once(tmp_path):
    captions = {i: [PROMPT] for i in range(1000)}
    once = write_stored_once(tmp_path / "once", captions, max_shard_samples=250)
    inline = write_inline(tmp_path / "inline", captions, max_shard_samples=250)
    stats = once.manifest.text_stats()
    assert stats["texts"] == 1 and stats["references"] == 1000 and stats["shards"] == 1
    assert stats["inline_bytes"] == 1000 * len(PROMPT.split()) * 64 * 2
    assert_same_samples(once, inline)  # a read resolves to exactly the per-sample layout
    assert once.schema == inline.schema and once.manifest.schema == STORED_ONCE
    before, after = files_bytes(tmp_path / "inline"), files_bytes(tmp_path / "once")
    # text_lengths and the text offsets go too; 32 bytes of key and 8 of offsets per sample stay
    assert before - after >= stats["saved"] > 0.9 * stats["inline_bytes"] - 1000 * 40
    print(f"\n1000 samples, one prompt of {len(PROMPT.split())} tokens x 64 bf16: {before} bytes inline, {after} stored once "
          f"(saved {before - after}; inspect: {stats['saved']})")
    out = CliRunner().invoke(app, ["inspect", str(tmp_path / "once")])
    assert out.exit_code == 0, out.output
    assert "texts (each stored once): 1 in 1 text shards" in out.output and "1000 references" in out.output
    info = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "once"), "--json"]).output)
    assert info["texts"] == stats
    assert "texts" not in json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "inline"), "--json"]).output)


def test_several_captions_per_sample_resolve_in_order_and_a_text_is_written_once(tmp_path):
    captions = {i: [PROMPT, f"caption {i % 3}", PROMPT] for i in range(12)}
    once = write_stored_once(tmp_path / "once", captions, max_shard_samples=5)
    assert_same_samples(once, write_inline(tmp_path / "inline", captions, max_shard_samples=5))
    assert once.manifest.text_stats()["texts"] == 4 and once.manifest.text_stats()["references"] == 36
    raw = once.read(5, resolve=False)  # each caption's row as stored, no copy
    assert TEXT_KEYS in raw.fields and [t["text"].data_ptr() for t in raw.texts][0] == raw.texts[2]["text"].data_ptr()
    assert torch.equal(torch.cat([t["text"] for t in raw.texts]), once[5].fields["text"])
    assert once.manifest.version == 3 and Cache(tmp_path / "inline").manifest.version == 2  # caches without texts stay 2
    assert json.loads((tmp_path / "inline" / "index.json").read_text())["format_version"] == 2
    with ShardWriter(tmp_path / "once", FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        assert w.has_text(text_key(PROMPT)) and w.write_text(PROMPT, {"text": embedding(PROMPT)}) == text_key(PROMPT)
    assert Cache(tmp_path / "once").manifest.text_stats()["texts"] == 4  # cached: not stored again


def test_a_sample_cannot_refer_to_a_text_never_written_and_layouts_do_not_mix(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        with pytest.raises(ValueError, match="neither in the cache nor written"):
            w.write("k", (64, 64), {"latent": latent(0), "source": source(0), TEXT_KEYS: key_rows([text_key("nothing")])})
        w.write_text(PROMPT, {"text": embedding(PROMPT)})
    with pytest.raises(Exception, match="texts stored once"):
        ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema={"clip": Field(torch.bfloat16, ragged=True)})
    with pytest.raises(Exception, match="field schema differs"):
        ShardWriter(tmp_path, FINGERPRINT, INLINE)
    with pytest.raises(ValueError, match="starts with its text_schema"):
        ShardWriter(tmp_path / "new", FINGERPRINT, STORED_ONCE)
    ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE).close()  # an existing cache's own layout by default
    with pytest.raises(ValueError, match="ragged"):
        ShardWriter(tmp_path / "other", FINGERPRINT, STORED_ONCE, text_schema={"text": Field(torch.bfloat16)})


def test_a_crash_before_the_commit_leaves_no_text_and_the_rerun_stores_it(tmp_path):
    w = ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA)
    key = w.write_text(PROMPT, {"text": embedding(PROMPT)})
    w.write("k00000", (64, 64), {"latent": latent(0), "source": source(0), TEXT_KEYS: key_rows([key])})
    w._write_shard(next(iter(w._buffers))[0], w._buffers[next(iter(w._buffers))])  # a shard on disk, never committed
    w.close()  # killed: nothing committed
    assert not (tmp_path / "_log").exists() or not any((tmp_path / "_log").glob("*.json"))
    once = write_stored_once(tmp_path, {0: [PROMPT], 1: [PROMPT]})
    assert len(once) == 2 and once.manifest.text_stats()["texts"] == 1
    assert verify(tmp_path).ok, verify(tmp_path).problems
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, rank=1) as w:  # texts committed, their samples never
        w.write_text("orphan one", {"text": embedding("orphan one")})
        w.write_text("orphan two", {"text": embedding("orphan two")})
    assert Cache(tmp_path).manifest.text_stats()["texts"] == 3 and verify(tmp_path).ok
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE) as w:
        assert w.drop_unreferenced_texts() == 2 and w.drop_unreferenced_texts() == 0
    assert Cache(tmp_path).manifest.text_stats()["texts"] == 1 and verify(tmp_path).ok


def test_removal_drops_texts_no_sample_refers_to_and_gc_deletes_them_after_the_readers(tmp_path):
    captions = {i: [PROMPT if i % 2 else f"unique {i}"] for i in range(10)}
    write_stored_once(tmp_path, captions, max_shard_samples=4)
    old = Cache(tmp_path)
    before = {old[i].key: old[i].fields["text"].clone() for i in range(len(old))}
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        assert w.remove({f"k{i:05d}" for i in range(0, 10, 2)} | {"k00001"}) == 6  # every unique caption's sample
    new = Cache(tmp_path)
    assert new.manifest.text_stats()["texts"] == 1 and len(new) == 4
    assert all(torch.equal(new[i].fields["text"], embedding(PROMPT)) for i in range(4))
    for i in range(len(old)):  # a reader of the earlier generation still reads every text
        assert torch.equal(old[i].fields["text"], before[old[i].key])
    report = verify(tmp_path)
    assert report.ok and report.texts == 1, report.problems
    retired = [p for p in (tmp_path / "texts").iterdir() if p.relative_to(tmp_path).as_posix() not in new.texts.paths()]
    assert retired
    deleted = gc(tmp_path).deleted
    assert all(p.relative_to(tmp_path).as_posix() in deleted for p in retired)
    assert all((tmp_path / p).is_file() for p in new.texts.paths()) and verify(tmp_path).ok
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        w.remove_dataset("")
    assert Cache(tmp_path).manifest.text_stats()["texts"] == 0 and verify(tmp_path).ok


def test_two_ranks_storing_one_text_at_once_keep_both_copies_and_read_one(tmp_path):
    write_stored_once(tmp_path, {0: [PROMPT], 1: ["other"]}, rank=0)
    write_stored_once(tmp_path, {2: [PROMPT]}, rank=1)
    a, b = ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, rank=2), \
        ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, rank=3)
    for w, i in ((a, 3), (b, 4)):  # neither sees the other's buffer: both store the new text
        w.write(f"k{i:05d}", (64, 64), {"latent": latent(i), "source": source(i),
                                         TEXT_KEYS: key_rows([w.write_text("both", {"text": embedding("both")})])})
    a.finish()
    b.finish()
    cache = Cache(tmp_path, check_digests=True)
    assert cache.manifest.text_stats()["texts"] == 4  # "both" twice
    assert [cache[i].key for i in range(len(cache))] == [f"k{i:05d}" for i in range(5)]
    assert torch.equal(cache[4].fields["text"], embedding("both")) and verify(tmp_path).ok
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        w.remove({"k00003", "k00004"})
    assert Cache(tmp_path).manifest.text_stats()["texts"] == 2 and verify(tmp_path).ok


def test_a_commit_referring_to_a_text_another_writer_dropped_is_refused(tmp_path):
    write_stored_once(tmp_path, {0: ["gone soon"], 1: [PROMPT]})
    late = ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA, rank=1)
    assert late.has_text(text_key("gone soon"))
    late.write("k00009", (64, 64), {"latent": latent(9), "source": source(9), TEXT_KEYS: key_rows([text_key("gone soon")])})
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        w.remove({"k00000"})
    with pytest.raises(CacheBusy, match="no longer in the cache"):
        late.flush()
    late.close()
    assert verify(tmp_path).ok and len(Cache(tmp_path)) == 1


def test_a_damaged_text_shard_is_found_and_repaired(tmp_path):
    write_stored_once(tmp_path, {i: [PROMPT, f"c{i}"] for i in range(6)}, max_shard_samples=3)
    cache = Cache(tmp_path)
    t = cache.locate_text(text_key(PROMPT))[0]
    path = cache.text_path(t)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, _ = json.loads(data[8 : 8 + n])["text"]["data_offsets"]
    data[8 + n + start + 1] ^= 0x40  # a flipped bit in the first text row's embedding
    path.write_bytes(bytes(data))
    report = verify(tmp_path)
    assert str(path) in report.bad_files
    with pytest.raises(CorruptSample, match="does not match its stored digest"):
        damaged = Cache(tmp_path, check_digests=True)
        [damaged[i] for i in range(len(damaged))]
    rel = path.relative_to(tmp_path).as_posix()
    table = cache.texts
    keys, captions, _ = table.samples_of(table.row_of(rel))
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:
        w.replace(rel, [(k, {"text": embedding(c)}) for k, c in zip(keys, captions)])  # captions are in the manifest
    assert verify(tmp_path).ok
    repaired = Cache(tmp_path, check_digests=True)
    assert all(torch.equal(repaired[i].fields["text"][: len(PROMPT.split())], embedding(PROMPT)) for i in range(6))


def test_texts_survive_a_snapshot_and_the_read_ahead_knows_their_shards(tmp_path):
    write_stored_once(tmp_path, {i: [PROMPT, f"c{i % 4}"] for i in range(20)}, max_shard_samples=5)
    cache = Cache(tmp_path)
    compact(tmp_path, cache.manifest)
    snap = Cache(tmp_path)
    assert snap.manifest.text_stats() == cache.manifest.text_stats()
    assert snap.manifest.shards.referenced_texts() == cache.manifest.shards.referenced_texts()
    assert_same_samples(snap, cache)
    for j in range(len(snap.shards)):
        wanted = {snap.locate_text(k)[0] for k in snap.manifest.shards.texts_of(int(snap.shards.rows[j]))}
        assert set(snap.text_shards_of(j)) == wanted
    with ShardWriter(tmp_path, FINGERPRINT, STORED_ONCE, text_schema=TEXT_SCHEMA) as w:  # a writer starts from it
        w.remove({"k00000"})
    assert verify(tmp_path).ok and len(Cache(tmp_path)) == 19


def test_the_text_index_reads_snapshot_keys_as_arrays_and_tells_keys_of_one_prefix_apart():
    import numpy as np

    from shards.texts import TextIndex, hex_prefixes, key_prefixes

    keys = [text_key(f"caption {i}") for i in range(50)]
    data = np.frombuffer("".join(keys).encode(), dtype=np.uint8)
    assert np.array_equal(hex_prefixes(data, np.arange(51) * 64), key_prefixes(keys))
    twin = keys[7][:16] + "0" * 48  # the same first 8 bytes as keys[7]
    index = TextIndex(key_prefixes([*keys[:10], twin, *keys[10:]]), np.array([10, 41]))
    assert index.candidates(keys[7]) == [(0, 7), (1, 0)] and index.candidates(keys[30]) == [(1, 21)]
    assert index.candidates(text_key("not stored")) == []


def test_a_cache_in_object_storage_downloads_the_text_shards_its_samples_need(tmp_path):
    from shards import open_cache

    bucket = tmp_path / "bucket"
    local = write_stored_once(bucket, {i: [PROMPT, f"c{i % 3}"] for i in range(9)}, max_shard_samples=3)
    remote = open_cache(f"file://{bucket}", local_dir=tmp_path / "local")
    assert not (tmp_path / "local" / "texts").exists()  # nothing but the manifest until a read
    assert remote.check_files() == []
    assert_same_samples(remote, local)
    assert sorted(p.name for p in (tmp_path / "local" / "texts").iterdir()) == sorted(p.rsplit("/", 1)[1] for p in local.texts.paths())
    (bucket / local.texts.paths()[0]).unlink()
    problems = open_cache(f"file://{bucket}", local_dir=tmp_path / "other").check_files()
    assert [p for p, _ in problems] == [f"file://{bucket}/{local.texts.paths()[0]}"]
