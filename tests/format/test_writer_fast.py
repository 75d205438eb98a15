"""The streaming shard writer keeps every guarantee: shard files byte for byte those the previous encoding wrote (the
fields stacked or concatenated, saved by safetensors, the header made canonical), NaN and Inf refused naming the
sample and the field, per-sample digests equal to `sample_digest`, the file's sha256 in the manifest, input tensors of
any layout written as they read, contiguous ones never copied, and a hashing thread's failure failing the shard."""

import hashlib
import json
import struct

import numpy as np
import pytest
import torch

import shards.encode
from shards import Cache, Field, ShardWriter, verify
from shards.buckets import Bucket
from shards.encode import check_sample, encode_shard
from shards.reader import ShardReader
from shards.schema import BASE_VERSION, DIGEST, FORMAT_NAME, KEY, OFFSETS_SUFFIX, sample_digest, schema_to_json, serialize
from shards.texts import TEXT_KEYS, key_rows

SCHEMA = {"f64": Field(torch.float64), "f32": Field(torch.float32, ragged=True), "f16": Field(torch.float16),
          "bf16": Field(torch.bfloat16, ragged=True), "i64": Field(torch.int64), "i32": Field(torch.int32, ragged=True),
          "i16": Field(torch.int16), "i8": Field(torch.int8), "u8": Field(torch.uint8, ragged=True), "flag": Field(torch.bool),
          "Zeta": Field(torch.bfloat16)}  # every stored dtype, fixed and ragged, a 0-dim field, a name sorting before "_"


def golden_sample(i: int) -> dict[str, torch.Tensor]:
    """Values from arithmetic only (no random generator), the same in every torch version; ragged rows 0 to 3."""
    n = i % 4
    a = torch.arange(24, dtype=torch.float64) * (i + 1) / 7
    return {"f64": a[:6].reshape(2, 3), "f32": a[: n * 2].float().reshape(n, 2), "f16": a[:4].half(),
            "bf16": (a[: n * 3] - 5).bfloat16().reshape(n, 3), "i64": torch.tensor([i, -i, 2**40 + i]),
            "i32": torch.arange(n, dtype=torch.int32) - i, "i16": torch.tensor([i * 300, -7], dtype=torch.int16),
            "i8": torch.tensor([-i], dtype=torch.int8), "u8": torch.tensor(list(f"s{i}".encode()), dtype=torch.uint8),
            "flag": torch.tensor(i % 2 == 0), "Zeta": a[:8].bfloat16().reshape(2, 4)}


# sha256 of the shard files the writer wrote before it streamed shards (stack/cat, safetensors.torch.save, the header
# made canonical), for `write_golden` and `write_golden_texts`
GOLDEN = {
    "32x96/r00000-000000.safetensors": "99276fe0351c9212ef9910d58c2e6d9fa6202b8f0e161607c9d6db56c957cfc7",
    "32x96/r00000-000001.safetensors": "a41a2875c888ef7e41a534c253f2f180acf9353574be56a46ff3cdc8355508fb",
    "64x64/r00000-000000.safetensors": "c23521bdd31fa109e4d540127846ae9fd2114a5cf4983335a60f4264510e5601",
    "64x64/r00000-000001.safetensors": "7cfa646ef5b404a54449ecfc11c7547348f72b0ac9e2149dc91d97a2de6f823e",
}
GOLDEN_TEXTS = {
    "64x64/r00000-000000.safetensors": "2912784c74356433426ae1f0ff2d8385b2309c065c64f65167e62ec5a59e1736",
    "64x64/r00000-000001.safetensors": "07323be10c2dd46316c6e3da28cf9236d1b849f657e7caf53d765bcc3a26f92a",
    "texts/r00000-000000.safetensors": "d7b9488ce48c571ea0cde2e8963b4f3fcc02d0b72cd66f09cfbe86fca2413304",
}


def write_golden(root) -> None:
    with ShardWriter(root, {"golden": 1}, SCHEMA, max_shard_samples=5) as w:
        for i in range(13):
            w.write(f"k{i:03d}", [(64, 64), (32, 96)][i % 2], golden_sample(i), source=f"src/{i}", stamp=i)


def write_golden_texts(root) -> None:
    texts = {"text": Field(torch.bfloat16, ragged=True), "pooled": Field(torch.float32, ragged=True)}
    schema = {"latent": Field(torch.bfloat16), TEXT_KEYS: Field(torch.uint8, ragged=True)}
    with ShardWriter(root, {"golden": 2}, schema, text_schema=texts, max_shard_samples=4) as w:
        for i in range(6):
            keys = [w.write_text(c, {"text": torch.arange(len(c) * 4, dtype=torch.float32).reshape(-1, 4).bfloat16(),
                                     "pooled": torch.full((1, 3), float(len(c)))}) for c in (f"caption {j}" for j in range(i % 3))]
            w.write(f"t{i:03d}", (64, 64), {"latent": torch.arange(16, dtype=torch.float32).reshape(4, 4).bfloat16() * i,
                                            TEXT_KEYS: key_rows(keys)}, source=f"src/{i}")


def shard_hashes(root) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.safetensors")) if "_snapshots" not in p.parts}


def old_serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """`shards.schema.serialize` as it was: safetensors' bytes, the header re-emitted with sorted keys."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.dumps(json.loads(data[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    assert len(header) <= n
    return data[:8] + header + b" " * (n - len(header)) + data[8 + n :]


def old_encode_shard(bucket, items, schema, shapes, fingerprint_sha256, rank, kind=None) -> tuple[bytes, dict[str, int]]:
    """`shards.encode.encode_shard` as it was: every field stacked (or concatenated, with offsets) into one tensor."""
    tensors, field_bytes = {}, {}
    for name, spec in schema.items():
        rows = [fields[name] for _, fields, _, _ in items]
        if spec.ragged:
            tensors[name] = torch.cat(rows)
            tensors[name + OFFSETS_SUFFIX] = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64).cumsum(0)
        else:
            tensors[name] = torch.stack(rows)
        field_bytes[name] = sum(t.numel() * t.element_size() for k, t in tensors.items() if k in (name, name + OFFSETS_SUFFIX))
    keys = [k.encode("ascii") for k, *_ in items]
    tensors[KEY] = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8)
    tensors[KEY + OFFSETS_SUFFIX] = torch.tensor([0] + [len(k) for k in keys], dtype=torch.int64).cumsum(0)
    tensors[DIGEST] = torch.frombuffer(bytearray(b"".join(sample_digest(k, f) for k, f, _, _ in items)), dtype=torch.uint8).view(len(items), -1)
    metadata = {"format": FORMAT_NAME, "format_version": str(BASE_VERSION), "bucket": bucket.name, "samples": str(len(items)),
                "fields": json.dumps(schema_to_json(schema), sort_keys=True), "shapes": json.dumps(shapes, sort_keys=True),
                "fingerprint_sha256": fingerprint_sha256, "rank": str(rank)}
    if kind is not None:
        metadata["kind"] = kind
    return old_serialize(tensors, metadata), field_bytes


@pytest.fixture(params=["inline", "threads"])
def hashing(request, monkeypatch):
    """Hashing on the writing thread (a small shard), and on hashing threads (as a large shard is); the device's
    writeback started every 100 bytes written."""
    monkeypatch.setattr(shards.encode, "WRITEBACK_BYTES", 100)
    if request.param == "threads":
        monkeypatch.setattr(shards.encode, "THREADS_MIN_BYTES", 0)
        monkeypatch.setattr(shards.encode, "HASH_THREADS", 2)
    return request.param


def checked_items(bucket: Bucket, indices, schema=SCHEMA):
    items, shapes = [], {}
    for i in indices:
        shapes, fields = check_sample(f"k{i:03d}", bucket, golden_sample(i), schema, shapes, True)
        items.append((f"k{i:03d}", fields, "", 0))
    return items, shapes


@pytest.mark.parametrize("indices", [[0], [1, 2, 3], list(range(9)), [0, 4, 8]])  # [0, 4, 8]: every ragged row empty
def test_a_shard_is_byte_identical_to_the_previous_encoding(hashing, indices):
    bucket = Bucket(64, 64)
    items, shapes = checked_items(bucket, indices)
    for kind in (None, "texts"):
        encoded, field_bytes = encode_shard(bucket, items, SCHEMA, shapes, "ab" * 32, 3, kind)
        old, old_field_bytes = old_encode_shard(bucket, items, SCHEMA, shapes, "ab" * 32, 3, kind)
        assert bytes(encoded) == old and len(encoded) == len(old)
        assert encoded.sha256 == hashlib.sha256(old).hexdigest()
        assert field_bytes == old_field_bytes


def test_caches_keep_the_bytes_the_previous_writer_wrote(hashing, tmp_path):
    write_golden(tmp_path / "a")
    assert shard_hashes(tmp_path / "a") == GOLDEN
    write_golden_texts(tmp_path / "b")
    assert shard_hashes(tmp_path / "b") == GOLDEN_TEXTS
    assert verify(tmp_path / "a").ok and verify(tmp_path / "b").ok


def test_serialize_writes_what_it_wrote_before():
    tensors = {f"t{dtype}"[7:]: torch.arange(6).to(dtype).reshape(2, 3) for dtype in
               (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
                torch.uint8, torch.bool)}
    tensors |= {"empty": torch.zeros(0, 4, dtype=torch.int64), "scalar": torch.tensor(7, dtype=torch.int32),
                "empty_strided": torch.empty(0, dtype=torch.int64).expand(0), "B": torch.ones(3, dtype=torch.uint8)}
    for metadata in ({"format": FORMAT_NAME, "kind": "snapshot", "x": "a \"quoted\" \\ value\n"}, {}):
        assert serialize(tensors, metadata) == old_serialize(tensors, metadata)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_naming_the_sample_and_the_field(tmp_path, dtype, ragged, bad):
    schema = {"latent": Field(dtype, ragged=ragged), "size": Field(torch.int32)}
    with ShardWriter(tmp_path, {"f": 1}, schema) as w:
        w.write("good", (64, 64), {"latent": torch.ones(3, 4, dtype=dtype), "size": torch.tensor([1], dtype=torch.int32)})
        values = torch.ones(3, 4, dtype=dtype)
        values[2, 1] = bad
        with pytest.raises(ValueError, match=r"^sample bad0: field latent holds NaN or Inf$"):
            w.write("bad0", (64, 64), {"latent": values, "size": torch.tensor([1], dtype=torch.int32)})
        assert not w.listed("bad0")
    assert [s.key for s in Cache(tmp_path)] == ["good"]


@pytest.mark.parametrize("dtype,big", [(torch.float16, 65504.0), (torch.bfloat16, 3.3e38), (torch.float32, 3.4e38),
                                       (torch.float64, 1.7e308)])
def test_finite_values_whose_sum_overflows_are_kept(tmp_path, dtype, big):
    """The finite check sums a field; a sum that overflows from finite values is not a NaN or an Inf in the field."""
    values = torch.full((64, 8), big, dtype=dtype)
    values[0, 0] = -big
    assert not torch.isfinite(values.sum())
    with ShardWriter(tmp_path, {"f": 1}, {"latent": Field(dtype)}) as w:
        w.write("big", (64, 64), {"latent": values})
    assert torch.equal(Cache(tmp_path)[0].fields["latent"], values)


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [[float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")],
                                 [float("-inf"), float("inf"), float("nan")]])
def test_finite_catches_every_nan_and_inf_among_ordinary_and_extreme_values(dtype, bad):
    """NaN, +Inf, -Inf and an +Inf/-Inf pair (whose sum is NaN) are caught in ordinary values and beside values whose
    sum overflows (the check then goes value by value)."""
    top = torch.finfo(dtype).max
    for fill in (1.0, top):
        values = torch.full((16, 128, 128), fill, dtype=dtype)
        values[1::2] *= -1 if fill == top else 1
        for i, b in enumerate(bad):
            values[i, 5 + i, 7] = b
        assert not shards.encode.finite(values), (dtype, bad, fill)
        assert not shards.encode.finite(values.transpose(0, 2)), (dtype, bad, fill)  # any layout


@pytest.mark.parametrize("dtype", FLOATS)
def test_finite_keeps_values_near_the_dtypes_limits(dtype):
    info = torch.finfo(dtype)
    for values in (torch.tensor([info.max, info.max, -info.max, info.max], dtype=dtype),
                   torch.full((64, 8), info.max, dtype=dtype), torch.full((64, 8), -info.max, dtype=dtype),
                   torch.tensor([info.tiny, -info.tiny, info.eps, info.smallest_normal / 4, 0.0, -0.0], dtype=dtype)):
        assert shards.encode.finite(values), (dtype, values)


@pytest.mark.parametrize("dtype", FLOATS)
def test_ordinary_values_are_settled_by_the_sum_alone(dtype, monkeypatch):
    """Values of ordinary magnitude never take the value-by-value check: a float16 latent of values near 1 overflows a
    float16 sum, so it is summed into a float32 result."""
    values = (torch.rand(16, 128, 128, generator=torch.Generator().manual_seed(0)) + 0.5).to(dtype)

    def isfinite(_):
        raise AssertionError("the value-by-value check ran")

    monkeypatch.setattr(torch, "isfinite", isfinite)
    assert shards.encode.finite(values)
    assert shards.encode.finite(torch.randn(300, 2304, generator=torch.Generator().manual_seed(1)).to(dtype) * 4)


def test_a_text_with_nan_is_refused_and_check_finite_off_keeps_it(tmp_path):
    texts = {"text": Field(torch.bfloat16, ragged=True)}
    schema = {"latent": Field(torch.bfloat16), TEXT_KEYS: Field(torch.uint8, ragged=True)}
    nan = torch.tensor([[1.0, float("nan")]]).bfloat16()
    with ShardWriter(tmp_path / "a", {"f": 1}, schema, text_schema=texts) as w:
        with pytest.raises(ValueError, match=r"text 'a cat': field text holds NaN or Inf"):
            w.write_text("a cat", {"text": nan})
    with ShardWriter(tmp_path / "b", {"f": 1}, {"latent": Field(torch.bfloat16)}, check_finite=False) as w:
        w.write("nan", (64, 64), {"latent": nan})
    assert torch.equal(Cache(tmp_path / "b")[0].fields["latent"].isnan(), nan.isnan())


def test_digests_and_the_file_sha256_match_what_is_on_disk(hashing, tmp_path):
    write_golden(tmp_path)
    cache = Cache(tmp_path)
    for j, entry in enumerate(cache.manifest.shards):
        data = (tmp_path / entry.path).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.bytes == len(data)
        reader = ShardReader(tmp_path / entry.path)
        for row, key in enumerate(reader.keys):
            assert reader.digest(row) == sample_digest(key, golden_sample(int(key[1:])))
    assert verify(tmp_path).ok


def test_inputs_of_any_layout_are_written_as_they_read(hashing, tmp_path):
    schema = {"latent": Field(torch.bfloat16), "text": Field(torch.float32, ragged=True), "mask": Field(torch.bool)}

    def sample(i, contiguous):
        latent = torch.arange(48, dtype=torch.float32).reshape(4, 12).bfloat16().t() + i  # (12, 4), transposed
        text = torch.arange(40, dtype=torch.float32).reshape(5, 8)[:, ::2] * i  # (5, 4), every other column
        mask = torch.tensor([True, False]).expand(3, 2)  # stride 0
        fields = {"latent": latent, "text": text, "mask": mask}
        return {k: v.contiguous() for k, v in fields.items()} if contiguous else fields

    for name, contiguous in (("strided", False), ("contiguous", True)):
        with ShardWriter(tmp_path / name, {"f": 1}, schema) as w:
            for i in range(4):
                w.write(f"k{i}", (64, 64), sample(i, contiguous))
    assert shard_hashes(tmp_path / "strided") == shard_hashes(tmp_path / "contiguous")
    for s in Cache(tmp_path / "strided"):
        assert all(torch.equal(s.fields[k], v) for k, v in sample(int(s.key[1:]), False).items())
    reader = ShardReader(tmp_path / "strided" / next(iter(shard_hashes(tmp_path / "strided"))))
    assert [reader.digest(row) for row in range(4)] == [sample_digest(key, sample(int(key[1:]), True)) for key in reader.keys]
    assert verify(tmp_path / "strided").ok


def test_a_contiguous_field_is_written_from_its_own_memory():
    """No copy of a shard is made: the file's buffers are the samples' tensors themselves."""
    bucket = Bucket(64, 64)
    items, shapes = checked_items(bucket, range(5))
    encoded, _ = encode_shard(bucket, items, SCHEMA, shapes, "0" * 64, 0)
    addresses = {buf.ctypes.data for buf in encoded.buffers() if isinstance(buf, np.ndarray) and buf.nbytes}
    for _, fields, _, _ in items:
        assert {t.data_ptr() for t in fields.values() if t.numel()} <= addresses


def test_a_failing_digest_fails_the_shard_and_nothing_is_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(shards.encode, "THREADS_MIN_BYTES", 0)
    monkeypatch.setattr(shards.encode, "HASH_THREADS", 2)
    write_golden(tmp_path)
    real = shards.encode.sample_digest

    def digest(key, fields):
        if key == "k102":
            raise MemoryError("no memory for the digest")
        return real(key, fields)

    monkeypatch.setattr(shards.encode, "sample_digest", digest)
    w = ShardWriter(tmp_path, {"golden": 1}, SCHEMA, max_shard_samples=3)
    w.write("k101", (64, 64), golden_sample(1))
    w.write("k102", (64, 64), golden_sample(2))
    with pytest.raises(MemoryError, match="no memory for the digest"):
        w.write("k103", (64, 64), golden_sample(3))
    w.close()
    assert not list(tmp_path.rglob("*.tmp"))
    assert shard_hashes(tmp_path) == GOLDEN and len(Cache(tmp_path)) == 13
    monkeypatch.undo()
    with ShardWriter(tmp_path, {"golden": 1}, SCHEMA) as w:  # the next writer removes what the failed one renamed, if any
        w.write("k101", (64, 64), golden_sample(1))
    assert len(Cache(tmp_path)) == 14 and verify(tmp_path).ok
