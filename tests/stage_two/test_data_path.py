"""The data path of training: the data order (`BatchPlan`) and the background reader (`BatchStream`)."""

import json
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from shards import Bucket, Cache, CorruptSample
from train.data import BatchStream, Epoch, TrainingSamples
from train.order import BatchPlan

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


def spans(bucket_sizes: dict, per_shard: int) -> dict:
    """Global index ranges of shards of `per_shard` samples (the last one of a bucket shorter), buckets in turn."""
    out, start = {}, 0
    for bucket, n in bucket_sizes.items():
        out[bucket] = []
        while n > 0:
            size = min(per_shard, n)
            out[bucket].append(range(start, start + size))
            start, n = start + size, n - size
    return out


SKEWED = {Bucket(64, 64): 230, Bucket(48, 80): 37, Bucket(80, 48): 5}


def test_every_sample_once_per_epoch_one_bucket_per_batch_few_shards_per_batch():
    ranges = spans(SKEWED, per_shard=10)
    plan = BatchPlan(ranges, 4, seed=1, world_size=2, shuffle_shards=3)
    shard_of = {i: (b, j) for b, rs in ranges.items() for j, r in enumerate(rs) for i in r}
    used = Counter()
    batches = list(plan.global_batches(0))
    assert [p.cursor for p in batches] == list(range(plan.batches_per_epoch()))
    for planned in batches:
        assert len(planned.indices) == 8 and {shard_of[i][0] for i in planned.indices} == {planned.bucket}
        assert len({shard_of[i] for i in planned.indices}) <= 2 * 3  # at most two windows of three shards
        used.update(planned.indices)
    assert set(used) == set(range(272))
    assert sum(used.values()) - 272 == sum(-n % 8 for n in SKEWED.values())  # only the last batch of a bucket repeats
    assert [p.indices for p in batches] != [p.indices for p in plan.global_batches(1)]  # a new order each epoch
    buckets = [p.bucket for p in batches]
    assert buckets[:10].count(Bucket(64, 64)) < 10  # buckets interleave rather than run one after another


def test_n_ranks_see_what_one_process_with_the_global_batch_sees():
    ranges = spans(SKEWED, per_shard=7)
    one = BatchPlan(ranges, 12, seed=5, remainder="drop")
    ranks = [BatchPlan(ranges, 4, seed=5, rank=r, world_size=3, remainder="drop") for r in range(3)]
    per_rank = [r(epoch=2) for r in ranks]
    assert len({len(b) for b in per_rank}) == 1  # the same number of batches: no rank waits on another
    assert [sum(parts, []) for parts in zip(*per_rank)] == one(epoch=2)
    assert all(len(b) == 12 for b in one(epoch=2))


def test_resume_jumps_to_any_batch_without_replaying():
    plan = BatchPlan(spans(SKEWED, per_shard=6), 3, seed=2, shuffle_shards=2)
    full = plan(epoch=1)
    for start in range(len(full) + 1):
        assert plan(epoch=1, start=start) == full[start:]


def test_the_order_of_ten_million_samples_takes_memory_of_its_shards_only():
    """100,000 shards of 100 samples in 40 buckets: a plan, a jump into the middle of an epoch and its next
    batches, without anything per sample in memory (numpy's allocations are traced)."""
    buckets = {Bucket(512 + 32 * i, 512): 250_000 for i in range(40)}
    tracemalloc.start()
    plan = BatchPlan(spans(buckets, per_shard=100), 8, seed=0, shuffle_shards=4)
    n = plan.batches_per_epoch()
    rng = np.random.default_rng(0)
    for start in rng.integers(1, n, size=3).tolist():
        first, second = plan.batches(3, start - 1), plan.batches(3, start)
        next(first)
        assert next(first) == next(second)  # batch `start` found directly equals the one after `start - 1`
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n == 10_000_000 // 8 and len(plan.samples) == 40
    assert peak < 40 << 20, f"{peak / 2**20:.0f} MiB traced for 10M samples"  # a list of indices alone would be 80+ MiB


@pytest.fixture(scope="module")
def shard_per_sample(tmp_path_factory):
    """24 images cached by stage one, one shard per sample: many shards in each bucket."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("many")
    precompute(str(make_folder(root / "data", count=24)), "tiny-sana", root / "cache", workers=0, progress=False,
               max_shard_mb=0)
    return root / "cache"


def take(cache_root, n: int, *, workers: int, start=(0, 0), readahead: int = 4, samples_cls=TrainingSamples,
         until=None) -> tuple[list, BatchStream]:
    """The first `n` batches of a stream from (epoch, cursor) `start`, epochs handed over as the loop does; with
    `until`, the stream stays open until `until(stream, batches)` holds (30 s at most): its background threads run on
    their own schedule, so a test of what they did waits for it rather than for a time."""
    cache = Cache(cache_root)

    def epoch(number, first=0):
        return Epoch(number, BatchPlan.of(cache, 2, seed=3, shuffle_shards=2), samples_cls(cache, 3, 0.5), first)

    stream = BatchStream(epoch(*start), workers=workers, prefetch=3, readahead=readahead)
    out = []
    with stream:
        while len(out) < n:
            if stream.needs_epoch():
                stream.add_epoch(epoch(stream._epochs[-1].number + 1))
            out.append(next(stream))
        deadline = time.monotonic() + 30
        while until is not None and not until(stream, out) and time.monotonic() < deadline:
            time.sleep(0.01)
    return out, stream


def same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x["epoch"], x["cursor"], x["keys"], x["bucket"]) == (y["epoch"], y["cursor"], y["keys"], y["bucket"])
        for name in ("latents", "text", "text_mask"):
            assert torch.equal(x[name], y[name]), name


def test_background_threads_yield_exactly_the_synchronous_batches(shard_per_sample):
    n = 30  # across two epoch hand-overs (13 batches per epoch)
    sync, _ = take(shard_per_sample, n, workers=0)
    assert {b["epoch"] for b in sync} == {0, 1, 2}
    for workers in (1, 3):
        batches, stream = take(shard_per_sample, n, workers=workers)
        same(batches, sync)
        assert not any(t.is_alive() for t in stream._threads)  # closed: nothing left running
    assert stream.read_ahead["shards"] > 0 and stream.read_ahead["failed"] == 0


def test_a_resumed_stream_continues_the_same_batches(shard_per_sample):
    full, _ = take(shard_per_sample, 30, workers=1)
    at = next(k for k, b in enumerate(full) if (b["epoch"], b["cursor"]) == (1, 4))
    resumed, _ = take(shard_per_sample, 30 - at - 1, workers=2, start=(1, 4))
    same(resumed, full[at + 1 :])


def test_the_read_ahead_reads_whole_shards_of_coming_batches(shard_per_sample):
    cache = Cache(shard_per_sample)
    sizes = {j: cache.path(j).stat().st_size for j in range(len(cache.shards))}
    shard_of = {cache[i].key: cache.locate(i)[0] for i in range(len(cache))}

    def touched(batches) -> set[int]:
        return {shard_of[k] for b in batches for k in b["keys"]}

    # the read-ahead thread runs ahead of the batches on its own schedule: the stream stays open until it has read as
    # many bytes as the taken batches' shards hold (a count it keeps), then it must have read them whole
    batches, stream = take(shard_per_sample, 12, workers=1, readahead=64,
                           until=lambda s, out: s.read_ahead["bytes"] >= sum(sizes[j] for j in touched(out)))
    touched = touched(batches)
    assert stream.read_ahead["shards"] >= len(touched) and stream.read_ahead["failed"] == 0
    assert stream.read_ahead["bytes"] >= sum(sizes[j] for j in touched)


class FailingSamples(TrainingSamples):
    """Fails building batch 3 of epoch 0 (whichever thread builds it), as a reader meeting an unreadable file would."""

    error: Exception = OSError("Input/output error: cache/shards/00042.safetensors")

    def batch(self, epoch, indices, passes=None):
        if epoch == 0 and indices == BatchPlan.of(self.cache, 2, seed=3, shuffle_shards=2)(0)[3]:
            raise FailingSamples.error
        return super().batch(epoch, indices, passes)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_error_stops_the_stream_naming_the_batch(shard_per_sample, workers):
    FailingSamples.error = OSError("Input/output error: cache/shards/00042.safetensors")
    with pytest.raises(RuntimeError, match=r"the data reader failed on batch 3 of epoch 0: OSError: Input/output error: "
                                           r"cache/shards/00042") as raised:
        take(shard_per_sample, 10, workers=workers, samples_cls=FailingSamples)
    assert isinstance(raised.value.__cause__, OSError)
    assert not [t for t in threading.enumerate() if t.name.startswith(("batches-", "readahead"))]


def test_a_damaged_sample_reaches_the_loop_as_itself(shard_per_sample):
    FailingSamples.error = CorruptSample("sample x of shard y does not match its digest")
    with pytest.raises(CorruptSample, match="does not match its digest"):
        take(shard_per_sample, 10, workers=1, samples_cls=FailingSamples)


def test_training_in_the_background_equals_training_synchronously(shard_per_sample, tmp_path):
    from train.config import TrainConfig
    from train.loop import train

    def losses(workers: int, run: Path) -> list:
        train(TrainConfig(model="tiny-sana", cache=shard_per_sample, run=run, steps=16, batch_size=2, workers=workers,
                          prefetch=2, readahead=8, progress=False, log_every=1, validate=False, lr=1e-3))
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(2, tmp_path / "async") == losses(0, tmp_path / "sync")  # 16 steps over two epochs
