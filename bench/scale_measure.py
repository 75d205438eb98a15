"""The measurements of the scale benchmark (bench/scale.py) that run in a fresh process each (its memory and
mappings its own): loading a cache, the incremental decision, random reads, a trainer's start and one epoch."""

from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shards  # noqa: E402
from bench.scale_build import key, source, stamp  # noqa: E402
from shards import Cache  # noqa: E402

torch.set_num_threads(1)  # as in the benchmark's own process


def memory(field: str) -> int:
    """A line of /proc/self/status in bytes, e.g. VmRSS (resident now) or VmHWM (its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Start VmHWM afresh at the current RSS, and return that. (Not ru_maxrss: Linux copies the parent's into
    a child at fork, so a child of the big builder process would report the builder's peak.)"""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return memory("VmRSS")


def peak_growth(before: int) -> int:
    return memory("VmHWM") - before


def mapped_shards() -> int:
    with open("/proc/self/maps") as f:
        return sum(".safetensors" in line for line in f)


def measure_load(root: str) -> dict:
    before, t0 = reset_peak(), time.perf_counter()
    cache = Cache(root)
    seconds = time.perf_counter() - t0
    return {"load_s": seconds, "load_peak_bytes": peak_growth(before), "samples": len(cache)}


def measure_decide(root: str, n: int, budget_s: float) -> dict:
    inputs = [(source(i), key(i), stamp(i)) for i in range(n)]  # the run's listing of its inputs, not timed
    before, t0 = reset_peak(), time.perf_counter()
    manifest = shards.load(root)
    load_s = time.perf_counter() - t0
    if hasattr(manifest, "by_source"):
        table = manifest.by_source()
        indexed, method = n, "Manifest.by_source()"
    else:
        table, indexed, method = {}, 0, "Manifest.samples()"
        for k, s, st, *_ in manifest.samples():
            table[s] = (k, st)
            indexed += 1
            if indexed % 256 == 0 and time.perf_counter() - t0 > budget_s:
                break
    index_s = time.perf_counter() - t0 - load_s
    t1 = time.perf_counter()
    unchanged = sum(tuple(table.get(s, ())[:2]) == (k, st) for s, k, st in inputs)
    lookup_s = time.perf_counter() - t1
    total = load_s + index_s * n / indexed + lookup_s  # the table's rate so far, when unfinished
    return {"decide_s": total, "decide_complete": indexed == n, "decide_indexed": indexed, "decide_load_s": load_s,
            "decide_lookup_s": lookup_s, "decide_peak_bytes": peak_growth(before), "unchanged": unchanged,
            "decide_method": method}


def measure_readers(root: str, max_reads: int, seed: int = 0) -> dict:
    cache = Cache(root)
    rng = random.Random(seed)
    counts = cache.shards.column("samples").tolist()
    if len(cache) <= max_reads:
        order = list(range(len(cache)))
    else:  # one sample of every shard: every shard is opened once
        starts = list(itertools.accumulate(counts, initial=0))
        order = [starts[j] + rng.randrange(counts[j]) for j in range(len(counts))]
    rng.shuffle(order)
    most_open = most_mapped = 0
    t0 = time.perf_counter()
    for r, i in enumerate(order):
        for t in cache[i].fields.values():
            t.clone()
        most_open = max(most_open, len(cache._readers))
        if r % 32 == 0:
            most_mapped = max(most_mapped, mapped_shards())
    most_mapped = max(most_mapped, mapped_shards())
    return {"reads": len(order), "read_s": time.perf_counter() - t0, "max_open_readers": most_open,
            "max_mapped": most_mapped, "max_map_count": int(Path("/proc/sys/vm/max_map_count").read_text())}


class RawSamples:
    """What the trainer's stream asks of its samples, without a model's text layout: the fields copied out."""

    def __init__(self, cache: Cache):
        self.cache = cache

    def batch(self, epoch: int, indices: list[int], passes: list[int] | None = None) -> dict:
        return {"fields": [{k: t.clone() for k, t in self.cache[i].fields.items()} for i in indices], "keys": indices}

    def shards_of(self, indices: list[int]) -> list:
        return [(self.cache, j) for j in sorted({self.cache.locate(i)[0] for i in indices})]


def measure_trainer_start(root: str, batch: int = 64) -> dict:
    """A trainer's start on this cache, resumed in the middle of an epoch: open the generation, build the data
    order, jump to the batch, build it through the stream. Seconds and peak RSS growth (the model aside)."""
    from train.data import BatchStream, Epoch
    from train.order import BatchPlan

    before, t0 = reset_peak(), time.perf_counter()
    cache = Cache(root)
    plan = BatchPlan.of(cache, batch, seed=0)
    middle = plan.batches_per_epoch() // 2
    stream = BatchStream(Epoch(3, plan, RawSamples(cache), middle), workers=1, prefetch=4, readahead=64)
    first = next(stream)
    seconds = time.perf_counter() - t0
    stream.close()
    return {"start_s": seconds, "start_peak_bytes": peak_growth(before), "start_batch": first["cursor"] - 1}


def measure_epoch(root: str, batch: int = 64) -> dict:
    """One whole epoch through the trainer's stream (every shard opened, read ahead, mapped and unmapped)."""
    from train.data import BatchStream, Epoch
    from train.order import BatchPlan

    before, t0 = reset_peak(), time.perf_counter()
    cache = Cache(root)
    plan = BatchPlan.of(cache, batch, seed=0)
    seen, most_mapped = 0, 0
    with BatchStream(Epoch(0, plan, RawSamples(cache)), workers=1, prefetch=4, readahead=64) as stream:
        for k in range(plan.batches_per_epoch()):
            seen += len(next(stream)["keys"])
            if k % 64 == 0:
                most_mapped = max(most_mapped, mapped_shards())
        read_ahead = dict(stream.read_ahead)
    return {"epoch_s": time.perf_counter() - t0, "epoch_samples": seen, "epoch_peak_bytes": peak_growth(before),
            "epoch_max_mapped": most_mapped, "epoch_read_ahead_shards": read_ahead["shards"],
            "epoch_read_ahead_failed": read_ahead["failed"]}
