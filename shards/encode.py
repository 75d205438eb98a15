"""Samples on their way into a shard: each checked against the schema as it is written, then a bucket's
samples encoded into the bytes of one shard file (one tensor per field, offsets of the ragged ones, the keys
and a digest per sample: what `ShardReader` reads).

A shard is never assembled in memory: `encode_shard` lays the file out (its header, then views of the samples' own
tensors in file order) and `EncodedShard.write_to` streams those views to the file, computing the file's sha256 over the
same buffers as they are written, while the samples' blake2b digests run on hashing threads (hashlib releases the GIL).
Each byte of a sample is read three times (digest, file sha256, write) and copied once, into the page cache; the device
starts writing it while the rest of the shard is hashed and written, so the fsync that publishes the shard waits less.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import numpy as np
import torch

from shards.atomic import start_writeback
from shards.buckets import Bucket
from shards.schema import (
    BASE_VERSION,
    DIGEST,
    DIGEST_SIZE,
    FORMAT_NAME,
    KEY,
    OFFSETS_SUFFIX,
    Schema,
    safetensors_header,
    sample_digest,
    schema_to_json,
    tensor_bytes,
)

# Digests and the file's sha256 run on threads beside the writing one when a shard is at least this big (below it,
# starting threads costs more than it saves): HASH_THREADS digest threads and one for the sha256, when the process may
# use more than one core.
THREADS_MIN_BYTES = 4 << 20
WRITEBACK_BYTES = 16 << 20  # a large shard's bytes go to the device in steps of this many as they are written
HASH_THREADS = 2 if (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) > 1 else 0

Item = tuple[str, dict[str, torch.Tensor], str, int]  # a sample to encode: (key, fields, source, stamp)


def check_stamp(key: str, stamp: int) -> None:
    if isinstance(stamp, (bool, float, str)) or not 0 <= int(stamp) < 2**63:
        raise ValueError(f"sample {key}: stamp {stamp!r} is not a 63-bit digest (an int in [0, 2**63))")


def finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf. One sum, no boolean copy of the tensor: a NaN or an Inf makes the
    sum NaN or Inf (whatever it is accumulated in), so a finite sum proves every value finite; a sum that is not
    finite (finite values can overflow it) is settled value by value.

    The sum must not overflow for ordinary values, or every field pays both: float16 (largest value 65504; a latent of
    values near 1 sums past it) is summed into a float32 result. bfloat16 has float32's range and torch accumulates it
    in float32, so its own sum overflows only where a float32 one would, at 2-3x less cost than asking for a float32
    result; float32 and float64 sum in their own dtype (a float64 sum of float32 costs ~10x and is needed only for
    sums beyond 3e38)."""
    return math.isfinite(t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()) or bool(torch.isfinite(t).all())


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
        if check_finite and t.is_floating_point() and not finite(t):
            raise ValueError(f"sample {key}: field {name} holds NaN or Inf")
        fields[name] = t.detach().to("cpu").contiguous()
    return shapes, fields


def hash_threads(nbytes: int) -> int:
    """Threads to compute the digests of a shard of `nbytes` with, beside the writing thread (0: all on it)."""
    return HASH_THREADS if nbytes >= THREADS_MIN_BYTES else 0


class EncodedShard:
    """The bytes of one shard file, not joined: its header, then the data of each tensor as views of the samples' own
    tensors, in file order. `len()` is the file's size; `sha256` its hex digest once written (or computed on demand).

    Args:
        header: the file's first bytes (`safetensors_header`).
        pieces: the data, in file order: buffers, and the digests' bytes as hashing threads fill them.
        threads: hash the file beside the writing thread (else as each piece is written, on it).
    """

    def __init__(self, header: bytes, pieces: list, threads: bool = False):
        self._pieces = [header, *pieces]
        self._size = sum(_nbytes(p) for p in self._pieces)
        self._threads = threads
        self._hashing: threading.Thread | None = None
        self._sha256: str | None = None
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers())

    def buffers(self) -> Iterator:
        """The file's bytes in order, as buffers: the header, then views of the samples' tensors (and the few bytes of
        offsets, keys and digests; the digests once the hashing threads are done)."""
        for piece in self._pieces:
            yield piece.result() if isinstance(piece, _Digests) else piece

    def write_to(self, f: BinaryIO) -> None:
        """Write the file's bytes to `f` (open for writing, at its start), its sha256 computed over the same buffers: on a
        thread beside this one, or here as each buffer is written (still in the CPU's cache)."""
        h = None if self._threads else hashlib.sha256()
        if self._threads:
            self._hashing = threading.Thread(target=self._hash, name="shard-sha256", daemon=True)
            self._hashing.start()
        written = started = 0
        for buf in self.buffers():
            f.write(buf)
            if h is not None:
                h.update(buf)
            written += _nbytes(buf)
            if written - started >= WRITEBACK_BYTES:  # the device writes while the rest is hashed and written
                f.flush()
                start_writeback(f.fileno(), started, written - started)
                started = written
        if h is not None:
            self._sha256 = h.hexdigest()

    def _hash(self) -> None:
        try:
            h = hashlib.sha256()
            for buf in self.buffers():
                h.update(buf)
            self._sha256 = h.hexdigest()
        except BaseException as e:  # raised by `sha256`, on the thread that asks
            self._error = e

    @property
    def sha256(self) -> str:
        """The file's sha256 (hex). After `write_to` it was computed beside the writing (this waits for it: the fsync of
        a publication runs meanwhile); else it is computed now."""
        if self._hashing is not None:
            self._hashing.join()
            self._hashing = None
            if self._error is not None:
                raise self._error
        if self._sha256 is None:
            h = hashlib.sha256()
            for buf in self.buffers():
                h.update(buf)
            self._sha256 = h.hexdigest()
        return self._sha256


def _nbytes(piece) -> int:
    return piece.nbytes if isinstance(piece, np.ndarray) else len(piece) if isinstance(piece, bytes) else piece.size


class _Digests:
    """The bytes of a shard's `__digest__` tensor, each sample's digest, computed by hashing threads: `size` is known
    before they are, `result()` waits for them."""

    def __init__(self, parts: list[Future], size: int):
        self.parts, self.size = parts, size

    def result(self) -> bytes:
        return b"".join(part.result() for part in self.parts)


def encode_shard(bucket: Bucket, items: list[Item], schema: Schema, shapes: dict[str, list],
                 fingerprint_sha256: str, rank: int, kind: str | None = None) -> tuple[EncodedShard, dict[str, int]]:
    """The bytes of a shard holding `items` (streamed from the samples' tensors, see `EncodedShard`), and per field
    the bytes it occupies (offsets included).

    The file is byte for byte the one written since the first cache (the fields stacked, or concatenated with
    offsets when ragged, saved with safetensors and its header made canonical by `shards.schema.serialize`).

    Args:
        shapes: the bucket's per-field shapes, recorded in the shard's metadata.
        rank: the global rank of the writer, recorded too.
        kind: the file's `kind` metadata (`"texts"` for a text shard; none for a shard of samples).
    """
    n = len(items)
    tensors: list[tuple[str, torch.dtype, list[int]]] = []
    data: list[list] = []  # per tensor, its pieces
    field_bytes: dict[str, int] = {}
    for name, spec in schema.items():
        rows = [tensor_bytes(fields[name]) for _, fields, _, _ in items]  # views of contiguous CPU tensors: no copy
        first = items[0][1][name].shape
        if spec.ragged:
            lengths = [fields[name].shape[0] for _, fields, _, _ in items]
            offsets = np.cumsum([0, *lengths], dtype="<i8")  # (N + 1,)
            tensors += [(name, spec.dtype, [sum(lengths), *first[1:]]), (name + OFFSETS_SUFFIX, torch.int64, [n + 1])]
            data += [rows, [offsets]]
            field_bytes[name] = sum(r.nbytes for r in rows) + offsets.nbytes
        else:
            tensors.append((name, spec.dtype, [n, *first]))  # (N, *shape)
            data.append(rows)
            field_bytes[name] = sum(r.nbytes for r in rows)
    keys = [k.encode("ascii") for k, *_ in items]
    tensors += [(KEY, torch.uint8, [sum(map(len, keys))]), (KEY + OFFSETS_SUFFIX, torch.int64, [n + 1]),
                (DIGEST, torch.uint8, [n, DIGEST_SIZE])]
    threads = hash_threads(sum(field_bytes.values()))
    data += [[b"".join(keys)], [np.cumsum([0, *map(len, keys)], dtype="<i8")], [_digests(items, threads)]]
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(BASE_VERSION),
        "bucket": bucket.name,
        "samples": str(n),
        "fields": json.dumps(schema_to_json(schema), sort_keys=True),
        "shapes": json.dumps(shapes, sort_keys=True),
        "fingerprint_sha256": fingerprint_sha256,
        "rank": str(rank),
    }
    if kind is not None:
        metadata["kind"] = kind
    header, order = safetensors_header(tensors, metadata)
    for i in order:  # every sample of the shard fits its bucket's shapes: a mismatch here is a bug, never bad input
        name, dtype, shape = tensors[i]
        assert sum(map(_nbytes, data[i])) == math.prod(shape) * dtype.itemsize, f"{name}: rows do not fit {shape}"
    return EncodedShard(header, [piece for i in order for piece in data[i]], threads=threads > 0), field_bytes


def _digests(items: list[Item], threads: int) -> bytes | _Digests:
    """Each item's `sample_digest`, back to back: computed now, or by `threads` hashing threads (a future)."""
    if not threads:
        return b"".join(sample_digest(key, fields) for key, fields, _, _ in items)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-digests")
    parts = [pool.submit(sample_digest, key, fields) for key, fields, _, _ in items]
    pool.shutdown(wait=False)  # its threads end once the digests are done
    return _Digests(parts, len(items) * DIGEST_SIZE)
