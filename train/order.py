"""The data order: which samples form each batch of each epoch, computed rather than stored.

Every draw here is a pure function of (seed, epoch, ...), so a resumed run sees exactly the batches an
uninterrupted one would, whichever thread or rank builds them.
"""

from __future__ import annotations

import copy
import hashlib
import heapq
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from shards import Bucket
from train.streams import Stream, cache_labels, held_out, holds_out, is_eval_source, resolution_draws, source_draws, whole_shares

BATCH_SAMPLER_VERSION = 3


def derived_seed(*parts: int) -> int:
    """A 63-bit seed determined by `parts` alone (no hidden RNG state to save and restore)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_generator(*parts: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator seeded by `parts`, on `device` when that is an accelerator (so draws happen there)."""
    device = torch.device(device or "cpu")
    where = device if device.type not in ("cpu", "meta") else "cpu"
    return torch.Generator(where).manual_seed(derived_seed(*parts))


@dataclass
class _BucketEpoch:
    """One stream's order in one pass of an epoch: its shards shuffled, grouped into windows of `shuffle_shards`
    consecutive shards whose samples are shuffled together."""

    shard_order: np.ndarray  # positions in the bucket's shard list
    window_starts: np.ndarray  # stream position where each window starts, and the end
    perms: OrderedDict = field(default_factory=OrderedDict)  # window -> its permutation and shards (a few recent)


@dataclass(frozen=True)
class PlannedBatch:
    """Batch `cursor` (0-based) of an epoch: its bucket and the global batch's sample indices."""

    cursor: int
    bucket: Bucket
    indices: list[int]
    source: str = ""
    passes: list[int] | None = None  # per sample, which pass over its stream drew it (None: all the first)


class BatchPlan:
    """Batches of global sample indices, every batch from one bucket (one shape, no padded images).

    The order is built for cold storage and for caches of any size:
    - Within a bucket, each epoch shuffles the bucket's shards, groups them into windows of `shuffle_shards`
      consecutive shards, and shuffles the samples of each window; the bucket's global batches are
      consecutive runs of that stream. So a batch reads from at most 2 x `shuffle_shards` shards, and
      whole shards can be read (or downloaded) once per epoch, sequentially, ahead of need. The cost in
      randomness: a batch's samples come from `shuffle_shards` shards of its bucket (which change every
      epoch) rather than from the whole bucket, so samples stage one stored in one shard share batches
      more often than under a full shuffle; samples of a bucket held in at most `shuffle_shards` shards are
      fully shuffled.
    - Buckets interleave: bucket b's k-th batch is due at (k + u) / n_b through the epoch, u uniform in
      [0, 1) per batch, and batches come in order of that time. Every bucket is spread evenly over the
      epoch with a random local order.
    - Nothing per sample is stored: memory and start-up are O(shards); batch `s` of an epoch is found in
      O(buckets x log samples) (`batches(epoch, start=s)`), so a resume does not replay the epoch.

    A cache of several sources (named datasets) draws from each by its share: every bucket and source is a
    stream of its own, batches never mix sources, and a stream drawn more often than it has samples (repeats,
    or a large weight) shuffles anew for every pass over it within the epoch.

    Held-out samples (`held_out`: a source marked `eval = true`, or `--eval-fraction` of every other) are left out here,
    in the plan: a stream's shards count only the samples it trains on, and the o-th of those in a shard is found by a
    bisection over the sorted held-out indices (memory O(held-out), no per-sample table), so no batch of any epoch
    holds one. Without held-out samples, the plan and its seeds are those of a plan that never heard of them.

    Global batches hold `batch_size * world_size` samples and are the same on every rank (a function of
    seed and epoch alone); rank r takes slice r of each. So every rank gets the same number of batches of
    the same shape at every step, and N ranks see exactly the samples one process with the global batch
    would. With `remainder="repeat"` (default) a bucket's last global batch is completed with samples from
    the start of that bucket's order, so every sample is used every epoch; `"drop"` drops it instead.

    Args:
        ranges: global index ranges of the shards of each bucket (or `Stream`: bucket and source), or use
            `of(cache)`.
        draws: samples drawn per epoch from each stream (`source_draws`); default: each sample once.
        batch_size: samples per batch on each rank.
        seed, rank, world_size: the run's.
        remainder: "repeat" or "drop".
        shuffle_shards: shards whose samples are shuffled together.
        held_out: global indices of the samples never drawn (any order), or None.
    """

    def __init__(self, ranges: dict[Bucket | Stream, list[range] | tuple[np.ndarray, np.ndarray]], batch_size: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1, remainder: str = "repeat", shuffle_shards: int = 4,
                 draws: dict[Stream, int] | None = None, held_out: np.ndarray | None = None):
        if remainder not in ("repeat", "drop"):
            raise ValueError(f"remainder {remainder!r}: choose repeat or drop")
        if batch_size < 1 or shuffle_shards < 1:
            raise ValueError("batch size and shuffle shards must be at least 1")
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.remainder, self.shuffle_shards = remainder, shuffle_shards
        self.global_size = batch_size * world_size
        self.streams: list[Stream] = []
        self._starts: list[np.ndarray] = []  # per stream: its shards' first global index
        self._sizes: list[np.ndarray] = []  # and their sample counts
        ranges = {key if isinstance(key, Stream) else Stream(key): spans for key, spans in ranges.items()}
        # sorted held-out indices, and how many trained samples come before each: the o-th trained sample after
        # index i0 is found by one bisection (`_trained`)
        self._held = np.unique(np.asarray(held_out if held_out is not None else [], dtype=np.int64))
        self._held_before = self._held - np.arange(len(self._held))
        for stream, spans in sorted(ranges.items()):
            if isinstance(spans, tuple):
                starts, stops = (np.asarray(a, dtype=np.int64) for a in spans)
            else:
                starts = np.fromiter((r.start for r in spans), dtype=np.int64, count=len(spans))
                stops = np.fromiter((r.stop for r in spans), dtype=np.int64, count=len(spans))
            if len(self._held):  # the samples each shard trains on
                stops = stops - (np.searchsorted(self._held, stops) - np.searchsorted(self._held, starts))
            keep = stops > starts
            if keep.any() and (draws is None or draws.get(stream, 0) > 0):
                self.streams.append(stream)
                self._starts.append(starts[keep])
                self._sizes.append(stops[keep] - starts[keep])
        self.buckets = [stream.bucket for stream in self.streams]
        self.samples = [int(s.sum()) for s in self._sizes]
        self.draws = [self.samples[i] if draws is None else int(draws[st]) for i, st in enumerate(self.streams)]
        g = self.global_size
        self.counts = [(n + g - 1) // g if remainder == "repeat" else n // g for n in self.draws]
        # one source: the seeds of the plan before sources existed (its runs resume onto the same batches)
        self._single = len({(st.source, st.cache) for st in self.streams}) <= 1
        self.labels: list[str] | None = None  # with several caches, how batches name their source: "CACHE/SOURCE"
        self.resolutions: dict[Stream, int | None] | None = None  # with several resolutions, each stream's in pixels
        self.classes: dict[str, float] = {}  # class sources (`is_reg`) by `source_name`: their prior_loss_weight
        self._epochs: OrderedDict[tuple[int, int, int], _BucketEpoch] = OrderedDict()  # a few recent (epoch, stream, pass)

    @classmethod
    def of(cls, cache, batch_size: int, *, weights: list[float] | None = None, eval_fraction: float = 0.0,
           resolution_weights: dict[int, float] | None = None, **kwargs) -> BatchPlan:
        """The plan of a `shards.Cache`'s generation (or of several caches', their samples numbered one after
        the other), from their shard tables (no shard is opened): a stream per bucket, source and resolution, each
        source drawn by the share stage one recorded for it; with `weights`, every cache's draws are scaled to its
        share of the epoch; with `resolution_weights` (resolution in pixels -> weight), every resolution's. Held-out samples (`held_out`: sources marked `eval = true`, and `eval_fraction` of the
        others by key) are never drawn; a source's share counts the samples it trains on."""
        caches = cache if isinstance(cache, (list, tuple)) else [cache]
        held = held_out(caches, eval_fraction) if holds_out(caches, eval_fraction) else {}
        ranges, draws, offset, totals, excluded = {}, {}, 0, [], []
        for c, one in enumerate(caches):
            starts = one.shard_starts + offset
            heights, widths, frames = (one.shards.column(c) for c in ("height", "width", "frames"))
            names = np.array(one.shards.datasets(), dtype=object)
            records = one.manifest.extra.get("sources", {})
            tags = one.shards.column("resolution")
            samples = {}
            for h, w, f, name, tag in sorted(set(zip(heights.tolist(), widths.tolist(), frames.tolist(), names.tolist(),
                                                     tags.tolist()))):
                if is_eval_source(records.get(name, {})):  # no stream: nothing of it is drawn
                    continue
                mine = np.flatnonzero((heights == h) & (widths == w) & (frames == f) & (names == name) & (tags == tag))
                stream = Stream(Bucket(int(h), int(w), int(f)), name, c, int(tag))
                ranges[stream] = (starts[mine], starts[mine + 1])
                out = held[stream][0] if stream in held else np.zeros(0, np.int64)
                excluded.append(out)
                samples[stream] = int((starts[mine + 1] - starts[mine]).sum()) - len(out)
            mine = source_draws({st: n for st, n in samples.items() if n > 0}, records)
            draws |= mine
            totals.append(sum(mine.values()))
            offset += len(one)
        if weights:  # each cache's share of the epoch in whole draws, spread over its streams as its own draws are
            target = whole_shares({c: sum(totals) * w / sum(weights) for c, w in enumerate(weights)})
            draws = {st: d for c in range(len(caches)) if totals[c] for st, d in whole_shares(
                {st: d * target[c] / totals[c] for st, d in draws.items() if st.cache == c}).items()}
        resolutions = None  # each stream's in pixels: the one its shards record, or its cache's base resolution
        if resolution_weights or any(st.resolution for st in ranges):
            resolutions = {st: caches[st.cache].spec.resolution(st.resolution) for st in ranges}
        if resolution_weights:
            if unknown := sorted({st.cache for st, r in resolutions.items() if r is None}):
                one = caches[unknown[0]]
                raise ValueError(f"--resolution-weight: the cache {getattr(one, 'location', one.root)} does not record the "
                                 f"resolution it was built at; re-run stage one on it (nothing is encoded again) or leave "
                                 f"the option out")
            draws = resolution_draws(draws, resolutions, resolution_weights)
        plan = cls(ranges, batch_size, draws=draws, held_out=np.concatenate(excluded) if excluded else None, **kwargs)
        plan.resolutions = resolutions
        if len(caches) > 1:
            plan.labels = cache_labels([getattr(one, "location", str(one.root)) for one in caches])
        for b, stream in enumerate(plan.streams):
            record = caches[stream.cache].manifest.extra.get("sources", {}).get(stream.source, {})
            if record.get("is_reg"):
                plan.classes[plan.source_name(b)] = float(record.get("prior_loss_weight", 1.0))
        return plan

    def source_name(self, b: int) -> str:
        """How metrics name stream `b`'s source: its name, prefixed with its cache's when there are several."""
        stream = self.streams[b]
        return stream.source if self.labels is None else f"{self.labels[stream.cache]}/{stream.source}"

    def draws_by_source(self) -> dict[str, int]:
        """Samples each source gives an epoch (before a last batch is completed or dropped)."""
        out: dict[str, int] = defaultdict(int)
        for b, d in enumerate(self.draws):
            out[self.source_name(b)] += d
        return dict(out)

    def draws_by_resolution(self) -> dict[int, int]:
        """Samples each resolution gives an epoch, for caches built at several (else empty)."""
        out: dict[int, int] = defaultdict(int)
        for b, d in enumerate(self.draws):
            if self.resolutions is not None and self.resolutions[self.streams[b]] is not None:
                out[self.resolutions[self.streams[b]]] += d
        return dict(sorted(out.items()))

    def batches_per_epoch(self) -> int:
        return sum(self.counts)

    def fork(self) -> BatchPlan:
        """The same plan with its own memo of shuffles, for another thread (the shard tables are shared)."""
        twin = copy.copy(self)
        twin._epochs = OrderedDict()
        return twin

    # --- within a stream ---

    def _tag(self, b: int, p: int) -> tuple:
        """What sets stream `b`'s pass `p` apart in the seeds (nothing for the one pass of a one-source cache at its
        base resolution)."""
        stream = self.streams[b]
        return (() if self._single and p == 0 else (stream.source, stream.cache, p)) + self._resolution_tag(b)

    def _resolution_tag(self, b: int) -> tuple:
        """A stream of another resolution than the cache's base one seeds apart from one of its bucket at the base, and
        a clip bucket apart from the other frame counts of its size (an image stream's seeds are as they always were)."""
        stream = self.streams[b]
        return ((stream.resolution,) if stream.resolution else ()) + (("frames", stream.bucket.frames) if stream.bucket.frames else ())

    def _bucket_epoch(self, epoch: int, b: int, p: int) -> _BucketEpoch:
        """Stream `b`'s order in pass `p` of `epoch` (kept for the few most recent)."""
        key = (epoch, b, p)
        out = self._epochs.get(key)
        if out is None:
            bucket, sizes = self.buckets[b], self._sizes[b]
            order = torch.randperm(len(sizes), generator=seeded_generator(self.seed, epoch, bucket.height, bucket.width,
                                                                    *self._tag(b, p))).numpy()
            per_window = np.add.reduceat(sizes[order], np.arange(0, len(order), self.shuffle_shards))
            out = self._epochs[key] = _BucketEpoch(order, np.concatenate([[0], np.cumsum(per_window)]))
            if len(self._epochs) > 2 * len(self.streams) + 4:  # two epochs' worth at a hand-over
                self._epochs.popitem(last=False)
        else:
            self._epochs.move_to_end(key)
        return out

    def _window(self, epoch: int, b: int, p: int, w: int, be: _BucketEpoch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window `w` of stream `b`'s pass `p`: the permutation of its samples, its shards' first global indices
        and their cumulative sample counts (kept for the few most recent windows: a batch reads one or two)."""
        window = be.perms.get(w)
        if window is None:
            size = int(be.window_starts[w + 1] - be.window_starts[w])
            bucket = self.buckets[b]
            perm = torch.randperm(size, generator=seeded_generator(self.seed, epoch, bucket.height, bucket.width, w,
                                                             *self._tag(b, p))).numpy()
            shards = be.shard_order[w * self.shuffle_shards : (w + 1) * self.shuffle_shards]
            window = (perm, self._starts[b][shards], np.cumsum(self._sizes[b][shards]))
            be.perms[w] = window
            if len(be.perms) > 4:
                be.perms.popitem(last=False)
        else:
            be.perms.move_to_end(w)
        return window

    def _sample(self, epoch: int, b: int, q: int) -> tuple[int, int]:
        """Global index and pass of draw `q` of stream `b` in `epoch`: pass q // samples, position q % samples of
        that pass's order (draws past the epoch's, which complete a last batch, wrap to its first)."""
        p, q = divmod(q % self.draws[b], self.samples[b])
        be = self._bucket_epoch(epoch, b, p)
        w = int(np.searchsorted(be.window_starts, q, side="right")) - 1
        perm, starts, ends = self._window(epoch, b, p, w, be)
        o = int(perm[q - be.window_starts[w]])
        s = int(np.searchsorted(ends, o, side="right"))
        return self._trained(int(starts[s]), o - (int(ends[s - 1]) if s else 0)), p

    def _trained(self, start: int, r: int) -> int:
        """The global index of the `r`-th trained (not held-out) sample from index `start` on."""
        if not len(self._held):
            return start + r
        t = start - int(np.searchsorted(self._held, start)) + r  # trained samples before it, over all indices
        return t + int(np.searchsorted(self._held_before, t, side="right"))

    def global_batch(self, epoch: int, b: int, k: int) -> tuple[list[int], list[int] | None]:
        """The samples of stream `b`'s `k`-th global batch in `epoch`, and the pass that drew each (None when all
        come from the first: a sample drawn twice in an epoch gets other noise, caption and flip each time)."""
        g = self.global_size
        drawn = [self._sample(epoch, b, q) for q in range(k * g, (k + 1) * g)]
        passes = [p for _, p in drawn]
        return [i for i, _ in drawn], passes if any(passes) else None

    # --- across streams ---

    def _due(self, epoch: int, b: int, k: int) -> float:
        """When stream `b`'s batch `k` comes in the epoch, in [0, 1)."""
        bucket = self.buckets[b]
        who = () if self._single else (self.streams[b].source, self.streams[b].cache)
        u = derived_seed(self.seed, epoch, bucket.height, bucket.width, k, 7, *who, *self._resolution_tag(b)) / float(1 << 63)
        return (k + u) / self.counts[b]

    def _due_before(self, epoch: int, b: int, tau: float) -> int:
        """How many of bucket `b`'s batches are due before `tau` (their times increase with k)."""
        lo, hi = 0, self.counts[b]
        while lo < hi:
            mid = (lo + hi) // 2
            if self._due(epoch, b, mid) < tau:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _seek(self, epoch: int, start: int) -> list[int]:
        """Batches of each bucket among the epoch's first `start` (a bisection over time, not a replay)."""
        total = self.batches_per_epoch()
        if start <= 0:
            return [0] * len(self.buckets)
        if start >= total:
            return list(self.counts)
        lo, hi = 0.0, 1.0
        while True:
            mid = (lo + hi) / 2
            if not lo < mid < hi:
                break
            if sum(self._due_before(epoch, b, mid) for b in range(len(self.buckets))) <= start:
                lo = mid
            else:
                hi = mid
        done = [self._due_before(epoch, b, lo) for b in range(len(self.buckets))]
        for b in range(len(self.buckets)):  # batches due exactly at `lo` (a tie), in bucket order as the merge takes them
            while sum(done) < start and done[b] < self.counts[b] and self._due(epoch, b, done[b]) == lo:
                done[b] += 1
        return done

    def global_batches(self, epoch: int, start: int = 0) -> Iterator[PlannedBatch]:
        """The epoch's global batches from its `start`-th on."""
        done = self._seek(epoch, start)
        heap = [(self._due(epoch, b, k), b) for b, k in enumerate(done) if k < self.counts[b]]
        heapq.heapify(heap)
        cursor = start
        while heap:
            _, b = heapq.heappop(heap)
            k = done[b]
            done[b] += 1
            if done[b] < self.counts[b]:
                heapq.heappush(heap, (self._due(epoch, b, done[b]), b))
            indices, passes = self.global_batch(epoch, b, k)
            yield PlannedBatch(cursor, self.buckets[b], indices, self.source_name(b), passes)
            cursor += 1

    def batches(self, epoch: int, start: int = 0) -> Iterator[PlannedBatch]:
        """This rank's batches of `epoch` from its `start`-th on: slice `rank` of each global batch."""
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        for planned in self.global_batches(epoch, start):
            yield PlannedBatch(planned.cursor, planned.bucket, planned.indices[mine], planned.source,
                               planned.passes[mine] if planned.passes else None)

    def __call__(self, epoch: int, start: int = 0) -> list[list[int]]:
        """This rank's batches of `epoch` as lists of indices (for tests and small caches)."""
        return [p.indices for p in self.batches(epoch, start)]
