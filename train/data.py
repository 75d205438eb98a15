"""Streaming the cache: per-sample conditioning draws, collate, and the background threads that keep
batches ready ahead of the training step for the whole run.

The data order is `train.order.BatchPlan`'s. All randomness here is a pure function of (seed, epoch,
sample index), so a resumed run sees exactly the batches and draws an uninterrupted one would, whichever
thread built them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from shards import CONTROL_PREFIX, FLIP_PREFIX, MASK, Cache, DamagedCache, TextSpec, prompt_key
from shards.references import REFERENCE_FIELDS
from shards.references import unpack as unpack_references
from train.families import text_input
from train.families.base import LOSS_MASKS, ModelPreset
from train.order import BatchPlan, PlannedBatch, seeded_generator

log = logging.getLogger("train")
# an edit batch's reference latents: per sample, the list of its references' latents (C, h, w) (`Family.forward`)
REFERENCES = "references"


@dataclass(frozen=True)
class TextLayout:
    """How a cache's text fields (`shards.TextSpec`) become the transformer's text input: one caption of a sample,
    and a batch of captions collated, as the family that reads the layout defines them (`Family.text`)."""

    spec: TextSpec = TextSpec("masked", None, 0)

    @classmethod
    def of(cls, cache: Cache) -> TextLayout:
        return cls(cache.spec.text)

    @property
    def kind(self) -> str:
        return self.spec.layout

    def captions(self, fields: dict) -> int:
        """How many captions a sample's fields hold (a cached prompt holds one)."""
        return text_input(self.kind).captions(fields)

    def caption(self, fields: dict, pick: int = 0) -> dict[str, torch.Tensor]:
        """Caption `pick` of a sample's or a cached prompt's fields."""
        return text_input(self.kind).caption(self.spec, fields, pick)

    def collate(self, conds: list[dict[str, torch.Tensor]]) -> dict:
        """Per-caption conditioning -> the batch's (`text` padded to the longest caption (B, L, D), `text_mask` (B, L),
        and the layout's other fields)."""
        return text_input(self.kind).collate(self.spec, conds)


class TrainingSamples(torch.utils.data.Dataset):
    """Cache samples made ready for the model, indexed by (epoch, global index).

    Reads one cache generation: the given `Cache`'s, or the newest of a cache directory. With `check_digests`,
    every sample is checked against its stored digest (`shards.CorruptSample` names the shard). Per sample and epoch: a fresh latent from the cached
    posterior (mean + std * eps) where the cache stores one, one of the sample's captions, and caption dropout:
    to the cached empty-caption embedding (`null="empty"`) or to zeroed embeddings (`null="zeros"`), as the
    family was trained (`Family.null_caption`). With `control` (ControlNet training), also the control image's latent,
    drawn from its cached posterior like the image's, right after it (DC-AE's is taken as stored); a ControlNet
    sample is never the flipped view (its control latent is the unflipped image's). With `masked` (--masked-loss),
    also the sample's loss mask at latent resolution (`shards.MASK`; all 255 for a sample cached without one),
    mirrored with the flipped view; it takes no draw. A clip's latent keeps its frame axis, (C, T, h, w), and is drawn
    like an image's. `conditioning`: further per-sample fields the family's transformer takes
    (`Family.conditioning_fields`), stacked into the batch under their names in `conditioning_dtype` (the run's compute
    dtype); they take no draw.

    A cache whose samples have reference images (an edit model's, `shards.references`) gives each sample's references'
    latents, as stored (the posteriors' means: the pipelines encode a reference with argmax), under `references`: per
    sample the list of its (C, h, w) latents in `conditioning_dtype`, possibly empty (a text-to-image sample of a cache
    that has edit samples too); at most `max_references` each (the preset's `ModelPreset.references`; 0: any). They
    take no draw. A sample with references is never the flipped view: its references are the unflipped images, and an
    instruction may name a side ("the cup on the left"), which a mirrored target would contradict; the samples
    without references of such a cache flip as usual.
    """

    def __init__(self, cache: Cache | str | os.PathLike, seed: int, caption_dropout: float, null: str = "empty", *,
                 check_digests: bool = True, offset: int = 0, control: bool = False, masked: bool = False,
                 conditioning: tuple[str, ...] = (), conditioning_dtype: torch.dtype = torch.float32,
                 max_references: int = 0):
        if not isinstance(cache, Cache):
            cache = Cache(cache)
        cache.check_digests = check_digests
        self.cache, self.seed, self.caption_dropout = cache, seed, caption_dropout
        self.offset = offset  # the number of this cache's first sample among a run's several (its draws' seeds)
        self.layout = TextLayout.of(cache)
        self.posterior = cache.spec.latent.posterior == "mean_std"  # a KL VAE's: sample a latent per draw
        self.control = control
        if control and cache.spec.control is None:
            raise ValueError(f"{cache.location} holds no control latents; build the cache with stage one's --control")
        if masked:
            check_masks(cache)
        self.masked = masked
        check_conditioning(cache, conditioning)
        self.conditioning, self.conditioning_dtype = tuple(conditioning), conditioning_dtype
        self.references, self.max_references = has_references(cache), max_references
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

    def __getitem__(self, item: tuple[int, ...]) -> dict:
        """Draw (epoch, index) or (epoch, index, pass): a sample drawn again in an epoch (repeats) draws anew."""
        epoch, i, *rest = item
        s = self.cache.read(i, resolve=False)  # texts stored once: each caption's row as it is, no copy
        g = seeded_generator(self.seed, epoch, self.offset + i, *(rest if rest and rest[0] else ()))
        # a source cached with flipped latents (`flip = true`): the flipped view, one draw in two
        flipped = s.fields.get(FLIP_PREFIX + ("latent_mean" if self.posterior else "latent"))
        references = self._references(s) if self.references else None
        flippable = flipped is not None and len(flipped) and not self.control and not references
        view = FLIP_PREFIX if flippable and float(torch.rand((), generator=g)) < 0.5 else ""
        latent = self._draw(s, view, g)
        control = self._draw(s, CONTROL_PREFIX, g) if self.control else None
        pick = int(torch.randint(len(s.texts) if s.texts is not None else self.layout.captions(s.fields), (1,), generator=g))
        cond = self.layout.caption(s.texts[pick]) if s.texts is not None else self.layout.caption(s.fields, pick)
        if self.caption_dropout and float(torch.rand((), generator=g)) < self.caption_dropout:
            cond = self.null
        # text stays in its storage dtype (bf16 by default) until the device: half the bytes to copy
        item = {"key": s.key, "bucket": s.bucket, "latent": latent, "cond": cond}
        if self.masked:
            item["mask"] = sample_mask(s.fields, latent.shape[-2:], flipped=view == FLIP_PREFIX)
        if self.conditioning:
            item["conditioning"] = {name: s[name] for name in self.conditioning}
        if references is not None:
            item[REFERENCES] = references
        return {**item, "control": control} if self.control else item

    def _references(self, s) -> list[torch.Tensor]:
        """A sample's reference latents (C, h, w) each, as stored."""
        refs = unpack_references(s.fields)
        if self.max_references and len(refs) > self.max_references:
            raise ValueError(f"sample {s.key} of {self.cache.location} has {len(refs)} reference images; the model takes at "
                             f"most {self.max_references}. Build the cache for this model's preset (stage one counts such "
                             f"samples as too_many_references)")
        return refs

    def _draw(self, s, prefix: str, g: torch.Generator) -> torch.Tensor:
        """The latent in fields `prefix` + the latent fields' names: a draw from the cached posterior
        (mean + std * eps), or as stored (DC-AE). (C, h, w), or (C, T, h, w) for a clip"""
        dims = 4 if s.bucket.frames else 3  # a clip's latent has its frame axis, a one-frame clip's too
        if self.posterior:
            mean, std = s[prefix + "latent_mean"].float(), s[prefix + "latent_std"].float()
            shape = mean.shape[-dims:]
            return mean.reshape(shape) + std.reshape(shape) * torch.randn(shape, generator=g)
        return s[prefix + "latent"].float().reshape(s[prefix + "latent"].shape[-dims:])

    def collate(self, samples: list[dict]) -> dict:
        """Stack latents (B, C, h, w) (a clip's (B, C, T, h, w)) and control latents as `control` (B, C, h, w); the
        conditioning fields under their names (B, ...) in the compute dtype; the text as `TextLayout.collate` builds it;
        an edit cache's references as `references`, B lists of (C, h, w) latents in the compute dtype (not stacked: a
        reference has the size its pipeline prepares it at, not the bucket's); with loss masks, `mask` (B, 1, h, w) and
        the same masks left in host memory (`LOSS_MASKS`, a list: the device copy leaves it), which token routing counts
        on without waiting for the device."""
        return {
            "latents": torch.stack([s["latent"] for s in samples]),
            **({"control": torch.stack([s["control"] for s in samples])} if "control" in samples[0] else {}),
            **({"mask": torch.stack([s["mask"] for s in samples]), LOSS_MASKS: [s["mask"] for s in samples]}
               if "mask" in samples[0] else {}),
            **{name: torch.stack([s["conditioning"][name] for s in samples]).to(self.conditioning_dtype)
               for name in self.conditioning},
            **({REFERENCES: [[r.to(self.conditioning_dtype) for r in s[REFERENCES]] for s in samples]}
               if REFERENCES in samples[0] else {}),
            **self.layout.collate([s["cond"] for s in samples]),
            "bucket": tuple(samples[0]["bucket"]),
            "keys": [s["key"] for s in samples],
        }

    def batch(self, epoch: int, indices: list[int], passes: list[int] | None = None) -> dict:
        """The collated batch of these samples in `epoch` (drawn in these passes over their stream)."""
        return self.collate([self[(epoch, i, p)] for i, p in zip(indices, passes or [0] * len(indices))])

    def shards_of(self, indices: list[int]) -> list[tuple[Cache, int]]:
        """(cache, shard) of every shard these samples lie in, in shard order: what the read-ahead reads."""
        return [(self.cache, j) for j in sorted({self.cache.locate(i)[0] for i in indices})]


def sample_mask(fields: dict, size: tuple[int, int], flipped: bool = False) -> torch.Tensor:
    """A sample's loss mask (1, h, w) uint8 (255: keep) from its fields, mirrored for the flipped view; all 255 for a
    sample cached without one (every element counts)."""
    m = fields.get(MASK)
    if m is None or not len(m):
        return torch.full((1, *size), 255, dtype=torch.uint8)
    m = m.reshape(1, *size)
    return m.flip(-1) if flipped else m


def check_conditioning(cache: Cache, names: tuple[str, ...]) -> None:
    """Refuse a cache without the conditioning fields the model takes (`Family.conditioning_fields`), naming them."""
    missing = [name for name in names if name not in cache.schema]
    if missing:
        raise ValueError(f"{cache.location} holds no {', '.join(missing)} field(s), which this model takes beside the "
                         f"latents; build the cache for this model's preset with stage one (python -m precompute DATA "
                         f"--model PRESET --cache DIR)")


def has_references(cache: Cache) -> bool:
    """Whether the cache's samples have reference images' latents (`shards.references`: an edit model's cache)."""
    return all(name in cache.schema for name in REFERENCE_FIELDS)


def check_references(cache: Cache, preset: ModelPreset) -> None:
    """Refuse, before any weights load, an edit preset (`ModelPreset.references` > 0) on a cache without reference
    images and a preset that takes none on an edit cache, naming the cache, the preset and what to do."""
    edit = has_references(cache)
    if preset.references and not edit:
        raise ValueError(
            f"{cache.location} holds no reference images (no {' / '.join(REFERENCE_FIELDS)} fields), and {preset.name} is "
            f"an edit model: each sample is a target image, its caption (the instruction) and up to {preset.references} "
            f"reference image(s). Build an edit cache for it with stage one: python -m precompute DATA --model "
            f"{preset.name} --cache {cache.root}-{preset.name} --references (each image x.png with its reference x.ref.png "
            f"beside it, or a source's reference_folder / reference_column in the dataset file); or train a text-to-image "
            f"preset on this cache" + (f" (it was built for {cache.spec.preset})" if cache.spec.preset else ""))
    if edit and not preset.references:
        built = cache.spec.preset
        raise ValueError(
            f"{cache.location} is an edit cache (its samples have reference images' latents{', built for ' + built if built else ''}) "
            f"and {preset.name} takes no reference images: train an edit preset on it"
            + (f" (--model {built})" if built else "")
            + f", or build a cache without references for {preset.name}: python -m precompute DATA --model {preset.name} "
              f"--cache {cache.root}-{preset.name} (without --references)")
    if edit and any(
            isinstance(r, dict) and r.get("flip") for r in (cache.manifest.extra.get("sources") or {}).values()):
        log.info("%s: samples with reference images train unflipped (their references are the unflipped images); those "
                 "without references take their flipped view as cached", cache.location)


def check_masks(cache: Cache) -> None:
    """Refuse --masked-loss on a cache without loss masks (none of its sources was cached with them), naming the fix."""
    if cache.spec.latent.temporal_downsample:
        raise ValueError(f"--masked-loss: {cache.location} holds clips, and loss masks are cached for images only; train "
                         f"without --masked-loss")
    sources = (cache.manifest.extra.get("sources") or {}).values()
    if MASK in cache.schema and any(isinstance(r, dict) and r.get("masks") for r in sources):
        return
    raise ValueError(f"--masked-loss: {cache.location} holds no loss masks (no source of it was cached with masks); "
                     f"build it with stage one's --masks (x.mask.png beside each image, a mask_file_name column, a "
                     f"KEY.mask.png tar member, a mask column, a source's mask = \"DIR\") or --alpha-mask, or train "
                     f"without --masked-loss")


class CacheSamples:
    """The samples of a run's several caches, numbered one after the other (the data order's global indices);
    a batch comes from one of them. Each cache's `TrainingSamples` draws with seeds of the global index."""

    def __init__(self, parts: list[TrainingSamples]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p.cache) for p in parts])
        self.cache = parts[0].cache  # the first: its prompts validate the run

    def _part(self, i: int) -> int:
        return int(np.searchsorted(self.starts, i, side="right")) - 1

    def batch(self, epoch: int, indices: list[int], passes: list[int] | None = None) -> dict:
        k = self._part(indices[0])
        if any(self._part(i) != k for i in indices):
            raise ValueError("a batch mixes samples of two caches; the data order never plans one")
        return self.parts[k].batch(epoch, [i - int(self.starts[k]) for i in indices], passes)

    def shards_of(self, indices: list[int]) -> list[tuple[Cache, int]]:
        k = self._part(indices[0])
        return self.parts[k].shards_of([i - int(self.starts[k]) for i in indices])


@dataclass
class Epoch:
    """What the stream reads in one epoch: its order and its samples (one cache generation), from batch
    `start` on (a resumed epoch starts past 0); or the `error` that opening its generation raised."""

    number: int
    plan: BatchPlan | None
    samples: TrainingSamples | None
    start: int = 0
    error: BaseException | None = None


class _Failed:
    """A batch that could not be built: its error is raised where the training loop takes it."""

    def __init__(self, error: BaseException, epoch: int, cursor: int):
        self.error, self.epoch, self.cursor = error, epoch, cursor


class BatchStream:
    """The run's batches in step order, built ahead of the training step by background threads.

    `workers` threads build batches (read the samples out of the memory-mapped shards, draw latents and
    captions, collate, pin for a CUDA copy) into queues of `prefetch` batches in all, batch k by thread
    k mod workers, taken back in order. One more thread reads ahead: it walks the data order up to
    `readahead` batches past the step and reads every shard those batches touch, and the text shards their samples
    refer to in a cache that stores each text once, whole and sequentially (a remote cache downloads it first), so
    the builders find their samples in memory. The threads live
    for the whole run: `add_epoch` hands them the next epoch before the current one ends (`needs_epoch`
    says when: at the same batch on every rank). With `workers=0` each batch is built in the training
    thread when it is taken: the same batches, synchronously, nothing read ahead.

    A batch is `TrainingSamples.collate`'s dict plus `epoch` and `cursor` (batches of that epoch done once
    it is taken). A damaged sample or cache file raises its `DamagedCache` where its batch is taken; any other failure of
    a builder raises a RuntimeError there naming the batch, with the cause chained.

    Threads rather than DataLoader worker processes: building a batch is copies out of memory-mapped
    files and tensor ops, which release the GIL; handing a batch over from another process costs shared
    memory, pickling and page faults in the receiver on top (bench/data_path.py measures both).
    """

    def __init__(self, first: Epoch, *, workers: int = 1, prefetch: int = 4, readahead: int = 64, pin: bool = False):
        self.workers, self.readahead, self.pin = workers, readahead, pin
        self.lead = prefetch + 1  # batches before an epoch's end at which the next one is handed over
        self._epochs = [first]
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.taken = 0  # batches taken since the stream started
        self.position = (first.number, first.start)  # (epoch, cursor) of the last batch taken
        self.wait_s = 0.0  # time the training thread waited for batches
        self.read_ahead = {"shards": 0, "bytes": 0, "failed": 0}
        self._threads: list[threading.Thread] = []
        self._sync = self._items(wait=False) if workers == 0 else None
        self._queues = [queue.Queue(maxsize=max(1, -(-prefetch // workers))) for _ in range(workers)]
        for w in range(workers):
            self._threads.append(threading.Thread(target=self._build_loop, args=(w,), name=f"batches-{w}", daemon=True))
        if workers and readahead:
            self._threads.append(threading.Thread(target=self._read_ahead, name="readahead", daemon=True))
        for t in self._threads:
            t.start()

    # --- the training thread's side ---

    def needs_epoch(self) -> bool:
        """Whether the next epoch should be handed over now (`add_epoch`)."""
        last = self._epochs[-1]
        epoch, cursor = self.position
        return last.error is None and epoch == last.number and cursor >= last.plan.batches_per_epoch() - self.lead

    def add_epoch(self, epoch: Epoch) -> None:
        with self._changed:
            self._epochs.append(epoch)
            self._changed.notify_all()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        try:
            if self._sync is not None:
                item = next(self._sync)
                item = item if isinstance(item, _Failed) else self._build(*item)
            else:
                item = self._take()
        finally:
            self.wait_s += time.perf_counter() - t0
        if isinstance(item, _Failed):
            self.close()
            if isinstance(item.error, DamagedCache):  # the message names the file and its repair
                raise item.error
            raise RuntimeError(f"the data reader failed on batch {item.cursor} of epoch {item.epoch}: "
                               f"{type(item.error).__name__}: {item.error}") from item.error
        self.taken += 1
        self.position = (item["epoch"], item["cursor"])
        if self.readahead:
            with self._changed:
                self._changed.notify_all()  # the read-ahead may go one batch further
        return item

    def _take(self):
        q = self._queues[self.taken % self.workers]
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if not self._threads[self.taken % self.workers].is_alive():
                    raise RuntimeError("a data reader thread stopped without a batch or an error") from None

    def close(self) -> None:
        """Stop the threads (each finishes the batch it is building)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        for q in self._queues:
            while not q.empty():  # unblock a builder waiting to put
                q.get_nowait()
        for t in self._threads:
            t.join(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the background threads ---

    def _items(self, wait: bool = True) -> Iterator:
        """Every batch of the run in order, as (epoch, planned batch), or a `_Failed` epoch; each caller walks
        its own copy of the order."""
        index = 0
        while not self._stop.is_set():
            with self._changed:
                while index >= len(self._epochs) and not self._stop.is_set():
                    if not wait:
                        raise RuntimeError("the next epoch was not handed over before the last one ended")
                    self._changed.wait()
                if self._stop.is_set():
                    return
                epoch = self._epochs[index]
            if epoch.error is not None:
                yield _Failed(epoch.error, epoch.number, 0)
                return
            for planned in epoch.plan.fork().batches(epoch.number, epoch.start):
                yield epoch, planned
            index += 1

    def _build(self, epoch: Epoch, planned: PlannedBatch):
        try:
            batch = epoch.samples.batch(epoch.number, planned.indices, planned.passes)
        except Exception as e:  # noqa: BLE001 (raised in the training thread, where the batch is taken)
            return _Failed(e, epoch.number, planned.cursor)
        if self.pin:
            batch = map_tensors(batch, torch.Tensor.pin_memory)
        batch.update(epoch=epoch.number, cursor=planned.cursor + 1, source=planned.source)
        if planned.source in epoch.plan.classes:  # a class source's batch: its loss is weighted (`TrainStep`)
            batch["prior_loss_weight"] = epoch.plan.classes[planned.source]
        return batch

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False

    def _build_loop(self, w: int) -> None:
        for k, item in enumerate(self._items()):
            if k % self.workers != w:
                continue
            out = item if isinstance(item, _Failed) else self._build(*item)
            if not self._put(self._queues[w], out) or isinstance(out, _Failed):
                return

    def _read_ahead(self) -> None:
        """Read the shards of the batches ahead, whole, in the order they will be needed."""
        recent: OrderedDict = OrderedDict()  # shards read lately: not read again while their window lasts
        buffer = bytearray(8 << 20)
        for k, item in enumerate(self._items()):
            if isinstance(item, _Failed):
                return
            with self._changed:
                while k >= self.taken + self.readahead and not self._stop.is_set():
                    self._changed.wait()
            if self._stop.is_set():
                return
            epoch, planned = item
            for cache, j in epoch.samples.shards_of(planned.indices):
                self._read_one(recent, buffer, (cache.root, cache.generation, j), cache.fetch, j)
                try:  # the text shards its samples refer to (a cache that stores each text once)
                    texts = cache.text_shards_of(j)
                except Exception as e:  # noqa: BLE001 (the builder reads the shard itself and reports what fails)
                    texts = []
                    log.debug("read-ahead of the texts of shard %d of %s failed: %s", j, cache.root, e)
                for t in texts:
                    self._read_one(recent, buffer, (cache.root, cache.generation, "texts", t), cache.fetch_text, t)

    def _read_one(self, recent: OrderedDict, buffer: bytearray, key: tuple, fetch, j: int) -> None:
        """Read one shard (or text shard) whole unless it was read lately."""
        if key in recent:
            recent.move_to_end(key)
            return
        recent[key] = True
        if len(recent) > 4096:
            recent.popitem(last=False)
        try:
            self.read_ahead["bytes"] += read_whole(fetch(j), buffer)
            self.read_ahead["shards"] += 1
        except Exception as e:  # noqa: BLE001 (the builder reads the shard itself and reports what fails)
            self.read_ahead["failed"] += 1
            log.debug("read-ahead of shard %d of %s failed: %s", j, key[0], e)


def map_tensors(batch: dict, fn) -> dict:
    """The batch with `fn` applied to each of its tensors: the tensor entries and each sample's `references`."""
    out = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[name] = fn(value)
        elif name == REFERENCES:
            out[name] = [[fn(r) for r in refs] for refs in value]
        else:
            out[name] = value
    return out


def batch_tensors(batch: dict) -> Iterator[torch.Tensor]:
    """Every tensor of a batch: its tensor entries and each sample's `references`."""
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            yield value
        elif name == REFERENCES:
            yield from (r for refs in value for r in refs)


def to_device(batch: dict, device: torch.device | str) -> dict:
    """A batch's tensors on `device` (asynchronous copies from pinned memory), references included."""
    return map_tensors(batch, lambda v: v.to(device, non_blocking=True))


def read_whole(path: os.PathLike, buffer: bytearray) -> int:
    """Read a file sequentially in large chunks (into the page cache; the bytes are dropped); returns its size."""
    view, total = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(view):
            total += n
    return total
