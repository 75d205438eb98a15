"""Stage one: encode an image-caption dataset once into the bucketed shard cache.

Reads images in DataLoader workers while the encoders run, writes shards per bucket through
`shards.ShardWriter`, and is incremental (content-keyed; an input whose size and mtime are unchanged is
not even read), resumable and crash-safe. Under torchrun every rank encodes a disjoint part of the inputs
into its own shards, all committing into the cache's one log; rank 0 holds the cache's lock for the run.
What leaves the cache, and when, is `precompute.removal`'s.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from precompute.config import DEFAULT_BATCH, PrecomputeConfig
from precompute.distributed import gather, lock_cache, setup_distributed
from precompute.encode import Encoders, best_device
from precompute.inputs import SourcesDataset, build_loader, open_inputs, unsalted, where
from precompute.families.base import Preset
from precompute.removal import (RemovalRefused, cached_inputs, damaged_shards, forget_created, removal_refused, removals,
                                replace_damaged, warn_damaged)
from precompute.report import check_disk_space, estimate_bytes_per_sample, report
from shards import CONTROL_PREFIX, FLIP_PREFIX, CacheSpec, Prompt, ShardWriter, exists, load, prompt_key
from shards.atomic import atomic_write_bytes
from shards.options import torch_dtype


def main(data: str, *args, **options) -> dict:
    """`run(PrecomputeConfig(data, *args, **options))`: the tests' and benchmarks' `main(DATA, MODEL, CACHE, workers=0)`."""
    return run(PrecomputeConfig(data, *args, **options))


def run(config: PrecomputeConfig) -> dict:
    """Encode `config.data` into `config.cache`. Returns the run summary (also printed); exit codes are the caller's.

    Raises:
        CacheBusy: another run is writing the cache.
        RemovalRefused: the run would remove more than allowed (everything it encoded is kept).
    """
    t_start = time.perf_counter()
    rank, world, local_rank = setup_distributed()
    device = best_device()
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)

    created = [d for d in (config.cache, *config.cache.parents) if not d.exists()]  # deepest first
    config.cache.mkdir(parents=True, exist_ok=True)
    lock = lock_cache(config.cache, rank, world)
    try:
        if rank == 0 and not config.repair:
            name_sources(config)
        if world > 1:
            dist.barrier()  # every rank scopes its inputs by the names rank 0 committed
        summary = _run(config, device, rank, world, t_start)
    except BaseException:
        if lock is not None and created:
            forget_created(created)
        raise
    finally:
        if lock is not None:
            lock.release()
    if world > 1:  # after _run's last barrier: no rank exits while a peer's gloo/NCCL connection is still open
        dist.destroy_process_group()
    return summary


def _run(config: PrecomputeConfig, device: torch.device, rank: int, world: int, t_start: float) -> dict:
    is_main, cache, repair = rank == 0, config.cache, config.repair
    preset, policy, storage = config.preset(), config.policy(), torch_dtype(config.storage_dtype)
    batch_size = config.batch_size or DEFAULT_BATCH[device.type]
    # 1. what the cache holds, from its manifest alone (no shard is opened), read under the lock; then the
    # inputs of every source, split disjointly by global rank. A source's scope is its own samples: new,
    # changed and removed count within it, and other sources are never touched. The loader's workers start
    # reading images now, while the encoders load.
    manifest = load(cache) if exists(cache) else None
    check_control(config, manifest)
    sources = config.sources()
    previous = {s.name: {key: src for key, src, *_ in manifest.samples(s.name)} if manifest else {} for s in sources}
    everything = frozenset(k for k, *_ in manifest.samples()) if manifest else frozenset()
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
        skip = everything - needed
    else:
        skip = everything  # an input whose content is cached in another source is read, then counted a duplicate
        if manifest is not None and is_main:
            warn_damaged(cache, manifest)
    parts, listings = [], {}
    for source in sources:
        mine = previous[source.name]
        known = {} if repair else unsalted(manifest.by_source(source.name), source) if manifest else {}
        only = {mine[k] for k in needed if k in mine} if repair else None
        inputs = open_inputs(config, source, policy, known, skip, rank=rank, world=world, only=only)
        if inputs.listed == 0 and not inputs.failures and not repair and not (manifest and manifest.num_samples):
            raise RemovalRefused(f"{where(source)}={source.path} lists no input, and the cache at {cache} holds no sample: "
                                 f"DATA lists nothing to encode. Is the folder empty or unmounted?")
        if inputs.listed == 0 and mine and not config.allow_removal and not repair:
            raise RemovalRefused(f"{where(source)}={source.path} lists no input, and the cache at {cache} holds {len(mine)} samples "
                                 f"of source {source.name!r}: a re-run would remove them all. Is the folder empty or unmounted? "
                                 f"Pass --allow-removal to remove them.")
        parts.append((source, inputs.dataset))
        listings[source.name] = inputs
    total = sum(i.total for i in listings.values()) if all(i.total is not None for i in listings.values()) else None
    workers = max(i.workers for i in listings.values())
    loader = build_loader(SourcesDataset(parts), workers, device)
    batches = iter(loader)  # forks the workers before any encoder weights exist in this process

    # 2. encoders and the fingerprint of everything that determines the cached values; a cache built
    # differently is refused before anything is encoded
    try:
        enc = Encoders(preset, device, vae_dtype=config.vae_dtype, text_dtype=config.text_dtype, pretrained=config.pretrained)
        bad = [b.name for b in policy.buckets if b.height % enc.downsample or b.width % enc.downsample]
        if bad:
            raise ValueError(f"buckets {bad} of the {preset.base_resolution} table are not multiples of the VAE's "
                             f"downsampling factor {enc.downsample}; choose a preset with another base resolution")
        # dtypes by torch's names ("bfloat16"), as every cache records them, whatever the option's spelling
        fingerprint = {**enc.fingerprint(), "storage_dtype": str(storage).removeprefix("torch."), "buckets": policy.fingerprint(),
                       "captions": {"caption_column": config.caption_column, "caption_keys": list(config.caption_key)}}
        if config.control:  # the cache holds control latents: never mixed with a cache without them (check_control)
            fingerprint["control"] = enc.latent_spec().control_fingerprint()
        schema = cache_schema(enc, storage, manifest, sources, cache, config.control)
        if manifest is not None:
            manifest.check_compatible(fingerprint, schema, cache)
        growth = sum(max(0, (i.listed or 0) - len(previous[name])) for name, i in listings.items())
        if config.check_disk and is_main and growth and not repair:
            check_disk_space(cache, estimate_bytes_per_sample(enc, policy, storage, control=config.control) * growth)
    except BaseException:
        del batches  # stops the workers now, not when the traceback is freed
        raise

    # 3. encode per bucket as images arrive, write shards
    writer = ShardWriter(cache, fingerprint, schema, rank=rank, max_shard_bytes=config.max_shard_mb << 20)
    counts: Counter = Counter()
    by_source: dict[str, Counter] = {s.name: Counter() for s in sources}
    failures: list[dict] = [{**f, "dataset": name} for name, i in listings.items() for f in i.failures]
    counts["failed"] += len(failures)
    for f in failures:
        by_source[f["dataset"]]["failed"] += 1
    seen: dict[str, tuple[str, str]] = {}  # key -> (source name, input)
    restamps: dict[str, int] = {}
    repaired: dict[str, dict[str, torch.Tensor]] = {}  # key -> fields, re-encoded for a damaged shard
    pending: dict = defaultdict(list)

    flipped_fields = [name for name in enc.latent_spec().flipped_fields if name in schema]

    def encode_and_write(items: list[dict]) -> None:
        latents = enc.encode_images(torch.stack([it["pixels"] for it in items]))  # (B, C, h, w) each
        flips = [j for j, it in enumerate(items) if it.get("flip")]
        mirrored = enc.encode_images(torch.stack([items[j]["pixels"].flip(-1) for j in flips])) if flips else {}
        # the control images, cropped as their images, through the same VAE: the pipelines' control latents
        controls = enc.encode_images(torch.stack([it["control_pixels"] for it in items])) if config.control else {}
        captions = [c for it in items for c in it["captions"]]
        texts, truncated = [], []
        for i in range(0, len(captions), config.text_batch_size):
            batch = enc.encode_text(captions[i : i + config.text_batch_size])
            texts += batch.fields
            truncated += batch.truncated
        counts["captions_truncated"] += sum(truncated)
        at = 0
        for j, it in enumerate(items):
            mine = texts[at : at + len(it["captions"])]  # this image's captions, back to back per field
            at += len(it["captions"])
            fields = {name: t[j].to(storage) for name, t in latents.items()}
            for name in flipped_fields:  # one row: the flipped image's latent; none for a source without flip
                plain = latents[name.removeprefix(FLIP_PREFIX)]
                row = mirrored[name.removeprefix(FLIP_PREFIX)][flips.index(j)][None] if j in flips else plain[j][None][:0]
                fields[name] = row.to(storage)
            fields.update({CONTROL_PREFIX + name: t[j].to(storage) for name, t in controls.items()})
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
            writer.write(it["key"], it["bucket"], fields, source=it["source"], stamp=it.get("stamp", 0), dataset=it["dataset"])
            outcome = "changed" if it["source"] in inputs_of[it["dataset"]] else "new"
            counts[outcome] += 1
            by_source[it["dataset"]][outcome] += 1

    stamps_of = {s.name: manifest.by_source(s.name) if manifest and not repair else {} for s in sources}
    inputs_of = {name: set(mine.values()) for name, mine in previous.items()}  # what a "changed" input was cached as
    bar = tqdm(total=total, unit="img", desc=f"precompute[{rank}]" if world > 1 else "precompute",
               disable=not config.progress or not is_main, dynamic_ncols=True)
    t_loop = time.perf_counter()
    wait_s = 0.0  # time blocked on the loader: near zero when decoding is hidden behind encoding
    try:
        while True:
            t_wait = time.perf_counter()
            item = next(batches, None)
            wait_s += time.perf_counter() - t_wait
            if item is None:
                break
            for name in ("pixels", "control_pixels"):
                if isinstance(item.get(name), np.ndarray):
                    item[name] = torch.from_numpy(item[name])
            bar.update(1)
            status, name = item["status"], item["dataset"]
            if status == "failed":  # a damaged tar stands for the samples it did not yield (`samples`)
                failures.append({k: item[k] for k in ("source", "reason", "detail", "dataset", "samples") if k in item})
                counts["failed"] += item.get("samples", 1)
                by_source[name]["failed"] += item.get("samples", 1)
            elif item["key"] in seen or (status == "unchanged" and item["key"] not in previous[name] and not repair):
                counts["duplicate"] += 1  # twice in this run, or cached in another source
                by_source[name]["duplicate"] += 1
            elif status == "unchanged":
                seen[item["key"]] = (name, item["source"])
                counts["unchanged"] += 1
                by_source[name]["unchanged"] += 1
                cached = stamps_of[name].get(item["source"])
                if cached and cached[0] == item["key"] and item.get("stamp") and cached[1] != item["stamp"]:
                    restamps[item["key"]] = item["stamp"]  # touched, same content: next time it is not read
            elif repair and item["key"] not in needed:
                counts["changed_since"] += 1  # the input changed after it was cached: a plain re-run updates it
            else:
                seen[item["key"]] = (name, item["source"])
                if item.get("caption_fallback"):  # not UTF-8: read in the encoding named, reported in the summary
                    counts[f"caption_fallback:{item['caption_fallback']}"] += 1
                pending[item["bucket"]].append(item)
                if len(pending[item["bucket"]]) >= batch_size:
                    encode_and_write(pending.pop(item["bucket"]))
            bar.set_postfix(new=counts["new"] + counts["changed"], unchanged=counts["unchanged"], failed=counts["failed"], refresh=False)
        for bucket in sorted(pending):
            encode_and_write(pending.pop(bucket))
        writer.restamp(restamps)
        if repair:
            summary = replace_damaged(writer, damaged, repaired, partial(cached_inputs, manifest, sources), cache)
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
    parts = gather({"counts": counts, "by_source": by_source, "failures": failures, "seen": seen, "loop_s": loop_s,
                    "wait_s": wait_s, "complete": {name: i.complete for name, i in listings.items()}}, world)
    summary: dict = {}
    refused = None
    if is_main:
        counts = sum((Counter(p["counts"]) for p in parts), Counter())
        by_source = {s.name: sum((Counter(p["by_source"][s.name]) for p in parts), Counter()) for s in sources}
        failures = sorted((f for p in parts for f in p["failures"]), key=lambda f: (f["dataset"], f["source"]))
        stale: set[str] = set()
        for source in sources:  # each source's removals, on the evidence of its own listing
            name, mine = source.name, previous[source.name]
            seen_keys = {k for p in parts for k, (n, _) in p["seen"].items() if n == name}
            gone_or_changed, kept = removals(mine, seen_keys, {f["source"] for f in failures if f["dataset"] == name},
                                             all(p["complete"][name] for p in parts))
            read = {src for p in parts for n, src in p["seen"].values() if n == name}
            changed = {k for k in gone_or_changed if mine[k] in read}
            gone = gone_or_changed - changed  # inputs no longer listed (changed ones were re-encoded)
            refusal = removal_refused(config, source, gone, mine)
            if refusal is not None:
                refused, gone = refused or refusal, set()
            stale |= changed | gone
            by_source[name]["removed"] = len(gone)
            by_source[name]["kept_unreadable"] = kept
        with ShardWriter(cache, fingerprint, schema) as final:
            final.remove(stale)
            store_prompts(final, enc, config.validation_prompt, storage)
            store_decoder(final, enc, preset)
            record_sources(final, sources)
        counts["removed"] = sum(c["removed"] for c in by_source.values())
        counts["kept_unreadable"] = sum(c["kept_unreadable"] for c in by_source.values())
        atomic_write_bytes(cache / "failures.jsonl", "".join(json.dumps(f) + "\n" for f in failures).encode())
        summary = report(cache, counts, failures, time.perf_counter() - t_start, max(p["loop_s"] for p in parts), by_source)
        summary["data_wait_fraction"] = sum(p["wait_s"] for p in parts) / max(sum(p["loop_s"] for p in parts), 1e-9)
    if world > 1:
        dist.barrier()
    if refused is not None:
        raise refused
    return summary


def cache_schema(enc: Encoders, storage: torch.dtype, manifest, sources: list, cache: Path, control: bool = False) -> dict:
    """The fields of every sample: the encoders' schema (with the control latent's fields, for a ControlNet cache),
    or, for a cache written before flipped latents could be stored, its own (without them), in which no source may
    ask for `flip`."""
    schema = enc.schema(storage, control)
    flipped = set(enc.latent_spec().flipped_fields)
    if manifest is not None and not flipped & set(manifest.schema):
        schema = {name: field for name, field in schema.items() if name not in flipped}
        asking = [s.name for s in sources if s.flip]
        if asking:
            raise ValueError(f"source {asking[0]!r} sets flip = true, but the cache at {cache} was built before flipped "
                             f"latents could be stored: write it into a new cache (--cache DIR)")
    return schema


def check_control(config: PrecomputeConfig, manifest) -> None:
    """Refuse to mix samples with and without control latents in one cache: a cache built with --control is extended
    only by runs with it, one built without only by runs without (the fingerprint's `control` part says which)."""
    if manifest is None or bool(manifest.fingerprint.get("control")) == config.control:
        return
    if config.control:
        raise ValueError(f"--control: the cache at {config.cache} was built without control images, and a cache holds "
                         f"control latents for every sample or for none. Write the ControlNet cache into a new directory "
                         f"(--cache DIR), or leave --control out to extend this one")
    raise ValueError(f"the cache at {config.cache} holds control latents (it was built with --control, for ControlNet "
                     f"training) and every sample needs one: pass --control, with a control image for every image, or "
                     f"write into a new directory (--cache DIR)")


def name_sources(config: PrecomputeConfig) -> None:
    """Before encoding (rank 0, under the cache's lock): remove the sources `--remove-source` names, and give a
    name to samples cached before sources had one, when this run has exactly one source (the cache was built
    from it: re-running the same DATA must find them unchanged)."""
    if not exists(config.cache):
        if config.remove_source:
            raise FileNotFoundError(f"--remove-source: {config.cache} holds no cache")
        return
    manifest = load(config.cache)
    check_control(config, manifest)  # before a source is removed or renamed
    present, sources = manifest.datasets(), config.sources()
    missing = [name for name in config.remove_source if name not in present]
    if missing:
        raise ValueError(f"--remove-source {missing[0]}: the cache at {config.cache} has no such source; it has "
                         f"{', '.join(repr(n) for n in present) or 'none'}")
    unnamed = "" in present and len(sources) == 1 and sources[0].name not in present
    if not config.remove_source and not unnamed:
        return
    with ShardWriter(config.cache, manifest.fingerprint, manifest.schema) as writer:
        for name in config.remove_source:
            removed = writer.remove_dataset(name)
            print(f"{config.cache}: removed source {name!r} ({removed} samples)", file=sys.stderr)
        if config.remove_source:
            recorded = {k: v for k, v in manifest.extra.get("sources", {}).items() if k not in config.remove_source}
            writer.set_extra("sources", recorded)
        if unnamed:
            moved = writer.rename_dataset("", sources[0].name)
            print(f"{config.cache}: the {moved} samples cached before sources were named now belong to source "
                  f"{sources[0].name!r}", file=sys.stderr)


def record_sources(writer: ShardWriter, sources: list) -> None:
    """Each source's path and share (repeats or weight) in the manifest, where training reads them; sources this
    run does not list keep their records."""
    recorded = dict(writer.manifest.extra.get("sources", {}))
    recorded.update({s.name: s.record() for s in sources})
    if recorded != writer.manifest.extra.get("sources"):
        writer.set_extra("sources", recorded)


def store_prompts(writer: ShardWriter, enc: Encoders, validation_prompts, storage: torch.dtype) -> None:
    """The empty caption (guidance, caption dropout) and the validation prompts, beside the shards."""
    prompts = {"": False, **{p: True for p in validation_prompts}}  # text -> with instruction
    stored = {}
    for text, instruction in prompts.items():
        fields = enc.encode_text([text], instruction=instruction).fields[0]
        stored[prompt_key(text)] = Prompt(text, {name: t.to(storage) for name, t in fields.items()})
    writer.add_prompts(stored, enc.prompt_schema(storage))


def store_decoder(writer: ShardWriter, enc: Encoders, preset: Preset) -> None:
    """Stage one's record (`shards.CacheSpec`): how training rebuilds the VAE decoder, and its weights when they
    exist nowhere else; a re-run that changes nothing commits nothing."""
    decoder, files = enc.decoder_recipe()
    for path, blob in files.items():
        role = f"decoder:{Path(path).name}"
        if writer.manifest.files.get(role, {}).get("sha256") != hashlib.sha256(blob).hexdigest():
            writer.add_file(role, path, blob)
    record = CacheSpec(enc.latent_spec(), enc.text_spec(), preset.family, preset.name, preset.base_resolution, decoder,
                       extra={"text_encoder": preset.text.name}).record()
    if writer.manifest.extra.get("precompute") != json.loads(json.dumps(record)):
        writer.set_extra("precompute", record)
