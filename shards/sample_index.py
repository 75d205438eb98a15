"""The sample index searched in place: keys, sources and stamps of a generation's samples as the arrays they are
stored in (a snapshot's ragged columns, each committed shard's packed rows), with sorted 64-bit hashes of a
column and the permutation into the index to look a string up by `np.searchsorted`. A hit is checked against the
stored string, so a hash collision never finds the wrong sample. A hundred million samples cost arrays (12 bytes
per sample and column searched), not a hundred million Python objects.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from shards.schema import FormatError

# Every hash is masked with HASH_MASK: a test narrows it to force collisions (the stored strings decide).
HASH_MASK = (1 << 64) - 1
_M64 = (1 << 64) - 1
_P1, _P2, _SEED = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x2545F4914F6CDD1D
_CHUNK = 1 << 16  # strings hashed per block: bounds the temporary arrays (and smaller blocks stay in the CPU cache)
_ASKED = 1 << 16  # strings looked up per block
_FEW = 256  # up to this many hits of a block are compared with their stored strings one by one


def encode(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def hash_bytes(b: bytes) -> int:
    """The 64-bit hash of one string's bytes, as `hash_strings` computes it for a column."""
    h = _SEED
    for k in range(0, len(b), 8):
        h = ((h ^ int.from_bytes(b[k : k + 8], "little")) * _P1) & _M64
        h ^= h >> 29
    h ^= len(b)
    h = (h * _P2) & _M64
    h ^= h >> 31
    return h & HASH_MASK


def hash_strings(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(N,) uint64: `hash_bytes` of each ragged string `data[offsets[i]:offsets[i + 1]]` (uint8 data, (N + 1,) int64
    offsets), eight bytes at a time over every string at once."""
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=np.uint64)
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    size = len(data)
    for a in range(0, n, _CHUNK):
        starts = offsets[a : min(n, a + _CHUNK)].astype(np.int64)
        ends = offsets[a + 1 : min(n, a + _CHUNK) + 1].astype(np.int64)
        lengths = ends - starts
        h = np.full(len(starts), _SEED, dtype=np.uint64)
        if len(starts):
            for k in range(0, int(lengths.max(initial=0)), 8):
                live = np.flatnonzero(lengths > k)
                at = starts[live] + k
                words = _words(data, at, size)
                rest = lengths[live] - k
                short = rest < 8
                if short.any():  # the string's last word: its bytes alone
                    words[short] &= (np.uint64(1) << (rest[short].astype(np.uint64) * np.uint64(8))) - np.uint64(1)
                x = (h[live] ^ words) * np.uint64(_P1)
                h[live] = x ^ (x >> np.uint64(29))
        h ^= lengths.astype(np.uint64)
        h *= np.uint64(_P2)
        h ^= h >> np.uint64(31)
        out[a : a + len(starts)] = h & np.uint64(HASH_MASK)
    return out


def _words(data: np.ndarray, at: np.ndarray, size: int) -> np.ndarray:
    """The 8 bytes at each position `at` of `data` as little-endian uint64 (zeros past its end)."""
    out = np.zeros(len(at), dtype=np.uint64)
    inside = at + 8 <= size
    if inside.any() and size >= 8:
        windows = np.lib.stride_tricks.as_strided(data, shape=(size - 7, 8), strides=(data.strides[0], data.strides[0]))
        out[inside] = windows[at[inside]].copy().view("<u8").reshape(-1)
    for i in np.flatnonzero(~inside):  # the few strings within 8 bytes of the data's end
        p = int(at[i])
        out[i] = int.from_bytes(data[p : min(size, p + 8)].tobytes(), "little")
    return out


def digest_hash(b: bytes) -> int:
    """The 64-bit hash of a string that is itself a hex digest (a text key, a sha256): its first 16 hex digits, as
    `digest_hashes` reads them from a column. Any other string gets 0 (no stored digest is one: a column refuses them)."""
    try:
        head = bytes.fromhex(b[:16].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return 0
    return int.from_bytes(head, "big") & HASH_MASK if len(head) == 8 else 0


def digest_hashes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(N,) uint64: `digest_hash` of each ragged string (uint8 data, (N + 1,) int64 offsets), read from its first 16
    bytes (the others are not read), in blocks.

    Raises:
        FormatError: a string is not a hex digest (keys of a log that was edited or damaged).
    """
    n = len(offsets) - 1
    out = np.empty(max(n, 0), dtype=np.uint64)
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    for a in range(0, n, _CHUNK):
        starts = offsets[a : min(n, a + _CHUNK)].astype(np.int64)
        if np.any(offsets[a + 1 : a + 1 + len(starts)] - starts < 16):
            raise FormatError("a text key of the manifest is shorter than 16 hex digits; the log was edited or damaged")
        head = np.stack([_words(data, starts, len(data)), _words(data, starts + 8, len(data))], 1)  # (n, 2): 16 ASCII digits
        try:
            value = np.frombuffer(bytes.fromhex(head.astype("<u8").tobytes().decode("ascii")), dtype=">u8")
        except (ValueError, UnicodeDecodeError):
            value = np.zeros(0)
        if len(value) != len(starts):
            raise FormatError("a text key of the manifest is not hex; the log was edited or damaged")
        out[a : a + len(starts)] = value.astype(np.uint64) & np.uint64(HASH_MASK)
    return out


class Hash(NamedTuple):
    """How a column's strings are hashed: a column at once (`column(data, offsets)`) and one string (`one(raw)`), the
    same value for the same string."""

    column: Callable[[np.ndarray, np.ndarray], np.ndarray]
    one: Callable[[bytes], int]


STRINGS = Hash(hash_strings, hash_bytes)  # any string: every byte hashed
DIGESTS = Hash(digest_hashes, digest_hash)  # hex digests (text keys): their first 8 bytes are a hash already


class Strings:
    """Ragged UTF-8 strings: uint8 `data` and (N + 1,) int64 `offsets` (absolute into `data`), read in place."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets
        self._view = memoryview(data) if len(data) else memoryview(b"")

    @classmethod
    def pack(cls, strings: list[str]) -> Strings:
        joined = "".join(strings)
        offsets = np.zeros(len(strings) + 1, dtype=np.int64)
        if joined.isascii():  # a character is a byte: no string is encoded alone
            np.cumsum(np.fromiter(map(len, strings), dtype=np.int64, count=len(strings)), out=offsets[1:])
            return cls(np.frombuffer(joined.encode("ascii"), dtype=np.uint8), offsets)
        blobs = [encode(s) for s in strings]
        np.cumsum(np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)), out=offsets[1:])
        return cls(np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, i: int) -> memoryview:
        return self._view[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __getitem__(self, i: int) -> str:
        return str(self.raw(i), "utf-8", "surrogateescape")

    def slice(self, a: int, b: int) -> list[str]:
        offs = self.offsets[a : b + 1].tolist()
        view = self._view
        return [str(view[x:y], "utf-8", "surrogateescape") for x, y in zip(offs, offs[1:])]

    def hashes(self, a: int, b: int, hash: Hash = STRINGS) -> np.ndarray:
        return hash.column(self.data, self.offsets[a : b + 1])


class Store:
    """Where a run of samples is stored: keys and sources (`Strings`) and stamps (int64), positions in its own order."""

    def __init__(self, keys: Strings, sources: Strings, stamps: np.ndarray):
        self.keys, self.sources, self.stamps = keys, sources, stamps

    @classmethod
    def pack(cls, keys: list[str], sources: list[str], stamps: list[int]) -> Store:
        return cls(Strings.pack(keys), Strings.pack(sources), np.asarray(stamps, dtype=np.int64).reshape(-1))

    def __len__(self) -> int:
        return len(self.stamps)

    def rows(self, a: int, b: int) -> tuple[list[str], list[str], list[int]]:
        return self.keys.slice(a, b), self.sources.slice(a, b), self.stamps[a:b].tolist()


class SampleIndex:
    """The samples of a selection of a table's rows, in global index order, read where they are stored.

    Args:
        runs: (store, first position in the store, samples, global index of the first) per run of samples stored
            contiguously, in index order.
        rows: (table row, position in this index of its first sample) of each shard, in index order.
        hashes: how a column is hashed (`Hash`), by name, where not `STRINGS` (a text table's keys: `DIGESTS`).
    """

    def __init__(self, runs: list[tuple[Store, int, int, int]], rows: list[tuple[int, int]] | None = None,
                 hashes: dict[str, Hash] | None = None):
        self.hashers = hashes or {}
        merged: list[list] = []
        for store, a, n, g in runs:
            if n == 0:
                continue
            last = merged[-1] if merged else None
            if last is not None and last[0] is store and last[1] + last[2] == a and last[3] + last[2] == g:
                last[2] += n
            else:
                merged.append([store, a, n, g])
        self._stores = [m[0] for m in merged]
        self._from = [m[1] for m in merged]
        self._count = [m[2] for m in merged]
        self._global = np.array([m[3] for m in merged], dtype=np.int64)
        self._starts = [0] * len(merged)
        for i in range(1, len(merged)):
            self._starts[i] = self._starts[i - 1] + self._count[i - 1]
        self._n = sum(self._count)
        self._starts_np = np.asarray(self._starts, dtype=np.int64)
        self._rows = np.array([j for j, _ in rows or ()], dtype=np.int64)
        self._row_starts = np.array([p for _, p in rows or ()], dtype=np.int64)
        self._lookups: dict[str, _HashLookup] = {}

    def __len__(self) -> int:
        return self._n

    def _at(self, i: int) -> tuple[Store, int]:
        r = bisect_right(self._starts, i) - 1
        return self._stores[r], self._from[r] + i - self._starts[r]

    def entry(self, i: int) -> tuple[str, int, int]:
        """(key, stamp, global index) of sample `i`."""
        r = bisect_right(self._starts, i) - 1
        p = self._from[r] + i - self._starts[r]
        store = self._stores[r]
        return store.keys[p], int(store.stamps[p]), int(self._global[r]) + i - self._starts[r]

    def key(self, i: int) -> str:
        store, p = self._at(i)
        return store.keys[p]

    def source(self, i: int) -> str:
        store, p = self._at(i)
        return store.sources[p]

    def stamp(self, i: int) -> int:
        store, p = self._at(i)
        return int(store.stamps[p])

    def global_index(self, positions: np.ndarray) -> np.ndarray:
        """The global index (over every live sample of the table) of each position of this index."""
        positions = np.asarray(positions, dtype=np.int64)
        run = np.searchsorted(self._starts_np, positions, side="right") - 1
        return self._global[run] + positions - self._starts_np[run]

    def global_indices(self) -> np.ndarray:
        """The global index of every sample of this index, in order (int64)."""
        return np.concatenate([np.arange(g, g + n, dtype=np.int64) for g, n in zip(self._global, self._count)] or
                              [np.zeros(0, np.int64)])

    def row_of(self, i: int) -> tuple[int, int]:
        """(table row, position in its shard) of sample `i` (an index built with its rows)."""
        k = int(np.searchsorted(self._row_starts, i, side="right")) - 1
        return int(self._rows[k]), int(i - self._row_starts[k])

    def rows_of(self, positions: np.ndarray) -> np.ndarray:
        """The table row of the sample at each position (an index built with its rows), as `row_of` gives it (int64)."""
        k = np.searchsorted(self._row_starts, np.asarray(positions, dtype=np.int64), side="right") - 1
        return self._rows[k]

    def column(self, name: str, i: int) -> str:
        store, p = self._at(i)
        return getattr(store, name)[p]

    def hashes(self, name: str) -> np.ndarray:
        """(N,) uint64 hashes of column `name` ("keys" or "sources"), in index order."""
        hash = self.hashers.get(name, STRINGS)
        parts = [getattr(s, name).hashes(a, a + n, hash) for s, a, n in zip(self._stores, self._from, self._count)]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)

    def lookup(self, name: str) -> _HashLookup:
        """The sorted hashes of column `name` ("keys" or "sources"), built on first use."""
        if name not in self._lookups:
            self._lookups[name] = _HashLookup(self, name)
        return self._lookups[name]

    def find(self, name: str, value: str) -> int:
        """The last position whose column `name` holds `value`, or -1."""
        return self.lookup(name).find(value)

    def find_all(self, name: str, values: list[str]) -> np.ndarray:
        """`find` of each value (int64, -1 where absent)."""
        return self.lookup(name).find_all(values)

    def find_every(self, name: str, value: str) -> np.ndarray:
        """Every position whose column `name` holds `value`, in index order (int64)."""
        return self.lookup(name).find_every(value)

    def stamps_at(self, positions: np.ndarray) -> np.ndarray:
        """The stamps at these positions (int64), read column-wise from their stores."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.zeros(len(positions), dtype=np.int64)
        run = np.searchsorted(self._starts_np, positions, side="right") - 1
        for r in np.unique(run):
            mine = run == r
            out[mine] = self._stores[r].stamps[self._from[r] + positions[mine] - self._starts[r]]
        return out

    def __iter__(self) -> Iterator[tuple[str, str, int]]:
        """(key, source, stamp) of every sample, in order."""
        for store, a, n in zip(self._stores, self._from, self._count):
            for b in range(a, a + n, 65536):
                yield from zip(*store.rows(b, min(a + n, b + 65536)))


class _HashLookup:
    """One column's strings by hash: sorted hashes and, per hash, the position (stable: equal hashes in index order)."""

    def __init__(self, index: SampleIndex, name: str):
        self.index, self.name, self.hash = index, name, index.hashers.get(name, STRINGS)
        hashes = index.hashes(name)
        order = np.argsort(hashes, kind="stable")
        self.sorted = hashes[order]
        del hashes
        self.order = order.astype(np.uint32) if len(order) < 2**32 else order

    def _verify(self, lo: int, hi: int, raw: bytes) -> int:
        index, name = self.index, self.name
        for p in reversed(self.order[lo:hi].tolist()):  # the last in index order wins
            store, q = index._at(p)
            if getattr(store, name).raw(q) == raw:
                return p
        return -1

    def find(self, value: str) -> int:
        raw = encode(value)
        h = np.uint64(self.hash.one(raw))
        lo = int(np.searchsorted(self.sorted, h, side="left"))
        if lo == len(self.sorted) or self.sorted[lo] != h:
            return -1
        return self._verify(lo, int(np.searchsorted(self.sorted, h, side="right")), raw)

    def find_every(self, value: str) -> np.ndarray:
        raw = encode(value)
        h = np.uint64(self.hash.one(raw))
        lo, hi = (int(np.searchsorted(self.sorted, h, side=side)) for side in ("left", "right"))
        hits = []
        for p in self.order[lo:hi].tolist():
            store, q = self.index._at(p)
            if getattr(store, self.name).raw(q) == raw:
                hits.append(p)
        return np.array(sorted(hits), dtype=np.int64)

    def find_all(self, values: list[str]) -> np.ndarray:
        out = np.full(len(values), -1, dtype=np.int64)
        if not len(self.sorted):
            return out
        for a in range(0, len(values), _ASKED):
            part = values[a : a + _ASKED]
            packed = Strings.pack(part)
            h = packed.hashes(0, len(part), self.hash)
            asked = np.argsort(h)  # searched in order: each search starts near the last one (the cache stays warm)
            lo = np.empty(len(h), dtype=np.int64)
            lo[asked] = np.searchsorted(self.sorted, h[asked], side="left")
            n = len(self.sorted)
            hit = (lo < n) & (self.sorted[np.minimum(lo, n - 1)] == h)
            alone = hit & ((lo + 1 >= n) | (self.sorted[np.minimum(lo + 1, n - 1)] != h))
            one = np.flatnonzero(alone)  # the usual hit: one candidate, its string compared in bulk
            cand = self.order[lo[one]].astype(np.int64)
            same = self._equal(cand, packed, one) if len(one) > _FEW else self._equal_few(cand, packed, one)
            out[a + one[same]] = cand[same]
            for i in np.flatnonzero(hit & ~alone).tolist():  # a collision, or a value stored twice
                hi = int(np.searchsorted(self.sorted, h[i], side="right"))
                out[a + i] = self._verify(int(lo[i]), hi, bytes(packed.raw(i)))
        return out

    def _equal_few(self, positions: np.ndarray, queries: Strings, which: np.ndarray) -> np.ndarray:
        """`_equal` one string at a time: for a few, faster than a pass over all of them per eight bytes."""
        index, column = self.index, self.name
        out = np.zeros(len(positions), dtype=bool)
        for i, (p, w) in enumerate(zip(positions.tolist(), which.tolist())):
            store, q = index._at(p)
            out[i] = getattr(store, column).raw(q) == queries.raw(w)
        return out

    def _equal(self, positions: np.ndarray, queries: Strings, which: np.ndarray) -> np.ndarray:
        """(n,) bool: whether the stored string at each position is the query `which[i]` of `queries`, byte for byte,
        eight bytes at a time over all of them (grouped by the run they are stored in)."""
        index, out = self.index, np.zeros(len(positions), dtype=bool)
        run = np.searchsorted(index._starts_np, positions, side="right") - 1
        order = np.argsort(run, kind="stable")
        bounds = np.flatnonzero(np.diff(run[order])) + 1
        for sel in np.split(order, bounds) if len(order) else ():
            r = int(run[sel[0]])
            column = getattr(index._stores[r], self.name)
            p = index._from[r] + positions[sel] - index._starts[r]
            a, length = column.offsets[p], column.offsets[p + 1] - column.offsets[p]
            qa = queries.offsets[which[sel]]
            eq = length == queries.offsets[which[sel] + 1] - qa
            for k in range(0, int(length[eq].max(initial=0)), 8):
                live = np.flatnonzero(eq & (length > k))
                diff = _words(column.data, a[live] + k, len(column.data)) ^ _words(queries.data, qa[live] + k, len(queries.data))
                rest = (length[live] - k).astype(np.uint64)
                mask = np.where(rest >= 8, np.uint64(_M64), (np.uint64(1) << (np.minimum(rest, 7) * np.uint64(8))) - np.uint64(1))
                eq[live] &= (diff & mask) == 0
            out[sel] = eq
        return out


class KeyIndex(Mapping):
    """key -> (table row, position in its shard) of every live sample of a table, searched in place (the
    `ShardTable.key_index` of a table; a key listed twice maps to its last sample in index order)."""

    def __init__(self, table):
        self.table = table

    def _find(self, key: str) -> tuple[int, int] | None:
        return self.table.find_key(key)

    def __getitem__(self, key: str) -> tuple[int, int]:
        found = self._find(key) if isinstance(key, str) else None
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and self._find(key) is not None

    def __iter__(self) -> Iterator[str]:
        seen = set()  # a key listed twice is one entry (caches never hold one twice: this stays empty of repeats)
        for j in self.table.rows:
            for k in self.table.samples_of(int(j))[0]:
                if k not in seen:
                    seen.add(k)
                    yield k

    def __len__(self) -> int:
        return sum(1 for _ in self)


class StampTable(Mapping):
    """source -> (key, stamp) of the samples of a selection (one dataset, one resolution) that recorded their source,
    searched in place; a source listed twice maps to its last sample in index order. With `salt`, stamps are
    XORed with it (a source's caption options taken out, `precompute.inputs.unsalted`).

    Beyond the mapping: `find_all(sources)` looks many up at once (positions, -1 where absent), `at(position)` is the
    (key, stamp) there, and `global_index(positions)` their global indices, for a run that tallies by position."""

    def __init__(self, index: SampleIndex, salt: int = 0):
        self.index, self.salt = index, salt

    def salted(self, salt: int) -> StampTable:
        return StampTable(self.index, self.salt ^ salt)

    def position(self, source: str) -> int:
        return self.index.find("sources", source) if source else -1

    def find_all(self, sources: list[str]) -> np.ndarray:
        out = self.index.find_all("sources", sources)
        if "" in sources:  # an empty source was never recorded
            out[[i for i, s in enumerate(sources) if not s]] = -1
        return out

    def entry(self, position: int) -> tuple[str, int, int]:
        """(key, stamp, global index) at `position`."""
        key, stamp, g = self.index.entry(position)
        return key, stamp ^ self.salt, g

    def stamps_at(self, positions: np.ndarray) -> np.ndarray:
        """The stamps at these positions (int64), read column-wise."""
        return self.index.stamps_at(positions) ^ np.int64(self.salt)

    def at(self, position: int) -> tuple[str, int]:
        store, p = self.index._at(position)
        return store.keys[p], int(store.stamps[p]) ^ self.salt

    def get(self, source, default=None):
        p = self.position(source) if isinstance(source, str) else -1
        return self.at(p) if p >= 0 else default

    def __getitem__(self, source: str) -> tuple[str, int]:
        found = self.get(source)
        if found is None:
            raise KeyError(source)
        return found

    def __contains__(self, source) -> bool:
        return isinstance(source, str) and self.position(source) >= 0

    def __iter__(self) -> Iterator[str]:
        seen = set()
        for _, source, _ in self.index:
            if source and source not in seen:
                seen.add(source)
                yield source

    def __len__(self) -> int:
        return sum(1 for _ in self)
