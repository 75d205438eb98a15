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

This module holds the `Manifest` of one generation, how a generation is loaded (`load`) and how the log is
compacted. Beneath it: `shards.layout` (the names of a cache's files), `shards.table` (the shards of a
generation, in columns) and `shards.log` (the commit and snapshot files); what moved there is re-exported here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import numpy as np

from shards.buckets import Bucket
from shards.fingerprint import fingerprint_hash, normalize
from shards.layout import (
    LOG_DIR,
    LOG_NAME,
    MANIFEST,
    READERS_DIR,
    SNAPSHOT_DIR,
    SNAPSHOT_NAME,
    confined,
    parse_shard_name,
    shard_name,
)
from shards.log import (
    check_log_end,
    check_snapshot,
    committed,
    damaged_commit,
    damaged_snapshot,
    exists,
    first_generation,
    lost_snapshot,
    missing_manifest,
    prune_snapshots,
    read_commit,
    read_pointer,
    sample_index_digest,
    snapshot_digest,
    snapshots,
    write_commit,
    write_pointer,
    write_snapshot,
)
from shards.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    DamagedLog,
    FingerprintMismatch,
    FormatError,
    Schema,
    open_file,
    schema_from_json,
    schema_to_json,
    serialize,
)
from shards.table import ShardEntry, ShardTable

__all__ = [  # the library imports these from here, the moved ones included
    "COMPACT_MAX", "COMPACT_MIN", "LOG_DIR", "LOG_NAME", "MANIFEST", "READERS_DIR", "SNAPSHOT_DIR", "SNAPSHOT_NAME",
    "BucketStats", "Manifest", "ShardEntry", "ShardTable",
    "compact", "compaction_due", "confined", "exists", "first_generation", "load", "missing_manifest", "newest_copy",
    "parse_shard_name", "prune_snapshots", "read_commit", "replacements", "replay", "shard_name", "snapshot_replacements",
    "snapshots", "write_commit", "write_pointer", "write_snapshot",
]

# Compact the log into a snapshot once this many commits follow the last one: readers replay at most this
# many small files, and a commit pays for snapshots 1/COMPACT_EVERY of the time.
COMPACT_MIN, COMPACT_MAX = 256, 4096


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

    def datasets(self) -> dict[str, dict[str, int]]:
        """Totals per dataset (the named sources of stage one's dataset file; "" for samples written without
        one): `{name: {"samples", "shards", "bytes"}}`, in name order. From the shard table alone."""
        names = np.array(self.shards.datasets(), dtype=object)
        n, b = self.shards.column("samples"), self.shards.column("bytes")
        return {str(name): {"samples": int(n[names == name].sum()), "shards": int((names == name).sum()),
                            "bytes": int(b[names == name].sum())} for name in sorted(set(names.tolist()))}

    # -- the sample index --------------------------------------------------------------------------
    def samples(self, dataset: str | None = None) -> Iterator[tuple[str, str, int, int, int]]:
        """(key, source, stamp, shard index, row in shard) of every sample (of one dataset), in global index order."""
        names = self.shards.datasets() if dataset is not None else None
        for i, j in enumerate(self.shards.rows):
            if names is not None and names[i] != dataset:
                continue
            keys, sources, stamps = self.shards.samples_of(int(j))
            for r, (k, s, t) in enumerate(zip(keys, sources, stamps)):
                yield k, s, t, i, r

    def by_source(self, dataset: str | None = None) -> dict[str, tuple[str, int]]:
        """source -> (key, stamp) of every sample (of one dataset) that recorded its source, from the sample index
        (no shard is opened): an incremental run skips an input whose stamp is unchanged without reading it. A
        source listed twice maps to its last sample in index order."""
        return {source: (key, stamp) for key, source, stamp, _, _ in self.samples(dataset) if source}

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
        for old, new in commit.get("rename_dataset", []):
            self.shards.rename_dataset(str(old), str(new))
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
        tensors = self.shards.to_tensors()
        metadata = {
            "format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "kind": "snapshot", "generation": str(self.generation),
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True), "fingerprint_sha256": self.fingerprint_sha256,
            "fields": json.dumps(schema_to_json(self.schema), sort_keys=True), "field_order": json.dumps(self.shards.fields),
            "shapes": json.dumps({b.name: s for b, s in sorted(self.shapes.items())}, sort_keys=True),
            "files": json.dumps(self.files, sort_keys=True), "extra": json.dumps(self.extra, sort_keys=True),
            "next_seq": json.dumps(self.next_seq, sort_keys=True), "replaced": json.dumps(self.replaced, sort_keys=True),
        }
        metadata["samples_sha256"] = sample_index_digest(tensors)  # checked where the sample index is read
        metadata["sha256"] = snapshot_digest(metadata, tensors)  # checked on every load
        return serialize(tensors, metadata)

    @classmethod
    def from_init(cls, commit: dict, where: str) -> "Manifest":
        """The empty manifest the first commit of a cache starts (the commit itself is not applied)."""
        init = commit.get("init")
        if init is None:
            raise FormatError(f"{where}: the first commit of a cache must carry its fingerprint and schema")
        try:
            m = cls(init["fingerprint"], schema_from_json(init["fields"]))
        except (KeyError, TypeError, ValueError) as e:
            raise damaged_commit(Path(where), f"its init is incomplete: {e}") from None
        if m.fingerprint_sha256 != init["fingerprint_sha256"]:
            raise damaged_commit(Path(where), "fingerprint_sha256 does not match its fingerprint")
        return m

    @classmethod
    def from_snapshot(cls, path: Path) -> "Manifest":
        """The manifest a snapshot file holds.

        Raises:
            FileNotFoundError: no such snapshot (a writer pruned it a moment ago).
            DamagedLog: the file is there but is not a whole snapshot, or fails its digest.
            FormatError: a snapshot of another format version.
        """
        try:
            meta, tensors = open_file(path, kind="snapshot")
        except FormatError as e:
            if "format version" in str(e):
                raise
            raise damaged_snapshot(path, str(e)) from None
        check_snapshot(path, meta, tensors)  # the sample index aside: it is checked when read
        try:
            return cls._from_snapshot(path, meta, tensors)
        except (FormatError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:  # tables that do not fit
            raise damaged_snapshot(path, str(e)) from None

    @classmethod
    def _from_snapshot(cls, path: Path, meta: dict[str, str], tensors: dict) -> "Manifest":
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
        m.shards = ShardTable.from_tensors(fields, tensors, str(path), meta.get("samples_sha256"))
        return m


def snapshot_replacements(meta: dict[str, str], path: Path) -> dict[str, str]:
    """A snapshot's `replaced` map (repaired shard path -> its copy), each path checked to stay in the cache."""
    try:
        pairs = json.loads(meta["replaced"]).items()
    except (KeyError, ValueError, AttributeError) as e:  # metadata the snapshot's digest would have refused
        raise damaged_snapshot(path, f"its 'replaced' metadata cannot be read ({e})") from None
    return {confined(old, str(path)): confined(new, str(path)) for old, new in pairs}


@dataclass
class BucketStats:
    bucket: Bucket
    samples: int = 0
    shards: int = 0
    bytes: int = 0


# ---- loading a generation ---------------------------------------------------------------------------

def load(root: str | os.PathLike, generation: int | None = None) -> Manifest:
    """The manifest at `generation` (default: the newest): the newest snapshot at or before it, plus the
    commits after that snapshot.

    Raises:
        FileNotFoundError: nothing was ever committed here; the message says what the directory is.
        DamagedLog: a damaged commit or snapshot, or a commit missing before later ones; the message names it.
        FormatError: another format version, or a generation gc collected.
    """
    root = Path(root)
    pointer = read_pointer(root)
    if not committed(root):
        raise FileNotFoundError(missing_manifest(root)[1])
    if generation is not None and generation < 0:
        raise ValueError(f"generation {generation} is negative; the first generation is 0")
    for attempt in range(3):
        listed = snapshots(root)
        try:
            manifest = _start(root, generation)
            replay(root, manifest, generation)
            break
        except DamagedLog:
            # gc deletes the log before the snapshot it keeps, oldest first: a load that started from an older
            # snapshot meanwhile finds a gap, and loads again from the new oldest one
            if attempt == 2 or snapshots(root) == listed:
                raise
    if generation is not None and manifest.generation != generation:
        raise FormatError(f"{root} has no generation {generation} (the newest is {manifest.generation}); the run that "
                          f"recorded it belongs to another cache")
    if generation is None and pointer is not None and pointer > manifest.generation:
        # the pointer only ever names a snapshot of a committed generation: the end of the log was lost, and a
        # writer would take the shards of the lost commits for uncommitted ones
        missing = root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(pointer)
        raise DamagedLog(missing, f"{root / MANIFEST} names snapshot {missing}, but the log and snapshots end at generation "
                                  f"{manifest.generation}: the last commits (and that snapshot) were lost, and the shards "
                                  f"they list are not at fault (--repair cannot help). Restore {LOG_DIR}/ and "
                                  f"{SNAPSHOT_DIR}/ from a backup of the cache; without one, build the cache again into a "
                                  f"new directory (`make precompute DATA=... CACHE=NEW`). Nothing was deleted.")
    return manifest


def _start(root: Path, generation: int | None) -> Manifest:
    """The manifest a load of `generation` starts from: the newest snapshot at or before it, or commit 0's init."""
    first = root / LOG_DIR / LOG_NAME.format(0)
    manifest = _snapshot_at_or_before(root, generation)
    if manifest is None and (commit := read_commit(first)) is not None:
        manifest = Manifest.from_init(commit, str(first))
    if manifest is None:
        if not snapshots(root):  # gc always keeps a snapshot where it collected the log
            check_log_end(root, 0)
        if generation is not None and (lost := lost_snapshot(root, generation)) is not None:
            raise lost
        raise FormatError(f"{root} has no generation {generation} any more (the oldest kept is "
                          f"{first_generation(root)}): `python -m shards gc` collected it, since no registered run "
                          f"needed it")
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


def replay(root: Path, manifest: Manifest, upto: int | None = None, check_end: bool = True) -> list[dict]:
    """Apply the commits after `manifest.generation` up to `upto` (default: every one there is); returns them.

    The log ends at the first missing commit only when no later one exists (`check_end`: one listing of the log;
    a writer that checked it at its start passes False, since writers never leave a gap).

    Raises:
        DamagedLog: a commit fails its checks or cannot follow the one before, or one is missing before later ones.
    """
    applied = []
    while upto is None or manifest.generation < upto:
        path = root / LOG_DIR / LOG_NAME.format(manifest.generation + 1)
        commit = read_commit(path)
        if commit is None:
            if check_end and not check_log_end(root, manifest.generation + 1):
                continue  # committed while the log was listed
            break
        try:
            manifest.apply(commit, str(path))
        except DamagedLog:
            raise
        except (FormatError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, FingerprintMismatch):  # another cache's commit: not damage, said as it is
                raise
            raise damaged_commit(path, str(e)) from None
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
    while True:
        while (commit := read_commit(path := root / LOG_DIR / LOG_NAME.format(generation + 1))) is not None:
            for old, new in commit.get("replace", []):
                replaced[confined(old, str(path))] = confined(new["path"], str(path))
            generation += 1
        if check_log_end(root, generation + 1):
            return replaced


def newest_copy(path: str, replaced: dict[str, str]) -> list[str]:
    """`path` and its repaired copies, oldest first: the last one is what a reader opens."""
    chain = [path]
    while chain[-1] in replaced:
        chain.append(replaced[chain[-1]])
        if chain[-1] in chain[:-1]:
            raise FormatError(f"the repairs of {path} form a cycle; the manifest was edited or damaged")
    return chain


# ---- compacting the log ------------------------------------------------------------------------------

def compact(root: Path, manifest: Manifest, rank: int = 0, prune: bool = True) -> None:
    """Write `manifest` as the snapshot of its generation (unless another writer did), point `index.json` at the
    newest snapshot and, with `prune`, delete the snapshots no reader needs (`prune_snapshots`). `gc` compacts
    without pruning: its snapshot becomes the oldest once it has deleted the ones before it."""
    write_snapshot(root, manifest.generation, manifest.encode_snapshot(), rank)
    write_pointer(root, manifest)
    if prune:
        prune_snapshots(root)


def compaction_due(root: Path, generation: int) -> bool:
    """Whether to snapshot after committing `generation`: every COMPACT_MIN commits while the cache is young,
    then every generation/64 commits, at most every COMPACT_MAX (see FORMAT.md)."""
    last = snapshots(root)
    since = generation - (last[-1] if last else -1)
    return since >= COMPACT_MIN and (since >= COMPACT_MAX or since * 64 >= generation)
