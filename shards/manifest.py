"""The cache manifest `index.json`: fingerprint, field schema, every shard, totals per bucket.

The manifest is the cache's commit record. It is written last and atomically, so whatever it lists
is complete; files it does not list are not part of the cache.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shards.atomic import atomic_write_json, fsync_dir
from shards.buckets import Bucket
from shards.fingerprint import fingerprint_hash, normalize
from shards.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FingerprintMismatch,
    FormatError,
    Schema,
    check_version,
    schema_from_json,
    schema_to_json,
)

MANIFEST = "index.json"
RANK_MANIFEST_GLOB = "index.rank-*.json"
_SHARD_FILE = re.compile(r"\.?(r\d{5})-\d{6}\.safetensors(\.\d+\.tmp)?")


def rank_manifest_name(rank: int) -> str:
    """Manifest a rank of a multi-process run writes before the merge."""
    return f"index.rank-{rank:05d}.json"


@dataclass
class ShardEntry:
    """One shard as the manifest lists it.

    Args:
        path: POSIX path relative to the cache root, e.g. `"1024x768/r00000-000003.safetensors"`.
        bucket: the bucket all its samples belong to.
        samples: number of samples.
        bytes: file size.
        sha256: hex digest of the whole file.
        shapes: per field, the per-sample shape (fixed fields) or trailing shape (ragged fields,
            first dim `None`).
        field_bytes: per field, bytes the field occupies in this shard (offsets included).
    """

    path: str
    bucket: Bucket
    samples: int
    bytes: int
    sha256: str
    shapes: dict[str, list[int | None]]
    field_bytes: dict[str, int]

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "bucket": [self.bucket.height, self.bucket.width],
            "samples": self.samples,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "shapes": self.shapes,
            "field_bytes": self.field_bytes,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "ShardEntry":
        return cls(
            path=obj["path"],
            bucket=Bucket(*obj["bucket"]),
            samples=int(obj["samples"]),
            bytes=int(obj["bytes"]),
            sha256=obj["sha256"],
            shapes={k: list(v) for k, v in obj["shapes"].items()},
            field_bytes={k: int(v) for k, v in obj["field_bytes"].items()},
        )


@dataclass
class BucketStats:
    bucket: Bucket
    samples: int = 0
    shards: int = 0
    bytes: int = 0


@dataclass
class Manifest:
    """What a cache holds and how it was made.

    Args:
        fingerprint: everything that determines the cached values (encoder ids and hashes,
            dtypes, scaling factors, bucket table, preprocessing); canonical JSON, hashed.
        schema: the fields every sample has.
        shards: every published shard, in write order.
        files: other files of the cache by role (e.g. `"prompts"`), each `{"path", "bytes", "sha256"}`.
        extra: free-form JSON the stages record (e.g. run settings); not part of the fingerprint.
    """

    fingerprint: dict
    schema: Schema
    shards: list[ShardEntry] = field(default_factory=list)
    files: dict[str, dict] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fingerprint = normalize(self.fingerprint)

    @property
    def fingerprint_sha256(self) -> str:
        return fingerprint_hash(self.fingerprint)

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def buckets(self) -> dict[Bucket, BucketStats]:
        """Totals per bucket, in (height, width) order."""
        stats: dict[Bucket, BucketStats] = {}
        for s in self.shards:
            b = stats.setdefault(s.bucket, BucketStats(s.bucket))
            b.samples += s.samples
            b.shards += 1
            b.bytes += s.bytes
        return dict(sorted(stats.items()))

    def to_json(self) -> dict:
        buckets = {
            b.name: {"height": b.height, "width": b.width, "samples": st.samples, "shards": st.shards, "bytes": st.bytes}
            for b, st in self.buckets().items()
        }
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "fingerprint_sha256": self.fingerprint_sha256,
            "fingerprint": self.fingerprint,
            "fields": schema_to_json(self.schema),
            "totals": {"samples": self.num_samples, "shards": len(self.shards), "bytes": self.num_bytes},
            "buckets": buckets,
            "shards": [s.to_json() for s in self.shards],
            "files": self.files,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, obj: dict, where: str = "manifest") -> "Manifest":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise FormatError(f"{where} is not a {FORMAT_NAME} manifest (its 'format' field is missing or wrong)")
        check_version(obj.get("format_version"), where)
        try:
            manifest = cls(
                fingerprint=obj["fingerprint"],
                schema=schema_from_json(obj["fields"]),
                shards=[ShardEntry.from_json(s) for s in obj["shards"]],
                files=obj.get("files", {}),
                extra=obj.get("extra", {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where} is malformed ({type(e).__name__}: {e}); rebuild the cache") from e
        if obj.get("fingerprint_sha256") != manifest.fingerprint_sha256:
            raise FormatError(f"{where}: fingerprint_sha256 does not match its fingerprint; the manifest was edited or damaged")
        return manifest

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Manifest":
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no cache manifest at {path}; build the cache first with `make precompute DATA=... CACHE={path.parent}`"
            ) from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise FormatError(f"{path} is not valid JSON ({e}); restore it or rebuild the cache") from e
        return cls.from_json(obj, where=str(path))

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash leaves the previous manifest or this one, never a mix."""
        atomic_write_json(path, self.to_json())

    def check_compatible(self, other: "Manifest", root: str | os.PathLike) -> None:
        """Refuse to combine caches whose values were computed differently."""
        if other.fingerprint != self.fingerprint:
            raise FingerprintMismatch(str(root), self.fingerprint, other.fingerprint)
        if other.schema != self.schema:
            raise FormatError(
                f"{root}: field schema differs: cache has {schema_to_json(self.schema)}, "
                f"run has {schema_to_json(other.schema)}"
            )


def missing_manifest(root: str | os.PathLike) -> tuple[bool, str]:
    """Why a directory without `index.json` has none: (never committed, what to tell the user).

    A writer commits after every shard it publishes, so a run killed before its first commit leaves at
    most one shard file (and one temp file) per rank. More shard files than that mean commits happened
    and the manifest was lost afterwards.
    """
    root = Path(root)
    build = f"build it with `make precompute DATA=... CACHE={root}`"
    if not root.is_dir():
        return True, f"{root} does not exist; {build}"
    parts = sorted(p.name for p in root.glob(RANK_MANIFEST_GLOB))
    if parts:
        return False, (f"{root} has no {MANIFEST} but per-rank manifests of an unfinished multi-process run ({', '.join(parts)}); "
                       f"re-run the same `make precompute`, or merge them with `python -m shards merge {root}`")
    shards: dict[str, int] = {}
    leftovers = 0
    for path in root.glob("*/*"):
        m = _SHARD_FILE.fullmatch(path.name)
        if m:
            leftovers += 1
            if not m.group(2):
                shards[m.group(1)] = shards.get(m.group(1), 0) + 1
    if any(n > 1 for n in shards.values()):
        return False, (f"{root} holds {sum(shards.values())} shard files but no {MANIFEST}: the manifest was removed or lost after "
                       f"shards were committed. Restore {MANIFEST} from a backup, or rebuild the cache with `make precompute`")
    left = (f" ({leftovers} file(s) left by a run interrupted before its first commit; the next `make precompute` into it "
            f"clears them)") if leftovers else ""
    return True, f"{root} is not a cache yet: no manifest was ever committed{left}; {build}"


def merge(root: str | os.PathLike) -> Manifest:
    """Fold the per-rank manifests of a multi-process run into `index.json`.

    Idempotent: the rank manifests are removed only after the merged index is durable, and a
    shard listed twice (a merge interrupted before that removal) is kept once.

    Args:
        root: the cache directory.

    Returns:
        The merged manifest.
    """
    root = Path(root)
    parts = sorted(root.glob(RANK_MANIFEST_GLOB))
    index = root / MANIFEST
    if not parts:
        return Manifest.load(index)
    manifests = [Manifest.load(p) for p in parts]
    merged = Manifest.load(index) if index.exists() else Manifest(manifests[0].fingerprint, manifests[0].schema)
    seen = {s.path: s for s in merged.shards}
    for m in manifests:
        merged.check_compatible(m, root)
        for s in m.shards:
            if s.path in seen:
                if seen[s.path].sha256 != s.sha256:
                    raise FormatError(f"{root}: {s.path} is listed twice with different checksums; run `python -m shards verify {root}`")
                continue
            seen[s.path] = s
            merged.shards.append(s)
        merged.files.update(m.files)
        merged.extra.update(m.extra)
    merged.save(index)
    for p in parts:
        p.unlink()
    fsync_dir(root)
    return merged
