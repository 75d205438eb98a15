"""Round trip, golden header, stock safetensors, versions, fingerprints, appends, ranks and merge."""

import json
import struct

import pytest
import torch
from conftest import BUCKETS, FINGERPRINT, SCHEMA, make_sample, write_cache
from safetensors import safe_open

from shards import (
    Bucket,
    Cache,
    Field,
    FingerprintMismatch,
    FormatError,
    ShardReader,
    ShardWriter,
    verify,
)
from shards.log import snapshots
from shards.schema import BASE_VERSION


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
    assert meta["format_version"] == str(BASE_VERSION) and meta["bucket"] == "64x64"  # shards keep the layout of 2
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
        "format_version": "2",
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
    with pytest.raises(FormatError, match=r"version 99.*Upgrade the library.*shards upgrade"):
        Cache(tmp_path)

    from safetensors.torch import save_file

    path = tmp_path / "future.safetensors"
    save_file({"x": torch.zeros(1)}, path, metadata={"format": "cachedit-shards", "format_version": "3"})
    with pytest.raises(FormatError, match="version '3'|version 3"):
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
    before = sorted(p.name for p in (tmp_path / "_log").iterdir())
    other = {"vae": {"id": "other-vae", "scaling_factor": 0.13025}, "text_encoder": {"id": "tiny-t5", "max_length": 512}}
    with pytest.raises(FingerprintMismatch) as e:
        ShardWriter(tmp_path, other, SCHEMA)
    msg = str(e.value)
    assert "vae.id: cache='tiny-vae' run='other-vae'" in msg
    assert "text_encoder.max_length: cache=300 run=512" in msg
    assert "fingerprint" in msg
    assert sorted(p.name for p in (tmp_path / "_log").iterdir()) == before  # nothing committed


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


def test_two_ranks_commit_into_one_log_and_equal_one_writer(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    write_cache(single, range(30), max_shard_samples=4)
    writers = [ShardWriter(multi, FINGERPRINT, SCHEMA, rank=r, max_shard_samples=4) for r in range(2)]
    for i in range(30):  # interleaved: each takes the next generation number the other left free
        writers[i % 2].write(*make_sample(i))
    for w in writers:
        w.finish()
    a, b = Cache(single), Cache(multi)
    digests = lambda c: {k: c.shard(c.locate(i)[0]).digest(c.locate(i)[1]) for k, i in c.keys()}  # noqa: E731
    assert digests(a) == digests(b)
    assert {p.split("/")[1][:6] for p in (s.path for s in b.shards)} == {"r00000", "r00001"}
    generations = sorted(int(p.stem) for p in (multi / "_log").glob("*.json"))
    assert generations == list(range(len(generations)))  # one commit per shard, no number taken twice
    assert verify(multi).ok


def test_one_writer_per_rank_and_no_key_twice(tmp_path):
    from shards import CacheBusy

    w = ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    with pytest.raises(CacheBusy, match="rank 0 of the cache .* is being written by pid"):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    w.write(*make_sample(0))
    with pytest.raises(ValueError, match="key00000 is already in the cache"):
        w.write(*make_sample(0))
    w.finish()
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        with pytest.raises(ValueError, match="already in the cache"):
            w.write(*make_sample(0))
    assert len(Cache(tmp_path)) == 1


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


@pytest.mark.parametrize("history", ["one commit", "a snapshot, then an add and a removal"])
def test_format_doc_snippet_reads_the_cache(tmp_path, monkeypatch, history):
    """The stock-safetensors recipe in FORMAT.md stays true, from the log alone and from a snapshot plus the log."""
    from pathlib import Path

    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 3)
    write_cache(tmp_path, [0, 3, 6])  # generation 0: one shard of 64x64
    if history != "one commit":
        write_cache(tmp_path, [9])
        write_cache(tmp_path, [12])  # generation 2: snapshotted
        write_cache(tmp_path, [1])  # generation 3: an add after the snapshot
        with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
            w.remove({"key00012"})  # generation 4: a removal after the snapshot
        assert snapshots(tmp_path) == [2]
    doc = (Path(__file__).resolve().parents[2] / "shards" / "FORMAT.md").read_text()
    code = doc.split("## Reading with nothing but `safetensors`")[1].split("```python")[1].split("```")[0]
    scope = {}
    exec(code.replace("CACHE/", f"{tmp_path}/"), scope)
    assert list(scope["shards"]) == [s.path for s in Cache(tmp_path).shards]
    assert scope["key"] == "key00006"
    for name, t in make_sample(6)[2].items():
        assert torch.equal(scope["sample"][name], t)
