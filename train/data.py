"""Streaming the cache: a bucket batch sampler, per-sample conditioning draws, collate and prefetch.

All randomness here is a pure function of (seed, epoch, sample index), so a resumed run sees exactly
the batches and draws an uninterrupted one would, whichever worker produced them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from shards import Bucket, Cache, TextSpec, prompt_key

BATCH_SAMPLER_VERSION = 2


def derived_seed(*parts: int) -> int:
    """A 63-bit seed determined by `parts` alone (no hidden RNG state to save and restore)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(*parts: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator seeded by `parts`, on `device` when that is an accelerator (so draws happen there)."""
    device = torch.device(device or "cpu")
    where = device if device.type not in ("cpu", "meta") else "cpu"
    return torch.Generator(where).manual_seed(derived_seed(*parts))


@dataclass
class BucketBatchSampler:
    """Batches of global sample indices, every batch from one bucket (one shape, no padded images).

    The epoch's list of global batches (`batch_size * world_size` samples of one bucket each) is the same
    on every rank, a function of seed and epoch alone; rank r takes slice r of each. So every rank gets
    the same number of batches of the same shape at every step (no collective waits on a rank that ran
    out or on a larger bucket), and N ranks see exactly the samples one process with the global batch
    would. With `remainder="repeat"` (default) each bucket's last global batch is completed with other
    samples of that bucket, so every sample is used every epoch; `"drop"` drops it instead.

    Args:
        ranges: global index ranges per bucket (`Cache.ranges_by_bucket()`).
        batch_size: samples per batch on each rank.
        seed, rank, world_size: the run's.
        remainder: "repeat" or "drop".
    """

    ranges: dict[Bucket, list[range]]
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    remainder: str = "repeat"

    def __post_init__(self) -> None:
        if self.remainder not in ("repeat", "drop"):
            raise ValueError(f"remainder {self.remainder!r}: choose repeat or drop")
        if self.batch_size < 1:
            raise ValueError("batch size must be at least 1")

    def global_batches(self, epoch: int) -> list[tuple[Bucket, list[int]]]:
        g = _generator(self.seed, epoch)
        size = self.batch_size * self.world_size
        batches = []
        for bucket, ranges in sorted(self.ranges.items()):
            idx = torch.tensor([i for r in ranges for i in r], dtype=torch.int64)
            idx = idx[torch.randperm(len(idx), generator=g)].tolist()
            full = len(idx) // size * size
            rest = idx[full:]
            for k in range(0, full, size):
                batches.append((bucket, idx[k : k + size]))
            if rest and self.remainder == "repeat":
                fill = (idx * (size // len(idx) + 1))[: size - len(rest)]
                batches.append((bucket, rest + fill))
        order = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in order]

    def __call__(self, epoch: int, start: int = 0) -> list[list[int]]:
        """This rank's batches of `epoch`, from its `start`-th on (a resume jumps there in O(1) reads)."""
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return [b[mine] for _, b in self.global_batches(epoch)[start:]]

    def batches_per_epoch(self) -> int:
        return len(self.global_batches(0))


@dataclass(frozen=True)
class TextLayout:
    """How a cache's text fields (`shards.TextSpec`: "masked" or "sd3_joint") become the transformer's text input:
    one caption of a sample, and a batch of captions collated."""

    spec: TextSpec = TextSpec("masked", None, 0)

    @classmethod
    def of(cls, cache: Cache) -> "TextLayout":
        return cls(cache.spec.text)

    @property
    def kind(self) -> str:
        return self.spec.layout

    @staticmethod
    def captions(fields: dict) -> int:
        """How many captions a sample's fields hold (a cached prompt holds one)."""
        return len(fields["text_lengths"]) if "text_lengths" in fields else 1

    def caption(self, fields: dict, pick: int = 0) -> dict[str, torch.Tensor]:
        """Caption `pick` of a sample's or a cached prompt's fields."""
        out = {}
        if "text" in fields:
            lengths = fields["text_lengths"].tolist() if "text_lengths" in fields else [len(fields["text"])]
            start = sum(lengths[:pick])
            out["text"] = fields["text"][start : start + lengths[pick]]
        if self.kind == "sd3_joint":
            tokens = fields["clip"].shape[0] // self.captions(fields)
            out["clip"] = fields["clip"][pick * tokens : (pick + 1) * tokens]
            out["pooled"] = fields["pooled"][pick]
        return out

    def collate(self, conds: list[dict[str, torch.Tensor]]) -> dict:
        """Per-caption conditioning -> the batch's: `text` padded to the longest caption (B, L, D) with
        `text_mask` (B, L); for SD3 also `clip` (B, 77, D_clip), `pooled` (B, D_pooled), `t5_zeros`."""
        out: dict = {}
        if "text" in conds[0]:
            longest = max(c["text"].shape[0] for c in conds)
            text = torch.zeros(len(conds), longest, conds[0]["text"].shape[1], dtype=conds[0]["text"].dtype)
            mask = torch.zeros(len(conds), longest, dtype=torch.bool)
            for j, c in enumerate(conds):
                n = c["text"].shape[0]
                text[j, :n], mask[j, :n] = c["text"], True
            out.update(text=text, text_mask=mask)
        if self.kind == "sd3_joint":
            out.update(clip=torch.stack([c["clip"] for c in conds]), pooled=torch.stack([c["pooled"] for c in conds]),
                       t5_zeros=self.spec.t5_zeros)
        return out


class TrainingSamples(torch.utils.data.Dataset):
    """Cache samples made ready for the model, indexed by (epoch, global index).

    Reads one cache generation: the given `Cache`'s (read in this process; DataLoader workers reopen that
    generation), or the newest of a cache directory. With `check_digests`, every sample is checked against its
    stored digest (`shards.CorruptSample` names the shard). Per sample and epoch: a fresh latent from the cached
    posterior (mean + std * eps) where the cache stores one, one of the sample's captions, and caption dropout:
    to the cached empty-caption embedding (`null="empty"`, PixArt and Sana) or to zeroed embeddings
    (`null="zeros"`, SD3's convention).
    """

    def __init__(self, cache: Cache | str | os.PathLike, seed: int, caption_dropout: float, null: str = "empty", *,
                 check_digests: bool = True):
        if not isinstance(cache, Cache):
            cache = Cache(cache)
        cache.check_digests = check_digests
        self.seed, self.caption_dropout, self.check_digests = seed, caption_dropout, check_digests
        self.cache_dir, self.generation = cache.root, cache.generation  # what every worker reads
        self._cache: Cache | None = cache
        self.layout = TextLayout.of(cache)
        self.posterior = cache.spec.latent.posterior == "mean_std"  # a KL VAE's: sample a latent per draw
        if null not in ("empty", "zeros"):
            raise ValueError(f"caption dropout embedding {null!r}: choose empty or zeros")
        self.null = None
        if caption_dropout > 0:
            stored = cache.prompts().get(prompt_key(""))
            if stored is None:
                raise ValueError(f"{cache.root} holds no empty-caption embedding; re-run `make precompute` on it (only what is missing is encoded)")
            self.null = self.layout.caption(stored.fields)
            if null == "zeros":
                self.null = {k: torch.zeros_like(v) for k, v in self.null.items()}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": None}  # a worker maps the shards itself

    @property
    def cache(self) -> Cache:
        if self._cache is None:  # opened lazily, in each worker
            self._cache = Cache(self.cache_dir, self.generation, check_digests=self.check_digests)
        return self._cache

    def __getitem__(self, item: tuple[int, int]) -> dict:
        epoch, i = item
        s = self.cache[i]
        g = _generator(self.seed, epoch, i)
        if self.posterior:
            mean, std = s["latent_mean"].float(), s["latent_std"].float()
            latent = mean + std * torch.randn(mean.shape, generator=g)
        else:
            latent = s["latent"].float()
        pick = int(torch.randint(self.layout.captions(s.fields), (1,), generator=g))
        cond = self.layout.caption(s.fields, pick)
        if self.caption_dropout and float(torch.rand((), generator=g)) < self.caption_dropout:
            cond = self.null
        # text stays in its storage dtype (bf16 by default) until the device: half the bytes to copy
        return {"key": s.key, "bucket": s.bucket, "latent": latent, "cond": cond}

    def collate(self, samples: list[dict]) -> dict:
        """Stack latents (B, C, h, w); the text as `TextLayout.collate` builds it."""
        return {
            "latents": torch.stack([s["latent"] for s in samples]),
            **self.layout.collate([s["cond"] for s in samples]),
            "bucket": tuple(samples[0]["bucket"]),
            "keys": [s["key"] for s in samples],
        }


class EpochBatches(torch.utils.data.Sampler):
    """Feeds (epoch, index) batches to the DataLoader."""

    def __init__(self, batches: list[list[int]], epoch: int):
        self.batches, self.epoch = batches, epoch

    def __iter__(self):
        return iter([[(self.epoch, i) for i in b] for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def epoch_loader(dataset: TrainingSamples, batches: list[list[int]], epoch: int, workers: int, device: torch.device):
    """The batches of one epoch, collated, from `workers` DataLoader processes or (0) the training process.

    With memory-mapped shards a batch is a few small copies: reading it in the training process costs
    less than handing it over from a worker (shared memory, pickling, page faults in the receiver), and
    on CUDA it overlaps the device's queued work anyway. A read-ahead thread measured slower on CPU: it
    competes for the GIL with the step's Python.
    """
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=EpochBatches(batches, epoch), collate_fn=dataset.collate, num_workers=workers,
        pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None,
    )


class Prefetcher:
    """Copies batch k+1 to the device on a side CUDA stream while step k runs; a plain iterator on CPU.

    Also measures the time the training loop waits for data.
    """

    def __init__(self, loader, device: torch.device):
        self.loader, self.device = iter(loader), device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.wait_s = 0.0
        self._next = None
        self._started = False  # the first batch is read at the first `next`, where the loop handles read errors

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _load(self):
        import time

        t0 = time.perf_counter()
        batch = next(self.loader, None)
        self.wait_s += time.perf_counter() - t0
        if batch is None or self.stream is None:
            return batch
        with torch.cuda.stream(self.stream):
            return self._to_device(batch)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        import time

        if not self._started:
            self._started = True
            self._next = self._load()
        batch = self._next
        if batch is None:
            raise StopIteration
        if self.stream is not None:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            for v in batch.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(torch.cuda.current_stream(self.device))
            self.wait_s += time.perf_counter() - t0
        self._next = self._load()
        return batch if self.stream is not None else self._to_device(batch)
