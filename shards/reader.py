"""Readers: `ShardReader` for one memory-mapped shard, `Cache` for a whole cache directory."""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from shards.buckets import Bucket
from shards.manifest import MANIFEST, RANK_MANIFEST_GLOB, Manifest, ShardEntry, missing_manifest
from shards.prompts import Prompt, read_prompts
from shards.schema import (
    DIGEST,
    KEY,
    OFFSETS_SUFFIX,
    FormatError,
    Schema,
    open_file,
    schema_from_json,
)


@dataclass
class Sample:
    """One cached sample: its key, bucket and one tensor per field."""

    key: str
    bucket: Bucket
    fields: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]


class ShardReader:
    """One shard, memory-mapped.

    Opening reads only the header. Each tensor is a copy-on-write private mapping of the file
    (safetensors' `safe_open`), so reading sample `i` touches only that sample's pages, and the
    returned tensors are zero-copy views that callers may even write to without changing the file.

    Args:
        path: the shard file.

    Raises:
        FormatError: not a shard of this format, an unknown format version, or a damaged header.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        metadata, tensors = open_file(self.path)
        try:
            self.bucket = Bucket.parse(metadata["bucket"])
            self.num_samples = int(metadata["samples"])
            self.schema: Schema = schema_from_json(json.loads(metadata["fields"]))
            self.shapes: dict[str, list] = json.loads(metadata["shapes"])
            self.fingerprint_sha256 = metadata["fingerprint_sha256"]
        except (KeyError, ValueError) as e:
            raise FormatError(f"{self.path}: shard metadata is incomplete ({e})") from e
        self.metadata = metadata
        self._tensors = tensors
        self._offsets = {name: tensors[name + OFFSETS_SUFFIX].tolist() for name in [*self.ragged_fields, KEY]}
        key_bytes = tensors[KEY].numpy().tobytes()
        offs = self._offsets[KEY]
        self.keys = [key_bytes[offs[i] : offs[i + 1]].decode("ascii") for i in range(self.num_samples)]

    @property
    def ragged_fields(self) -> list[str]:
        return [name for name, spec in self.schema.items() if spec.ragged]

    def __len__(self) -> int:
        return self.num_samples

    def tensor(self, name: str) -> torch.Tensor:
        """A stored tensor by its name in the file, e.g. a field's packed rows."""
        return self._tensors[name]

    def fields(self, i: int) -> dict[str, torch.Tensor]:
        """Sample `i`'s fields as zero-copy views: fixed `(*shape)`, ragged `(L_i, *trailing)`."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.path} ({self.num_samples} samples)")
        out = {}
        for name, spec in self.schema.items():
            t = self._tensors[name]
            if spec.ragged:
                offs = self._offsets[name]
                out[name] = t[offs[i] : offs[i + 1]]
            else:
                out[name] = t[i]
        return out

    def __getitem__(self, i: int) -> Sample:
        return Sample(self.keys[i], self.bucket, self.fields(i))

    def digest(self, i: int) -> bytes:
        """The per-sample content digest stored at write time."""
        return self._tensors[DIGEST][i].numpy().tobytes()

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(self.num_samples))


class Cache:
    """A cache directory: the manifest plus lazily opened shards, indexed globally.

    Global sample index `i` runs over shards in manifest order; every shard holds one bucket, so
    a bucket's samples are a union of contiguous ranges (see `ranges_by_bucket`).

    Args:
        root: the cache directory (holding `index.json`).

    Raises:
        FileNotFoundError: no manifest; the message says how to build the cache.
        FormatError: an unknown format version, or a multi-process run that was never merged.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        pending = sorted(self.root.glob(RANK_MANIFEST_GLOB))
        if pending:
            raise FormatError(
                f"{self.root} has unmerged per-rank manifests ({', '.join(p.name for p in pending)}); "
                f"finish the run or merge them with `python -m shards merge {self.root}`"
            )
        if not (self.root / MANIFEST).exists():
            raise FileNotFoundError(missing_manifest(self.root)[1])
        self.manifest = Manifest.load(self.root / MANIFEST)
        self.shards: list[ShardEntry] = self.manifest.shards
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s.samples)
        self._readers: dict[int, ShardReader] = {}

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    @property
    def fingerprint(self) -> dict:
        return self.manifest.fingerprint

    def __len__(self) -> int:
        return self._starts[-1]

    def shard(self, j: int) -> ShardReader:
        """The reader of shard `j` (opened on first use, then kept)."""
        reader = self._readers.get(j)
        if reader is None:
            entry = self.shards[j]
            reader = ShardReader(self.root / entry.path)
            if reader.num_samples != entry.samples or reader.bucket != entry.bucket:
                raise FormatError(f"{reader.path} does not match the manifest; run `python -m shards verify {self.root}`")
            self._readers[j] = reader
        return reader

    def locate(self, i: int) -> tuple[int, int]:
        """(shard index, row in shard) of global sample `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        j = bisect.bisect_right(self._starts, i) - 1
        return j, i - self._starts[j]

    def __getitem__(self, i: int) -> Sample:
        j, row = self.locate(i)
        return self.shard(j)[row]

    def bucket_of(self, i: int) -> Bucket:
        return self.shards[self.locate(i)[0]].bucket

    def ranges_by_bucket(self, only: set[str] | None = None) -> dict[Bucket, list[range]]:
        """Global index ranges of each bucket's samples, without opening any shard.

        Args:
            only: restrict to these shard paths (e.g. the shards an interrupted epoch started with).
        """
        out: dict[Bucket, list[range]] = {}
        for j, s in enumerate(self.shards):
            if only is not None and s.path not in only:
                continue
            out.setdefault(s.bucket, []).append(range(self._starts[j], self._starts[j + 1]))
        return dict(sorted(out.items()))

    def prompts(self) -> dict[str, Prompt]:
        """The cached prompt embeddings (empty caption, validation prompts), by `prompt_key(text)`."""
        entry = self.manifest.files.get("prompts")
        return read_prompts(self.root / entry["path"]) if entry else {}

    def keys(self) -> Iterator[tuple[str, int]]:
        """(key, global index) of every sample; opens every shard's header."""
        for j in range(len(self.shards)):
            for row, key in enumerate(self.shard(j).keys):
                yield key, self._starts[j] + row
