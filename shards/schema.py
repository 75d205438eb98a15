"""Format identity, field schema and the errors every part of the library raises."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FORMAT_NAME = "cachedit-shards"
# 2: the manifest is a commit log with snapshots (1: a single index.json); 3: a cache that stores each text once
# (`shards.texts`). A cache without texts is still written as version 2, so that every reader of version 2 reads it.
FORMAT_VERSION = 3
BASE_VERSION = 2
READ_VERSIONS = (2, 3)
SHARD_VERSIONS = (1, 2)  # shard, text-shard and prompt files are laid out alike in all (they are written as 2)

# Tensor names inside a shard that are not fields. User field names may not start with "__".
KEY = "__key__"  # sample keys: ASCII bytes, ragged
DIGEST = "__digest__"  # (N, 16) uint8: blake2b-128 of each sample's field bytes
OFFSETS_SUFFIX = ".offsets"  # (N + 1,) int64 row offsets of a ragged field
DIGEST_SIZE = 16

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class FormatError(ValueError):
    """A cache file or manifest this library cannot read, with what to do about it."""


class CacheBusy(RuntimeError):
    """Another process is writing the cache."""


class DamagedCache(FormatError):
    """A cache file that is there but fails its checks or is missing where the log says it must be (a commit, a
    snapshot, a shard, the prompts file); the message names it and says how to repair or restore it."""


class DamagedLog(DamagedCache):
    """A commit or snapshot file that fails its checks, or a commit missing from the middle of the log: the shards
    may be intact. `path` is the file to restore."""

    def __init__(self, path, message: str):
        self.path = str(path)
        super().__init__(message)

    def __reduce__(self):  # pickled between processes with both arguments
        return type(self), (self.path, str(self))


class CorruptSample(DamagedCache):
    """A sample whose bytes do not match the digest stored with it."""


class FingerprintMismatch(ValueError):
    """Writing into a cache whose cached values were computed differently."""

    def __init__(self, root: str, existing: dict, new: dict):
        from shards.fingerprint import diff_fingerprints, fingerprint_hash

        self.differences = diff_fingerprints(existing, new)
        lines = [
            f"the cache at {root} was built with fingerprint {fingerprint_hash(existing)[:16]}, "
            f"this run has {fingerprint_hash(new)[:16]}; differing fields:"
        ]
        lines += [f"  {path}: cache={a!r} run={b!r}" for path, a, b in self.differences]
        lines.append("Write to a new cache directory, or rerun with the settings the cache was built with.")
        super().__init__("\n".join(lines))


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored; use one of {sorted(_DTYPES)}") from None


def check_version(found: Any, where: str, accepted: tuple[int, ...] = READ_VERSIONS) -> None:
    """Reject a file of another format or version, saying what to do."""
    if found not in accepted:
        raise FormatError(
            f"{where} has {FORMAT_NAME} format version {found!r}, this library reads versions "
            f"{', '.join(map(str, accepted))}. Upgrade the library (pip install -U) if the cache is newer, or "
            f"convert it with `python -m shards upgrade CACHE` if it is older."
        )


@dataclass(frozen=True)
class Field:
    """One named per-sample tensor of a cache.

    Args:
        dtype: the storage dtype; samples must arrive in it (the writer never casts silently).
        ragged: False for a fixed per-sample shape within a bucket, stacked `(N, *shape)`;
            True for a variable first dim `(L_i, *trailing)`, stored packed `(sum L_i, *trailing)`
            with `(N + 1,)` int64 offsets, so no padding is ever stored.
    """

    dtype: torch.dtype
    ragged: bool = False

    def to_json(self) -> dict:
        return {"dtype": dtype_name(self.dtype), "kind": "ragged" if self.ragged else "fixed"}

    @classmethod
    def from_json(cls, obj: dict) -> Field:
        if obj.get("kind") not in ("fixed", "ragged"):
            raise FormatError(f"unknown field kind {obj.get('kind')!r}")
        return cls(dtype_from_name(obj["dtype"]), obj["kind"] == "ragged")


Schema = dict[str, Field]


def validate_schema(schema: Schema) -> None:
    if not schema:
        raise ValueError("a cache needs at least one field")
    for name, field in schema.items():
        if not isinstance(name, str) or not name or name.startswith("__") or name.endswith(OFFSETS_SUFFIX):
            raise ValueError(f"field name {name!r} is reserved or empty")
        if not isinstance(field, Field):
            raise TypeError(f"field {name!r} must be a shards.Field, got {type(field).__name__}")
        dtype_name(field.dtype)


def schema_to_json(schema: Schema) -> dict:
    return {name: field.to_json() for name, field in sorted(schema.items())}


def schema_from_json(obj: dict) -> Schema:
    return {name: Field.from_json(spec) for name, spec in obj.items()}


def sample_digest(key: str, fields: dict[str, torch.Tensor]) -> bytes:
    """blake2b-128 over a sample's key and fields (name, dtype, shape and bytes, in name order).

    Equal digests mean the same key with identical tensors, whichever shard or run it landed in.
    """
    h = hashlib.blake2b(key.encode("ascii") + b"\0", digest_size=DIGEST_SIZE)
    for name in sorted(fields):
        t = fields[name]
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(tensor_bytes(t))  # hashlib releases the GIL over buffers past 2 KiB: digests run on other threads
    return h.digest()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes in C order as a flat uint8 array: a view of the tensor itself when it is a contiguous CPU tensor
    (no copy), else of a contiguous CPU copy."""
    if t.numel() == 0:  # its strides may be anything (0 too), which a dtype view refuses
        return np.empty(0, np.uint8)
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


# safetensors lays a file's data out by descending dtype alignment, then by name (its Rust `prepare`), and names dtypes
# so in the header. The order is that of safetensors 0.3 to 0.8, which wrote every cache so far; it is fixed here so that
# equal contents keep giving byte-identical files.
_STORED = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16",
           torch.float16: "F16", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DATA_ORDER = {dtype: rank for rank, dtype in enumerate(_STORED)}


def safetensors_header(tensors: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The first bytes of a safetensors file holding `tensors` (name, dtype, shape), up to its data, and the order in
    which their data follows (indices into `tensors`), back to back.

    The header is canonical: compact JSON with sorted keys, padded with spaces to a multiple of 8 bytes as safetensors
    pads it, so equal contents give byte-identical files (safetensors itself writes `__metadata__` in hash-map order,
    which differs from run to run). For ASCII names and metadata these are exactly the bytes `serialize` has written
    since the first cache; other names are escaped (`\\uXXXX`), which every JSON reader reads back.
    """
    try:
        order = sorted(range(len(tensors)), key=lambda i: (_DATA_ORDER[tensors[i][1]], tensors[i][0]))
    except KeyError as e:
        raise ValueError(f"dtype {e.args[0]} cannot be stored; use one of {sorted(_DTYPES)}") from None
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for i in order:
        name, dtype, shape = tensors[i]
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"data_offsets": [offset, end], "dtype": _STORED[dtype], "shape": list(shape)}
        offset = end
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes with a canonical header (`safetensors_header`), so equal contents give byte-identical files."""
    names = list(tensors)
    header, order = safetensors_header([(name, t.dtype, list(t.shape)) for name, t in tensors.items()], metadata)
    return b"".join([header, *(tensor_bytes(tensors[names[i]]) for i in order)])


def open_file(path, kind: str = "shard", tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Open one of our safetensors files: its metadata and every tensor as a private memory map (no tensor when
    `tensors` is False: the header alone).

    Raises:
        FileNotFoundError: no such file.
        FormatError: unreadable, not of this format or kind, or of an unknown version; the message
            says what to do.
    """
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            data = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise FormatError(f"{path}: cannot open as safetensors ({e}); run `python -m shards verify` on the cache") from e
    if metadata.get("format") != FORMAT_NAME or metadata.get("kind", "shard") != kind:
        raise FormatError(f"{path} is a safetensors file but not a {FORMAT_NAME} {kind} file")
    version = metadata.get("format_version", "")
    check_version(int(version) if version.isdigit() else version, str(path), SHARD_VERSIONS if kind != "snapshot" else READ_VERSIONS)
    return metadata, data
