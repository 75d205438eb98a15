"""The cache manifest: what a cache holds at each generation, kept as a commit log with snapshots.

Every commit is a new numbered JSON file `_log/GENERATION.json` of actions (add shards, remove shards,
replace a shard by its repaired copy, set auxiliary files and run records). It is created with "create if
absent" semantics (a hard link of a complete, fsynced temp file), so writers never overwrite each other and
a reader sees whole commits only. A commit costs one small file whatever the cache's size. Every so often a
writer compacts the state into `_snapshots/GENERATION.safetensors` (columnar tables: loading a million
shards is a memory map, not a JSON parse), and `index.json` points at the newest snapshot. A reader loads
the snapshot at or before the generation it wants and replays the commits after it.

Shard files are immutable. Removing samples retires whole shards (their kept samples are copied into new
ones); retired files stay on disk until `python -m shards gc`, so a reader of an earlier generation (a
training run mid-epoch) keeps working. See FORMAT.md.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import numpy as np
import torch

from shards.atomic import TMP_SUFFIX, atomic_write_json, fsync_dir
from shards.buckets import Bucket
from shards.fingerprint import fingerprint_hash, normalize
from shards.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FingerprintMismatch,
    FormatError,
    Schema,
    check_version,
    open_file,
    schema_from_json,
    schema_to_json,
    serialize,
)

MANIFEST = "index.json"  # points at the newest snapshot; the log is the truth
LOG_DIR = "_log"
SNAPSHOT_DIR = "_snapshots"
READERS_DIR = "_readers"
LOG_NAME = "{:012d}.json"
SNAPSHOT_NAME = "{:012d}.safetensors"
_SHARD_FILE = re.compile(r"\.?(r\d{5})-(\d{6,})\.safetensors(\.\d+\.tmp)?")
# Compact the log into a snapshot once this many commits follow the last one: readers replay at most this
# many small files, and a commit pays for snapshots 1/COMPACT_EVERY of the time.
COMPACT_MIN, COMPACT_MAX = 256, 4096


def shard_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}.safetensors"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(rank, seq) of a shard file name, None for other files."""
    m = _SHARD_FILE.fullmatch(name)
    return (int(m.group(1)[1:]), int(m.group(2))) if m and not m.group(3) and not name.startswith(".") else None


def confined(path: str, where: str = "manifest") -> str:
    """A manifest path, checked to stay inside the cache: relative, POSIX, without `..`.

    Raises:
        FormatError: the path is absolute, climbs out of the cache or is not a plain POSIX path.
    """
    parts = PurePosixPath(path).parts if isinstance(path, str) else ()
    if not parts or parts[0] == "/" or ".." in parts or "\\" in path or "\0" in path or path.startswith("~"):
        raise FormatError(f"{where} lists {path!r}, a path outside the cache; the manifest was edited or damaged")
    return path


@dataclass
class ShardEntry:
    """One shard as the manifest lists it.

    Args:
        path: POSIX path relative to the cache root, e.g. `"1024x768/r00000-000003.safetensors"`.
        bucket: the bucket all its samples belong to.
        samples: number of samples.
        bytes: file size.
        sha256: hex digest of the whole file.
        field_bytes: per field, bytes the field occupies in this shard (offsets included).
        keys, sources, stamps: per sample, its key, where it came from and a digest of the input's state
            (size, mtime) when it was read; set in commits, loaded on demand from snapshots.
    """

    path: str
    bucket: Bucket
    samples: int
    bytes: int
    sha256: str
    field_bytes: dict[str, int]
    keys: list[str] | None = None
    sources: list[str] | None = None
    stamps: list[int] | None = None

    def to_json(self) -> dict:
        return {"path": self.path, "bucket": [self.bucket.height, self.bucket.width], "samples": self.samples,
                "bytes": self.bytes, "sha256": self.sha256, "field_bytes": self.field_bytes,
                "keys": self.keys, "sources": self.sources, "stamps": self.stamps}

    @classmethod
    def from_json(cls, obj: dict, where: str = "commit") -> "ShardEntry":
        """An entry of a commit; its sample index (keys, and sources and stamps if given) must cover every sample."""
        e = cls(path=confined(obj["path"], where), bucket=Bucket(*obj["bucket"]), samples=int(obj["samples"]),
                bytes=int(obj["bytes"]), sha256=obj["sha256"], field_bytes={k: int(v) for k, v in obj["field_bytes"].items()},
                keys=obj.get("keys"), sources=obj.get("sources"), stamps=obj.get("stamps"))
        for name in ("keys", "sources", "stamps"):
            value = getattr(e, name)
            if (name == "keys" or value is not None) and (not isinstance(value, list) or len(value) != e.samples):
                raise FormatError(f"{where}: {e.path} is listed without {name} for each of its {e.samples} samples; "
                                  f"the log was edited or damaged")
        return e


class ShardTable:
    """The shards of one generation, in commit order, stored in columns: a million shards cost arrays,
    not a million objects; an entry is built when asked for."""

    def __init__(self, fields: list[str]):
        self.fields = list(fields)
        self._paths: list[str] = []
        self._height, self._width = array("i"), array("i")
        self._samples, self._bytes = array("q"), array("q")
        self._sha = bytearray()
        self._field_bytes = array("q")
        self._live = bytearray()
        self._row: dict[str, int] | None = None  # path -> row, built on first removal
        self._alive_rows: np.ndarray | None = None
        # per row: (keys, sources, stamps) from commits; snapshot rows read theirs from `_snapshot_samples`
        self._samples_of: dict[int, tuple[list[str], list[str], list[int]]] = {}
        self._snapshot_samples = None
        self._keys: dict[str, tuple[int, int]] | None = None

    # -- building --------------------------------------------------------------------------------
    def append(self, e: ShardEntry) -> None:
        if self._row is not None:
            if e.path in self._row and self._live[self._row[e.path]]:
                raise FormatError(f"{e.path} is listed twice; the manifest was edited or damaged")
            self._row[e.path] = len(self._paths)
        self._paths.append(e.path)
        self._height.append(e.bucket.height)
        self._width.append(e.bucket.width)
        self._samples.append(e.samples)
        self._bytes.append(e.bytes)
        self._sha += bytes.fromhex(e.sha256)
        self._field_bytes.extend(int(e.field_bytes.get(f, 0)) for f in self.fields)
        self._live.append(1)
        if e.keys is not None:
            self._samples_of[len(self._paths) - 1] = (list(e.keys), list(e.sources or [""] * e.samples),
                                                      list(e.stamps or [0] * e.samples))
        self._alive_rows = None
        self._keys = None

    def row_of(self, path: str) -> int:
        if self._row is None:
            self._row = {}
            for j, p in enumerate(self._paths):
                if self._live[j]:
                    self._row[p] = j
        try:
            return self._row[path]
        except KeyError:
            raise FormatError(f"{path} is not a shard of this generation") from None

    def remove(self, path: str) -> None:
        self._live[self.row_of(path)] = 0
        del self._row[path]
        self._alive_rows = None
        self._keys = None

    def replace(self, old: str, e: ShardEntry) -> None:
        """Put a shard's repaired copy in its place (same keys, same order): global indices are unchanged."""
        j = self.row_of(old)
        if e.samples != self._samples[j]:
            raise FormatError(f"{e.path} replaces {old} but holds {e.samples} samples, not {self._samples[j]}")
        if e.path in self:
            raise FormatError(f"{e.path} replaces {old} but is listed already; the manifest was edited or damaged")
        del self._row[old]
        self._row[e.path] = j
        self._paths[j] = e.path
        self._bytes[j] = e.bytes
        self._sha[32 * j : 32 * j + 32] = bytes.fromhex(e.sha256)
        if e.keys is not None:
            self._samples_of[j] = (list(e.keys), list(e.sources or [""] * e.samples), list(e.stamps or [0] * e.samples))

    def key_index(self) -> dict[str, tuple[int, int]]:
        """key -> (table row, position in the shard) of every live sample, built once per change."""
        if self._keys is None:
            self._keys = {}
            for j in self.rows:
                for r, k in enumerate(self.samples_of(int(j))[0]):
                    self._keys[k] = (int(j), r)
        return self._keys

    def restamp(self, key: str, stamp: int) -> None:
        if key not in self.key_index():
            raise FormatError(f"restamp of {key}, which is not in the cache")
        j, r = self._keys[key]
        keys, sources, stamps = self.samples_of(j)
        stamps = list(stamps)
        stamps[r] = stamp
        self._samples_of[j] = (keys, sources, stamps)

    # -- reading ---------------------------------------------------------------------------------
    @property
    def rows(self) -> np.ndarray:
        """Table rows of the live shards, in commit order."""
        if self._alive_rows is None:
            self._alive_rows = np.flatnonzero(np.frombuffer(bytes(self._live), dtype=np.uint8)) if self._live else np.zeros(0, np.int64)
        return self._alive_rows

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, path: str) -> bool:
        """Whether `path` is a live shard."""
        try:
            self.row_of(path)
        except FormatError:
            return False
        return True

    def entry_at_row(self, j: int) -> ShardEntry:
        f = len(self.fields)
        return ShardEntry(self._paths[j], Bucket(self._height[j], self._width[j]), self._samples[j], self._bytes[j],
                          self._sha[32 * j : 32 * j + 32].hex(), dict(zip(self.fields, self._field_bytes[f * j : f * j + f])))

    def __getitem__(self, i: int) -> ShardEntry:
        return self.entry_at_row(int(self.rows[i]))

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self.entry_at_row(int(j)) for j in self.rows)

    def paths(self) -> list[str]:
        return [self._paths[j] for j in self.rows]

    def column(self, name: str) -> np.ndarray:
        """A live column as an array: "samples", "bytes", "height", "width" or "field_bytes" (K, F)."""
        if name == "field_bytes":
            return np.frombuffer(self._field_bytes, dtype=np.int64).reshape(-1, len(self.fields))[self.rows]
        source = {"samples": self._samples, "bytes": self._bytes, "height": self._height, "width": self._width}[name]
        return np.frombuffer(source, dtype=np.int64 if source.typecode == "q" else np.int32)[self.rows]

    def samples_of(self, j: int) -> tuple[list[str], list[str], list[int]]:
        """(keys, sources, stamps) of table row `j`."""
        if j in self._samples_of:
            return self._samples_of[j]
        if self._snapshot_samples is None:
            raise FormatError("the sample index of this shard was not loaded")
        return self._snapshot_samples(j)


@dataclass
class Manifest:
    """What a cache holds at one generation and how it was made.

    Args:
        fingerprint: everything that determines the cached values (encoder ids and hashes, dtypes, scaling
            factors, bucket table, preprocessing); canonical JSON, hashed.
        schema: the fields every sample has.
        shapes: per bucket, per field, the per-sample shape (fixed fields) or trailing shape (ragged).
        files: other files of the cache by role (e.g. `"prompts"`), each `{"path", "bytes", "sha256"}`.
        extra: free-form JSON the stages record (e.g. run settings); not part of the fingerprint.
        generation: the last commit applied (-1: none).
    """

    fingerprint: dict
    schema: Schema
    shapes: dict[Bucket, dict[str, list]] = field(default_factory=dict)
    files: dict[str, dict] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    generation: int = -1
    next_seq: dict[str, int] = field(default_factory=dict)  # "rRRRRR/HxW" -> the next unused sequence number
    replaced: dict[str, str] = field(default_factory=dict)  # repaired shard path -> the path of its copy
    shards: ShardTable | None = None

    def __post_init__(self) -> None:
        self.fingerprint = normalize(self.fingerprint)
        if self.shards is None:
            self.shards = ShardTable(sorted(self.schema))

    @property
    def fingerprint_sha256(self) -> str:
        return fingerprint_hash(self.fingerprint)

    @property
    def num_samples(self) -> int:
        return int(self.shards.column("samples").sum())

    @property
    def num_bytes(self) -> int:
        return int(self.shards.column("bytes").sum())

    def buckets(self) -> dict[Bucket, "BucketStats"]:
        """Totals per bucket, in (height, width) order."""
        h, w = self.shards.column("height"), self.shards.column("width")
        n, b = self.shards.column("samples"), self.shards.column("bytes")
        stats: dict[Bucket, BucketStats] = {}
        if len(h):
            pairs, inverse = np.unique(np.stack([h, w], 1), axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            for k, (hh, ww) in enumerate(pairs):
                mine = inverse == k
                stats[Bucket(int(hh), int(ww))] = BucketStats(Bucket(int(hh), int(ww)), int(n[mine].sum()), int(mine.sum()), int(b[mine].sum()))
        return dict(sorted(stats.items()))

    def check_compatible(self, fingerprint: dict, schema: Schema, root: str | os.PathLike) -> None:
        """Refuse to combine values computed differently."""
        if normalize(fingerprint) != self.fingerprint:
            raise FingerprintMismatch(str(root), self.fingerprint, normalize(fingerprint))
        if schema != self.schema:
            raise FormatError(f"{root}: field schema differs: cache has {schema_to_json(self.schema)}, run has {schema_to_json(schema)}")

    # -- the sample index --------------------------------------------------------------------------
    def samples(self) -> Iterator[tuple[str, str, int, int, int]]:
        """(key, source, stamp, shard index, row in shard) of every sample, in global index order."""
        for i, j in enumerate(self.shards.rows):
            keys, sources, stamps = self.shards.samples_of(int(j))
            for r, (k, s, t) in enumerate(zip(keys, sources, stamps)):
                yield k, s, t, i, r

    def by_source(self) -> dict[str, tuple[str, int]]:
        """source -> (key, stamp) of every sample that recorded its source, from the sample index (no shard is
        opened): an incremental run skips an input whose stamp is unchanged without reading it. A source listed
        twice maps to its last sample in index order."""
        return {source: (key, stamp) for key, source, stamp, _, _ in self.samples() if source}

    def conflict(self, commit: dict) -> str | None:
        """Why `commit` cannot follow this generation, or None: a shard it removes or replaces is no longer
        listed, or a key it restamps is not (another writer committed a removal meanwhile)."""
        for path in [*commit.get("remove", []), *(old for old, _ in commit.get("replace", []))]:
            if path not in self.shards:
                return f"{path} is no longer a shard of the cache"
        missing = [key for key, _ in commit.get("restamp", []) if key not in self.shards.key_index()]
        return f"{len(missing)} restamped samples (e.g. {missing[0]}) are no longer in the cache" if missing else None

    # -- commits -----------------------------------------------------------------------------------
    def apply(self, commit: dict, where: str = "commit") -> None:
        """Apply one commit's actions."""
        gen = commit["generation"]
        if gen != self.generation + 1:
            raise FormatError(f"{where}: generation {gen} follows {self.generation}; the log has a gap")
        if "init" in commit:  # another writer started the cache first: it must be this cache
            init = commit["init"]
            if normalize(init["fingerprint"]) != self.fingerprint:
                raise FingerprintMismatch(where, init["fingerprint"], self.fingerprint)
            if schema_from_json(init["fields"]) != self.schema:
                raise FormatError(f"{where}: the cache's field schema differs from this writer's")
        for bucket, shapes in commit.get("shapes", {}).items():
            self.shapes.setdefault(Bucket.parse(bucket), shapes)
        for path in commit.get("remove", []):
            self.shards.remove(confined(path, where))
        for old, new in commit.get("replace", []):
            e = ShardEntry.from_json(new, where)
            if e.path == old or e.path in self.replaced:  # a repair chain must not loop back
                raise FormatError(f"{where}: {e.path} cannot replace {old}; the log was edited or damaged")
            self.shards.replace(confined(old, where), e)
            self.replaced[old] = e.path
            self._count(e.path)
        for obj in commit.get("add", []):
            e = ShardEntry.from_json(obj, where)
            self.shards.append(e)
            self._count(e.path)
        for key, stamp in commit.get("restamp", []):
            self.shards.restamp(key, int(stamp))
        for role, entry in commit.get("files", {}).items():
            if entry is None:
                self.files.pop(role, None)
            else:
                confined(entry["path"], where)
                self.files[role] = entry
        self.extra.update(commit.get("extra", {}))
        self.generation = gen

    def _count(self, path: str) -> None:
        parsed = parse_shard_name(PurePosixPath(path).name)
        if parsed:
            key = f"r{parsed[0]:05d}/{PurePosixPath(path).parent}"
            self.next_seq[key] = max(self.next_seq.get(key, 0), parsed[1] + 1)

    # -- snapshots ---------------------------------------------------------------------------------
    def encode_snapshot(self) -> bytes:
        rows = self.shards.rows
        t = self.shards
        f = len(t.fields)

        def ragged(strings: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
            data = [s.encode("utf-8", "surrogateescape") for s in strings]
            offsets = np.zeros(len(data) + 1, dtype=np.int64)
            np.cumsum([len(d) for d in data], out=offsets[1:])
            return torch.frombuffer(bytearray(b"".join(data)) or bytearray(1), dtype=torch.uint8)[: offsets[-1]], torch.from_numpy(offsets)

        tensors = {}
        tensors["shards.path"], tensors["shards.path.offsets"] = ragged([t._paths[j] for j in rows])
        tensors["shards.bucket"] = torch.from_numpy(np.stack([t.column("height"), t.column("width")], 1).astype(np.int32).reshape(-1, 2))
        tensors["shards.samples"] = torch.from_numpy(t.column("samples").copy())
        tensors["shards.bytes"] = torch.from_numpy(t.column("bytes").copy())
        sha = np.frombuffer(bytes(t._sha), dtype=np.uint8).reshape(-1, 32)
        tensors["shards.sha256"] = torch.from_numpy(sha[rows].copy().reshape(-1, 32))
        tensors["shards.field_bytes"] = torch.from_numpy(t.column("field_bytes").copy().reshape(-1, f))
        keys, sources, stamps, shard = [], [], [], []
        for i, j in enumerate(rows):
            k, s, st = t.samples_of(int(j))
            keys += k
            sources += s
            stamps += st
            shard += [i] * len(k)
        tensors["samples.key"], tensors["samples.key.offsets"] = ragged(keys)
        tensors["samples.source"], tensors["samples.source.offsets"] = ragged(sources)
        tensors["samples.stamp"] = torch.tensor(stamps, dtype=torch.int64)
        tensors["samples.shard"] = torch.tensor(shard, dtype=torch.int64)
        metadata = {
            "format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "kind": "snapshot", "generation": str(self.generation),
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True), "fingerprint_sha256": self.fingerprint_sha256,
            "fields": json.dumps(schema_to_json(self.schema), sort_keys=True), "field_order": json.dumps(t.fields),
            "shapes": json.dumps({b.name: s for b, s in sorted(self.shapes.items())}, sort_keys=True),
            "files": json.dumps(self.files, sort_keys=True), "extra": json.dumps(self.extra, sort_keys=True),
            "next_seq": json.dumps(self.next_seq, sort_keys=True), "replaced": json.dumps(self.replaced, sort_keys=True),
        }
        return serialize(tensors, metadata)

    @classmethod
    def from_init(cls, commit: dict, where: str) -> "Manifest":
        """The empty manifest the first commit of a cache starts (the commit itself is not applied)."""
        init = commit.get("init")
        if init is None:
            raise FormatError(f"{where}: the first commit of a cache must carry its fingerprint and schema")
        m = cls(init["fingerprint"], schema_from_json(init["fields"]))
        if m.fingerprint_sha256 != init["fingerprint_sha256"]:
            raise FormatError(f"{where}: fingerprint_sha256 does not match its fingerprint; the log was edited or damaged")
        return m

    @classmethod
    def from_snapshot(cls, path: Path) -> "Manifest":
        meta, tensors = open_file(path, kind="snapshot")
        try:
            schema = schema_from_json(json.loads(meta["fields"]))
            m = cls(json.loads(meta["fingerprint"]), schema, generation=int(meta["generation"]))
            if m.fingerprint_sha256 != meta["fingerprint_sha256"]:
                raise FormatError(f"{path}: fingerprint_sha256 does not match its fingerprint; the snapshot was edited or damaged")
            m.shapes = {Bucket.parse(k): v for k, v in json.loads(meta["shapes"]).items()}
            m.files, m.extra = json.loads(meta["files"]), json.loads(meta["extra"])
            m.next_seq, m.replaced = json.loads(meta["next_seq"]), snapshot_replacements(meta, path)
            fields = json.loads(meta["field_order"])
        except FormatError:
            raise
        except (KeyError, ValueError) as e:
            raise FormatError(f"{path}: snapshot metadata is incomplete ({e}); restore it or run `python -m shards verify`") from e
        for entry in m.files.values():
            confined(entry["path"], str(path))
        t = ShardTable(fields)
        paths = _Strings(tensors["shards.path"], tensors["shards.path.offsets"]).all()
        t._paths = [confined(p, str(path)) for p in paths]
        bucket = tensors["shards.bucket"].numpy()
        t._height, t._width = array("i", bucket[:, 0].tobytes()), array("i", bucket[:, 1].tobytes())
        t._samples, t._bytes = array("q", tensors["shards.samples"].numpy().tobytes()), array("q", tensors["shards.bytes"].numpy().tobytes())
        t._sha = bytearray(tensors["shards.sha256"].numpy().tobytes())
        t._field_bytes = array("q", tensors["shards.field_bytes"].numpy().tobytes())
        t._live = bytearray(b"\x01" * len(t._paths))
        t._snapshot_samples = _SnapshotSamples(tensors, tensors["shards.samples"].numpy(), str(path))
        m.shards = t
        return m


def snapshot_replacements(meta: dict[str, str], path: Path) -> dict[str, str]:
    """A snapshot's `replaced` map (repaired shard path -> its copy), each path checked to stay in the cache."""
    return {confined(old, str(path)): confined(new, str(path)) for old, new in json.loads(meta["replaced"]).items()}


class _Strings:
    """Ragged UTF-8 strings (bytes + (N + 1,) offsets) of a snapshot, decoded on demand without copying the bytes."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor):
        self.data, self.offsets = memoryview(data.numpy()), offsets.numpy()

    def __getitem__(self, span: slice) -> list[str]:
        offs = self.offsets[span.start : span.stop + 1].tolist()
        return [str(self.data[a:b], "utf-8", "surrogateescape") for a, b in zip(offs, offs[1:])]

    def all(self) -> list[str]:
        return self[0 : len(self.offsets) - 1]


class _SnapshotSamples:
    """A snapshot's sample index, decoded per shard on demand (training never asks)."""

    def __init__(self, tensors: dict[str, torch.Tensor], samples: np.ndarray, where: str):
        self.tensors, self.samples, self.where = tensors, samples, where
        self._columns = None

    def _load(self) -> tuple:
        t = self.tensors
        # the samples of shard j are rows bounds[j]:bounds[j + 1]
        bounds = np.searchsorted(t["samples.shard"].numpy(), np.arange(len(self.samples) + 1))
        if not np.array_equal(np.diff(bounds), self.samples) or bounds[-1] != len(t["samples.stamp"]):
            raise FormatError(f"{self.where}: the sample index does not match the shards' sample counts; the "
                              f"snapshot is damaged")
        return (bounds, _Strings(t["samples.key"], t["samples.key.offsets"]),
                _Strings(t["samples.source"], t["samples.source.offsets"]), t["samples.stamp"].numpy())

    def __call__(self, j: int) -> tuple[list[str], list[str], list[int]]:
        if self._columns is None:
            self._columns = self._load()
        bounds, keys, sources, stamps = self._columns
        a, b = int(bounds[j]), int(bounds[j + 1])
        return keys[a:b], sources[a:b], stamps[a:b].tolist()


@dataclass
class BucketStats:
    bucket: Bucket
    samples: int = 0
    shards: int = 0
    bytes: int = 0


# ---- the log on disk --------------------------------------------------------------------------------

def _committed(root: Path) -> bool:
    """Whether the log or a snapshot holds a generation (gc may have collected the first commits)."""
    return (root / LOG_DIR / LOG_NAME.format(0)).exists() or bool(snapshots(root))


def exists(root: str | os.PathLike) -> bool:
    """Whether `root` holds a cache: something was committed there, or it has an `index.json` (a cache of
    another version, or one whose log was lost; either way no directory to start afresh in)."""
    root = Path(root)
    return (root / MANIFEST).exists() or _committed(root)


def missing_manifest(root: str | os.PathLike) -> tuple[bool, str]:
    """Why a directory holds no committed cache: (never committed, what to tell the user).

    A writer commits after every shard it publishes, so a run killed before its first commit leaves at
    most one shard file (and one temp file) per rank. More shard files than that, or an `index.json`, mean
    commits happened and the log was lost afterwards.
    """
    root = Path(root)
    build = f"build it with `make precompute DATA=... CACHE={root}`"
    if not root.is_dir():
        return True, f"{root} does not exist; {build}"
    shards: dict[str, int] = {}
    leftovers = 0
    for path in root.glob("*/*"):
        m = _SHARD_FILE.fullmatch(path.name)
        if m and path.parent.name not in (LOG_DIR, SNAPSHOT_DIR):
            leftovers += 1
            if not m.group(3):
                shards[m.group(1)] = shards.get(m.group(1), 0) + 1
    pointer = (root / MANIFEST).exists()
    if any(n > 1 for n in shards.values()) or pointer:
        return False, (f"{root} holds {sum(shards.values())} shard files and {'an' if pointer else 'no'} {MANIFEST} "
                       f"but no commit log ({LOG_DIR}/ and {SNAPSHOT_DIR}/): it was removed or lost after shards were "
                       f"committed. Restore {LOG_DIR}/ and {SNAPSHOT_DIR}/ from a backup, or rebuild the cache with "
                       f"`make precompute`")
    left = (f" ({leftovers} file(s) left by a run interrupted before its first commit; the next `make precompute` into it "
            f"clears them)") if leftovers else ""
    return True, f"{root} is not a cache yet: no manifest was ever committed{left}; {build}"


def snapshots(root: Path) -> list[int]:
    """Generations with a snapshot, oldest first (temp files of a snapshot being written are not listed)."""
    return sorted(int(p.stem) for p in (root / SNAPSHOT_DIR).glob("*.safetensors") if p.stem.isdigit())


def first_generation(root: Path) -> int | None:
    """The oldest generation that can still be loaded (gc collects the log before the oldest one needed)."""
    if (root / LOG_DIR / LOG_NAME.format(0)).exists():
        return 0
    return next(iter(snapshots(root)), None)


def _pointer(root: Path) -> int | None:
    """The snapshot generation `index.json` names, after checking it is a cache of this format version."""
    path = root / MANIFEST
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON ({e}); delete it (the log under {LOG_DIR}/ is the truth) and retry") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a {FORMAT_NAME} manifest (its 'format' field is missing or wrong)")
    if obj.get("format_version") == 1:
        raise FormatError(f"{root} is a version 1 cache (a single index.json); this library reads version {FORMAT_VERSION}. "
                          f"Convert it in place, keeping every shard: python -m shards upgrade {root}")
    check_version(obj.get("format_version"), str(path))
    return obj.get("snapshot_generation")


def load(root: str | os.PathLike, generation: int | None = None) -> Manifest:
    """The manifest at `generation` (default: the newest): the newest snapshot at or before it, plus the
    commits after that snapshot.

    Raises:
        FileNotFoundError: nothing was ever committed here; the message says what the directory is.
        FormatError: another format version, a damaged log or snapshot, or a generation gc collected.
    """
    root = Path(root)
    _pointer(root)
    if not _committed(root):
        raise FileNotFoundError(missing_manifest(root)[1])
    if generation is not None and generation < 0:
        raise ValueError(f"generation {generation} is negative; the first generation is 0")
    first = root / LOG_DIR / LOG_NAME.format(0)
    manifest = _snapshot_at_or_before(root, generation)
    if manifest is None and (commit := read_commit(first)) is not None:
        manifest = Manifest.from_init(commit, str(first))
    if manifest is None:
        raise FormatError(f"{root} has no generation {generation} any more (the oldest kept is "
                          f"{first_generation(root)}): `python -m shards gc` collected it, since no registered run "
                          f"needed it")
    replay(root, manifest, generation)
    if generation is not None and manifest.generation != generation:
        raise FormatError(f"{root} has no generation {generation} (the newest is {manifest.generation}); the run that "
                          f"recorded it belongs to another cache")
    return manifest


def _snapshot_at_or_before(root: Path, generation: int | None) -> Manifest | None:
    """The newest snapshot at or before `generation`, loaded; a writer may prune the one listed a moment ago
    (`prune_snapshots`), so the listing is read again then."""
    for _ in range(3):
        base = [g for g in snapshots(root) if generation is None or g <= generation]
        if not base:
            return None
        try:
            return Manifest.from_snapshot(root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(base[-1]))
        except FileNotFoundError:
            continue
    raise FormatError(f"{root}: the snapshots under {SNAPSHOT_DIR}/ kept disappearing while loading; retry")


def replay(root: Path, manifest: Manifest, upto: int | None = None) -> list[dict]:
    """Apply the commits after `manifest.generation` up to `upto` (default: every one there is); returns them."""
    applied = []
    while upto is None or manifest.generation < upto:
        path = root / LOG_DIR / LOG_NAME.format(manifest.generation + 1)
        commit = read_commit(path)
        if commit is None:
            break
        manifest.apply(commit, str(path))
        applied.append(commit)
    return applied


def replacements(root: Path, manifest: Manifest) -> dict[str, str]:
    """Repaired shard path -> its copy, as of the newest generation: a reader of `manifest`'s (older) generation
    follows them. Reads the newest snapshot's metadata and the commits after it, not the whole state."""
    replaced = dict(manifest.replaced)
    generation = manifest.generation
    later = [g for g in snapshots(root) if g > generation]
    if later:
        path = root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(later[-1])
        replaced.update(snapshot_replacements(open_file(path, kind="snapshot", tensors=False)[0], path))
        generation = later[-1]
    while (commit := read_commit(path := root / LOG_DIR / LOG_NAME.format(generation + 1))) is not None:
        for old, new in commit.get("replace", []):
            replaced[confined(old, str(path))] = confined(new["path"], str(path))
        generation += 1
    return replaced


def newest_copy(path: str, replaced: dict[str, str]) -> list[str]:
    """`path` and its repaired copies, oldest first: the last one is what a reader opens."""
    chain = [path]
    while chain[-1] in replaced:
        chain.append(replaced[chain[-1]])
        if chain[-1] in chain[:-1]:
            raise FormatError(f"the repairs of {path} form a cycle; the manifest was edited or damaged")
    return chain


def read_commit(path: Path) -> dict | None:
    """The commit at `path`, None when that generation was not committed (yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        commit = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON ({e}): the commit log is damaged; run `python -m shards verify`") from e
    if not isinstance(commit, dict) or commit.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a {FORMAT_NAME} commit")
    check_version(commit.get("format_version"), str(path))
    return commit


def _create(final: Path, data: bytes, rank: int) -> bool:
    """Create `final` holding `data` if it does not exist yet (False if it does): the bytes go to a temp file
    first, fsynced, then are hard-linked to `final`, so `final` is never seen partial or overwritten."""
    tmp = final.with_name(f".{final.name}.r{rank:05d}.{os.getpid()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    fsync_dir(final.parent)
    return True


def write_commit(root: Path, commit: dict, rank: int = 0) -> bool:
    """Create `_log/GENERATION.json` if it does not exist yet: False when another writer took the number."""
    log = root / LOG_DIR
    if not log.is_dir():
        log.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
    body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **commit}
    return _create(log / LOG_NAME.format(commit["generation"]), json.dumps(body, separators=(",", ":")).encode(), rank)


def compact(root: Path, manifest: Manifest, rank: int = 0, prune: bool = True) -> None:
    """Write `manifest` as the snapshot of its generation (unless another writer did), point `index.json` at the
    newest snapshot and, with `prune`, delete the snapshots no reader needs (`prune_snapshots`). `gc` compacts
    without pruning: its snapshot becomes the oldest once it has deleted the ones before it."""
    directory = root / SNAPSHOT_DIR
    if not directory.is_dir():
        directory.mkdir(exist_ok=True)
        fsync_dir(root)
    _create(directory / SNAPSHOT_NAME.format(manifest.generation), manifest.encode_snapshot(), rank)
    write_pointer(root, manifest)
    if prune:
        prune_snapshots(root)


def prune_snapshots(root: Path) -> None:
    """Delete the snapshots between the oldest and the two newest. Every generation stays loadable: the log is
    kept until `gc`, and the oldest snapshot is where it starts once `gc` collected its beginning; the
    previous newest is kept for a reader that listed it a moment ago. Without this a million-shard cache
    would keep a hundred snapshots of growing size."""
    for generation in snapshots(root)[1:-2]:
        (root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(generation)).unlink(missing_ok=True)


def write_pointer(root: Path, manifest: Manifest) -> None:
    """Point `index.json` at the newest snapshot (none yet: null). Concurrent writers may leave it one snapshot
    behind; readers list `_snapshots/` and never depend on it."""
    newest = snapshots(root)
    atomic_write_json(root / MANIFEST, {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "fingerprint_sha256": manifest.fingerprint_sha256,
        "snapshot_generation": newest[-1] if newest else None,
        "note": f"the cache's state is {SNAPSHOT_DIR}/<snapshot_generation>.safetensors plus the commits after it in {LOG_DIR}/",
    })


def compaction_due(root: Path, generation: int) -> bool:
    """Whether to snapshot after committing `generation`: every COMPACT_MIN commits while the cache is young,
    then every generation/64 commits, at most every COMPACT_MAX (see FORMAT.md)."""
    last = snapshots(root)
    since = generation - (last[-1] if last else -1)
    return since >= COMPACT_MIN and (since >= COMPACT_MAX or since * 64 >= generation)
