"""Samples on their way into a shard: each checked against the schema as it is written, then a bucket's
samples encoded into the bytes of one shard file (one tensor per field, offsets of the ragged ones, the keys
and a digest per sample: what `ShardReader` reads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from shards.buckets import Bucket
from shards.schema import (
    BASE_VERSION,
    DIGEST,
    FORMAT_NAME,
    KEY,
    OFFSETS_SUFFIX,
    Schema,
    sample_digest,
    schema_to_json,
    serialize,
)

Item = tuple[str, dict[str, torch.Tensor], str, int]  # a sample to encode: (key, fields, source, stamp)


def check_stamp(key: str, stamp: int) -> None:
    if isinstance(stamp, (bool, float, str)) or not 0 <= int(stamp) < 2**63:
        raise ValueError(f"sample {key}: stamp {stamp!r} is not a 63-bit digest (an int in [0, 2**63))")


def check_sample(key: str, bucket: Bucket, sample: Mapping[str, torch.Tensor], schema: Schema,
                 known: dict[str, list], check_finite: bool) -> tuple[dict[str, list], dict[str, torch.Tensor]]:
    """A sample's shapes (per field, as a bucket's shapes are recorded) and its fields as contiguous CPU tensors.

    Args:
        known: the shapes recorded for the sample's bucket so far (empty for a new bucket).
        check_finite: refuse floating fields holding NaN or Inf.

    Raises:
        ValueError: the sample does not fit the schema or the bucket's shapes, or holds NaN/Inf.
    """
    if set(sample) != set(schema):
        raise ValueError(f"sample {key}: fields {sorted(sample)} do not match the schema {sorted(schema)}")
    shapes, fields = {}, {}
    for name, spec in schema.items():
        t = sample[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"sample {key}: field {name} is a {type(t).__name__}, not a tensor")
        if t.dtype != spec.dtype:
            raise ValueError(f"sample {key}: field {name} is {t.dtype}, the schema says {spec.dtype}")
        if spec.ragged and t.dim() == 0:
            raise ValueError(f"sample {key}: ragged field {name} needs at least one dim")
        shape = [None, *t.shape[1:]] if spec.ragged else list(t.shape)
        expected = shapes[name] = known.get(name, shape)
        if list(expected) != shape:
            raise ValueError(f"sample {key}: field {name} has shape {list(t.shape)}, bucket {bucket} has {expected}")
        if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"sample {key}: field {name} holds NaN or Inf")
        fields[name] = t.detach().to("cpu").contiguous()
    return shapes, fields


def encode_shard(bucket: Bucket, items: list[Item], schema: Schema, shapes: dict[str, list],
                 fingerprint_sha256: str, rank: int, kind: str | None = None) -> tuple[bytes, dict[str, int]]:
    """The bytes of a shard holding `items`, and per field the bytes it occupies (offsets included).

    Args:
        shapes: the bucket's per-field shapes, recorded in the shard's metadata.
        rank: the global rank of the writer, recorded too.
        kind: the file's `kind` metadata (`"texts"` for a text shard; none for a shard of samples).
    """
    tensors: dict[str, torch.Tensor] = {}
    field_bytes: dict[str, int] = {}
    for name, spec in schema.items():
        rows = [fields[name] for _, fields, _, _ in items]
        if spec.ragged:
            lengths = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64)
            tensors[name] = torch.cat(rows)  # (sum L_i, *trailing)
            tensors[name + OFFSETS_SUFFIX] = lengths.cumsum(0)  # (N + 1,)
        else:
            tensors[name] = torch.stack(rows)  # (N, *shape)
        field_bytes[name] = sum(
            t.numel() * t.element_size() for k, t in tensors.items() if k in (name, name + OFFSETS_SUFFIX)
        )
    keys = [k.encode("ascii") for k, *_ in items]
    tensors[KEY] = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8)
    tensors[KEY + OFFSETS_SUFFIX] = torch.tensor([0] + [len(k) for k in keys], dtype=torch.int64).cumsum(0)
    digests = b"".join(sample_digest(key, fields) for key, fields, _, _ in items)
    tensors[DIGEST] = torch.frombuffer(bytearray(digests), dtype=torch.uint8).view(len(items), -1)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(BASE_VERSION),
        "bucket": bucket.name,
        "samples": str(len(items)),
        "fields": json.dumps(schema_to_json(schema), sort_keys=True),
        "shapes": json.dumps(shapes, sort_keys=True),
        "fingerprint_sha256": fingerprint_sha256,
        "rank": str(rank),
    }
    if kind is not None:
        metadata["kind"] = kind
    return serialize(tensors, metadata), field_bytes
