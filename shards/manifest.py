"""The cache manifest: what a cache holds at one generation and how it was made.

A cache's history is a commit log with snapshots (see `shards.log` for its files and `shards.generations` for
loading a generation from them): every commit is a new numbered JSON file `_log/GENERATION.json` of actions (add
shards, remove shards, replace a shard by its repaired copy, set auxiliary files and run records), and every so
often the state is compacted into `_snapshots/GENERATION.safetensors` (columnar tables: loading a million shards
is a memory map, not a JSON parse). This module holds the `Manifest` of one generation: applying a commit to it,
and encoding it as a snapshot and reading it back. Beneath it: `shards.layout` (the names of a cache's files) and
`shards.table` (the shards of a generation, in columns). See FORMAT.md.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from shards.buckets import Bucket
from shards.fingerprint import fingerprint_hash, normalize
from shards.layout import confined, parse_shard_name
from shards.log import TEXT_INDEX, check_snapshot, damaged_commit, damaged_snapshot, sample_index_digest, snapshot_digest
from shards.sample_index import DIGESTS, SampleIndex, StampTable
from shards.schema import (
    BASE_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    FingerprintMismatch,
    FormatError,
    Schema,
    open_file,
    schema_from_json,
    schema_to_json,
    serialize,
)
from shards.table import ShardEntry, ShardTable
from shards.texts import TEXT_KEYS


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
        text_schema: the fields of a text row in a cache that stores texts once (`shards.texts`); None in others.
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
    text_schema: Schema | None = None
    texts: ShardTable | None = None  # the text shards (a cache that stores texts once)

    def __post_init__(self) -> None:
        self.fingerprint = normalize(self.fingerprint)
        if self.shards is None:
            self.shards = ShardTable(sorted(self.schema))
        if self.text_schema is not None and self.texts is None:
            self.texts = ShardTable(sorted(self.text_schema), TEXT_TABLE, DIGESTS)

    def copy(self) -> Manifest:
        """A manifest that changes apart from this one (a writer's, from the one a run decided on): the shard tables
        copied, their sample index shared."""
        m = copy.copy(self)
        m.shapes, m.files, m.extra = copy.deepcopy(self.shapes), copy.deepcopy(self.files), copy.deepcopy(self.extra)
        m.next_seq, m.replaced = dict(self.next_seq), dict(self.replaced)
        m.shards = self.shards.copy()
        m.texts = self.texts.copy() if self.texts is not None else None
        return m

    @property
    def version(self) -> int:
        """The format version of the cache's commits and snapshots: 3 when it stores texts once, 2 otherwise."""
        return FORMAT_VERSION if self.text_schema is not None else BASE_VERSION

    def text_stats(self) -> dict[str, int] | None:
        """Texts stored once (None in a cache that stores them with each sample): `texts` rows in `shards` text shards
        of `bytes`; `references` from samples, which would take `inline_bytes` stored with each; `saved` bytes (the
        inline bytes less the text shards and the samples' `text_keys`)."""
        if self.texts is None:
            return None
        stored = int(self.texts.column("bytes").sum())
        keys = int(self.shards.column("field_bytes")[:, self.shards.fields.index(TEXT_KEYS)].sum())
        inline = int(self.shards.column("text_ref_bytes").sum())
        return {"texts": int(self.texts.column("samples").sum()), "shards": len(self.texts), "bytes": stored,
                "references": int(self.shards.column("text_refs").sum()), "inline_bytes": inline, "key_bytes": keys,
                "saved": inline - stored - keys}

    @property
    def fingerprint_sha256(self) -> str:
        return fingerprint_hash(self.fingerprint)

    @property
    def num_samples(self) -> int:
        return int(self.shards.column("samples").sum())

    @property
    def num_bytes(self) -> int:
        return int(self.shards.column("bytes").sum())

    def buckets(self) -> dict[Bucket, BucketStats]:
        """Totals per bucket, in (height, width, frames) order."""
        h, w, f = (self.shards.column(c) for c in ("height", "width", "frames"))
        n, b = self.shards.column("samples"), self.shards.column("bytes")
        stats: dict[Bucket, BucketStats] = {}
        if len(h):
            triples, inverse = np.unique(np.stack([h, w, f], 1), axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            for k, (hh, ww, ff) in enumerate(triples):
                mine = inverse == k
                bucket = Bucket(int(hh), int(ww), int(ff))
                stats[bucket] = BucketStats(bucket, int(n[mine].sum()), int(mine.sum()), int(b[mine].sum()))
        return dict(sorted(stats.items()))

    def check_compatible(self, fingerprint: dict, schema: Schema, root: str | os.PathLike, text_schema: Schema | None = None) -> None:
        """Refuse to combine values computed differently, or laid out otherwise."""
        if normalize(fingerprint) != self.fingerprint:
            raise FingerprintMismatch(str(root), self.fingerprint, normalize(fingerprint))
        if schema != self.schema:
            raise FormatError(f"{root}: field schema differs: cache has {schema_to_json(self.schema)}, run has {schema_to_json(schema)}")
        if text_schema != self.text_schema:
            def layout(t):
                return "texts stored with each sample" if t is None else f"texts stored once, fields {schema_to_json(t)}"
            raise FormatError(f"{root}: the cache has {layout(self.text_schema)}, this writer {layout(text_schema)}")

    def resolutions(self) -> dict[int, int]:
        """Samples per resolution (`ShardEntry.resolution`: 0 is the cache's base resolution), from the shard table."""
        res, n = self.shards.column("resolution"), self.shards.column("samples")
        return {int(r): int(n[res == r].sum()) for r in sorted(set(res.tolist()))}

    def datasets(self) -> dict[str, dict[str, int]]:
        """Totals per dataset (the named sources of stage one's dataset file; "" for samples written without
        one): `{name: {"samples", "shards", "bytes"}}`, in name order. From the shard table alone."""
        names = np.array(self.shards.datasets(), dtype=object)
        n, b = self.shards.column("samples"), self.shards.column("bytes")
        return {str(name): {"samples": int(n[names == name].sum()), "shards": int((names == name).sum()),
                            "bytes": int(b[names == name].sum())} for name in sorted(set(names.tolist()))}

    def captions(self) -> dict[str, int]:
        """Captions per dataset, from the shard table alone: the rows of its shards' `text_lengths` field (one int32
        per caption; its bytes less the (N + 1) int64 offsets), or their `text_refs` where texts are stored once; {}
        for a cache without either."""
        spec = self.schema.get("text_lengths")
        names = np.array(self.shards.datasets(), dtype=object)
        if self.texts is not None:  # texts stored once: each shard's references to text rows, one per caption
            rows = self.shards.column("text_refs")
        elif spec is None or not spec.ragged or "text_lengths" not in self.shards.fields:
            return {}
        else:
            stored = self.shards.column("field_bytes")[:, self.shards.fields.index("text_lengths")]
            rows = (stored - 8 * (self.shards.column("samples") + 1)) // spec.dtype.itemsize
        return {str(name): int(rows[names == name].sum()) for name in sorted(set(names.tolist()))}

    # -- the sample index --------------------------------------------------------------------------
    def samples(self, dataset: str | None = None, resolution: int | None = None) -> Iterator[tuple[str, str, int, int, int]]:
        """(key, source, stamp, shard index, row in shard) of every sample (of one dataset; of one resolution, 0 for
        the cache's base one, see `ShardEntry.resolution`), in global index order."""
        names = self.shards.datasets() if dataset is not None else None
        resolutions = self.shards.column("resolution") if resolution is not None else None
        for i, j in enumerate(self.shards.rows):
            if (names is not None and names[i] != dataset) or (resolutions is not None and resolutions[i] != resolution):
                continue
            keys, sources, stamps = self.shards.samples_of(int(j))
            for r, (k, s, t) in enumerate(zip(keys, sources, stamps)):
                yield k, s, t, i, r

    def index(self, dataset: str | None = None, resolution: int | None = None) -> SampleIndex:
        """The sample index (keys, sources, stamps) of every sample (of one dataset; of one resolution), searched in
        place (`shards.sample_index`): no shard is opened and no Python object is made per sample."""
        names = self.shards.datasets() if dataset is not None else None
        resolutions = self.shards.column("resolution") if resolution is not None else None
        rows = self.shards.rows
        if names is not None or resolutions is not None:
            mine = np.ones(len(rows), dtype=bool)
            if names is not None:
                mine &= np.array([n == dataset for n in names], dtype=bool)
            if resolutions is not None:
                mine &= resolutions == resolution
            rows = rows[mine]
        return self.shards.index(rows)

    def by_source(self, dataset: str | None = None, resolution: int | None = None) -> StampTable:
        """source -> (key, stamp) of every sample (of one dataset, of one resolution) that recorded its source, from
        the sample index (no shard is opened): an incremental run skips an input whose stamp is unchanged without
        reading it. A source listed twice maps to its last sample in index order. A mapping searched in place
        (`shards.sample_index.StampTable`: sorted source hashes, stamps read column-wise)."""
        return StampTable(self.index(dataset, resolution))

    def conflict(self, commit: dict) -> str | None:
        """Why `commit` cannot follow this generation, or None: a shard it removes or replaces is no longer
        listed, or a key it restamps is not (another writer committed a removal meanwhile)."""
        for path in commit.get("remove", []):
            if path not in self.shards:
                return f"{path} is no longer a shard of the cache"
        for path in (old for old, _ in commit.get("replace", [])):
            if path not in self.shards and (self.texts is None or path not in self.texts):
                return f"{path} is no longer a shard of the cache"
        missing = [key for key, _ in commit.get("restamp", []) if key not in self.shards.key_index()]
        if missing:
            return f"{len(missing)} restamped samples (e.g. {missing[0]}) are no longer in the cache"
        return self._text_conflict(commit) if self.texts is not None else None

    def _text_conflict(self, commit: dict) -> str | None:
        """A text row the commit's samples refer to is not in the cache after it, or a text row it removes is still
        referred to by a sample it keeps (another writer removed or added samples meanwhile)."""
        for path in commit.get("remove_texts", []):
            if path not in self.texts:
                return f"{path} is no longer a text shard of the cache"
        added = {k for obj in commit.get("add_texts", []) for k in obj.get("keys") or []}
        removed = [self.texts.row_of(path) for path in commit.get("remove_texts", [])]
        gone = set()
        if removed:  # keys whose every copy goes (several ranks may have stored one text at once): no copy elsewhere
            leaving = sorted(set(self.texts.keys_at(removed)) - added)
            others = np.setdiff1d(self.texts.rows, removed)
            elsewhere = self.texts.index(others).find_all("keys", leaving) >= 0 if leaving else np.zeros(0, bool)
            gone = {k for k, kept in zip(leaving, elsewhere) if not kept}
        for obj in commit.get("add", []) + [new for _, new in commit.get("replace", [])]:
            refs = [k for k in obj.get("texts") or [] if k not in added]
            held = self.texts.has_keys(refs)
            missing = [k for k, h in zip(refs, held) if not h or k in gone]
            if missing:
                return f"text {missing[0]}, which samples of {obj.get('path')} refer to, is no longer in the cache"
        if gone:
            retired = {self.shards.row_of(p) for p in commit.get("remove", []) if p in self.shards}
            hashes = ShardTable.text_hashes(sorted(gone))
            still = gone & self.shards.referenced_texts(retired, hashes)  # decoded where a hash matches only
            if still:
                return f"text {sorted(still)[0]} is referred to by samples another writer added meanwhile"
        return None

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
            if schema_from_json(init["fields"]) != self.schema or text_schema_of(init) != self.text_schema:
                raise FormatError(f"{where}: the cache's field schema differs from this writer's")
        for bucket, shapes in commit.get("shapes", {}).items():
            self.shapes.setdefault(Bucket.parse(bucket), shapes)
        if self.texts is None and any(k in commit for k in ("add_texts", "remove_texts")):
            raise FormatError(f"{where}: text shards in a cache that stores texts with each sample; the log was edited or damaged")
        for path in commit.get("remove", []):
            self.shards.remove(confined(path, where))
        for path in commit.get("remove_texts", []):
            self.texts.remove(confined(path, where))
        for old, new in commit.get("replace", []):
            e = ShardEntry.from_json(new, where)
            if e.path == old or e.path in self.replaced:  # a repair chain must not loop back
                raise FormatError(f"{where}: {e.path} cannot replace {old}; the log was edited or damaged")
            table = self.texts if self.texts is not None and confined(old, where) in self.texts else self.shards
            table.replace(confined(old, where), e)
            self.replaced[old] = e.path
            self._count(e.path)
        for obj in commit.get("add_texts", []):  # before the samples that refer to them
            e = ShardEntry.from_json(obj, where)
            self.texts.append(e)
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
        tensors = self.shards.to_tensors(texts=self.texts is not None)
        metadata = {
            "format": FORMAT_NAME, "format_version": str(self.version), "kind": "snapshot", "generation": str(self.generation),
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True), "fingerprint_sha256": self.fingerprint_sha256,
            "fields": json.dumps(schema_to_json(self.schema), sort_keys=True), "field_order": json.dumps(self.shards.fields),
            "shapes": json.dumps({b.name: s for b, s in sorted(self.shapes.items())}, sort_keys=True),
            "files": json.dumps(self.files, sort_keys=True), "extra": json.dumps(self.extra, sort_keys=True),
            "next_seq": json.dumps(self.next_seq, sort_keys=True), "replaced": json.dumps(self.replaced, sort_keys=True),
        }
        if self.texts is not None:  # the text table's columns, and its index (keys, captions) digested apart
            tensors |= self.texts.to_tensors()
            metadata["text_fields"] = json.dumps(schema_to_json(self.text_schema), sort_keys=True)
            metadata["text_field_order"] = json.dumps(self.texts.fields)
            metadata["texts_sha256"] = sample_index_digest(tensors, TEXT_INDEX)  # checked where the text index is read
        metadata["samples_sha256"] = sample_index_digest(tensors)  # checked where the sample index is read
        metadata["sha256"] = snapshot_digest(metadata, tensors)  # checked on every load
        return serialize(tensors, metadata)

    @classmethod
    def from_init(cls, commit: dict, where: str) -> Manifest:
        """The empty manifest the first commit of a cache starts (the commit itself is not applied)."""
        init = commit.get("init")
        if init is None:
            raise FormatError(f"{where}: the first commit of a cache must carry its fingerprint and schema")
        try:
            m = cls(init["fingerprint"], schema_from_json(init["fields"]), text_schema=text_schema_of(init))
        except (KeyError, TypeError, ValueError) as e:
            raise damaged_commit(Path(where), f"its init is incomplete: {e}") from None
        if m.fingerprint_sha256 != init["fingerprint_sha256"]:
            raise damaged_commit(Path(where), "fingerprint_sha256 does not match its fingerprint")
        return m

    @classmethod
    def from_snapshot(cls, path: Path) -> Manifest:
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
    def _from_snapshot(cls, path: Path, meta: dict[str, str], tensors: dict) -> Manifest:
        try:
            schema = schema_from_json(json.loads(meta["fields"]))
            text_schema = schema_from_json(json.loads(meta["text_fields"])) if "text_fields" in meta else None
            m = cls(json.loads(meta["fingerprint"]), schema, generation=int(meta["generation"]), text_schema=text_schema)
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
        if text_schema is not None:
            m.texts = ShardTable.from_tensors(json.loads(meta["text_field_order"]), tensors, str(path), meta.get("texts_sha256"),
                                              TEXT_TABLE, DIGESTS)
        return m


TEXT_TABLE = ("texts", TEXT_INDEX.rstrip("."))  # the text table's tensors in a snapshot: `texts.*`, `text_index.*`


def text_schema_of(init: dict) -> Schema | None:
    """The text fields commit 0 records (`init.texts.fields`), None for a cache that stores texts with each sample."""
    texts = init.get("texts")
    return None if texts is None else schema_from_json(texts["fields"])


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
