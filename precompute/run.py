"""Stage one: encode an image-caption dataset once into the bucketed shard cache.

Reads images in DataLoader workers while the encoders run, writes shards per bucket through
`shards.ShardWriter`, and is incremental (content-keyed), resumable and crash-safe. Under torchrun
every rank encodes a disjoint part of the inputs into its own shards; rank 0 merges at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
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
)
from precompute.encode import DTYPES, Encoders, best_device
from precompute.presets import get_preset, get_text_encoder
from shards import MANIFEST, Cache, Manifest, Prompt, ShardWriter, bucket_table, merge, prompt_key
from shards.atomic import atomic_write_bytes
from shards.manifest import RANK_MANIFEST_GLOB


# Images per VAE batch. Large batches pay on GPUs; on CPUs a batch's activations fall out of the caches
# and every image costs more (make bench: tiny-pixart 42 img/s at batch 1, 31 at 4, 21 at 8).
DEFAULT_BATCH = {"cuda": 16, "cpu": 1}


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


def cached_sources(cache: Path) -> dict[str, str]:
    """key -> source of every sample already in the cache."""
    if not (cache / MANIFEST).exists():
        return {}
    c = Cache(cache)
    out = {}
    for j in range(len(c.shards)):
        reader = c.shard(j)
        packed, offsets = reader.tensor("source"), reader.tensor("source.offsets").tolist()
        for i, key in enumerate(reader.keys):
            out[key] = packed[offsets[i] : offsets[i + 1]].numpy().tobytes().decode("utf-8")
    return out


def estimate_bytes_per_sample(enc: Encoders, policy: ImagePolicy, storage: torch.dtype, captions: int = 1) -> int:
    """Latents at the largest bucket area plus half the token limit per caption: an estimate for the disk check."""
    area = max(b.height * b.width for b in policy.buckets) // enc.downsample**2
    latents = (2 if enc.preset.vae.gaussian else 1) * enc.latent_channels * area
    text = captions * enc.preset.text.max_length // 2 * enc.text_dim
    if enc.preset.text.kind == "sd3":  # every token is kept: CLIP's 77 and T5's whole length
        text = captions * (77 * enc.clip_dim + enc.pooled_dim + (0 if enc.preset.text.drop_t5 else enc.preset.text.max_length * enc.text_dim))
    return (latents + text) * storage.itemsize + 256


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
    max_failure_fraction: float = 0.1,
    max_shard_mb: int = 128,
    check_disk: bool = True,
    progress: bool = True,
) -> dict:
    """Encode DATA into CACHE. Returns the run summary (also printed); exit code is the caller's."""
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

    # 1. the cache's samples (after finishing an interrupted multi-process run), then the inputs, split
    # disjointly by global rank. The loader's workers start reading images now, while the encoders load.
    cache.mkdir(parents=True, exist_ok=True)
    if is_main and any(cache.glob(RANK_MANIFEST_GLOB)):
        merge(cache)
    if world > 1:
        dist.barrier()
    previous = cached_sources(cache)
    previous_by_source = {s: k for k, s in previous.items()}
    policy = ImagePolicy(bucket_table(preset.base_resolution), max_upscale=max_upscale, allow_upscale=allow_upscale,
                         extreme_aspect=extreme_aspect, max_pixels=max_pixels)
    if is_tar_source(data):
        urls = expand_tar_urls(data, allow_pipe)
        mine = urls[rank::world]
        dataset = TarDataset(mine, policy, frozenset(previous), tuple(caption_keys))
        total, workers = None, min(workers, len(mine))
    else:
        if not Path(data).is_dir():
            raise FileNotFoundError(f"DATA={data} is neither a folder of images nor webdataset tars")
        entries = list_folder(data, caption_column)
        mine = entries[rank::world]
        dataset = FolderDataset(mine, policy, frozenset(previous))
        total = len(mine)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
        prefetch_factor=4 if workers else None, multiprocessing_context="fork" if workers else None,
        collate_fn=None if device.type == "cuda" or not workers else pixels_as_array,
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
        if is_main and (cache / MANIFEST).exists():
            Manifest.load(cache / MANIFEST).check_compatible(Manifest(fingerprint, schema), cache)
        if world > 1:
            dist.barrier()
        if check_disk and is_main and total:
            need = estimate_bytes_per_sample(enc, policy, storage) * max(0, len(entries) - len(previous))
            free = shutil.disk_usage(cache).free
            if need > free:
                raise OSError(f"the cache needs about {need / 2**30:.1f} GiB at {cache} but {free / 2**30:.1f} GiB are free; "
                              f"free space or pass --no-check-disk")
    except BaseException:
        del batches  # stops the workers now, not when the traceback is freed
        raise

    # 3. encode per bucket as images arrive, write shards
    writer = ShardWriter(cache, fingerprint, schema, rank=rank, world_size=world, max_shard_bytes=max_shard_mb << 20)
    counts: Counter = Counter()
    failures: list[dict] = []
    seen: dict[str, str] = {}
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
            fields["source"] = torch.frombuffer(bytearray(it["source"].encode("utf-8")), dtype=torch.uint8)
            bad_fields = [n for n, t in fields.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            if bad_fields:
                failures.append({"source": it["source"], "reason": "non_finite", "detail": f"fields {bad_fields}"})
                counts["failed"] += 1
                continue
            writer.write(it["key"], it["bucket"], fields)
            counts["changed" if it["source"] in previous_by_source else "new"] += 1

    bar = tqdm(total=total, unit="img", desc=f"precompute[{rank}]" if world > 1 else "precompute",
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
            else:
                seen[item["key"]] = item["source"]
                pending[item["bucket"]].append(item)
                if len(pending[item["bucket"]]) >= batch_size:
                    encode_and_write(pending.pop(item["bucket"]))
            bar.set_postfix(new=counts["new"] + counts["changed"], unchanged=counts["unchanged"], failed=counts["failed"], refresh=False)
        for bucket in sorted(pending):
            encode_and_write(pending.pop(bucket))
        writer.finish()
        loop_s = time.perf_counter() - t_loop
    except BaseException:
        writer.close()  # everything published so far stays valid; buffered samples are redone next run
        raise
    finally:
        bar.close()

    # 5. rank 0: merge, drop samples whose source disappeared or changed, store prompt embeddings
    parts = gather({"counts": counts, "failures": failures, "seen": seen, "loop_s": loop_s, "wait_s": wait_s}, world)
    summary: dict = {}
    if is_main:
        counts = sum((Counter(p["counts"]) for p in parts), Counter())
        failures = sorted((f for p in parts for f in p["failures"]), key=lambda f: f["source"])
        seen_keys = set().union(*(p["seen"] for p in parts))
        if world > 1:
            merge(cache)
        stale = set(previous) - seen_keys
        with ShardWriter(cache, fingerprint, schema) as final:
            final.remove(stale)
            prompts = {"": False, **{p: True for p in validation_prompts}}  # text -> with instruction
            stored = {}
            for text, instruction in prompts.items():
                fields = enc.encode_text([text], instruction=instruction).fields[0]
                stored[prompt_key(text)] = Prompt(text, {name: t.to(storage) for name, t in fields.items()})
            final.add_prompts(stored, enc.prompt_schema(storage))
            decoder, files = enc.decoder_recipe()
            for path, data in files.items():
                final.add_file(f"decoder:{Path(path).name}", path, data)
            final.manifest.extra["precompute"] = {"preset": preset.name, "family": preset.family, "text_encoder": preset.text.name,
                                                  "base_resolution": preset.base_resolution, "decoder": decoder}
        counts["removed"] = len(stale) - counts["changed"]
        lines = "".join(json.dumps(f) + "\n" for f in failures)
        atomic_write_bytes(cache / "failures.jsonl", lines.encode())
        summary = report(cache, counts, failures, time.perf_counter() - t_start, max(p["loop_s"] for p in parts))
        summary["data_wait_fraction"] = sum(p["wait_s"] for p in parts) / max(sum(p["loop_s"] for p in parts), 1e-9)
    if world > 1:
        dist.barrier()
    return summary


def report(cache: Path, counts: Counter, failures: list[dict], elapsed: float, loop_s: float) -> dict:
    manifest = Cache(cache).manifest
    encoded = counts["new"] + counts["changed"]
    considered = encoded + counts["unchanged"] + counts["failed"]
    by_reason = Counter(f["reason"] for f in failures)
    field_bytes = Counter()
    for s in manifest.shards:
        field_bytes.update(s.field_bytes)
    n = max(manifest.num_samples, 1)
    summary = {
        "encoded": encoded,
        "new": counts["new"],
        "changed": counts["changed"],
        "unchanged": counts["unchanged"],
        "removed": counts["removed"],
        "duplicates": counts["duplicate"],
        "failed": counts["failed"],
        "failed_by_reason": dict(sorted(by_reason.items())),
        "captions_truncated": counts["captions_truncated"],
        "failure_fraction": counts["failed"] / max(considered, 1),
        "cache_samples": manifest.num_samples,
        "cache_bytes": manifest.num_bytes,
        "buckets": {b.name: st.samples for b, st in manifest.buckets().items()},
        "bytes_per_sample": {k: v / n for k, v in sorted(field_bytes.items())},
        "elapsed_s": elapsed,
        "encode_s": loop_s,  # reading, encoding and writing, without loading the encoders
        "images_per_s": encoded / loop_s if loop_s else 0.0,
    }
    out = sys.stderr
    print(f"\n{cache}: {summary['cache_samples']} samples, {manifest.num_bytes / 2**20:.1f} MiB", file=out)
    print(f"  new {summary['new']} / changed {summary['changed']} / unchanged {summary['unchanged']} / "
          f"removed {summary['removed']}; duplicates {summary['duplicates']}", file=out)
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
