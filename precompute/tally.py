"""What a rank's pass over its inputs found (`Tally`, and `Seen`: which inputs it read, over the cache's sample index)
and the latent fields of the samples the cache held when the run started (`CachedLatents`), which a changed input
whose image did not change takes instead of the VAE's."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from shards import LATENT_KEY, Cache, FormatError


class Seen:
    """The inputs a rank's pass read and kept (encoded or unchanged), without an object per cached sample: a cached
    sample is marked in a boolean column over the run's manifest's global index; an input the manifest does not hold
    (new, or changed: a new key) is kept by key with its source name and input.

    Args:
        table: the shard table of the manifest the run started with (None: a new cache); its key lookup finds the
            cached sample of an input read by key.
    """

    def __init__(self, table=None):
        self.table = table
        self.cached = np.zeros(int(table.column("samples").sum()) if table is not None else 0, dtype=bool)
        self.moved: dict[int, tuple[str, str]] = {}  # global index -> (source name, input), read from another input
        self.new: dict[str, tuple[str, str]] = {}  # key -> (source name, input) of inputs the manifest does not hold

    def cached_at(self, key: str) -> tuple[int, str] | None:
        """(global index, dataset) of cached sample `key`, or None."""
        found = self.table.find_key(key) if self.table is not None else None
        return None if found is None else (self.table.global_index(*found), self.table.dataset_of(found[0]))

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def contains(self, key: str, index: int | None = None) -> bool:
        """Whether `key` was kept; `index`: its global index when the caller knows it (from the stamp table)."""
        if key in self.new:
            return True
        if index is None:
            at = self.cached_at(key)
            index = at[0] if at is not None else None
        return index is not None and bool(self.cached[index])

    def add(self, key: str, name: str, source: str, index: int | None = None) -> None:
        """Keep `key`, read from `source` of source name `name` (`index`: its global index, from the stamp table: the
        input is the one the index records)."""
        if index is None:
            at = self.cached_at(key)
            if at is None:
                self.new[key] = (name, source)
                return
            index = at[0]
            if self.table.sample_index().source(index) != source:
                self.moved[index] = (name, source)
        self.cached[index] = True

    def __len__(self) -> int:
        return int(self.cached.sum()) + len(self.new)

    def part(self) -> dict:
        """What rank 0 gathers of it: the column packed to bits, and the inputs kept by key or moved."""
        return {"cached": np.packbits(self.cached), "samples": len(self.cached), "moved": self.moved, "new": self.new}

    @staticmethod
    def merged(parts: list[dict]) -> dict:
        """Every rank's `part` as one: the columns ORed, the dicts joined."""
        n = parts[0]["samples"]
        bits = np.zeros_like(parts[0]["cached"])
        for p in parts:
            bits |= p["cached"]
        return {"cached": np.unpackbits(bits, count=n).astype(bool), "moved": {k: v for p in parts for k, v in p["moved"].items()},
                "new": {k: v for p in parts for k, v in p["new"].items()}}


@dataclass
class Tally:
    """What one rank's pass found: counts overall and per source, the failures, and the keys it saw.

    Args:
        counts: outcomes of the whole pass (new, changed, unchanged, duplicate, failed, captions_truncated, ...).
        by_source: the same per source name.
        failures: one record per failed input (source, reason, detail, dataset).
        seen: every input read and kept (encoded or unchanged), `Seen`.
        restamps: key -> stamp of unchanged inputs whose stamp moved (touched, same content).
        repaired: key -> fields re-encoded for a damaged shard (`--repair`).
        repaired_texts: text key -> fields re-encoded from its sample's inputs for a damaged text shard (`--repair`).
        loop_s, wait_s: time in the pass, and of it the time the encoders idled waiting on the loader (the pass
            blocked on it with no batch left for them to encode).
        encoder_s: of the pass, the time inside the encoders' calls (VAE, image encoder, text encoder).
        write_wait_s: of the pass, the time the encoders idled waiting on the background writer (its queue full, its
            last batches).
        write_s: the background writer's time writing (serialising, digests, fsync, commits), beside the pass.
    """

    counts: Counter = field(default_factory=Counter)
    by_source: dict[str, Counter] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    seen: Seen = field(default_factory=Seen)
    restamps: dict[str, int] = field(default_factory=dict)
    repaired: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    repaired_texts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    loop_s: float = 0.0
    wait_s: float = 0.0
    encoder_s: float = 0.0
    write_wait_s: float = 0.0
    write_s: float = 0.0

    def fail(self, record: dict, samples: int = 1) -> None:
        self.failures.append(record)
        self.counts["failed"] += samples
        if "dataset" in record:
            self.by_source[record["dataset"]]["failed"] += samples

    def count(self, outcome: str, source: str) -> None:
        self.counts[outcome] += 1
        self.by_source[source][outcome] += 1


def once_per_input(failures: list[dict], resolutions: dict[str, tuple[int, ...]]) -> tuple[list[dict], Counter]:
    """`failures` with an input that failed at several of its source's resolutions (a source is read once per
    resolution) listed once, its detail saying at how many, and the failures that repeat one per source, which the
    counts of failed inputs leave out. `resolutions`: per source name, the resolutions it is read at. The order is
    kept (the first record of each input stands for it)."""
    first: dict[tuple[str, str], dict] = {}
    seen: dict[tuple[str, str], list[dict]] = {}
    for f in failures:
        seen.setdefault((f.get("dataset", ""), f["source"]), []).append(f)
    out, again = [], Counter()
    for f in failures:
        key = (f.get("dataset", ""), f["source"])
        if key in first:
            continue
        records = seen[key]
        first[key] = f
        if len(records) == 1:
            out.append(f)
            continue
        again[key[0]] += sum(r.get("samples", 1) for r in records[1:])
        mine = resolutions.get(key[0], ())
        where = (f"at each of the source's {len(mine)} resolutions ({', '.join(map(str, mine))})" if len(records) == len(mine)
                 else f"at {len(records)} of the source's resolutions ({', '.join(map(str, mine))})")
        others = list(dict.fromkeys(f"{r['reason']}: {r['detail']}" if r["reason"] != f["reason"] else r["detail"]
                                    for r in records[1:] if r.get("detail") != f.get("detail") or r["reason"] != f["reason"]))
        detail = "; ".join([d for d in (f.get("detail"), *others) if d])
        out.append({**f, "detail": f"{detail} ({where})" if detail else where})
    return out, again


class CachedLatents:
    """The latent fields of the samples a cache held when the run started, found by the input they came from.

    An input that changed but whose image did not (a new loss mask, edited captions) gets a new key; its old sample,
    found through the input's entry in the stamp table, holds the latent fields the VAE would compute again, which its
    `shards.LATENT_KEY` proves (the same image bytes, flip, control image and reference images). They are read with
    the shards reader from the generation the run started with (its shards are not retired before the run ends),
    digests checked; a sample that cannot be read is encoded again.

    Args:
        root: the cache.
        generation: the generation the run's manifest is.
        fields: the latent fields to copy (the image's, its flipped view's, its control image's, its references').
    """

    def __init__(self, root, generation: int, fields: list[str]):
        self.root, self.generation, self.fields = root, generation, fields
        self._cache: Cache | None = None

    def find_any(self, dataset: str, keys: list[str], latent_key: bytes) -> dict[str, torch.Tensor] | None:
        """`find` of the first of cached samples `keys` whose latent key is `latent_key` (a video's clips: the old clip
        that is this one), each candidate's latent key read alone, without the digest check a read makes."""
        try:
            for key in keys:
                i = self._indexed(dataset, key)
                if i is not None:
                    j, row = self._cache.locate(i)
                    if bytes(self._cache.shard(j).fields(row)[LATENT_KEY].numpy()) == latent_key:
                        return self.find(dataset, key, latent_key)
        except (FormatError, OSError, KeyError):
            pass
        return None

    def find(self, dataset: str, key: str, latent_key: bytes) -> dict[str, torch.Tensor] | None:
        """The latent fields of cached sample `key` of `dataset` if its latent key is `latent_key`, else None."""
        try:
            i = self._indexed(dataset, key)
            if i is None:
                return None
            fields = self._cache[i].fields
            if LATENT_KEY not in fields or bytes(fields[LATENT_KEY].numpy()) != latent_key:
                return None
            return {name: fields[name].clone() for name in self.fields}
        except (FormatError, OSError, KeyError):  # damaged or gone: the VAE computes them again
            return None

    def _indexed(self, dataset: str, key: str) -> int | None:
        """The global index of cached sample `key` of `dataset` (None: not one of its samples), the cache opened on
        first use; found by the manifest's key lookup (`ShardTable.find_key`)."""
        if self._cache is None:
            self._cache = Cache(self.root, self.generation, check_digests=True)
        table = self._cache.manifest.shards
        found = table.find_key(key)
        if found is None or table.dataset_of(found[0]) != dataset:
            return None
        return table.global_index(*found)
