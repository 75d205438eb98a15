"""ShardWriter: buffers samples per bucket and publishes each shard atomically, manifest last."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Mapping

import torch

from shards.atomic import TMP_SUFFIX, atomic_write_bytes, fsync_dir
from shards.buckets import Bucket
from shards.manifest import MANIFEST, Manifest, ShardEntry, rank_manifest_name
from shards.prompts import PROMPTS_FILE, Prompt, encode_prompts, read_prompts
from shards.reader import ShardReader
from shards.schema import (
    DIGEST,
    FORMAT_NAME,
    FORMAT_VERSION,
    KEY,
    OFFSETS_SUFFIX,
    Schema,
    sample_digest,
    schema_to_json,
    serialize,
    validate_schema,
)

_SHARD_RE = re.compile(r"r(\d{5})-(\d{6})\.safetensors")


def shard_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}.safetensors"


class ShardWriter:
    """Writes samples into a cache directory, one bucket per shard.

    Samples are buffered per bucket; a shard is published when its buffer reaches
    `max_shard_bytes` or `max_shard_samples` (and at `finish`), by writing it under a temp
    name, fsyncing, renaming, and then rewriting the manifest atomically. A crash at any
    instant leaves the previous manifest and every shard it lists intact; buffered samples
    that were not yet published are simply absent.

    Shard names carry the writer's rank, so the processes of a multi-process run never
    collide; each rank keeps its own manifest, folded into `index.json` by `shards.merge`.

    Args:
        root: the cache directory (created if missing). An existing cache is appended to.
        fingerprint: everything that determines the cached values; appending to a cache
            with another fingerprint raises `FingerprintMismatch` naming the differing fields.
        schema: the fields of every sample.
        rank: this process's global rank.
        world_size: number of writing processes; with more than one, this rank's manifest is
            `index.rank-RRRRR.json` until merged.
        max_shard_bytes: publish a bucket's shard once its samples reach this many bytes.
        max_shard_samples: ... or this many samples.
        max_buffer_bytes: bound on buffered bytes over all buckets; past it the largest
            buffer is published early (as a smaller shard).
        check_finite: refuse samples whose floating fields hold NaN or Inf.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: dict,
        schema: Schema,
        *,
        rank: int = 0,
        world_size: int = 1,
        max_shard_bytes: int = 128 << 20,
        max_shard_samples: int = 100_000,
        max_buffer_bytes: int = 1 << 30,
        check_finite: bool = True,
    ):
        validate_schema(schema)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.root = Path(root)
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        self.max_shard_samples = max_shard_samples
        self.max_buffer_bytes = max_buffer_bytes
        self.check_finite = check_finite
        self.root.mkdir(parents=True, exist_ok=True)

        # One writer per rank and cache: a second one would delete this one's files as orphans.
        self._lock = open(self.root / f".lock-r{rank:05d}", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"another process is writing rank {rank} of the cache at {self.root}") from None

        own = Manifest(fingerprint, schema)
        listed: list[ShardEntry] = []
        index = self.root / MANIFEST
        if index.exists():
            base = Manifest.load(index)
            base.check_compatible(own, self.root)
            listed += base.shards
            if world_size == 1:
                own = base
        self.manifest_path = index if world_size == 1 else self.root / rank_manifest_name(rank)
        if world_size > 1 and self.manifest_path.exists():
            previous = Manifest.load(self.manifest_path)  # an interrupted run of this rank
            previous.check_compatible(own, self.root)
            own = previous
            listed += previous.shards
        self.manifest = own
        self._shapes = {}  # bucket -> field -> shape, from what is already listed
        for s in listed:
            self._shapes.setdefault(s.bucket, s.shapes)
        self._next_seq: dict[Bucket, int] = {}
        for s in listed:
            m = _SHARD_RE.fullmatch(Path(s.path).name)
            if m and int(m.group(1)) == rank:
                self._next_seq[s.bucket] = max(self._next_seq.get(s.bucket, 0), int(m.group(2)) + 1)
        self._remove_orphans({s.path for s in listed})
        self._buffers: dict[Bucket, list[tuple[str, dict[str, torch.Tensor]]]] = {}
        self._buffer_bytes: dict[Bucket, int] = {}
        self._closed = False

    def _remove_orphans(self, listed: set[str]) -> None:
        """Delete this rank's temp files and shards no manifest lists (left by a crash)."""
        prefix = f"r{self.rank:05d}-"
        for path in self.root.glob("*/*"):
            name = path.name
            rel = path.relative_to(self.root).as_posix()
            is_tmp = name.startswith(f".{prefix}") and name.endswith(TMP_SUFFIX)
            if is_tmp or (_SHARD_RE.fullmatch(name) and name.startswith(prefix) and rel not in listed):
                path.unlink()

    @property
    def schema(self) -> Schema:
        return self.manifest.schema

    def write(self, key: str, bucket: Bucket | tuple[int, int], sample: Mapping[str, torch.Tensor]) -> None:
        """Add one sample; it becomes durable when its shard is published.

        Args:
            key: the sample's unique key (ASCII, e.g. a content hash).
            bucket: the sample's bucket `(height, width)`.
            sample: one tensor per schema field, in the field's dtype. Fixed fields have the
                same shape for every sample of a bucket; ragged ones `(L, *trailing)`.

        Raises:
            ValueError: the sample does not fit the schema, or holds NaN/Inf; nothing is written.
        """
        if self._closed:
            raise RuntimeError("write() after finish()")
        bucket = Bucket(*bucket)
        if not key or not key.isascii():
            raise ValueError(f"sample key {key!r} must be a non-empty ASCII string")
        if set(sample) != set(self.schema):
            raise ValueError(f"sample {key}: fields {sorted(sample)} do not match the schema {sorted(self.schema)}")
        known = self._shapes.get(bucket, {})
        shapes, fields = {}, {}
        for name, spec in self.schema.items():
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
            if self.check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"sample {key}: field {name} holds NaN or Inf")
            fields[name] = t.detach().to("cpu").contiguous()
        self._shapes.setdefault(bucket, shapes)
        self._buffers.setdefault(bucket, []).append((key, fields))
        size = sum(t.numel() * t.element_size() for t in fields.values())
        self._buffer_bytes[bucket] = self._buffer_bytes.get(bucket, 0) + size
        if self._buffer_bytes[bucket] >= self.max_shard_bytes or len(self._buffers[bucket]) >= self.max_shard_samples:
            self.flush(bucket)
        elif sum(self._buffer_bytes.values()) > self.max_buffer_bytes:
            self.flush(max(self._buffer_bytes, key=self._buffer_bytes.get))

    def flush(self, bucket: Bucket | None = None) -> None:
        """Publish the buffered samples of one bucket (or of all) as shards now."""
        for b in [Bucket(*bucket)] if bucket is not None else list(self._buffers):
            items = self._buffers.pop(b, [])
            self._buffer_bytes.pop(b, None)
            if items:
                self._publish(b, items)

    def _publish(self, bucket: Bucket, items: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
        self.manifest.shards.append(self._write_shard(bucket, items))
        self.manifest.save(self.manifest_path)  # the commit point

    def _write_shard(self, bucket: Bucket, items: list[tuple[str, dict[str, torch.Tensor]]]) -> ShardEntry:
        """Write one shard file durably under its final name; it is part of the cache once listed."""
        tensors: dict[str, torch.Tensor] = {}
        field_bytes: dict[str, int] = {}
        for name, spec in self.schema.items():
            rows = [fields[name] for _, fields in items]
            if spec.ragged:
                lengths = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64)
                tensors[name] = torch.cat(rows)  # (sum L_i, *trailing)
                tensors[name + OFFSETS_SUFFIX] = lengths.cumsum(0)  # (N + 1,)
            else:
                tensors[name] = torch.stack(rows)  # (N, *shape)
            field_bytes[name] = sum(
                t.numel() * t.element_size() for k, t in tensors.items() if k in (name, name + OFFSETS_SUFFIX)
            )
        keys = [k.encode("ascii") for k, _ in items]
        tensors[KEY] = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8)
        tensors[KEY + OFFSETS_SUFFIX] = torch.tensor([0] + [len(k) for k in keys], dtype=torch.int64).cumsum(0)
        digests = b"".join(sample_digest(key, fields) for key, fields in items)
        tensors[DIGEST] = torch.frombuffer(bytearray(digests), dtype=torch.uint8).view(len(items), -1)

        shapes = self._shapes[bucket]
        metadata = {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "bucket": bucket.name,
            "samples": str(len(items)),
            "fields": json.dumps(schema_to_json(self.schema), sort_keys=True),
            "shapes": json.dumps(shapes, sort_keys=True),
            "fingerprint_sha256": self.manifest.fingerprint_sha256,
            "rank": str(self.rank),
        }
        data = serialize(tensors, metadata)
        seq = self._next_seq.get(bucket, 0)
        self._next_seq[bucket] = seq + 1
        directory = self.root / bucket.name
        if not directory.is_dir():
            directory.mkdir(exist_ok=True)  # other ranks create bucket directories concurrently
            fsync_dir(self.root)
        path = directory / shard_name(self.rank, seq)
        atomic_write_bytes(path, data)
        return ShardEntry(
            path=path.relative_to(self.root).as_posix(),
            bucket=bucket,
            samples=len(items),
            bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            shapes=shapes,
            field_bytes=field_bytes,
        )

    def add_prompts(self, prompts: dict[str, Prompt], schema: Schema) -> None:
        """Store prompt embeddings (the empty caption, validation prompts) beside the shards.

        Prompts already stored are kept; the file is rewritten atomically and listed in the
        manifest at its next commit (at the latest `finish`).

        Args:
            prompts: by key (`shards.prompts.prompt_key(text)`).
            schema: the fields of a prompt (the text fields of the samples).
        """
        entry = self.manifest.files.get("prompts")
        merged = read_prompts(self.root / entry["path"]) if entry else {}
        merged.update(prompts)
        data = encode_prompts(merged, schema, self.manifest.fingerprint_sha256)
        self.add_file("prompts", entry["path"] if entry else PROMPTS_FILE, data, count=len(merged))

    def add_file(self, role: str, path: str, data: bytes, **info) -> None:
        """Store an auxiliary file (prompt embeddings, the decoder of a VAE that exists nowhere else).

        Written atomically now; listed in the manifest under `role`, with its size and sha256, at the
        next commit, so `verify` checks it like a shard.
        """
        target = self.root / path
        if not target.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"auxiliary file {path!r} must lie inside the cache {self.root}")
        if not target.parent.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(target.parent.parent)
        atomic_write_bytes(target, data)
        self.manifest.files[role] = {
            "path": target.relative_to(self.root).as_posix(),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            **info,
        }

    def remove(self, keys: set[str]) -> int:
        """Drop samples from the cache (e.g. their source images were removed or changed).

        Each shard holding any of them is rewritten without them (its other samples are copied,
        not re-encoded); the new shards and the removal are committed in one manifest write, so
        a crash leaves either the old shards or the new ones listed, never both.

        Returns:
            The number of samples removed.
        """
        self.flush()
        keep, added, retired, removed = [], [], [], 0
        for entry in self.manifest.shards:
            reader = ShardReader(self.root / entry.path)
            drop = [i for i, k in enumerate(reader.keys) if k in keys]
            if not drop:
                keep.append(entry)
                continue
            removed += len(drop)
            retired.append(entry)
            items = [(reader.keys[i], {n: t.clone() for n, t in reader.fields(i).items()}) for i in range(len(reader)) if i not in set(drop)]
            if items:
                added.append(self._write_shard(entry.bucket, items))
        if not retired:
            return 0
        self.manifest.shards = keep + added
        self.manifest.save(self.manifest_path)
        for entry in retired:
            (self.root / entry.path).unlink(missing_ok=True)
        return removed

    def finish(self) -> Manifest:
        """Publish every buffered sample, write the manifest (even for an empty run) and release the cache."""
        if not self._closed:
            self.flush()
            self.manifest.save(self.manifest_path)
            self.close()
        return self.manifest

    def close(self) -> None:
        """Release the cache without publishing buffered samples."""
        if not self._closed:
            self._closed = True
            self._buffers.clear()
            self._lock.close()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Publish only on success: an exception in flight means the caller's state is suspect,
        # and everything already published stays listed and valid.
        if exc_type is None:
            self.finish()
        else:
            self.close()
