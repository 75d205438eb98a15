"""Round trip, golden header, stock safetensors, versions, fingerprints, appends, ranks and merge."""

import json
import struct

import pytest
import torch
from conftest import BUCKETS, FINGERPRINT, SCHEMA, make_sample
from safetensors import safe_open

from shards import (
    FORMAT_VERSION,
    Bucket,
    Cache,
    Field,
    FingerprintMismatch,
    FormatError,
    Manifest,
    ShardReader,
    ShardWriter,
    merge,
    verify,
)


def write_cache(root, indices, **kwargs):
    with ShardWriter(root, FINGERPRINT, SCHEMA, **kwargs) as w:
        for i in indices:
            w.write(*make_sample(i))
    return w.manifest


def test_round_trip_three_buckets_ragged_text(tmp_path):
    manifest = write_cache(tmp_path, range(40), max_shard_samples=5)
    cache = Cache(tmp_path)
    assert len(cache) == 40
    assert set(cache.manifest.buckets()) == {Bucket(*b) for b in BUCKETS}
    assert all(len({s.bucket for s in manifest.shards if s.path.startswith(b.name)}) == 1 for b in cache.manifest.buckets())
    seen = {}
    for i in range(len(cache)):
        s = cache[i]
        seen[s.key] = s
    assert len(seen) == 40
    for i in range(40):
        key, bucket, fields = make_sample(i)
        got = seen[key]
        assert got.bucket == Bucket(*bucket)
        for name, t in fields.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (key, name)
    assert seen["key00000"]["text"].shape == (0, 16)  # an empty ragged row survives
    # the bucket ranges cover every sample once, each with its own bucket
    ranges = cache.ranges_by_bucket()
    assert sorted(i for rs in ranges.values() for r in rs for i in r) == list(range(40))
    for bucket, rs in ranges.items():
        assert all(cache.bucket_of(i) == bucket for r in rs for i in r)
    assert verify(tmp_path).ok


def test_ragged_fields_store_no_padding(tmp_path):
    manifest = write_cache(tmp_path, range(21))
    tokens = sum(i % 7 for i in range(21))
    text_bytes = sum(s.field_bytes["text"] for s in manifest.shards)
    offsets = 8 * (21 + len(manifest.shards))
    assert text_bytes == tokens * 16 * 2 + offsets


def test_stock_safe_open_reads_a_shard(tmp_path):
    manifest = write_cache(tmp_path, [0, 3, 6])  # one bucket
    entry = manifest.shards[0]
    with safe_open(tmp_path / entry.path, framework="pt") as f:
        meta = f.metadata()
        text = f.get_tensor("text")
        offsets = f.get_tensor("text.offsets")
        means = f.get_tensor("latent_mean")
    assert meta["format_version"] == str(FORMAT_VERSION) and meta["bucket"] == "64x64"
    assert means.shape == (3, 4, 8, 8)
    for row, i in enumerate([0, 3, 6]):
        assert torch.equal(text[offsets[row] : offsets[row + 1]], make_sample(i)[2]["text"])


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_golden_header(tmp_path):
    fields = {"latent": Field(torch.float16), "text": Field(torch.bfloat16, ragged=True)}
    with ShardWriter(tmp_path, {"v": 1}, fields) as w:
        w.write("a", (16, 8), {"latent": torch.zeros(2, 2, 1, dtype=torch.float16), "text": torch.zeros(3, 4, dtype=torch.bfloat16)})
        w.write("bb", (16, 8), {"latent": torch.ones(2, 2, 1, dtype=torch.float16), "text": torch.zeros(1, 4, dtype=torch.bfloat16)})
    header = read_header(tmp_path / "16x8" / "r00000-000000.safetensors")
    meta = header.pop("__metadata__")
    assert meta == {
        "format": "cachedit-shards",
        "format_version": "1",
        "bucket": "16x8",
        "samples": "2",
        "fields": '{"latent": {"dtype": "float16", "kind": "fixed"}, "text": {"dtype": "bfloat16", "kind": "ragged"}}',
        "shapes": '{"latent": [2, 2, 1], "text": [null, 4]}',
        "fingerprint_sha256": "afbf9d0f3560b0fd7795e81c42a0a79ee6b6fc67e064f77826aee642cad28d91",
        "rank": "0",
    }
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {
        "latent": ("F16", [2, 2, 2, 1]),
        "text": ("BF16", [4, 4]),
        "text.offsets": ("I64", [3]),
        "__key__": ("U8", [3]),
        "__key__.offsets": ("I64", [3]),
        "__digest__": ("U8", [2, 16]),
    }


def test_unknown_version_is_rejected_with_what_to_do(tmp_path):
    write_cache(tmp_path, range(3))
    index = json.loads((tmp_path / "index.json").read_text())
    index["format_version"] = 99
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"version 99.*Upgrade.*make precompute"):
        Cache(tmp_path)

    from safetensors.torch import save_file

    path = tmp_path / "future.safetensors"
    save_file({"x": torch.zeros(1)}, path, metadata={"format": "cachedit-shards", "format_version": "2"})
    with pytest.raises(FormatError, match="version '2'|version 2"):
        ShardReader(path)


def test_missing_cache_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="make precompute"):
        Cache(tmp_path / "nothing")


def test_append_with_same_fingerprint_extends_the_cache(tmp_path):
    write_cache(tmp_path, range(10))
    write_cache(tmp_path, range(10, 16))
    cache = Cache(tmp_path)
    assert len(cache) == 16
    assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(16)]
    assert verify(tmp_path).ok


def test_append_with_other_fingerprint_is_refused_naming_fields(tmp_path):
    write_cache(tmp_path, range(4))
    before = (tmp_path / "index.json").read_bytes()
    other = {"vae": {"id": "other-vae", "scaling_factor": 0.13025}, "text_encoder": {"id": "tiny-t5", "max_length": 512}}
    with pytest.raises(FingerprintMismatch) as e:
        ShardWriter(tmp_path, other, SCHEMA)
    msg = str(e.value)
    assert "vae.id: cache='tiny-vae' run='other-vae'" in msg
    assert "text_encoder.max_length: cache=300 run=512" in msg
    assert Manifest.load(tmp_path / "index.json").fingerprint_sha256 in msg or "fingerprint" in msg
    assert (tmp_path / "index.json").read_bytes() == before


def test_bad_samples_are_refused_before_anything_is_written(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        key, bucket, fields = make_sample(1)
        with pytest.raises(ValueError, match="key00001: field latent_mean holds NaN"):
            w.write(key, bucket, {**fields, "latent_mean": torch.full_like(fields["latent_mean"], float("nan"))})
        with pytest.raises(ValueError, match="float32, the schema says torch.bfloat16"):
            w.write(key, bucket, {**fields, "text": fields["text"].float()})
        with pytest.raises(ValueError, match="do not match the schema"):
            w.write(key, bucket, {"text": fields["text"]})
        w.write(key, bucket, fields)
        with pytest.raises(ValueError, match=r"shape \[4, 3, 3\], bucket 48x80 has \[4, 6, 10\]"):
            w.write("other", bucket, {**fields, "latent_mean": torch.zeros(4, 3, 3, dtype=torch.bfloat16)})
    assert len(Cache(tmp_path)) == 1


def test_two_ranks_then_merge_equal_one_writer(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    write_cache(single, range(30), max_shard_samples=4)
    writers = [ShardWriter(multi, FINGERPRINT, SCHEMA, rank=r, world_size=2, max_shard_samples=4) for r in range(2)]
    for i in range(30):
        writers[i % 2].write(*make_sample(i))
    for w in writers:
        w.finish()
    names = sorted(p.name for p in multi.glob("index*.json"))
    assert names == ["index.rank-00000.json", "index.rank-00001.json"]
    with pytest.raises(FormatError, match="unmerged"):
        Cache(multi)
    merged = merge(multi)
    assert sorted(p.name for p in multi.glob("index*.json")) == ["index.json"]
    assert merge(multi).num_samples == merged.num_samples == 30  # idempotent
    a, b = Cache(single), Cache(multi)
    digests = lambda c: {k: c.shard(c.locate(i)[0]).digest(c.locate(i)[1]) for k, i in c.keys()}  # noqa: E731
    assert digests(a) == digests(b)
    assert {p.split("/")[1][:6] for p in (s.path for s in b.shards)} == {"r00000", "r00001"}
    assert verify(multi).ok


def test_one_writer_per_rank(tmp_path):
    w = ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    with pytest.raises(RuntimeError, match="another process is writing rank 0"):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    w.finish()
    ShardWriter(tmp_path, FINGERPRINT, SCHEMA).finish()


def test_reading_one_sample_touches_only_its_bytes(tmp_path):
    # 64 samples of 64 KiB latents in one shard: reading one sample must not read the shard.
    big = {"x": Field(torch.float32)}
    with ShardWriter(tmp_path, {"v": 1}, big) as w:
        for i in range(64):
            w.write(f"s{i}", (8, 8), {"x": torch.full((16, 1024), float(i))})
    reader = ShardReader(next(tmp_path.glob("8x8/*.safetensors")))
    x = reader[37]["x"]
    assert x.untyped_storage().nbytes() >= 64 * 16 * 1024 * 4  # a view on the mapping, no copy made
    assert float(x[0, 0]) == 37.0
    x += 1  # copy-on-write: the file is untouched
    assert float(ShardReader(reader.path)[37]["x"][0, 0]) == 37.0


def test_format_doc_snippet_reads_the_cache(tmp_path):
    """The stock-safetensors recipe in FORMAT.md stays true."""
    from pathlib import Path

    write_cache(tmp_path, [0, 3, 6])
    doc = (Path(__file__).resolve().parents[1] / "shards" / "FORMAT.md").read_text()
    code = doc.split("## Reading with nothing but `safetensors`")[1].split("```python")[1].split("```")[0]
    scope = {}
    exec(code.replace("CACHE/", f"{tmp_path}/"), scope)
    assert scope["key"] == "key00006"
    for name, t in make_sample(6)[2].items():
        assert torch.equal(scope["sample"][name], t)


def test_remove_rewrites_only_affected_shards_in_one_commit(tmp_path):
    manifest = write_cache(tmp_path, range(24), max_shard_samples=4)
    untouched = {s.path for s in manifest.shards if s.bucket == Bucket(48, 80)}
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove({"key00000", "key00003", "key00002", "nope"}) == 3
    cache = Cache(tmp_path)
    assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(24) if i not in (0, 2, 3)]
    assert untouched <= {s.path for s in cache.shards}
    for key, i in cache.keys():
        n = int(key[3:])
        assert torch.equal(cache[i]["latent_mean"], make_sample(n)[2]["latent_mean"])
    assert verify(tmp_path).ok  # retired files deleted, no orphans


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
    (tmp_path / "prompts.safetensors").write_bytes(b"garbage")
    assert verify(tmp_path).bad_files == [str(tmp_path / "prompts.safetensors")]
