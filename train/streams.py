"""What an epoch draws from: its streams (one bucket, source, cache and resolution each), the share of the epoch each
stream gets (its source's repeats or weight, a resolution's weight), and the samples no stream trains on (held out
for the held-out loss). `train.order.BatchPlan` turns these into batches."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from shards import Bucket


@dataclass(frozen=True, order=True)
class Stream:
    """The shards of one bucket and one source (a named dataset) of one cache (of a run's several), at one resolution
    of a cache of several (`resolution`: the shards' `ShardEntry.resolution`, 0 for the cache's base one): what the
    plan draws batches from."""

    bucket: Bucket
    source: str = ""
    cache: int = 0
    resolution: int = 0


def source_draws(samples: dict[Stream, int], records: dict[str, dict]) -> dict[Stream, int]:
    """Samples each stream gives an epoch, from its source's share as stage one recorded it
    (`manifest.extra["sources"]`): `repeats` r draws each sample r times; sources with a `weight` share the draws
    their samples would take once, in proportion to their weights. A source without a record draws once.
    A source's draws are spread over its buckets in proportion to their samples (rounded to whole draws)."""
    per_source: dict[str, int] = defaultdict(int)
    for stream, n in samples.items():
        per_source[stream.source] += n
    weights = {name: float(records[name]["weight"]) for name in per_source if "weight" in records.get(name, {})}
    wanted: dict[str, float] = {name: n * int(records.get(name, {}).get("repeats", 1))
                                for name, n in per_source.items() if name not in weights}
    pool = sum(per_source[name] for name in weights)
    wanted |= {name: pool * w / sum(weights.values()) for name, w in weights.items()}
    draws = whole_shares(wanted)
    out: dict[Stream, int] = {}
    for name, total in draws.items():
        mine = {stream: n for stream, n in samples.items() if stream.source == name}
        out |= whole_shares({stream: total * n / per_source[name] for stream, n in mine.items()})
    return out


def is_eval_source(record: dict) -> bool:
    """Whether stage one marked the source `eval = true`: held out of training, its loss computed on it."""
    return bool(record.get("eval"))


def key_fraction(key: str) -> float:
    """Where a string falls in [0, 1), uniformly: a function of the string alone."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8, person=b"held-out").digest()
    return int.from_bytes(digest, "little") / 2.0**64


def sample_fraction(key: str, source: str, dataset: str = "") -> float:
    """Where a sample falls in [0, 1) for `--eval-fraction`: by its input (the file or tar member stage one read it
    from), so every sample of one image is held out or trained together — its copies at each resolution, and its
    versions before and after a caption, mask or flip edit, which change its key. A sample with no recorded input
    (cached before inputs were named) falls by its key. The source's name is mixed in, so two sources holding the
    same file names fall independently. A sample held out of training is held out in every run, resume, world size
    and generation of the cache."""
    return key_fraction(f"{dataset}\0{source}" if source else key)


def holds_out(caches, fraction: float) -> bool:
    """Whether any sample of these caches is held out: a fraction is asked for, or a source is marked `eval = true`."""
    caches = caches if isinstance(caches, (list, tuple)) else [caches]
    return fraction > 0 or any(is_eval_source(r) for one in caches for r in one.manifest.extra.get("sources", {}).values())


_held_in_shard: dict[tuple[str, str, float], tuple[np.ndarray, np.ndarray]] = {}  # a shard never changes: hashed once


def held_out(caches, fraction: float) -> dict[Stream, tuple[np.ndarray, np.ndarray]]:
    """The samples no training batch draws, per stream, as (global indices, their place in [0, 1)) in index
    order: every sample of a source stage one marked `eval = true`, and, of the other sources, those whose input falls
    below `fraction` (`sample_fraction`). Read from the manifests' sample index, no shard opened; each shard's keys are
    hashed once per process (a new generation hashes only its new shards). With several caches, their samples are
    numbered one after the other, as `BatchPlan.of` numbers them."""
    caches = caches if isinstance(caches, (list, tuple)) else [caches]
    out: dict[Stream, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    offset = 0
    for c, one in enumerate(caches):
        records = one.manifest.extra.get("sources", {})
        names, table = one.shards.datasets(), one.shards
        heights, widths, frames, tags = (table.column(c) for c in ("height", "width", "frames", "resolution"))
        for j, name in enumerate(names):
            share = 1.0 if is_eval_source(records.get(name, {})) else fraction
            if share <= 0:
                continue
            entry = table[j]
            memo = (entry.path, entry.sha256, share)
            if memo not in _held_in_shard:
                keys, inputs, _ = table.samples_of(int(table.rows[j]))
                where = np.array([sample_fraction(k, s, name) for k, s in zip(keys, inputs)], dtype=np.float64)
                rows = np.flatnonzero(where < share)
                _held_in_shard[memo] = (rows, where[rows])
            rows, where = _held_in_shard[memo]
            if len(rows):
                stream = Stream(Bucket(int(heights[j]), int(widths[j]), int(frames[j])), name, c, int(tags[j]))
                out[stream].append((rows + int(one.shard_starts[j]) + offset, where))
        offset += len(one)
    return {st: (np.concatenate([i for i, _ in parts]), np.concatenate([w for _, w in parts]))
            for st, parts in sorted(out.items())}


def resolution_draws(draws: dict[Stream, int], resolution_of: dict[Stream, int], weights: dict[int, float]) -> dict[Stream, int]:
    """The epoch's draws shared out between resolutions by `weights` (resolution in pixels -> weight), each
    resolution's spread over its streams as their own draws are (rounded to whole draws, the total kept).

    Raises:
        ValueError: a resolution of the streams has no weight, or a weight names a resolution they do not hold.
    """
    per: dict[int, int] = defaultdict(int)
    for stream, n in draws.items():
        per[resolution_of[stream]] += n
    held = ", ".join(map(str, sorted(per)))
    if missing := sorted(set(per) - set(weights)):
        raise ValueError(f"--resolution-weight gives no weight to resolution {missing[0]}, which the cache holds; give one "
                         f"to each of {held}, e.g. --resolution-weight " + ",".join(f"{r}=1" for r in sorted(per)))
    if extra := sorted(set(weights) - set(per)):
        raise ValueError(f"--resolution-weight {extra[0]}=...: the cache holds no samples at {extra[0]}; it holds {held}")
    total, weight = sum(per.values()), sum(weights[r] for r in per)
    target = whole_shares({r: total * weights[r] / weight for r in sorted(per)})
    out: dict[Stream, int] = {}
    for r in sorted(per):
        if per[r]:
            out |= whole_shares({st: n * target[r] / per[r] for st, n in draws.items() if resolution_of[st] == r})
    return out


def cache_labels(locations: list[str]) -> list[str]:
    """Short names of a run's caches: the last component of each location, numbered where two are alike."""
    names = [location.rstrip("/").rsplit("/", 1)[-1] for location in locations]
    return [f"{i}-{n}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def whole_shares(parts: dict) -> dict:
    """Shares rounded to whole numbers with their sum kept (largest remainders first, ties in key order)."""
    floors = {k: math.floor(v + 1e-9) for k, v in parts.items()}
    short = round(sum(parts.values())) - sum(floors.values())
    for k in sorted(parts, key=lambda k: -(parts[k] - floors[k]))[:max(short, 0)]:
        floors[k] += 1
    return floors
