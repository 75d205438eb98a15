"""The measurements of the scale benchmark (bench/scale.py) that run in a fresh process each (its memory and
mappings its own): loading a cache, the incremental decision, random reads, a trainer's start and one epoch."""

from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shards  # noqa: E402
from bench.scale_build import source, stamp  # noqa: E402
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


class Listed(NamedTuple):
    """A listed folder input as `FolderDataset` reads it: its source, and the stamp its files' stat gives."""

    source: str
    stamp: int


def measure_decide(root: str, n: int, budget_s: float = 0.0) -> dict:
    """Stage one's "nothing changed" decision over the synthetic cache, by the functions `precompute.run` uses, in
    this (fresh) process: the manifest loaded; per source its sample index, the cache's key lookup (the skip set) and
    the source's stamp table at its resolution; the rank's writer opened; a folder listing of the n inputs looked up
    in the stamp table (`FolderDataset`, its entries' stamps given: os.stat is not measured), read as the loader's
    worker reads it (`SourcesDataset`: blocks of inputs stamped and compared at once) and sorted by
    `EncodingPass.take` (the duplicate check, the set of inputs kept); rank 0's removals (`decide_removals`) from
    the pass's gathered tally and the final writer's removal. No shard is opened and nothing is encoded.
    `budget_s` is unused (the whole decision always runs)."""
    from collections import Counter
    from types import SimpleNamespace

    import precompute.folders as folders
    from precompute.config import PrecomputeConfig
    from precompute.encoding import EncodingPass
    from precompute.inputs import SourcesDataset
    from precompute.run import SkipKeys, decide_removals
    from precompute.tally import Seen, Tally
    from shards import ShardWriter

    listing = [Listed(source(i), stamp(i)) for i in range(n)]  # the run's listing of its inputs: not timed
    policy = PrecomputeConfig("unused").policy()
    folders.entry_stamp = lambda entry: entry.stamp  # the listing's stamps stand for os.stat's
    before, t0, c0 = reset_peak(), time.perf_counter(), time.process_time()
    manifest = shards.load(root)
    load_s = time.perf_counter() - t0
    # open_all_inputs: per source its samples, every key (the skip set), the stamp table at its resolution
    previous = {"": manifest.index("")}
    skip = SkipKeys(manifest.shards.key_index())
    stamps = {("", 0): manifest.by_source("", 0)}
    dataset = folders.FolderDataset(listing, policy, skip, stamps[("", 0)])
    if (dataset.positions < 0).any():
        manifest.shards.sample_index().lookup("keys")  # as open_source builds it before the loader's workers fork
    index_s = time.perf_counter() - t0 - load_s
    writer = ShardWriter(root, manifest.fingerprint, manifest.schema, text_schema=manifest.text_schema, manifest=manifest.copy())
    tally = Tally(by_source={"": Counter()}, seen=Seen(manifest.shards))
    sorter = EncodingPass.__new__(EncodingPass)  # its sorting alone: no encoder exists
    sorter.tally, sorter.stamps, sorter.previous, sorter.needed = tally, stamps, previous, None
    t1 = time.perf_counter()
    for item in SourcesDataset([(SimpleNamespace(name="", flip=False, salt=lambda: 0), dataset, 0)]):  # as the loader's worker
        sorter.take(item)
    lookup_s = time.perf_counter() - t1
    writer.restamp(tally.restamps)
    writer.finish()
    # rank 0: every rank's tally gathered, the removals decided and committed
    t2 = time.perf_counter()
    by_source = {"": Counter()}
    inputs = SimpleNamespace(sources=[SimpleNamespace(name="", path="images", from_file=False)], previous=previous, dropped={})
    config = SimpleNamespace(allow_removal=False, max_removal_fraction=0.5)
    stale, refused = decide_removals(config, inputs, Seen.merged([tally.seen.part()]), [], {"": True}, manifest, by_source)
    final = ShardWriter(root, manifest.fingerprint, manifest.schema, text_schema=manifest.text_schema, manifest=manifest.copy())
    final.remove(stale)
    final.close()
    finish_s = time.perf_counter() - t2
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert refused is None and not stale and tally.counts["unchanged"] == n, (tally.counts, len(stale))
    return {"decide_s": total, "decide_cpu_s": cpu, "decide_complete": True, "decide_indexed": n, "decide_load_s": load_s, "decide_index_s": index_s,
            "decide_lookup_s": lookup_s, "decide_finish_s": finish_s, "decide_peak_bytes": peak_growth(before),
            "unchanged": tally.counts["unchanged"], "restamped": len(tally.restamps),
            "decide_method": "precompute.run: by_source + FolderDataset + EncodingPass.take + decide_removals"}


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
