"""Stage one's pass over a rank's inputs: each decoded input is sorted (failed, duplicate, unchanged, to encode),
batched per bucket, encoded, checked and written; what the pass found is tallied for the run's summary. A changed
input whose image did not change (only its loss mask or captions did) takes its old sample's latent fields instead
of the VAE's (`CachedLatents`).

Three threads overlap so that the encoders never wait on the pass's own work: the pass's thread sorts and batches
the decoded inputs (decoded in the loader's worker processes) and checks what was encoded, the encoder's thread runs
the encoders on ready batches, the writer's thread writes the samples (`precompute.background`). A bounded queue
stands between each two; a failure in any stage stops the pass and is raised on the pass's thread.

An edit preset's samples carry their reference images, each prepared at its own size (`Family.prepare_reference`):
they are encoded in groups of one size and stored as the sample's reference fields (`shards.references`). Where the
text encoder sees them too (`Family.text_takes_references`), each caption is encoded with its sample's references
and its text is keyed by caption and references (`shards.texts.text_key`), so a caption of two samples with other
references is two texts."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from precompute.background import BackgroundCalls, BackgroundWrites, held_bytes
from precompute.clips import CLIP
from precompute.encode import Encoders, TextBatch
from precompute.progress import PlainProgress
from precompute.tally import CachedLatents, Tally
from shards import CONTROL_PREFIX, FLIP_PREFIX, LATENT_KEY, MASK, ShardWriter
from shards.encode import finite
from shards.references import REFERENCE_LATENT, pack
from shards.texts import TEXT_KEYS, key_rows, text_key

# Batches handed to the encoder's thread and not yet finished: the one it encodes and the next, ready. While it
# encodes one, the pass finishes the one before and prepares the one after; more ahead would only hold memory.
IN_FLIGHT = 2
IN_FLIGHT_BYTES = 2 << 30  # their pixels' bytes (a batch larger than this is encoded alone)
# Texts taken for encoding remembered past the writer taking them (then `has_text` finds them): a bound, not a count
QUEUED_TEXTS = 1 << 16


@dataclass
class Batch:
    """One bucket's batch on its way through the pass: prepared on the pass's thread (`EncodingPass.prepare`),
    encoded on the encoder's (`encode`), finished on the pass's (`finish`).

    Args:
        items: the batch's decoded inputs, in the order taken.
        reused: per item, its latent fields copied from the cache (`EncodingPass.reusable`), or None: encoded.
    """

    items: list[dict]
    reused: list[dict | None]
    video: bool = False  # clips: `Encoders.encode_videos`
    pixels: torch.Tensor | None = None  # (B, 3, H, W) or (B, 3, F, H, W) uint8 of the items to encode
    flips: list[int] = field(default_factory=list)  # of those, the ones with a flipped view
    mirrored_pixels: torch.Tensor | None = None  # their flipped images
    control_pixels: torch.Tensor | None = None  # (B, 3, H, W) control images
    reference_groups: list[tuple[list[tuple[int, int]], torch.Tensor]] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)  # every caption of the batch (`caption_inputs`)
    contexts: list[bytes] = field(default_factory=list)
    keys: list[str] | None = None  # their text keys, in a cache that stores each text once
    encode_texts: list[int] = field(default_factory=list)  # the captions to encode, by index
    text_references: list[list[torch.Tensor]] | None = None  # each of those's references, for a text encoder that sees them
    # the encoders' outputs: latent fields in the storage dtype on the host; per text-encoder call its `TextBatch`
    latents: dict[str, torch.Tensor] | None = None
    mirrored: dict[str, torch.Tensor] | None = None
    controls: dict[str, torch.Tensor] | None = None
    reference_latents: list[tuple[list[tuple[int, int]], torch.Tensor]] = field(default_factory=list)
    texts: list[TextBatch] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """The host memory its pixels hold until encoded."""
        pixels = [self.pixels, self.mirrored_pixels, self.control_pixels, *(x for _, x in self.reference_groups)]
        return sum(t.nbytes for t in pixels if t is not None)


@dataclass
class EncodingPass:
    """One rank's pass: `run(batches)` reads every decoded input, encodes the ones to write in batches of one
    bucket, and writes them (or keeps them in `tally.repaired`, repairing). While it runs, the writer is written to
    only from the background thread of `BackgroundWrites`; when it returns, every write is done.

    Args:
        enc: the encoders.
        writer: the rank's shard writer (written to on the pass's background thread; this thread only asks it
            `has_text`, a lookup).
        schema: the cache's fields (a cache without flipped latents has none to fill).
        storage: the stored dtype.
        batch_size: images per encoder batch; text_batch_size: captions per text-encoder batch.
        control: the inputs carry control images, encoded like their images.
        previous: per source, the sample index of its samples cached before this run (`shards.sample_index.SampleIndex`).
        stamps: per source and resolution (`ShardEntry.resolution`), input -> (key, stamp) cached (empty when repairing).
        needed: repairing: the keys of the damaged shards' samples (None: not repairing).
        cached: the latent fields cached before this run, for changed inputs whose image did not change (None: encode
            every image).
        rebuild_texts: repairing: text keys of damaged text shards to encode again from their samples' inputs (texts
            seen with reference images), kept in `tally.repaired_texts`.
        texts_only: repairing: keys of samples read for their texts alone (their own shard is intact).
        overlap: the encoders run on a thread of their own, while this one sorts, batches and finishes batches
            (False: one after the other on this thread, the same batches and writes in the same order).
    """

    enc: Encoders
    writer: ShardWriter
    schema: dict
    storage: torch.dtype
    batch_size: int
    text_batch_size: int
    control: bool
    previous: dict
    stamps: dict[str, dict]
    needed: set[str] | None
    tally: Tally
    cached: CachedLatents | None = None
    rebuild_texts: set[str] = field(default_factory=set)
    texts_only: set[str] = field(default_factory=set)
    overlap: bool = True

    def __post_init__(self) -> None:
        self.flipped_fields = [name for name in self.enc.latent_spec().flipped_fields if name in self.schema]
        self.references = REFERENCE_LATENT in self.schema  # an edit preset's cache: every sample has reference fields
        # the text encoder sees each sample's references: a caption's text is keyed by caption and references
        self.text_references = self.references and self.enc.text_family.text_takes_references
        self.pending: dict = defaultdict(list)
        self.truncated_texts: set[str] = set()  # text keys of the captions this run found truncated
        self.bad_texts: set[str] = set()  # text keys whose text held NaN/Inf: not stored
        self.queued_texts: set[str] = set()  # text keys this pass took for encoding, not yet held by the writer
        self.queued_kept = 0  # of them, how many its last `forget_written_texts` kept
        self.late_duplicates: list[tuple[str, str]] = []  # (dataset, outcome counted) of samples another rank committed first
        self.writes: BackgroundWrites | None = None
        self.encoder: BackgroundCalls | None = None  # the encoder's thread (None: serial)
        self.in_flight: deque[Batch] = deque()  # batches handed to it, not finished yet, in the order batched
        self.finished = 0  # batches it encoded that were finished

    @property
    def repair(self) -> bool:
        return self.needed is not None

    def run(self, batches, bar: tqdm | PlainProgress) -> None:
        """Encode and write every input of `batches`; returns once every write is done.

        Three stages overlap, each behind a bounded queue: this thread sorts the decoded inputs and batches them
        (`take`, `prepare`), the encoder's thread runs the encoders on ready batches (`encode`), this thread again
        checks the encoded samples and hands their writes to the writer's thread (`finish`), in the order batched:
        the cache written is the one a serial pass writes (`overlap=False`).

        Raises:
            what an encoder call or a write raised (out of memory, disk full, a sample the writer refused), at the
            input after it: the batches queued after it are not written, and what was committed before stays.
        """
        tally = self.tally
        t_loop = time.perf_counter()
        self.writes = BackgroundWrites()
        self.encoder = BackgroundCalls(IN_FLIGHT, IN_FLIGHT_BYTES, "encoder") if self.overlap else None
        try:
            while True:
                self.writes.check()  # a write failed: stop now, not after the inputs
                self.finish_encoded()  # an encoder call failed: raised here
                t_wait = time.perf_counter()
                item = next(batches, None)
                tally.wait_s += self.starved(t_wait)  # near zero when decoding is hidden behind encoding
                if item is None:
                    break
                bar.update(item.get("inputs", 1))  # an input's clips after its first count no input
                self.take(item)
                counts = tally.counts
                bar.set_postfix(new=counts["new"] + counts["changed"] + self.batched(), unchanged=counts["unchanged"],
                                failed=counts["failed"], refresh=False)
            for bucket in sorted(self.pending):
                self.encode_and_write(self.pending.pop(bucket))
            self.finish_encoded(keep=0)
            if self.encoder is not None:
                self.encoder.drain()
            t_wait = time.perf_counter()
            self.writes.drain()
            tally.write_wait_s += self.starved(t_wait)
        except BaseException:
            if self.encoder is not None:
                self.encoder.stop()  # the call in flight ends; the batches after it are never encoded
            self.writes.stop()  # the shard in flight is committed; queued batches are redone next run
            raise
        finally:
            tally.write_s = self.writes.busy_s
        for dataset, outcome in self.late_duplicates:
            tally.counts[outcome] -= 1
            tally.by_source[dataset][outcome] -= 1
            tally.counts["duplicate"] += 1
        tally.loop_s = time.perf_counter() - t_loop

    def take(self, item: dict) -> None:
        """Sort one decoded input; an input to encode waits for a full batch of its bucket."""
        tally, status, name = self.tally, item["status"], item["dataset"]
        for key in ("pixels", "control_pixels", "mask_pixels"):
            if isinstance(item.get(key), np.ndarray):
                item[key] = torch.from_numpy(item[key])
        for ref in item.get("reference_pixels") or ():  # each reference's `pixels` (and `text_pixels`)
            ref.update({k: torch.from_numpy(v) for k, v in ref.items() if isinstance(v, np.ndarray)})
        if status == "unchanged" and "index" in item and item.get("key") is None:
            self.take_unchanged(np.asarray(item["index"], dtype=np.int64), name)
        elif status == "failed":  # a damaged tar stands for the samples it did not yield (`samples`)
            tally.fail({k: item[k] for k in ("source", "reason", "detail", "dataset", "samples") if k in item}, item.get("samples", 1))
        elif tally.seen.contains(item["key"], item.get("index")) or (
                status == "unchanged" and not self.repair and not self.cached_in(item, name)):
            tally.count("duplicate", name)  # twice in this run, or cached in another source
        elif status == "unchanged":
            tally.seen.add(item["key"], name, item["source"], item.get("index"))
            tally.count("unchanged", name)
            tally.counts["later_clips"] += item.get("inputs", 1) == 0  # the failure share counts inputs, not clips
            # an input found by its stamp (`index`) has that stamp: only one read again may have moved
            cached = self.stamps[(name, item.get("resolution", 0))].get(item["source"]) if item.get("index") is None else None
            if item.get("touched") or cached and cached[0] == item["key"] and item.get("stamp") and cached[1] != item["stamp"]:
                tally.restamps[item["key"]] = item["stamp"]  # touched, same content: next time it is not read
        elif self.repair and item["key"] not in self.needed:
            tally.counts["changed_since"] += 1  # the input changed after it was cached: a plain re-run updates it
        else:
            tally.seen.add(item["key"], name, item["source"])
            tally.counts["later_clips"] += item.get("inputs", 1) == 0
            if item.get("caption_fallback"):  # not UTF-8: read in the encoding named, reported in the summary
                tally.counts[f"caption_fallback:{item['caption_fallback']}"] += 1
            self.pending[item["bucket"]].append(item)
            if len(self.pending[item["bucket"]]) >= self.batch_size:
                self.encode_and_write(self.pending.pop(item["bucket"]))

    def batched(self) -> int:
        """Inputs taken for encoding whose batch is not finished yet (waiting for a full batch, or on the encoder's
        side): new or changed, for the progress line, unless repairing."""
        if self.repair:
            return 0
        return sum(map(len, self.pending.values())) + sum(len(batch.items) for batch in self.in_flight)

    def take_unchanged(self, indices: np.ndarray, name: str) -> None:
        """Inputs of source `name` unchanged by their stamps, by the global indices of their cached samples (a folder's
        block): kept, but those kept already in this run (an input listed twice), which are duplicates."""
        cached = self.tally.seen.cached
        first = np.zeros(len(indices), dtype=bool)
        first[np.unique(indices, return_index=True)[1]] = True
        fresh = first & ~cached[indices]
        cached[indices[fresh]] = True
        kept = int(fresh.sum())
        for outcome, n in (("unchanged", kept), ("duplicate", len(indices) - kept)):
            if n:
                self.tally.counts[outcome] += n
                self.tally.by_source[name][outcome] += n

    def cached_in(self, item: dict, name: str) -> bool:
        """Whether the cached sample of an unchanged input is source `name`'s (one found by its stamp always is)."""
        if item.get("index") is not None:
            return True
        at = self.tally.seen.cached_at(item["key"])
        return at is not None and at[1] == name

    def encode_and_write(self, items: list[dict]) -> None:
        """Encode one bucket's batch (images, flipped images, control images, references, captions) and hand its
        writes (its new texts, then each sample) to the background writer as one batch: at once in a serial pass;
        overlapping, on the encoder's thread while this one goes on with the next inputs (`finish_encoded` finishes
        it once its encoding is done)."""
        batch = self.prepare(items)
        if self.encoder is None:
            self.encode(batch)
            self.finish(batch)
            return
        self.finish_encoded(keep=IN_FLIGHT - 1)  # room for this one: the encoder is at most a batch ahead of it
        self.encoder.submit([partial(self.encode, batch)], batch.nbytes)
        self.in_flight.append(batch)

    def finish_encoded(self, keep: int | None = None) -> None:
        """Finish the batches whose encoding is done, in the order batched; then wait for the oldest and finish it
        while more than `keep` are on the encoder's side (None: wait for none).

        Raises:
            what an encoder call raised (no batch after it is finished).
        """
        if self.encoder is None:
            return
        self.encoder.check()
        while self.in_flight and (self.encoder.completed > self.finished or keep is not None and len(self.in_flight) > keep):
            self.encoder.wait_for(self.finished + 1)
            self.finish(self.in_flight.popleft())
            self.finished += 1

    def prepare(self, items: list[dict]) -> Batch:
        """On the pass's thread: what the encoders are to compute for a batch. Latent fields found in the cache
        (`reusable`) are taken; the rest's pixels stacked per call (in pinned memory for a CUDA device: copied
        while it runs); the batch's captions listed, and in a cache that stores each text once only those of texts
        not stored or taken for encoding yet (`store_texts` decides as a serial pass would: a text is encoded once)."""
        batch = Batch(items, [self.reusable(it) for it in items])
        self.tally.counts["latents_reused"] += sum(f is not None for f in batch.reused)
        fresh = [it for it, f in zip(items, batch.reused) if f is None]
        if fresh:
            batch.video = bool(fresh[0]["bucket"].frames)
            batch.pixels = self.stacked([it["pixels"] for it in fresh])  # (B, 3, H, W) images, (B, 3, F, H, W) clips of one bucket
            batch.flips = [j for j, it in enumerate(fresh) if it.get("flip")]
            if batch.flips:
                batch.mirrored_pixels = self.stacked([fresh[j]["pixels"].flip(-1) for j in batch.flips])
            if self.control:  # the control images, cropped as their images, through the same VAE: the pipelines' control latents
                batch.control_pixels = self.stacked([it["control_pixels"] for it in fresh])
            if self.references:
                batch.reference_groups = self.reference_groups(fresh)
        batch.captions, batch.contexts, references = self.caption_inputs(items)
        if TEXT_KEYS in self.schema:  # each text in a text row the samples refer to (`shards.texts`)
            batch.keys = [text_key(c, x) for c, x in zip(batch.captions, batch.contexts)]
            batch.encode_texts = self.texts_to_encode(batch.keys)
        else:
            batch.encode_texts = list(range(len(batch.captions)))
        batch.text_references = None if references is None else [references[i] for i in batch.encode_texts]
        return batch

    def encode(self, batch: Batch) -> None:
        """On the encoder's thread (or the pass's, serial): the encoders' calls of a prepared batch, their outputs
        kept in it. Latent fields leave the encoders in the storage dtype, on the host: the device's memory is the
        next batch's."""
        enc = self.enc
        # the thread's current device, for what the encoders allocate without naming one ("cuda" alone: the current one)
        with torch.cuda.device(enc.device) if enc.device.type == "cuda" else contextlib.nullcontext():
            if batch.pixels is not None:
                batch.latents = self.on_host(self.encoded(enc.encode_videos if batch.video else enc.encode_images, batch.pixels))
                if batch.mirrored_pixels is not None:
                    batch.mirrored = self.on_host(self.encoded(enc.encode_images, batch.mirrored_pixels))
                if batch.control_pixels is not None:
                    batch.controls = self.on_host(self.encoded(enc.encode_images, batch.control_pixels))
            for where, x in batch.reference_groups:
                batch.reference_latents.append((where, self.on_host(self.encoded(enc.encode_references, x))))
            captions = [batch.captions[i] for i in batch.encode_texts]
            for i in range(0, len(captions), self.text_batch_size):
                part = slice(i, i + self.text_batch_size)
                refs = None if batch.text_references is None else batch.text_references[part]
                batch.texts.append(self.encoded(enc.encode_text, captions[part], True, refs))

    def finish(self, batch: Batch) -> None:
        """On the pass's thread, once the batch is encoded: its texts kept, each sample's fields built and checked
        (NaN/Inf fails it), and its writes (its new texts, then each sample) handed to the writer as one batch."""
        tally, items = self.tally, batch.items
        images = self.image_fields(batch)
        texts = [fields for part in batch.texts for fields in part.fields]
        truncated = [cut for part in batch.texts for cut in part.truncated]
        encoded = [batch.captions[i] for i in batch.encode_texts]
        encoded_contexts = [batch.contexts[i] for i in batch.encode_texts]
        self.truncated_texts.update(text_key(c, x) for c, x, cut in zip(encoded, encoded_contexts, truncated) if cut)
        stored_once = batch.keys is not None
        writes: list[tuple[partial, dict]] = []  # (write, the tensors it writes), in the order they run
        if stored_once:
            self.store_texts(batch, texts, writes)
            texts = batch.keys
        else:
            tally.counts["captions_truncated"] += sum(truncated)
        at = 0
        for j, it in enumerate(items):
            mine = texts[at : at + len(it["captions"])]  # this image's captions, back to back per field (or their keys)
            at += len(it["captions"])
            fields = self.sample_fields(it, images[j], None if stored_once else mine, mine if stored_once else None)
            bad_fields = [n for n, t in fields.items() if t.is_floating_point() and not finite(t)]
            bad_fields += [f"text of caption {k}" for k, key in enumerate(mine) if stored_once and key in self.bad_texts]
            if bad_fields:
                tally.fail({"source": it["source"], "reason": "non_finite", "detail": f"fields {bad_fields}", "dataset": it["dataset"]})
            elif self.repair:
                if it["key"] not in self.texts_only:
                    tally.repaired[it["key"]] = fields
            else:
                scope = (it["dataset"], it.get("resolution", 0))
                # "changed" if cached as one at its resolution (an image cached at another resolution is new at this one)
                outcome = "changed" if it["source"] in self.stamps.get(scope, ()) else "new"
                fields = {name: t.cpu() for name, t in fields.items()}  # queued in host memory, the device's freed
                writes.append((partial(self.write_sample, it, fields, outcome), fields))
                tally.count(outcome, it["dataset"])  # undone if another rank commits it first (`write_sample`)
        if writes:
            t_wait = time.perf_counter()
            self.writes.submit([write for write, _ in writes], held_bytes([t for _, fields in writes for t in fields.values()]))
            tally.write_wait_s += self.starved(t_wait)

    def starved(self, since: float) -> float:
        """Of the time since `since`, which this thread spent waiting (on the loader, on the writer), the part the
        encoders idled through for want of a batch: all of it in a serial pass; overlapping, the part after the
        encoder's thread ran out of batches (none can come while this thread waits)."""
        now = time.perf_counter()
        if self.encoder is None:
            return now - since
        idle = self.encoder.idle_since
        return 0.0 if idle is None else now - max(since, idle)

    def write_sample(self, it: dict, fields: dict[str, torch.Tensor], outcome: str) -> None:
        """On the background thread: write one sample, unless another rank committed it meanwhile (the same image and
        captions), which counts it a duplicate instead of `outcome`."""
        if self.writer.listed(it["key"]):
            self.late_duplicates.append((it["dataset"], outcome))
            return
        self.writer.write(it["key"], it["bucket"], fields, source=it["source"], stamp=it.get("stamp", 0), dataset=it["dataset"],
                          resolution=it.get("resolution", 0))

    def encoded(self, encode, *args):
        """`encode(*args)`, its time counted as the encoders' (`Tally.encoder_s`): on CUDA, until its kernels are done."""
        t0 = time.perf_counter()
        out = encode(*args)
        if self.enc.device.type == "cuda":
            torch.cuda.synchronize(self.enc.device)
        self.tally.encoder_s += time.perf_counter() - t0
        return out

    def stacked(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """`torch.stack(tensors)`, into pinned memory for a CUDA device (its copy to the device does not wait on
        the host)."""
        if self.enc.device.type != "cuda":
            return torch.stack(tensors)
        out = torch.empty((len(tensors), *tensors[0].shape), dtype=tensors[0].dtype, pin_memory=True)
        return torch.stack(tensors, out=out)

    def on_host(self, out: dict[str, torch.Tensor] | torch.Tensor):
        """An encoder's outputs (a tensor, or a dict of them) in the storage dtype, on the host."""
        if isinstance(out, torch.Tensor):
            return out.to(self.storage).cpu()
        return {name: t.to(self.storage).cpu() for name, t in out.items()}

    def caption_inputs(self, items: list[dict]) -> tuple[list[str], list[bytes], list[list[torch.Tensor]] | None]:
        """Every caption of a batch, in order; per caption what its text key adds to the caption (`text_key`'s
        context: its sample's `reference_digest` where the text encoder sees the references, else nothing); and, for
        such a text encoder, per caption its sample's references' `text_pixels` (None for any other: captions alone).
        Each caption variant of a sample sees the sample's references."""
        captions = [c for it in items for c in it["captions"]]
        if not self.text_references:
            return captions, [b""] * len(captions), None
        contexts, references = [], []
        for it in items:
            refs = it.get("reference_pixels") or []  # none: a text-to-image sample, its text the caption's alone
            contexts += [it["reference_digest"] if refs else b""] * len(it["captions"])
            references += [[r["text_pixels"] for r in refs]] * len(it["captions"])
        return captions, contexts, references

    def texts_to_encode(self, keys: list[str]) -> list[int]:
        """Of a batch's text keys (one per caption, see `caption_inputs`), the index of the first caption of each
        text to encode: one the cache does not hold, not taken for encoding by this pass before, or, repairing, one
        of `rebuild_texts`. A text taken is never encoded again (kept, written, or found holding NaN/Inf)."""
        first: dict[str, int] = {}  # each new text's key -> its first caption's index
        for i, k in enumerate(keys):
            if k not in first and k not in self.queued_texts:
                first[k] = i
        if first:  # the cache's texts searched in place, the batch's at once
            for k, held in zip(list(first), self.writer.has_texts(list(first))):
                if held and k not in self.rebuild_texts:
                    del first[k]
        self.queued_texts.update(first)
        if len(self.queued_texts) > max(QUEUED_TEXTS, 2 * self.queued_kept):
            self.forget_written_texts()
        return list(first.values())

    def forget_written_texts(self) -> None:
        """Of the texts taken for encoding, forget those the writer holds now (buffered or committed: `has_text` finds
        them): only those still on their way to it, never written (NaN/Inf) or to rebuild stay, so the set holds the
        texts in flight, not every text of the run."""
        queued = list(self.queued_texts)
        held = self.writer.has_texts(queued)
        self.queued_texts = {k for k, h in zip(queued, held) if not h or k in self.rebuild_texts}
        self.queued_kept = len(self.queued_texts)

    def store_texts(self, batch: Batch, texts: list[dict[str, torch.Tensor]], writes: list[tuple[partial, dict]]) -> None:
        """A batch's encoded texts (one per `batch.encode_texts`) written once, appended to `writes` before the
        samples that refer to them. A text holding NaN/Inf is not written (its samples fail as non_finite).
        Repairing, a text of `rebuild_texts` is kept in `tally.repaired_texts`."""
        for i, fields in zip(batch.encode_texts, texts):
            key = batch.keys[i]
            fields = {name: t.to(self.storage).cpu() for name, t in fields.items()}
            ok = all(finite(t) for t in fields.values() if t.is_floating_point())
            if key in self.rebuild_texts and ok:
                self.tally.repaired_texts[key] = fields
            elif ok:
                writes.append((partial(self.writer.write_text, batch.captions[i], fields, batch.contexts[i]), fields))
            else:
                self.bad_texts.add(key)
        self.tally.counts["captions_truncated"] += sum(k in self.truncated_texts for k in batch.keys)  # per caption, as before

    def reusable(self, it: dict) -> dict[str, torch.Tensor] | None:
        """The latent fields of a changed input's old sample, when its image (its video, and which clip of it) did not
        change (`CachedLatents`)."""
        if self.cached is None or self.repair or "latent_key" not in it:
            return None
        old = self.stamps[(it["dataset"], it.get("resolution", 0))].get(it["source"])
        # a video's clips are several samples of one input: any of them may be this clip's old self
        candidates = it.get("replaces") or ((old[0],) if old else ())
        candidates = [k for k in candidates if k != it["key"] and (at := self.tally.seen.cached_at(k)) and at[1] == it["dataset"]]
        return self.cached.find_any(it["dataset"], candidates, it["latent_key"]) if candidates else None

    def image_fields(self, batch: Batch) -> list[dict[str, torch.Tensor]]:
        """Per item of an encoded batch, its latent fields in the storage dtype: its image's, its flipped image's (one
        row for a source with flip, none otherwise), its control image's and its references' (`reference_fields`);
        from the VAE, or copied from its old sample when only its mask or captions changed (`reusable`)."""
        if batch.pixels is None:
            return batch.reused
        latents, mirrored, controls, flips = batch.latents, batch.mirrored or {}, batch.controls or {}, batch.flips
        fresh = sum(f is None for f in batch.reused)
        references = self.reference_fields(batch, fresh) if self.references else None
        encoded = []
        for j in range(fresh):
            fields = {name: t[j] for name, t in latents.items()}
            for name in self.flipped_fields:  # one row: the flipped image's latent; none for a source without flip
                plain = latents[name.removeprefix(FLIP_PREFIX)]
                fields[name] = mirrored[name.removeprefix(FLIP_PREFIX)][flips.index(j)][None] if j in flips else plain[j][None][:0]
            fields.update({CONTROL_PREFIX + name: t[j] for name, t in controls.items()})
            if references is not None:
                fields.update(references[j])
            encoded.append(fields)
        it = iter(encoded)
        return [f if f is not None else next(it) for f in batch.reused]

    def reference_groups(self, items: list[dict]) -> list[tuple[list[tuple[int, int]], torch.Tensor]]:
        """The references of a batch's items to encode, in groups of one size, at most `batch_size` images a group:
        per group its (item, reference) places and its (B, 3, h, w) pixels in [-1, 1]. A reference is prepared at
        its own size (`Family.prepare_reference`)."""
        by_size: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # (h, w) -> (item, reference)
        for j, it in enumerate(items):
            for r, ref in enumerate(it.get("reference_pixels") or ()):
                by_size[tuple(ref["pixels"].shape[-2:])].append((j, r))
        groups = []
        for where in by_size.values():
            for i in range(0, len(where), self.batch_size):
                part = where[i : i + self.batch_size]
                groups.append((part, self.stacked([items[j]["reference_pixels"][r]["pixels"] for j, r in part])))
        return groups

    def reference_fields(self, batch: Batch, count: int) -> list[dict[str, torch.Tensor]]:
        """Per encoded item (`count` of them), its references' two fields (`shards.references.pack`, storage dtype;
        empty for an item without references), from the family's `encode_references` of each group of one size."""
        latents: list[list[torch.Tensor | None]] = [[None] * len(it.get("reference_pixels") or ())
                                                    for it, f in zip(batch.items, batch.reused) if f is None]
        for where, out in batch.reference_latents:
            for (j, r), latent in zip(where, out):  # (C, h', w') each
                latents[j][r] = latent
        assert len(latents) == count
        channels = self.enc.latent_spec().channels
        return [pack(refs, channels, self.storage) for refs in latents]

    def loss_mask(self, it: dict) -> torch.Tensor:
        """The sample's `shards.MASK` row: its mask's area average over each latent cell's pixels, 0-255, (1, h, w)
        uint8; (0, h, w) without a mask."""
        _, h, w = self.enc.latent_spec().shape(it["bucket"].height, it["bucket"].width)
        m = it.get("mask_pixels")  # (1, H, W) uint8, cropped as the image
        if m is None:
            return torch.zeros((0, h, w), dtype=torch.uint8)
        # the mean of whole numbers 0-255 over (H / h) x (W / w) pixels: exact in fp32 (an all-white cell is 255)
        cells = F.adaptive_avg_pool2d(m.float()[None], (h, w))[0]
        return cells.round().to(torch.uint8)

    def sample_fields(self, it: dict, images: dict[str, torch.Tensor], captions: list[dict[str, torch.Tensor]] | None,
                      text_keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The stored fields of sample `it` with its latent fields `images`, in the storage dtype: its captions' text
        fields, or the keys of its captions' texts (`text_keys`) in a cache that stores each text once."""
        storage = self.storage
        fields = dict(images)
        if MASK in self.schema:
            fields[MASK] = self.loss_mask(it)
        if LATENT_KEY in self.schema:
            fields[LATENT_KEY] = torch.frombuffer(bytearray(it["latent_key"]), dtype=torch.uint8)
        if text_keys is not None:
            fields[TEXT_KEYS] = key_rows(text_keys)
        else:
            fields.update({name: torch.cat([c[name] for c in captions]).to(storage) for name in captions[0]})
            fields["text_lengths"] = torch.tensor([c["text"].shape[0] if "text" in c else 0 for c in captions], dtype=torch.int32)
        if CLIP in self.schema:
            fields[CLIP] = torch.tensor(it["clip"], dtype=torch.int32)
        fields["original_size"] = torch.tensor(it["original_size"], dtype=torch.int32)
        fields["crop"] = torch.tensor(it["crop"], dtype=torch.int32)
        fields["source"] = torch.frombuffer(bytearray(it["source"].encode("utf-8", "surrogateescape")), dtype=torch.uint8)
        return fields
