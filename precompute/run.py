"""Stage one: encode an image-caption dataset once into the bucketed shard cache.

Reads images in DataLoader workers while the encoders run, writes shards per bucket through
`shards.ShardWriter`, and is incremental (content-keyed; an input whose size and mtime are unchanged is
not even read), resumable and crash-safe. Under torchrun every rank encodes a disjoint part of the inputs
into its own shards, all committing into the cache's one log; rank 0 holds the cache's lock for the run.

A sample leaves the cache only on evidence: its input was listed completely, without error, and is gone
(or changed, and its new content was encoded). Inputs that fail to read never remove anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from precompute.data import (
    REASONS,
    FolderDataset,
    ImagePolicy,
    TarDataset,
    expand_tar_urls,
    is_tar_source,
    list_folder,
    tar_name,
)
from precompute.encode import DTYPES, Encoders, best_device
from precompute.presets import get_preset, get_text_encoder
from shards import Cache, CacheBusy, CacheLock, Prompt, ShardWriter, bucket_table, exists, load, prompt_key, verify
from shards.atomic import atomic_write_bytes
from shards.reader import stat_problems


# Images per VAE batch. Large batches pay on GPUs; on CPUs a batch's activations fall out of the caches
# and every image costs more (make bench: tiny-pixart 42 img/s at batch 1, 31 at 4, 21 at 8).
DEFAULT_BATCH = {"cuda": 16, "cpu": 1}
# A run that would remove more than this share of the cache stops and says what it would remove.
MAX_REMOVAL_FRACTION = 0.5


class RemovalRefused(ValueError):
    """A run would remove more of the cache than allowed; nothing was removed."""


def pixels_as_array(item: dict) -> dict:
    """A worker's item with its pixels as a numpy array: sent through the pipe in one copy. A tensor goes
    through shared memory instead (a file, a descriptor passed over a socket and a mapping per image),
    which costs the receiving process more than the copy for the image sizes a CPU encodes."""
    if "pixels" in item:
        item = {**item, "pixels": item["pixels"].numpy()}
    return item


def setup_distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank) under torchrun; (0, 1, 0) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def lock_cache(cache: Path, rank: int, world: int) -> CacheLock | None:
    """Rank 0 takes the cache's lock for the whole run (every rank learns whether it could): two runs on one
    cache would encode the same samples twice. Raises `CacheBusy` on every rank when another run holds it."""
    lock, busy = None, None
    if rank == 0:
        try:
            lock = CacheLock(cache)
        except CacheBusy as e:
            busy = str(e)
    busy = gather(busy, world)[0]
    if busy:
        raise CacheBusy(busy)
    return lock


def estimate_bytes_per_sample(enc: Encoders, policy: ImagePolicy, storage: torch.dtype, captions: int = 1) -> int:
    """Latents at the largest bucket area plus half the token limit per caption: an estimate for the disk check."""
    area = max(b.height * b.width for b in policy.buckets) // enc.downsample**2
    latents = (2 if enc.preset.vae.gaussian else 1) * enc.latent_channels * area
    text = captions * enc.preset.text.max_length // 2 * enc.text_dim
    if enc.preset.text.kind == "sd3":  # every token is kept: CLIP's 77 and T5's whole length
        text = captions * (77 * enc.clip_dim + enc.pooled_dim + (0 if enc.preset.text.drop_t5 else enc.preset.text.max_length * enc.text_dim))
    return (latents + text) * storage.itemsize + 256


def check_disk_space(cache: Path, need: int) -> None:
    free = shutil.disk_usage(cache).free
    if need > free:
        raise OSError(f"the cache needs about {_size(need)} more at {cache} but {_size(free)} are free; free space, "
                      f"choose another --cache, or pass --no-check-disk")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


@dataclass
class Inputs:
    """This rank's part of DATA and what the listing found."""

    dataset: torch.utils.data.Dataset
    total: int | None  # inputs of this rank, when known before reading (folders)
    listed: int | None  # inputs of every rank (folders)
    complete: bool  # the listing saw every input without error: removal may use it
    failures: list[dict] = field(default_factory=list)  # listing errors of this rank's part
    workers: int = 0


def open_inputs(data: str, policy: ImagePolicy, known: dict[str, tuple[str, int]], keys: frozenset[str], *,
                caption_column: str, caption_keys: tuple[str, ...], allow_pipe: bool, rank: int, world: int,
                workers: int, only: set[str] | None = None) -> Inputs:
    """DATA as a dataset of prepared samples, split disjointly by rank; with `only`, a folder's inputs of
    those sources alone."""
    if is_tar_source(data):
        urls = expand_tar_urls(data, allow_pipe)
        mine = urls[rank::world]
        return Inputs(TarDataset(mine, policy, keys, caption_keys), None, None, True, workers=min(workers, len(mine)))
    if not Path(data).is_dir():
        raise FileNotFoundError(f"DATA={data} is neither a folder of images nor webdataset tars")
    listing = list_folder(data, caption_column)
    entries = listing.entries if only is None else [e for e in listing.entries if e.source in only]
    mine = entries[rank::world]
    return Inputs(FolderDataset(mine, policy, keys, known), len(mine), len(entries), listing.complete,
                  failures=listing.failures[rank::world], workers=workers)


def removals(previous: dict[str, str], seen: set[str], failed_sources: set[str], complete: bool) -> tuple[set[str], int]:
    """The cached keys to remove on evidence, and how many unseen ones are kept because their input failed to
    read (or the listing was incomplete).

    Args:
        previous: key -> source of every cached sample.
        seen: keys of every input read in this run (encoded or unchanged).
        failed_sources: sources whose read failed; a damaged tar protects every sample it held.
        complete: whether the listing itself succeeded everywhere.
    """
    unseen = {k: s for k, s in previous.items() if k not in seen}
    if not complete:
        return set(), len(unseen)
    tars = tuple(tar_name(s) + "/" for s in failed_sources)
    kept = {k for k, s in unseen.items() if s in failed_sources or (tars and s.startswith(tars))}
    return set(unseen) - kept, len(kept)


def main(
    data: str,
    model: str,
    cache: Path,
    *,
    text_encoder: str | None = None,
    pretrained: str | None = None,
    drop_t5: bool = False,
    max_length: int | None = None,
    batch_size: int | None = None,
    text_batch_size: int = 64,
    workers: int = 2,
    storage_dtype: str = "bfloat16",
    vae_dtype: str | None = None,
    text_dtype: str | None = None,
    force_fp16: bool = False,
    max_upscale: float = 2.0,
    allow_upscale: bool = False,
    extreme_aspect: str = "skip",
    max_pixels: int = 178_956_970,
    caption_column: str = "text",
    caption_keys: tuple[str, ...] = ("caption", "text", "prompt"),
    validation_prompts: tuple[str, ...] = (),
    allow_pipe: bool = False,
    allow_removal: bool = False,
    max_removal_fraction: float = MAX_REMOVAL_FRACTION,
    max_shard_mb: int = 128,
    check_disk: bool = True,
    repair: bool = False,
    progress: bool = True,
) -> dict:
    """Encode DATA into CACHE. Returns the run summary (also printed); exit code is the caller's.

    Raises:
        CacheBusy: another run is writing the cache.
        RemovalRefused: the run would remove more than allowed (everything it encoded is kept).
    """
    t_start = time.perf_counter()
    rank, world, local_rank = setup_distributed()
    is_main = rank == 0
    preset = get_preset(model)
    if text_encoder:
        preset = replace(preset, text=get_text_encoder(text_encoder))
    if (preset.family == "sd3") != (preset.text.kind == "sd3"):
        raise ValueError(f"--text-encoder {preset.text.name}: the {preset.family} family needs "
                         + ("CLIP-L + CLIP-G + T5 (clip-l-g-t5)" if preset.family == "sd3" else "a single text encoder"))
    if drop_t5:
        if preset.text.kind != "sd3":
            raise ValueError(f"--drop-t5 applies to SD3 presets (CLIP-L + CLIP-G + T5); {preset.name} encodes captions with "
                             f"{preset.text.name} alone")
        preset = replace(preset, text=replace(preset.text, drop_t5=True))
    if max_length:
        preset = replace(preset, text=replace(preset.text, max_length=max_length))
    device = best_device()
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    batch_size = batch_size or DEFAULT_BATCH[device.type]
    if storage_dtype not in DTYPES:
        raise ValueError(f"--storage-dtype {storage_dtype!r}: choose one of {sorted(DTYPES)}")
    storage = DTYPES[storage_dtype]
    if extreme_aspect not in ("skip", "clamp"):
        raise ValueError(f"--extreme-aspect {extreme_aspect!r}: choose skip or clamp")
    if repair and world > 1:
        raise ValueError("--repair runs in one process (it re-encodes only the damaged shards' samples)")

    cache.mkdir(parents=True, exist_ok=True)
    lock = lock_cache(cache, rank, world)
    try:
        summary = _run(data, cache, preset, device, storage, storage_dtype, batch_size, text_batch_size, workers, rank, world,
                    t_start, pretrained=pretrained, vae_dtype=vae_dtype, text_dtype=text_dtype, force_fp16=force_fp16,
                    policy=ImagePolicy(bucket_table(preset.base_resolution), max_upscale=max_upscale,
                                       allow_upscale=allow_upscale, extreme_aspect=extreme_aspect, max_pixels=max_pixels),
                    caption_column=caption_column, caption_keys=tuple(caption_keys), validation_prompts=validation_prompts,
                    allow_pipe=allow_pipe, allow_removal=allow_removal, max_removal_fraction=max_removal_fraction,
                    max_shard_mb=max_shard_mb, check_disk=check_disk, repair=repair, progress=progress)
    finally:
        if lock is not None:
            lock.release()
    if world > 1:  # after _run's last barrier: no rank exits while a peer's gloo/NCCL connection is still open
        dist.destroy_process_group()
    return summary


def _run(data, cache, preset, device, storage, storage_dtype, batch_size, text_batch_size, workers, rank, world, t_start, *,
         pretrained, vae_dtype, text_dtype, force_fp16, policy, caption_column, caption_keys, validation_prompts, allow_pipe,
         allow_removal, max_removal_fraction, max_shard_mb, check_disk, repair, progress) -> dict:
    is_main = rank == 0
    # 1. what the cache holds, from its manifest alone (no shard is opened), read under the lock; then the
    # inputs, split disjointly by global rank. The loader's workers start reading images now, while the
    # encoders load.
    manifest = load(cache) if exists(cache) else None
    previous = {key: source for key, source, *_ in manifest.samples()} if manifest else {}
    known = manifest.by_source() if manifest else {}
    damaged: dict[str, list[str]] = {}
    if repair:
        if manifest is None:
            raise FileNotFoundError(f"{cache} holds no cache to repair; build it with `make precompute DATA=... CACHE={cache}`")
        damaged = damaged_shards(cache, manifest)
        if not damaged:
            print(f"{cache}: every shard of generation {manifest.generation} is intact; nothing to repair", file=sys.stderr)
            return {"repaired_shards": 0, "repaired_samples": 0, "unrepairable": []}
        needed = {k for keys in damaged.values() for k in keys}
        # only the damaged samples' inputs are read (a folder's others are not listed; a tar's are skipped by key)
        known, skip = {}, frozenset(previous) - needed
        only = {previous[k] for k in needed}
    else:
        skip, only = frozenset(previous), None
        if manifest is not None and is_main:
            warn_damaged(cache, manifest)
    inputs = open_inputs(data, policy, known, skip, caption_column=caption_column, caption_keys=caption_keys,
                         allow_pipe=allow_pipe, rank=rank, world=world, workers=workers, only=only)
    if inputs.listed == 0 and previous and not allow_removal and not repair:
        raise RemovalRefused(f"DATA={data} lists no input, and the cache at {cache} holds {len(previous)} samples: a re-run "
                             f"would remove them all. Is the folder empty or unmounted? Pass --allow-removal to remove them.")
    loader = torch.utils.data.DataLoader(
        inputs.dataset, batch_size=None, num_workers=inputs.workers, pin_memory=device.type == "cuda",
        prefetch_factor=4 if inputs.workers else None, multiprocessing_context="fork" if inputs.workers else None,
        collate_fn=None if device.type == "cuda" or not inputs.workers else pixels_as_array,
    )
    batches = iter(loader)  # forks the workers before any encoder weights exist in this process

    # 2. encoders and the fingerprint of everything that determines the cached values; a cache built
    # differently is refused before anything is encoded
    try:
        enc = Encoders(preset, device, vae_dtype=vae_dtype, text_dtype=text_dtype, pretrained=pretrained, force_fp16=force_fp16)
        bad = [b.name for b in policy.buckets if b.height % enc.downsample or b.width % enc.downsample]
        if bad:
            raise ValueError(f"buckets {bad} of the {preset.base_resolution} table are not multiples of the VAE's "
                             f"downsampling factor {enc.downsample}; choose a preset with another base resolution")
        fingerprint = {**enc.fingerprint(), "storage_dtype": storage_dtype, "buckets": policy.fingerprint(),
                       "captions": {"caption_column": caption_column, "caption_keys": list(caption_keys)}}
        schema = enc.schema(storage)
        if manifest is not None:
            manifest.check_compatible(fingerprint, schema, cache)
        if check_disk and is_main and inputs.listed and not repair:
            check_disk_space(cache, estimate_bytes_per_sample(enc, policy, storage) * max(0, inputs.listed - len(previous)))
    except BaseException:
        del batches  # stops the workers now, not when the traceback is freed
        raise

    # 3. encode per bucket as images arrive, write shards
    writer = ShardWriter(cache, fingerprint, schema, rank=rank, max_shard_bytes=max_shard_mb << 20)
    counts: Counter = Counter()
    failures: list[dict] = list(inputs.failures)
    counts["failed"] += len(failures)
    seen: dict[str, str] = {}
    restamps: dict[str, int] = {}
    repaired: dict[str, dict[str, torch.Tensor]] = {}  # key -> fields, re-encoded for a damaged shard
    pending: dict = defaultdict(list)

    def encode_and_write(items: list[dict]) -> None:
        latents = enc.encode_images(torch.stack([it["pixels"] for it in items]))  # (B, C, h, w) each
        captions = [c for it in items for c in it["captions"]]
        texts, truncated = [], []
        for i in range(0, len(captions), text_batch_size):
            batch = enc.encode_text(captions[i : i + text_batch_size])
            texts += batch.fields
            truncated += batch.truncated
        counts["captions_truncated"] += sum(truncated)
        at = 0
        for j, it in enumerate(items):
            mine = texts[at : at + len(it["captions"])]  # this image's captions, back to back per field
            at += len(it["captions"])
            fields = {name: t[j].to(storage) for name, t in latents.items()}
            fields.update({name: torch.cat([c[name] for c in mine]).to(storage) for name in mine[0]})
            fields["text_lengths"] = torch.tensor([c["text"].shape[0] if "text" in c else 0 for c in mine], dtype=torch.int32)
            fields["original_size"] = torch.tensor(it["original_size"], dtype=torch.int32)
            fields["crop"] = torch.tensor(it["crop"], dtype=torch.int32)
            fields["source"] = torch.frombuffer(bytearray(it["source"].encode("utf-8", "surrogateescape")), dtype=torch.uint8)
            bad_fields = [n for n, t in fields.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            if bad_fields:
                failures.append({"source": it["source"], "reason": "non_finite", "detail": f"fields {bad_fields}"})
                counts["failed"] += 1
                continue
            if repair:
                repaired[it["key"]] = fields
                continue
            if writer.listed(it["key"]):  # the same image and captions, committed by another rank meanwhile
                counts["duplicate"] += 1
                continue
            writer.write(it["key"], it["bucket"], fields, source=it["source"], stamp=it.get("stamp", 0))
            counts["changed" if it["source"] in known else "new"] += 1

    bar = tqdm(total=inputs.total, unit="img", desc=f"precompute[{rank}]" if world > 1 else "precompute",
               disable=not progress or not is_main, dynamic_ncols=True)
    t_loop = time.perf_counter()
    wait_s = 0.0  # time blocked on the loader: near zero when decoding is hidden behind encoding
    try:
        while True:
            t_wait = time.perf_counter()
            item = next(batches, None)
            wait_s += time.perf_counter() - t_wait
            if item is None:
                break
            if isinstance(item.get("pixels"), np.ndarray):
                item["pixels"] = torch.from_numpy(item["pixels"])
            bar.update(1)
            status = item["status"]
            if status == "failed":
                failures.append({k: item[k] for k in ("source", "reason", "detail")})
                counts["failed"] += 1
            elif item["key"] in seen:
                counts["duplicate"] += 1
            elif status == "unchanged":
                seen[item["key"]] = item["source"]
                counts["unchanged"] += 1
                cached = known.get(item["source"])
                if cached and cached[0] == item["key"] and item.get("stamp") and cached[1] != item["stamp"]:
                    restamps[item["key"]] = item["stamp"]  # touched, same content: next time it is not read
            elif repair and item["key"] not in needed:
                counts["changed_since"] += 1  # the input changed after it was cached: a plain re-run updates it
            else:
                seen[item["key"]] = item["source"]
                pending[item["bucket"]].append(item)
                if len(pending[item["bucket"]]) >= batch_size:
                    encode_and_write(pending.pop(item["bucket"]))
            bar.set_postfix(new=counts["new"] + counts["changed"], unchanged=counts["unchanged"], failed=counts["failed"], refresh=False)
        for bucket in sorted(pending):
            encode_and_write(pending.pop(bucket))
        writer.restamp(restamps)
        if repair:
            summary = replace_damaged(writer, damaged, repaired, previous, cache)
        writer.finish()
        loop_s = time.perf_counter() - t_loop
    except BaseException:
        writer.close()  # everything committed so far stays valid; buffered samples are redone next run
        raise
    finally:
        bar.close()

    if repair:
        return summary

    # 4. rank 0: remove what is gone on evidence, store prompt embeddings and the decoder recipe
    parts = gather({"counts": counts, "failures": failures, "seen": seen, "loop_s": loop_s, "wait_s": wait_s,
                    "complete": inputs.complete}, world)
    summary: dict = {}
    refused = None
    if is_main:
        counts = sum((Counter(p["counts"]) for p in parts), Counter())
        failures = sorted((f for p in parts for f in p["failures"]), key=lambda f: f["source"])
        seen_keys = set().union(*(p["seen"] for p in parts))
        stale, kept = removals(previous, seen_keys, {f["source"] for f in failures}, all(p["complete"] for p in parts))
        read_sources = {s for p in parts for s in p["seen"].values()}
        changed = {k for k in stale if previous[k] in read_sources}
        gone = stale - changed  # inputs no longer listed (changed ones were re-encoded)
        if gone and not allow_removal and len(gone) > max_removal_fraction * len(previous):
            refused = RemovalRefused(
                f"{len(gone)} of the cache's {len(previous)} samples are no longer in DATA={data} (e.g. "
                f"{', '.join(sorted(previous[k] for k in gone)[:3])}), over --max-removal-fraction {max_removal_fraction:g}; "
                f"nothing was removed and everything encoded is kept. If they really are gone, re-run with --allow-removal.")
            stale = changed
        with ShardWriter(cache, fingerprint, schema) as final:
            final.remove(stale)
            store_prompts(final, enc, validation_prompts, storage)
            store_decoder(final, enc, preset)
        counts["removed"] = len(stale) - len(changed)
        counts["kept_unreadable"] = kept
        atomic_write_bytes(cache / "failures.jsonl", "".join(json.dumps(f) + "\n" for f in failures).encode())
        summary = report(cache, counts, failures, time.perf_counter() - t_start, max(p["loop_s"] for p in parts))
        summary["data_wait_fraction"] = sum(p["wait_s"] for p in parts) / max(sum(p["loop_s"] for p in parts), 1e-9)
    if world > 1:
        dist.barrier()
    if refused is not None:
        raise refused
    return summary


def warn_damaged(cache: Path, manifest) -> None:
    """One stat per shard: a plain re-run reports unchanged inputs without reading their samples, so it says
    when listed shards are missing or truncated (what --repair re-encodes)."""
    bad = stat_problems((cache / path, int(size)) for path, size in zip(manifest.shards.paths(), manifest.shards.column("bytes")))
    if bad:
        print(f"warning: {len(bad)} shard(s) of {cache} are missing or truncated (e.g. {bad[0][0]}: {bad[0][1]}); their "
              f"samples count as unchanged here. Re-run with --repair to re-encode them.", file=sys.stderr)


def damaged_shards(cache: Path, manifest) -> dict[str, list[str]]:
    """Shards of the newest generation that are missing or fail `verify` (size, sha256, digests): path -> keys."""
    report = verify(cache)
    bad = {Path(p).resolve() for p in report.bad_files}
    return {entry.path: manifest.shards.samples_of(int(j))[0]
            for j, entry in zip(manifest.shards.rows, manifest.shards) if (cache / entry.path).resolve() in bad}


def replace_damaged(writer: ShardWriter, damaged: dict[str, list[str]], encoded: dict, previous: dict[str, str], cache: Path) -> dict:
    """Commit a re-encoded copy of every damaged shard whose samples were all encoded again, in their order:
    a training run of any generation reads the copy at the same global indices."""
    repaired, unrepairable = [], []
    for path, keys in damaged.items():
        missing = [previous[k] for k in keys if k not in encoded]
        if missing:
            unrepairable.append({"shard": path, "inputs_missing_or_changed": missing})
        else:
            writer.replace(path, [(k, encoded[k]) for k in keys])
            repaired.append(path)
    samples = sum(len(damaged[p]) for p in repaired)
    print(f"\n{cache}: repaired {len(repaired)} of {len(damaged)} damaged shard(s), {samples} samples re-encoded", file=sys.stderr)
    for u in unrepairable:
        print(f"  not repaired: {u['shard']}: inputs missing or changed since they were cached: "
              f"{', '.join(u['inputs_missing_or_changed'][:3])}; restore them and run --repair again", file=sys.stderr)
    return {"repaired_shards": len(repaired), "repaired_samples": samples, "unrepairable": unrepairable}


def store_prompts(writer: ShardWriter, enc: Encoders, validation_prompts, storage: torch.dtype) -> None:
    """The empty caption (guidance, caption dropout) and the validation prompts, beside the shards."""
    prompts = {"": False, **{p: True for p in validation_prompts}}  # text -> with instruction
    stored = {}
    for text, instruction in prompts.items():
        fields = enc.encode_text([text], instruction=instruction).fields[0]
        stored[prompt_key(text)] = Prompt(text, {name: t.to(storage) for name, t in fields.items()})
    writer.add_prompts(stored, enc.prompt_schema(storage))


def store_decoder(writer: ShardWriter, enc: Encoders, preset) -> None:
    """How training rebuilds the VAE decoder, and its weights when they exist nowhere else; a re-run that
    changes nothing commits nothing."""
    decoder, files = enc.decoder_recipe()
    for path, blob in files.items():
        role = f"decoder:{Path(path).name}"
        if writer.manifest.files.get(role, {}).get("sha256") != hashlib.sha256(blob).hexdigest():
            writer.add_file(role, path, blob)
    record = {"preset": preset.name, "family": preset.family, "text_encoder": preset.text.name,
              "base_resolution": preset.base_resolution, "decoder": decoder}
    if writer.manifest.extra.get("precompute") != json.loads(json.dumps(record)):
        writer.set_extra("precompute", record)


def report(cache: Path, counts: Counter, failures: list[dict], elapsed: float, loop_s: float) -> dict:
    manifest = Cache(cache).manifest
    encoded = counts["new"] + counts["changed"]
    considered = encoded + counts["unchanged"] + counts["failed"]
    by_reason = Counter(f["reason"] for f in failures)
    field_bytes = dict(zip(manifest.shards.fields, (int(v) for v in manifest.shards.column("field_bytes").sum(0))))
    n = max(manifest.num_samples, 1)
    summary = {
        "encoded": encoded,
        "new": counts["new"],
        "changed": counts["changed"],
        "unchanged": counts["unchanged"],
        "removed": counts["removed"],
        "kept_unreadable": counts["kept_unreadable"],
        "duplicates": counts["duplicate"],
        "failed": counts["failed"],
        "failed_by_reason": dict(sorted(by_reason.items())),
        "captions_truncated": counts["captions_truncated"],
        "failure_fraction": counts["failed"] / max(considered, 1),
        "cache_samples": manifest.num_samples,
        "cache_bytes": manifest.num_bytes,
        "generation": manifest.generation,
        "buckets": {b.name: st.samples for b, st in manifest.buckets().items()},
        "bytes_per_sample": {k: v / n for k, v in sorted(field_bytes.items())},
        "elapsed_s": elapsed,
        "encode_s": loop_s,  # reading, encoding and writing, without loading the encoders
        "images_per_s": encoded / loop_s if loop_s else 0.0,
    }
    out = sys.stderr
    print(f"\n{cache}: {summary['cache_samples']} samples, {manifest.num_bytes / 2**20:.1f} MiB, generation {manifest.generation}", file=out)
    print(f"  new {summary['new']} / changed {summary['changed']} / unchanged {summary['unchanged']} / "
          f"removed {summary['removed']}; duplicates {summary['duplicates']}", file=out)
    if summary["kept_unreadable"]:
        print(f"  kept {summary['kept_unreadable']} cached samples whose input could not be read or listed this time", file=out)
    print(f"  encoded {encoded} in {loop_s:.1f}s ({summary['images_per_s']:.1f} images/s; {elapsed:.1f}s with setup); "
          f"{summary['captions_truncated']} captions truncated to the token limit", file=out)
    if failures:
        print(f"  skipped {len(failures)} ({summary['failure_fraction']:.1%}), listed in {cache / 'failures.jsonl'}:", file=out)
        for reason, k in sorted(by_reason.items()):
            print(f"    {reason:<18} {k:>7}  {REASONS.get(reason, '')}", file=out)
    print("  buckets (height x width: samples):", file=out)
    for name, k in summary["buckets"].items():
        print(f"    {name:>10}: {k}", file=out)
    print("  bytes per sample: " + ", ".join(f"{k} {v:,.0f}" for k, v in summary["bytes_per_sample"].items()), file=out)
    return summary
