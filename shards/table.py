"""The shards of one generation: `ShardEntry` (one shard as a commit lists it) and `ShardTable` (all of them,
in columns), with the table's form in a snapshot: columns of tensors, the sample index decoded on demand.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shards.buckets import Bucket
from shards.layout import confined
from shards.log import damaged_snapshot, sample_index_digest
from shards.sample_index import DIGESTS, STRINGS, Hash, KeyIndex, SampleIndex, Store, Strings
from shards.schema import FormatError

# Keys of shards appended since a table's key lookup was built are kept in a dict (a writer's own, a log tail's) up to
# this many; past that the rows appended since the lookup was built get a lookup of their own (sorted hashes, as the
# whole table's), and once those pass an eighth of the table's samples the lookup is built again over the whole table.
# So the keys held as Python objects are bounded whatever the table's size.
RECENT_KEYS = 1 << 18


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
        dataset: the named dataset (a `[[source]]` of stage one's dataset file) every sample of the shard
            belongs to; "" for shards written without one.
        texts: in a cache that stores texts once (`shards.texts`), the keys of the text rows its samples refer to,
            each once, sorted; None in other caches and in text shards.
        text_refs: the references its samples make to text rows (a text referred to twice counts twice).
        text_ref_bytes: the bytes those references would take stored with each sample (the text fields' rows).
        resolution: the resolution (side of the square area, in pixels) whose bucket table its samples were cached
            at, for a cache holding several; 0: the cache's base resolution (`CacheSpec.base_resolution`). Two
            tables can share a bucket, so a shard says which one it belongs to.
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
    dataset: str = ""
    texts: list[str] | None = None
    text_refs: int = 0
    text_ref_bytes: int = 0
    resolution: int = 0

    def to_json(self) -> dict:
        # a clip's bucket adds its frames; an image's is [height, width] as it always was
        bucket = [self.bucket.height, self.bucket.width] + ([self.bucket.frames] if self.bucket.frames else [])
        obj = {"path": self.path, "bucket": bucket, "samples": self.samples,
               "bytes": self.bytes, "sha256": self.sha256, "field_bytes": self.field_bytes,
               "keys": self.keys, "sources": self.sources, "stamps": self.stamps}
        if self.texts is not None:  # keys written only by caches that store texts once: others' commits are unchanged
            obj |= {"texts": self.texts, "text_refs": self.text_refs, "text_ref_bytes": self.text_ref_bytes}
        # written only when set: the commits of caches without them read and write back byte for byte
        return obj | ({"dataset": self.dataset} if self.dataset else {}) | ({"resolution": self.resolution} if self.resolution else {})

    @classmethod
    def from_json(cls, obj: dict, where: str = "commit") -> ShardEntry:
        """An entry of a commit; its sample index (keys, and sources and stamps if given) must cover every sample."""
        e = cls(path=confined(obj["path"], where), bucket=Bucket(*obj["bucket"]), samples=int(obj["samples"]),
                bytes=int(obj["bytes"]), sha256=obj["sha256"], field_bytes={k: int(v) for k, v in obj["field_bytes"].items()},
                keys=obj.get("keys"), sources=obj.get("sources"), stamps=obj.get("stamps"), dataset=obj.get("dataset", ""),
                texts=obj.get("texts"), text_refs=int(obj.get("text_refs", 0)), text_ref_bytes=int(obj.get("text_ref_bytes", 0)),
                resolution=obj.get("resolution", 0))
        if e.texts is not None and (not isinstance(e.texts, list) or not all(isinstance(k, str) for k in e.texts)):
            raise FormatError(f"{where}: {e.path} is listed with texts {e.texts!r}, not a list of text keys; the log was edited "
                              f"or damaged")
        if not isinstance(e.dataset, str):
            raise FormatError(f"{where}: {e.path} is listed with dataset {e.dataset!r}, not a string; the log was edited or damaged")
        if isinstance(e.resolution, bool) or not isinstance(e.resolution, int) or not 0 <= e.resolution < 2**31:
            raise FormatError(f"{where}: {e.path} is listed with resolution {e.resolution!r}, not a whole number of pixels; "
                              f"the log was edited or damaged")
        for name in ("keys", "sources", "stamps"):
            value = getattr(e, name)
            if (name == "keys" or value is not None) and (not isinstance(value, list) or len(value) != e.samples):
                raise FormatError(f"{where}: {e.path} is listed without {name} for each of its {e.samples} samples; "
                                  f"the log was edited or damaged")
        return e


class ShardTable:
    """The shards of one generation, in commit order, stored in columns: a million shards cost arrays,
    not a million objects; an entry is built when asked for.

    `key_hash`: how its keys are hashed for lookups (`shards.sample_index.Hash`): a text table's keys are hex digests,
    hashed by their first digits (`DIGESTS`)."""

    def __init__(self, fields: list[str], names: tuple[str, str] = ("shards", "samples"), key_hash: Hash = STRINGS):
        self.fields = list(fields)
        self.names = names  # the prefixes of its tensors in a snapshot: the shard columns', the sample index's
        self.key_hash = key_hash
        self._paths: list[str] = []
        self._height, self._width = array("i"), array("i")
        self._frames = array("i")  # per row: `Bucket.frames` (0 for images)
        self._samples, self._bytes = array("q"), array("q")
        self._sha = bytearray()
        self._field_bytes = array("q")
        self._live = bytearray()
        self._dataset = array("i")  # per row: an index into _dataset_names
        self._dataset_names: list[str] = [""]
        self._resolution = array("i")  # per row: `ShardEntry.resolution`
        self._row: dict[str, int] | None = None  # path -> row, built on first removal
        self._alive_rows: np.ndarray | None = None
        # per row: its keys, sources and stamps from commits, packed (`Store`); snapshot rows read theirs from
        # `_snapshot_samples`
        self._samples_of: dict[int, Store] = {}
        self._snapshot_samples = None
        # the key lookup: the sorted key hashes of the live rows when it was built (rows before `_key_end`), those of the
        # rows appended after them until the recent keys last overflowed, and the keys of rows appended since
        self._key_base: SampleIndex | None = None
        self._key_end = 0
        self._key_mid: SampleIndex | None = None
        self._key_recent: dict[str, tuple[int, int]] = {}
        # per row: the text keys its samples refer to (`ShardEntry.texts`), from commits, packed (no object per key);
        # snapshot rows read theirs there
        self._texts_of: dict[int, Strings] = {}
        self._text_refs = array("q")  # per row: references to text rows, and the bytes they would take inline
        self._text_ref_bytes = array("q")

    def copy(self) -> ShardTable:
        """A table that changes apart from this one: the columns copied (per shard), the sample index shared (its
        snapshot's columns and each committed shard's packed rows are never changed in place)."""
        t = ShardTable.__new__(ShardTable)
        t.__dict__.update(self.__dict__)
        for name, value in self.__dict__.items():
            if isinstance(value, (list, dict, bytearray)):
                setattr(t, name, type(value)(value))
            elif isinstance(value, array):
                setattr(t, name, array(value.typecode, value))
        t._alive_rows = None
        t.__dict__.pop("_starts_of", None)
        return t

    # -- building --------------------------------------------------------------------------------
    def append(self, e: ShardEntry) -> None:
        if self._row is not None:
            if e.path in self._row and self._live[self._row[e.path]]:
                raise FormatError(f"{e.path} is listed twice; the manifest was edited or damaged")
            self._row[e.path] = len(self._paths)
        self._paths.append(e.path)
        self._height.append(e.bucket.height)
        self._width.append(e.bucket.width)
        self._frames.append(e.bucket.frames)
        self._samples.append(e.samples)
        self._bytes.append(e.bytes)
        self._sha += bytes.fromhex(e.sha256)
        self._field_bytes.extend(int(e.field_bytes.get(f, 0)) for f in self.fields)
        self._live.append(1)
        self._dataset.append(self._dataset_id(e.dataset))
        self._resolution.append(e.resolution)
        if e.keys is not None:
            self._samples_of[len(self._paths) - 1] = Store.pack(e.keys, e.sources or [""] * e.samples, e.stamps or [0] * e.samples)
        if e.texts is not None:
            self._texts_of[len(self._paths) - 1] = Strings.pack(e.texts)
        self._text_refs.append(e.text_refs)
        self._text_ref_bytes.append(e.text_ref_bytes)
        self._alive_rows = None
        if self._key_base is not None and e.keys is not None:  # kept up to date: a writer asks after every commit
            j = len(self._paths) - 1
            self._key_recent.update((k, (j, r)) for r, k in enumerate(e.keys))
            if len(self._key_recent) > RECENT_KEYS:
                if len(self._key_recent) + len(self._key_mid or ()) > max(RECENT_KEYS, len(self._key_base) // 8):
                    self._forget_keys()
                else:  # the rows appended since the whole table's lookup, searched as it is
                    rows = self.rows
                    self._key_mid, self._key_recent = self.index(rows[rows >= self._key_end]), {}
        else:
            self._forget_keys()

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
        self._forget_keys()

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
        if e.dataset != self._dataset_names[self._dataset[j]]:
            raise FormatError(f"{e.path} replaces {old} but belongs to dataset {e.dataset!r}, not "
                              f"{self._dataset_names[self._dataset[j]]!r}")
        if e.resolution != self._resolution[j]:
            raise FormatError(f"{e.path} replaces {old} but belongs to resolution {e.resolution}, not {self._resolution[j]}")
        if e.keys is not None:
            self._samples_of[j] = Store.pack(e.keys, e.sources or [""] * e.samples, e.stamps or [0] * e.samples)
            self._forget_keys()
        if e.texts is not None:  # a repaired copy refers to the texts its shard did (the same samples)
            self._texts_of[j] = Strings.pack(e.texts)

    def _dataset_id(self, name: str) -> int:
        try:
            return self._dataset_names.index(name)  # a cache holds a handful of datasets
        except ValueError:
            self._dataset_names.append(name)
            return len(self._dataset_names) - 1

    def rename_dataset(self, old: str, new: str) -> int:
        """Every live shard of dataset `old` now belongs to `new`; returns how many."""
        if old not in self._dataset_names:
            return 0
        before, after = self._dataset_names.index(old), self._dataset_id(new)
        ids = np.frombuffer(self._dataset, dtype=np.int32)
        moved = self.rows[ids[self.rows] == before]
        for j in moved:
            self._dataset[int(j)] = after
        return len(moved)

    def key_index(self) -> KeyIndex:
        """key -> (table row, position in the shard) of every live sample, a mapping searched in place (`find_key`)."""
        return KeyIndex(self)

    def find_key(self, key: str) -> tuple[int, int] | None:
        """(table row, position in the shard) of live sample `key` (its last copy in index order), or None. Searches
        the sorted key hashes of the table as it was when first asked (built then: O(samples) arrays, no object per
        sample), and the keys of the shards appended since."""
        recent = self._key_recent.get(key)
        if recent is not None and self._live[recent[0]]:
            return recent
        base = self.sample_index()
        if self._key_mid is not None and (p := self._key_mid.find("keys", key)) >= 0:
            j, r = self._key_mid.row_of(p)
            if self._live[j]:
                return j, r
        p = base.find("keys", key)
        if p < 0:
            return None
        j, r = base.row_of(p)
        return (j, r) if self._live[j] else None

    def has_keys(self, keys: list[str]) -> np.ndarray:
        """(n,) bool: whether each key is a live sample's, as `find_key` tells it, looked up in bulk (the key hashes
        of a block of them searched at once)."""
        out = np.zeros(len(keys), dtype=bool)
        if not keys:
            return out
        live = np.frombuffer(bytes(self._live), dtype=np.uint8)
        recent, asked = self._key_recent, []
        for i, k in enumerate(keys):
            found = recent.get(k)
            if found is not None and live[found[0]]:
                out[i] = True
            else:
                asked.append(i)
        base = self.sample_index()
        for index in (self._key_mid, base):  # the rows appended since the whole table's lookup first
            if index is None or not asked:
                continue
            positions = index.find_all("keys", [keys[i] for i in asked])
            found = np.zeros(len(asked), dtype=bool)
            found[positions >= 0] = live[index.rows_of(positions[positions >= 0])] == 1
            out[np.asarray(asked, dtype=np.int64)[found]] = True
            asked = [i for i, f in zip(asked, found) if not f]
        return out

    def global_index(self, j: int, r: int) -> int:
        """The global index of the sample at position `r` of live table row `j`."""
        rows = self.rows
        if getattr(self, "_starts_of", (None,))[0] is not rows:  # cumulative samples of the live rows, once per change
            self._starts_of = (rows, np.concatenate([[0], np.cumsum(self.column("samples"))]))
        return int(self._starts_of[1][int(np.searchsorted(rows, j))]) + r

    def dataset_of(self, j: int) -> str:
        """The dataset of table row `j`."""
        return self._dataset_names[self._dataset[j]]

    def sample_index(self) -> SampleIndex:
        """The sample index of every live row as the table was when first asked (positions are global indices until a
        shard is appended): the one `find_key` searches (its key lookup built on the first search), once per change."""
        if self._key_base is None:
            self._key_base, self._key_end, self._key_mid, self._key_recent = self.index(), len(self._paths), None, {}
        return self._key_base

    def _forget_keys(self) -> None:
        self._key_base, self._key_mid, self._key_recent = None, None, {}

    def restamp(self, key: str, stamp: int) -> None:
        found = self.find_key(key)
        if found is None:
            raise FormatError(f"restamp of {key}, which is not in the cache")
        j, r = found
        keys, sources, stamps = self.samples_of(j)
        stamps[r] = stamp
        self._samples_of[j] = Store.pack(keys, sources, stamps)  # the same keys: the key lookup stays valid

    def _store_of(self, j: int) -> tuple[Store, int]:
        """Where row `j`'s samples are stored, and the position of its first there."""
        if j in self._samples_of:
            return self._samples_of[j], 0
        if self._snapshot_samples is None:
            raise FormatError("the sample index of this shard was not loaded")
        return self._snapshot_samples.store(), int(self._snapshot_samples.columns()[0][j])

    def index(self, rows: np.ndarray | None = None) -> SampleIndex:
        """The sample index of the live rows `rows` (all of them by default; in table order), read where it is stored:
        a snapshot's columns in place, a committed shard's packed rows. Positions are in index order; `global_index`
        maps them to the global index over every live sample."""
        live = self.rows
        counts = self.column("samples")
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if rows is None:
            chosen = np.arange(len(live))
        else:
            chosen = np.searchsorted(live, np.asarray(rows, dtype=np.int64))
        runs, row_starts, at = [], [], 0
        for i in chosen.tolist():
            j, n = int(live[i]), int(counts[i])
            store, a = self._store_of(j)
            runs.append((store, a, n, int(starts[i])))
            row_starts.append((j, at))
            at += n
        return SampleIndex(runs, row_starts, {"keys": self.key_hash} if self.key_hash is not STRINGS else None)

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
        return ShardEntry(self._paths[j], Bucket(self._height[j], self._width[j], self._frames[j]), self._samples[j], self._bytes[j],
                          self._sha[32 * j : 32 * j + 32].hex(), dict(zip(self.fields, self._field_bytes[f * j : f * j + f])),
                          dataset=self._dataset_names[self._dataset[j]], resolution=self._resolution[j])

    def __getitem__(self, i: int) -> ShardEntry:
        return self.entry_at_row(int(self.rows[i]))

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self.entry_at_row(int(j)) for j in self.rows)

    def paths(self) -> list[str]:
        return [self._paths[j] for j in self.rows]

    def column(self, name: str) -> np.ndarray:
        """A live column as an array: "samples", "bytes", "height", "width", "frames", "resolution", "text_refs",
        "text_ref_bytes" or "field_bytes" (K, F)."""
        if name == "field_bytes":
            return np.frombuffer(self._field_bytes, dtype=np.int64).reshape(-1, len(self.fields))[self.rows]
        source = {"samples": self._samples, "bytes": self._bytes, "height": self._height, "width": self._width,
                  "frames": self._frames, "resolution": self._resolution, "text_refs": self._text_refs, "text_ref_bytes": self._text_ref_bytes}[name]
        return np.frombuffer(source, dtype=np.int64 if source.typecode == "q" else np.int32)[self.rows]

    def datasets(self) -> list[str]:
        """The dataset of every live shard, in table order (a list of K references to a few strings)."""
        names = self._dataset_names
        return [names[self._dataset[j]] for j in self.rows]

    def samples_of(self, j: int) -> tuple[list[str], list[str], list[int]]:
        """(keys, sources, stamps) of table row `j`."""
        if j in self._samples_of:
            store = self._samples_of[j]
            return store.rows(0, len(store))
        if self._snapshot_samples is None:
            raise FormatError("the sample index of this shard was not loaded")
        return self._snapshot_samples(j)

    def texts_of(self, j: int) -> list[str]:
        """The text keys the samples of table row `j` refer to (`ShardEntry.texts`; empty in a cache without texts)."""
        if j in self._texts_of:
            refs = self._texts_of[j]
            return refs.slice(0, len(refs))
        if self._snapshot_samples is None:
            return []
        return self._snapshot_samples.texts(j)

    def referenced_texts(self, skip: set[int] = frozenset(), hashes: np.ndarray | None = None) -> set[str]:
        """Every text key the live shards (but the table rows in `skip`) refer to. Reads the sample index. With `hashes`
        (sorted uint64, `text_hashes`), only the keys whose hash is one of them: the others are not decoded."""
        out: set[str] = set()
        if hashes is None:
            for j in self.rows:
                if int(j) not in skip:
                    out.update(self.texts_of(int(j)))
            return out
        for strings, a, b in self._text_spans(skip):
            hit = np.flatnonzero(members(strings.hashes(a, b, DIGESTS), hashes))
            out.update(strings[a + i] for i in hit.tolist())
        return out

    def referenced_hashes(self, skip: set[int] = frozenset()) -> np.ndarray:
        """The hashes of every text key the live shards (but the table rows in `skip`) refer to: sorted, unique."""
        parts = [strings.hashes(a, b, DIGESTS) for strings, a, b in self._text_spans(skip)]
        return sorted_unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)

    @staticmethod
    def text_hashes(keys: list[str]) -> np.ndarray:
        """The hashes of text keys, as `referenced_hashes` and a text table's lookup compute them: sorted, unique."""
        return sorted_unique(Strings.pack(keys).hashes(0, len(keys), DIGESTS))

    def _text_spans(self, skip: set[int]) -> list[tuple[Strings, int, int]]:
        """Where the text references of the live rows (but `skip`) are stored: (strings, first, end), a snapshot's
        contiguous rows as one span."""
        snapshot = self._snapshot_samples.columns()[4] if self._snapshot_samples is not None else None
        spans: list[list] = []
        for j in self.rows.tolist():
            if j in skip:
                continue
            if j in self._texts_of:
                refs = self._texts_of[j]
                spans.append([refs, 0, len(refs)])
            elif snapshot is not None:
                bounds, strings = snapshot
                a, b = int(bounds[j]), int(bounds[j + 1])
                if spans and spans[-1][0] is strings and spans[-1][2] == a:
                    spans[-1][2] = b
                elif b > a:
                    spans.append([strings, a, b])
        return [tuple(s) for s in spans]

    def keys_at(self, rows) -> list[str]:
        """The keys of the samples of these table rows, in order (of a text table: the text keys)."""
        return [k for j in rows for k in self.samples_of(int(j))[0]]

    def check_sample_index(self) -> None:
        """Check the sample index this table reads from its snapshot (if any) against the snapshot's digest; the
        first use of the index checks it too. Reads the whole index, O(samples).

        Raises:
            DamagedLog: the snapshot's sample index is damaged (the shards it lists are not at fault).
        """
        if self._snapshot_samples is not None:
            self._snapshot_samples.columns()

    # -- in a snapshot ---------------------------------------------------------------------------
    def to_tensors(self, texts: bool = False) -> dict[str, torch.Tensor]:
        """The live shards and their sample index as the tensors of a snapshot; with `texts` (a cache that stores texts
        once) also the references of each shard's samples to text rows."""
        rows = self.rows
        f = len(self.fields)
        tensors = {}
        P, S = self.names
        tensors[f"{P}.path"], tensors[f"{P}.path.offsets"] = _ragged([self._paths[j] for j in rows])
        tensors[f"{P}.bucket"] = torch.from_numpy(
            np.stack([self.column("height"), self.column("width")], 1).astype(np.int32).reshape(-1, 2))
        tensors[f"{P}.samples"] = torch.from_numpy(self.column("samples").copy())
        tensors[f"{P}.bytes"] = torch.from_numpy(self.column("bytes").copy())
        sha = np.frombuffer(bytes(self._sha), dtype=np.uint8).reshape(-1, 32)
        tensors[f"{P}.sha256"] = torch.from_numpy(sha[rows].copy().reshape(-1, 32))
        tensors[f"{P}.field_bytes"] = torch.from_numpy(self.column("field_bytes").copy().reshape(-1, f))
        if any(self._dataset_names[1:]):
            tensors[f"{P}.dataset"], tensors[f"{P}.dataset.offsets"] = _ragged(self.datasets())
        if any(self._frames):  # written only by caches of clips: an image cache's snapshot is as it always was
            tensors[f"{P}.frames"] = torch.from_numpy(self.column("frames").copy())
        if any(self._resolution):
            tensors[f"{P}.resolution"] = torch.from_numpy(self.column("resolution").copy())
        # the sample index copied from where it is stored, as arrays (no string decoded): byte for byte what the
        # strings' UTF-8 back to back would be
        counts = self.column("samples")
        stores = [(*self._store_of(int(j)), int(n)) for j, n in zip(rows, counts)]
        tensors[f"{S}.key"], tensors[f"{S}.key.offsets"] = _joined([(st.keys, a, a + n) for st, a, n in stores])
        tensors[f"{S}.source"], tensors[f"{S}.source.offsets"] = _joined([(st.sources, a, a + n) for st, a, n in stores])
        tensors[f"{S}.stamp"] = torch.from_numpy(np.concatenate([np.asarray(st.stamps[a : a + n], dtype=np.int64)
                                                                 for st, a, n in stores] or [np.zeros(0, np.int64)]))
        tensors[f"{S}.shard"] = torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int64), counts))
        if texts:
            tensors[f"{P}.text_refs"] = torch.from_numpy(
                np.stack([self.column("text_refs"), self.column("text_ref_bytes")], 1).astype(np.int64).reshape(-1, 2))
            refs = [self._texts_at(int(j)) for j in rows]
            tensors[f"{S}.text"], tensors[f"{S}.text.offsets"] = _joined([r for r in refs if r is not None])
            per_row = [0 if r is None else r[2] - r[1] for r in refs]
            tensors[f"{S}.text_shard"] = torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int64), per_row))
        return tensors

    def _texts_at(self, j: int) -> tuple[Strings, int, int] | None:
        """Where the text references of row `j` are stored: (strings, first, end), or None (none recorded)."""
        if j in self._texts_of:
            refs = self._texts_of[j]
            return refs, 0, len(refs)
        texts = self._snapshot_samples.columns()[4] if self._snapshot_samples is not None else None
        if texts is None:
            return None
        bounds, strings = texts
        return strings, int(bounds[j]), int(bounds[j + 1])

    @classmethod
    def from_tensors(cls, fields: list[str], tensors: dict[str, torch.Tensor], where: str,
                     samples_sha256: str | None = None, names: tuple[str, str] = ("shards", "samples"),
                     key_hash: Hash = STRINGS) -> ShardTable:
        """The table a snapshot holds (`to_tensors`), its columns copied out of the memory map, its sample
        index left there until asked for, then checked against `samples_sha256` (the snapshot's metadata)."""
        t = cls(fields, names, key_hash)
        P, prefix = names[0], names[1] + "."
        tensors = {name.replace(f"{P}.", "shards.", 1): v for name, v in tensors.items() if name.startswith(f"{P}.")} | {
            name.replace(f"{names[1]}.", "samples.", 1): v for name, v in tensors.items() if name.startswith(f"{names[1]}.")}
        paths = _Strings(tensors["shards.path"], tensors["shards.path.offsets"]).all()
        t._paths = [confined(p, where) for p in paths]
        bucket = tensors["shards.bucket"].numpy()
        t._height, t._width = array("i", bucket[:, 0].tobytes()), array("i", bucket[:, 1].tobytes())
        frames = tensors.get("shards.frames")
        t._frames = array("i", frames.numpy().astype(np.int32).tobytes() if frames is not None else bytes(4 * len(t._paths)))
        t._samples, t._bytes = array("q", tensors["shards.samples"].numpy().tobytes()), array("q", tensors["shards.bytes"].numpy().tobytes())
        t._sha = bytearray(tensors["shards.sha256"].numpy().tobytes())
        t._field_bytes = array("q", tensors["shards.field_bytes"].numpy().tobytes())
        t._live = bytearray(b"\x01" * len(t._paths))
        if "shards.dataset" in tensors:
            names = _Strings(tensors["shards.dataset"], tensors["shards.dataset.offsets"]).all()
            t._dataset = array("i", (t._dataset_id(n) for n in names))
        else:  # written before datasets existed, or by a cache of one unnamed dataset
            t._dataset = array("i", bytes(4 * len(t._paths)))
        if "shards.text_refs" in tensors:
            refs = tensors["shards.text_refs"].numpy()
            t._text_refs, t._text_ref_bytes = array("q", refs[:, 0].tobytes()), array("q", refs[:, 1].tobytes())
        else:
            t._text_refs, t._text_ref_bytes = array("q", bytes(8 * len(t._paths))), array("q", bytes(8 * len(t._paths)))
        # absent: written before resolutions were recorded, or every shard is of the cache's base resolution
        t._resolution = array("i", tensors["shards.resolution"].numpy().astype(np.int32).tobytes()
                              if "shards.resolution" in tensors else bytes(4 * len(t._paths)))
        t._snapshot_samples = _SnapshotSamples(tensors, tensors["shards.samples"].numpy(), where, samples_sha256, prefix)
        return t


_INTACT: set[tuple] = set()  # snapshot files (path, inode, size, mtime, index) whose sample index this process checked


def _file_index_digest(path: Path, tensors: dict[str, torch.Tensor], prefix: str) -> str:
    """`sample_index_digest` of a snapshot's sample index (`prefix`: its tensors' names in the file), its bytes read
    from the file in order rather than through the tensors' memory map."""
    import hashlib
    import json

    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        base = 8 + size
        for name in sorted(n for n in tensors if n.startswith("samples.")):
            t = tensors[name]
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            begin, end = header[prefix + name[len("samples."):]]["data_offsets"]
            f.seek(base + begin)
            left = end - begin
            while left > 0:
                chunk = f.read(min(left, 8 << 20))
                if not chunk:
                    raise ValueError(f"{path} ends inside {name}")
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """`np.unique` of a 1-D array by sorting (numpy 2's hash-table unique is many times slower on millions of hashes)."""
    out = np.sort(values)
    return out[np.concatenate(([True], out[1:] != out[:-1]))] if len(out) else out


def members(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """(n,) bool: whether each value is in `sorted_set` (sorted, unique); `np.isin` by a search of the values in order."""
    out = np.zeros(len(values), dtype=bool)
    if len(values) and len(sorted_set):
        order = np.argsort(values)
        v = values[order]
        at = np.minimum(np.searchsorted(sorted_set, v), len(sorted_set) - 1)
        out[order] = sorted_set[at] == v
    return out


def _joined(parts: list[tuple[Strings, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Strings `first:end` of each part, back to back: what `_ragged` makes of them decoded, without decoding them."""
    merged: list[list] = []
    for strings, a, b in parts:  # a snapshot's rows are one run of its columns
        if merged and merged[-1][0] is strings and merged[-1][2] == a:
            merged[-1][2] = b
        elif b > a:
            merged.append([strings, a, b])
    parts = merged
    n = sum(b - a for _, a, b in parts)
    offsets = np.zeros(n + 1, dtype=np.int64)
    chunks, at, total = [], 1, 0
    for strings, a, b in parts:
        if b == a:
            continue
        lo, hi = int(strings.offsets[a]), int(strings.offsets[b])
        chunks.append(np.asarray(strings.data[lo:hi], dtype=np.uint8))
        offsets[at : at + b - a] = strings.offsets[a + 1 : b + 1] - lo + total
        at, total = at + b - a, total + hi - lo
    data = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
    return torch.from_numpy(data), torch.from_numpy(offsets)


def _ragged(strings: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Strings as UTF-8 bytes and their (N + 1,) offsets."""
    data = [s.encode("utf-8", "surrogateescape") for s in strings]
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    return torch.frombuffer(bytearray(b"".join(data)) or bytearray(1), dtype=torch.uint8)[: offsets[-1]], torch.from_numpy(offsets)


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
    """A snapshot's sample index, decoded per shard on demand (training never asks). The first use reads all of it
    (the rows of every shard are found in one pass) and checks it against its digest, once: every key, source and
    stamp a writer, `verify` or an incremental run takes from it is the one written, and a damaged index is named as
    the snapshot's damage, never blamed on the shards it lists nor copied into the next snapshot."""

    def __init__(self, tensors: dict[str, torch.Tensor], samples: np.ndarray, where: str, sha256: str | None = None,
                 prefix: str = "samples."):
        self.tensors, self.samples, self.where, self.sha256, self.prefix = tensors, samples, where, sha256, prefix
        self._columns = None

    def columns(self) -> tuple:
        if self._columns is None:
            self._columns = self._load()
        return self._columns

    def _load(self) -> tuple:
        t = self.tensors
        if self.sha256 is not None and not self._intact():
            raise damaged_snapshot(Path(self.where), "its sample index does not match the samples_sha256 written with it")
        # the samples of shard j are rows bounds[j]:bounds[j + 1]
        bounds = np.searchsorted(t["samples.shard"].numpy(), np.arange(len(self.samples) + 1))
        if not np.array_equal(np.diff(bounds), self.samples) or bounds[-1] != len(t["samples.stamp"]):
            raise damaged_snapshot(Path(self.where), "its sample index does not match the shards' sample counts")
        texts = None
        if "samples.text_shard" in t:  # each shard's references to text rows, rows text_bounds[j]:text_bounds[j + 1]
            text_bounds = np.searchsorted(t["samples.text_shard"].numpy(), np.arange(len(self.samples) + 1))
            texts = (text_bounds, Strings(t["samples.text"].numpy(), t["samples.text.offsets"].numpy()))
        keys = Strings(t["samples.key"].numpy(), t["samples.key.offsets"].numpy())
        sources = Strings(t["samples.source"].numpy(), t["samples.source.offsets"].numpy())
        self._store = Store(keys, sources, t["samples.stamp"].numpy())
        return bounds, keys, sources, self._store.stamps, texts

    def store(self) -> Store:
        """The whole index as one `Store` (positions in snapshot order), checked as `columns` checks it."""
        self.columns()
        return self._store

    def _intact(self) -> bool:
        """Whether the sample index matches its digest: read from the file (the page cache, not this process's memory
        map, whose pages would stay resident), once per process and snapshot file as it is on disk."""
        path = Path(self.where)
        try:
            st = path.stat()
            seen = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, self.prefix, self.sha256)
            if seen in _INTACT:
                return True
            digest = _file_index_digest(path, self.tensors, self.prefix)
        except (OSError, ValueError, KeyError):  # not a file this process can read again: the mapped tensors
            seen, digest = None, sample_index_digest(self.tensors)
        if digest != self.sha256:
            return False
        if seen is not None:
            _INTACT.add(seen)
        return True

    def texts(self, j: int) -> list[str]:
        texts = self.columns()[4]
        if texts is None:
            return []
        bounds, keys = texts
        return keys.slice(int(bounds[j]), int(bounds[j + 1]))

    def __call__(self, j: int) -> tuple[list[str], list[str], list[int]]:
        bounds, keys, sources, stamps, _ = self.columns()
        a, b = int(bounds[j]), int(bounds[j + 1])
        return keys.slice(a, b), sources.slice(a, b), stamps[a:b].tolist()
