"""Stage one: encode an image-caption dataset once into the bucketed shard cache.

Reads images in DataLoader workers while the encoders run, writes shards per bucket through
`shards.ShardWriter`, and is incremental (content-keyed; an input whose size and mtime are unchanged is
not even read), resumable and crash-safe. Under torchrun every rank encodes a disjoint part of the inputs
into its own shards, all committing into the cache's one log; rank 0 holds the cache's lock for the run.
What leaves the cache, and when, is `precompute.removal`'s.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from precompute.clips import CLIP, cached_clips, unsalted_clips
from precompute.config import DEFAULT_BATCH, PrecomputeConfig
from precompute.distributed import gather_to_main, lock_cache, setup_distributed
from precompute.encode import Encoders, best_device
from precompute.encoding import EncodingPass
from precompute.families.base import Preset
from precompute.inputs import SourcesDataset, build_loader, open_inputs, unsalted, where
from precompute.presets import weights_sources
from precompute.progress import PlainProgress
from precompute.removal import (
    LOCK_FILE,
    RemovalRefused,
    cached_inputs,
    damaged_shards,
    forget_created,
    removal_refused,
    removals,
    repair_texts,
    replace_damaged,
    replace_texts,
    text_referrers,
    warn_damaged,
)
from precompute.report import check_disk_space, estimate_bytes_per_sample, report
from precompute.tally import CachedLatents, Seen, Tally, once_per_input
from shards import LATENT_KEY, MASK, CacheSpec, Field, Prompt, ShardWriter, exists, load, prompt_key
from shards.atomic import atomic_write_bytes
from shards.options import torch_dtype
from shards.references import REFERENCE_FIELDS
from shards.sample_index import SampleIndex, StampTable
from shards.texts import TEXT_KEYS, TEXT_LENGTHS


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

    # the encoders' weights can be had (or the run stops at once, before anything is listed or created)
    sources = weights_sources(config.preset(), config.pretrained)
    created = [d for d in (config.cache, *config.cache.parents) if not d.exists()]  # deepest first
    config.cache.mkdir(parents=True, exist_ok=True)
    lock = lock_cache(config.cache, rank, world)
    try:
        if rank == 0 and not config.repair:
            name_sources(config)
        if world > 1:
            dist.barrier()  # every rank scopes its inputs by the names rank 0 committed
        summary = _run(config, device, rank, world, t_start, sources)
        if created and world == 1 and not config.repair and summary.get("cache_samples") == 0:
            drop_empty_cache(config.cache, created)
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


def drop_empty_cache(cache: Path, created: list[Path]) -> None:
    """A cache this run created and cached no sample into (every input failed) is not left behind: all of it goes but
    failures.jsonl, which says why each input failed (and the directories, when nothing failed). `created`: the cache
    directory and the parents the run made, deepest first; the caller holds the lock until it lets go."""
    failures = cache / "failures.jsonl"
    for entry in cache.iterdir():
        if entry == failures and failures.stat().st_size:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif not LOCK_FILE.fullmatch(entry.name):  # the lock's files go with the directory, once it is let go
            entry.unlink()
    print(f"{cache}: no sample was cached, so no cache is kept" + (f"; {failures} lists why each input failed"
                                                                    if failures.exists() else ""), file=sys.stderr)
    if not failures.exists():
        forget_created(created)


@dataclass
class Inputs:
    """What a rank reads: per source, the samples cached before (its sample index, searched in place) and its
    listing; per source and resolution, its stamp table (input -> (key, stamp), empty when repairing); the loader over
    them all; when repairing, the damaged shards and the keys of their samples."""

    sources: list
    previous: dict[str, SampleIndex]
    listings: dict
    batches: Iterator
    total: int | None
    damaged: dict[str, list[str]] = field(default_factory=dict)
    needed: set[str] | None = None
    # per source, the global indices of its cached samples of resolutions it no longer has (sorted)
    dropped: dict[str, np.ndarray] = field(default_factory=dict)
    texts_only: set[str] = field(default_factory=set)  # repairing: keys read for the texts they refer to alone
    stamps: dict[tuple[str, int], StampTable | dict] = field(default_factory=dict)


class SkipKeys:
    """Keys already cached (an input of one is "unchanged" after reading): the manifest's key lookup, searched in
    place (`shards.table.ShardTable.key_index`), less the keys of `needed` (repairing: their inputs are encoded again)."""

    def __init__(self, keys, needed: set[str] = frozenset()):
        self.keys, self.needed = keys, needed

    def __contains__(self, key) -> bool:
        return key not in self.needed and key in self.keys


def _run(config: PrecomputeConfig, device: torch.device, rank: int, world: int, t_start: float, sources: dict[str, str]) -> dict:
    manifest = load(config.cache) if exists(config.cache) else None
    check_control(config, manifest)
    if manifest is not None:
        config.keep_resolutions(manifest)
        kept = config.keep_recorded(manifest)
        if rank == 0:
            say_recorded(config, manifest, kept)
    # 1. what the cache holds, from its manifest alone (no shard is opened), read under the lock; then the inputs of
    # every source, split disjointly by global rank. The loader's workers start reading images now, while the
    # encoders load.
    repaired, rebuild = {}, {}  # rebuild: damaged text shards of texts seen with reference images -> their keys
    if config.repair and manifest is not None and manifest.texts is not None:  # texts first: the samples refer to them
        repaired, rebuild = repair_texts(config, manifest, device) if rank == 0 else ({}, {})
        if world > 1:
            dist.barrier()
    inputs = open_all_inputs(config, manifest, device, rank, world, rebuild)
    if inputs is None:  # a repair with nothing damaged (or no sample left to rebuild a damaged text shard from)
        return {"repaired_shards": 0, "repaired_samples": 0, "unrepairable": [], **repaired,
                **(replace_texts(None, rebuild, {}, config.cache) if rebuild else {})}
    # 2. encoders and the fingerprint of everything that determines the cached values; a cache built differently is
    # refused before anything is encoded
    try:
        enc = Encoders(config.preset(), device, vae_dtype=config.vae_dtype, text_dtype=config.text_dtype, pretrained=config.pretrained,
                       sources=sources)
        fingerprint, schema, text_schema = check_cache(config, enc, manifest, inputs, is_main=rank == 0)
    except BaseException:
        del inputs.batches  # stops the workers now, not when the traceback is freed
        raise
    # 3. encode per bucket as images arrive, write shards
    storage = torch_dtype(config.storage_dtype)
    writer = ShardWriter(config.cache, fingerprint, schema, rank=rank, max_shard_bytes=config.max_shard_mb << 20,
                         text_schema=text_schema, manifest=manifest.copy() if manifest is not None else None)
    tally = Tally(by_source={s.name: Counter() for s in inputs.sources}, seen=Seen(manifest.shards if manifest else None))
    for name, listing in inputs.listings.items():
        for failure in listing.failures:
            tally.fail({**failure, "dataset": name})
    stamps = inputs.stamps
    # a clip is a batch of its own by default: an 81-frame 480p clip holds twice the pixels of 16 images at 1024²
    batch = config.batch_size or (1 if config.video else DEFAULT_BATCH[device.type])
    encoding = EncodingPass(enc, writer, schema, storage, batch, config.text_batch_size,
                            config.control, inputs.previous, stamps, inputs.needed, tally, cached_latents(config, enc, manifest, schema),
                            rebuild_texts={k for keys in rebuild.values() for k in keys}, texts_only=inputs.texts_only)
    desc = f"precompute[{rank}]" if world > 1 else "precompute"
    if config.progress and sys.stderr.isatty() or rank != 0:  # rank 0 speaks for all
        bar = tqdm(total=inputs.total, unit="input" if config.video else "img", desc=desc, disable=rank != 0, dynamic_ncols=True)
    else:  # a log file or a pipe: a plain line now and then
        bar = PlainProgress(inputs.total, config.log_seconds, desc)
    try:
        encoding.run(inputs.batches, bar)
        writer.restamp(tally.restamps)
        if inputs.needed is not None:
            summary = replace_damaged(writer, inputs.damaged, tally.repaired, partial(cached_inputs, manifest, inputs.sources), config.cache)
            summary.update(repaired)
            if rebuild:  # after the samples: a text shard rebuilt from the inputs of the samples that refer to its texts
                more = replace_texts(writer, rebuild, tally.repaired_texts, config.cache)
                summary.update(more, repaired_text_shards=repaired.get("repaired_text_shards", 0) + more["repaired_text_shards"])
        writer.finish()
    except BaseException:
        writer.close()  # everything committed so far stays valid; buffered samples are redone next run
        raise
    finally:
        bar.close()
    if inputs.needed is not None:
        return summary
    # 4. rank 0: remove what is gone on evidence, store prompt embeddings and the decoder recipe
    # every rank's tally to rank 0 alone (its kept inputs a bit per cached sample), which decides and commits
    parts = gather_to_main({"counts": tally.counts, "by_source": tally.by_source, "failures": tally.failures,
                            "seen": tally.seen.part(), "loop_s": tally.loop_s, "wait_s": tally.wait_s, "encoder_s": tally.encoder_s,
                            "write_wait_s": tally.write_wait_s, "write_s": tally.write_s,
                            "complete": {name: i.complete for name, i in inputs.listings.items()}}, rank, world)
    summary, refused = {}, None
    if rank == 0:
        summary, refused = finish(config, enc, fingerprint, schema, text_schema, inputs, parts, t_start, manifest)
    if world > 1:
        dist.barrier()
    if refused is not None:
        raise refused
    return summary


def open_all_inputs(config: PrecomputeConfig, manifest, device: torch.device, rank: int, world: int,
                    rebuild: dict[str, list[str]] | None = None) -> Inputs | None:
    """Every source's inputs for this rank, and the loader over them. A source's scope is its own samples: new,
    changed and removed count within it, and other sources are never touched. A source cached at several
    resolutions is read once per resolution, each read against that resolution's samples. Repairing, only the
    damaged samples' inputs are read (a folder's others are not listed; a tar's are skipped by key), and those of the
    samples referring to the texts of `rebuild`'s text shards (texts seen with their samples' reference images, which
    only the inputs give); None if nothing is damaged."""
    cache, repair = config.cache, config.repair
    sources = config.sources()
    # the sample index searched in place: per source its samples, and every key of the cache
    previous = {s.name: manifest.index(s.name) if manifest else SampleIndex([]) for s in sources}
    everything = manifest.shards.key_index() if manifest else frozenset()
    damaged, needed = {}, None
    if repair:
        if manifest is None:
            raise FileNotFoundError(f"{cache} holds no cache to repair; build it with `make precompute DATA=... CACHE={cache}`")
        damaged = damaged_shards(cache, manifest)
        needed = {k for keys in damaged.values() for k in keys}
        texts_only = text_referrers(manifest, rebuild or {}) - needed
        if not damaged and not texts_only:
            if not rebuild:
                print(f"{cache}: every shard of generation {manifest.generation} is intact; nothing to repair", file=sys.stderr)
            return None
        needed |= texts_only
        skip = SkipKeys(everything, needed)
    else:
        skip = everything  # an input whose content is cached in another source is read, then counted a duplicate
        if manifest is not None and rank == 0:
            warn_damaged(cache, manifest)
    parts, listings, dropped, stamps = [], {}, {}, {}
    for source in sources:
        tags = {config.resolution_tag(r) for r in config.resolutions(source)}
        gone = [manifest.index(source.name, tag).global_indices() for tag in (manifest.resolutions() if manifest and not repair else ())
                if tag not in tags]
        dropped[source.name] = np.sort(np.concatenate(gone)) if gone else np.zeros(0, np.int64)
        for resolution in config.resolutions(source):
            tag = config.resolution_tag(resolution)
            # input -> (key, stamp) cached at this resolution: searched in place, shared by the listing and the pass
            stamps[(source.name, tag)] = manifest.by_source(source.name, tag) if manifest and not repair else {}
            if source.name in listings:  # the same listing again, on another resolution's table
                more = open_source(config, manifest, source, tag, skip, needed, rank, world, stamps[(source.name, tag)])
                if more is not None:
                    parts.append((source, more.dataset, tag))
                    listings[source.name] = also_read(listings[source.name], more)
                continue
            inputs = open_source(config, manifest, source, tag, skip, needed, rank, world, stamps[(source.name, tag)], must=True)
            listings[source.name] = inputs
            parts.append((source, inputs.dataset, tag))
    total = sum(i.total for i in listings.values()) if all(i.total is not None for i in listings.values()) else None
    workers = max(i.workers for i in listings.values())
    loader = build_loader(SourcesDataset(parts), workers, device)
    batches = iter(loader)  # forks the workers before any encoder weights exist in this process
    return Inputs(sources, previous, listings, batches, total, damaged, needed, dropped, texts_only if repair else set(), stamps)


def open_source(config: PrecomputeConfig, manifest, source, tag: int, skip, needed: set[str] | None,
                rank: int, world: int, stamps: StampTable | dict | None = None, must: bool = False):
    """One source's inputs at one resolution (`tag`, see `PrecomputeConfig.resolution_tag`), read against that
    resolution's cached samples; repairing, only the damaged ones' inputs (None when it has none and not `must`).
    The source's first resolution (`must`) is where a listing that finds nothing is refused. `stamps`: its stamp
    table at `tag` (`Manifest.by_source`)."""
    cache, repair = config.cache, config.repair
    policy = config.policy(tag or None)
    only = None
    if repair:  # the inputs of the needed samples cached at this resolution
        at_tag = manifest.index(source.name, tag) if manifest else SampleIndex([])
        only = {at_tag.source(p) for p in at_tag.find_all("keys", sorted(needed)).tolist() if p >= 0} if len(at_tag) else set()
    if repair and not only and not must:
        return None
    if repair or not manifest:
        known = {}
    elif config.video:  # every input's cached clips: kept, skipped or encoded again together
        known = unsalted_clips(cached_clips(manifest, source.name, tag), source.salt())
    else:
        known = unsalted(stamps if stamps is not None else manifest.by_source(source.name, tag), source)
    inputs = open_inputs(config, source, policy, known, skip, rank=rank, world=world, only=only)
    positions = getattr(inputs.dataset, "positions", None)
    if manifest is not None and manifest.num_samples and (positions is None or bool((positions < 0).any())):
        # the key lookup `skip` searches: built once, here, before the loader's workers fork
        manifest.shards.sample_index().lookup("keys")
    if must:
        mine = manifest.datasets().get(source.name, {}).get("samples", 0) if manifest else 0
        if inputs.listed == 0 and not inputs.failures and not repair and not (manifest and manifest.num_samples):
            raise RemovalRefused(f"{where(source)}={source.path} lists no input, and the cache at {cache} holds no sample: "
                                 f"DATA lists nothing to encode. Is the folder empty or unmounted?")
        if inputs.listed == 0 and mine and not config.allow_removal and not repair:
            raise RemovalRefused(f"{where(source)}={source.path} lists no input, and the cache at {cache} holds {mine} samples "
                                 f"of source {source.name!r}: a re-run would remove them all. Is the folder empty or unmounted? "
                                 f"Pass --allow-removal to remove them.")
    return inputs


def also_read(first, more):
    """A source's listing read again at another resolution: its inputs count once more, its listing failures once."""
    return replace(first, total=None if first.total is None or more.total is None else first.total + more.total,
                   listed=None if first.listed is None or more.listed is None else first.listed + more.listed,
                   complete=first.complete and more.complete, workers=max(first.workers, more.workers))


def check_cache(config: PrecomputeConfig, enc: Encoders, manifest, inputs: Inputs, is_main: bool) -> tuple[dict, dict, dict | None]:
    """The run's fingerprint, sample schema and text schema (None: texts stored with each sample), checked against the
    cache's (a cache built otherwise is refused) and the buckets' fit to the VAE; with room on disk for the new samples."""
    policy, storage = config.policy(), torch_dtype(config.storage_dtype)
    for resolution in config.resolutions():
        bad = [b.name for b in config.table(resolution) if b.height % enc.downsample or b.width % enc.downsample]
        if bad:
            raise ValueError(f"buckets {bad} of the {resolution} table are not multiples of the VAE's downsampling factor "
                             f"{enc.downsample}; choose another --resolution")
    check_tables(config, manifest)
    # dtypes by torch's names ("bfloat16"), as every cache records them, whatever the option's spelling
    fingerprint = {**enc.fingerprint(), "storage_dtype": str(storage).removeprefix("torch."), "buckets": policy.fingerprint(),
                   "captions": {"caption_column": config.caption_column, "caption_keys": list(config.caption_key)}}
    if config.control:  # the cache holds control latents: never mixed with a cache without them (check_control)
        fingerprint["control"] = enc.latent_spec().control_fingerprint()
    schema = cache_schema(enc, storage, manifest, inputs.sources, config.cache, config.control)
    # each text stored once in a new cache (unless --no-dedup-texts); an existing cache keeps its layout
    dedup = manifest.text_schema is not None if manifest is not None else config.dedup_texts
    text_schema = enc.prompt_schema(storage) if dedup else None
    if text_schema is not None:
        schema = texts_stored_once(schema, text_schema)
    if manifest is not None:
        manifest.check_compatible(fingerprint, schema, config.cache, text_schema)
    growth = {s.name: max(0, (inputs.listings[s.name].listed or 0) - len(inputs.previous[s.name])) for s in inputs.sources}
    if config.check_disk and is_main and any(growth.values()) and not config.repair:
        # a source's caption variants are that many captions per sample (fewer where some were identical); latents at
        # the largest resolution
        largest = config.policy(max(config.resolutions()))
        # an edit sample's references: one at that area (a typical edit pair; more where the source has more)
        need = sum(n * clips_per_input(enc, s) * estimate_bytes_per_sample(enc, largest, storage, captions=s.caption_variants,
                                                                            control=config.control,
                                                                            references=int(s.takes_references and bool(enc.preset.references)))
                   for s in inputs.sources if (n := growth[s.name]))
        check_disk_space(config.cache, need)
    return fingerprint, schema, text_schema


def clips_per_input(enc: Encoders, source) -> int:
    """For the disk estimate, latent frames an input of `source` holds at most: its longest clip's, times the clips
    of "uniform" (1 for an image model's)."""
    if not source.frame_buckets:
        return 1
    return enc.latent_spec().latent_frames(source.frame_buckets[-1]) * (source.clips if source.clip_extraction == "uniform" else 1)


def texts_stored_once(schema: dict, text_schema: dict) -> dict:
    """The sample schema of a cache that stores each text once: the text fields and `text_lengths` leave the samples,
    which refer to their texts by `text_keys` (`shards.texts`)."""
    out = {name: field for name, field in schema.items() if name not in text_schema and name != TEXT_LENGTHS}
    return {**out, TEXT_KEYS: Field(torch.uint8, ragged=True)}


def finish(config: PrecomputeConfig, enc: Encoders, fingerprint: dict, schema: dict, text_schema: dict | None, inputs: Inputs,
           parts: list[dict], t_start: float, manifest=None) -> tuple[dict, RemovalRefused | None]:
    """Rank 0, after every rank's pass: each source's removals on the evidence of its own listing, the prompts, the
    decoder recipe and the sources' records committed; failures.jsonl and the summary. Returns the summary and the
    refusal to raise once every rank is done (what was encoded is kept). `manifest`: the one the run started with
    (None: a new cache); the removals are decided on its global indices."""
    cache, sources = config.cache, inputs.sources
    counts = sum((Counter(p["counts"]) for p in parts), Counter())
    by_source = {s.name: sum((Counter(p["by_source"][s.name]) for p in parts), Counter()) for s in sources}
    failures = sorted((f for p in parts for f in p["failures"]), key=lambda f: (f["dataset"], f["source"]))
    # an input read at several resolutions fails at each: it is one failed input, listed and counted once
    failures, again = once_per_input(failures, {s.name: config.resolutions(s) for s in sources})
    for name, n in again.items():
        by_source[name]["failed"] -= n
    counts["failed"] -= sum(again.values())
    counts["failed_again"] = sum(again.values())  # the reads that failed, for the share of inputs that failed
    complete = {s.name: all(p["complete"][s.name] for p in parts) for s in sources}
    stale, refused = decide_removals(config, inputs, Seen.merged([p["seen"] for p in parts]), failures, complete, manifest, by_source)
    storage = torch_dtype(config.storage_dtype)
    # the manifest the run decided on, brought up to date with the pass's commits: the cache is not loaded again
    with ShardWriter(cache, fingerprint, schema, text_schema=text_schema, manifest=manifest.copy() if manifest is not None else None) as final:
        final.remove(stale)
        final.drop_unreferenced_texts()  # texts of samples refused, or of a run killed between texts and samples
        store_prompts(final, enc, config.validation_prompt, storage)
        store_decoder(final, enc, enc.preset, recorded_tables(config, final.manifest))
        record_sources(final, sources)
    counts["removed"] = sum(c["removed"] for c in by_source.values())
    counts["kept_unreadable"] = sum(c["kept_unreadable"] for c in by_source.values())
    atomic_write_bytes(cache / "failures.jsonl", "".join(json.dumps(f) + "\n" for f in failures).encode())
    # where the passes' time went, over every rank's pass: the encoders are what the run is for; time waiting on the
    # loader or the writer is time they idle
    passes = max(sum(p["loop_s"] for p in parts), 1e-9)
    shares = {"encoder_s": sum(p["encoder_s"] for p in parts),
              "encoder_busy_fraction": sum(p["encoder_s"] for p in parts) / passes,
              "data_wait_fraction": sum(p["wait_s"] for p in parts) / passes,
              "writer_wait_fraction": sum(p["write_wait_s"] for p in parts) / passes,
              "writer_busy_fraction": sum(p["write_s"] for p in parts) / passes}
    summary = report(cache, counts, failures, time.perf_counter() - t_start, max(p["loop_s"] for p in parts), by_source, shares)
    return summary, refused


def decide_removals(config: PrecomputeConfig, inputs: Inputs, seen: dict, failures: list[dict], complete: dict[str, bool],
                    manifest, by_source: dict[str, Counter]) -> tuple[set[str], RemovalRefused | None]:
    """Rank 0: each source's cached samples to remove on the evidence of its own listing (`seen`: every rank's
    `Seen.part` merged; `complete`: per source, whether every rank listed it completely), on the global indices of
    the manifest the run started with (None: a new cache); counts `removed` and `kept_unreadable` into `by_source`.
    Returns the keys to remove and the refusal to raise once every rank is done."""
    sources, previous = inputs.sources, inputs.previous
    index = manifest.shards.sample_index() if manifest is not None else None  # positions are global indices
    stale: list[np.ndarray] = []
    refused = None
    for source in sources:
        # samples of a resolution the source is no longer cached at go, counted as removed
        name, dropped = source.name, inputs.dropped.get(source.name, np.zeros(0, np.int64))
        mine = previous[name].global_indices()
        mine = mine[~np.isin(mine, dropped)] if len(dropped) else mine  # (N,) global indices of its cached samples
        gone_or_changed, kept = removals(mine, seen["cached"], index.source if index is not None else None,
                                         {f["source"] for f in failures if f["dataset"] == name},
                                         complete[name])
        changed = read_again(gone_or_changed, name, seen, index, manifest)
        gone = gone_or_changed[~changed]  # inputs no longer listed (changed ones were re-encoded)
        refusal = removal_refused(config, source, heapq.nsmallest(3, map(index.source, gone.tolist())) if len(gone) else [],
                                  len(gone), len(mine))
        if refusal is not None:
            refused, gone = refused or refusal, gone[:0]
        stale += [gone_or_changed[changed], gone, dropped]
        by_source[name]["removed"] = len(gone) + len(dropped)
        by_source[name]["kept_unreadable"] = kept
    return {index.key(int(g)) for g in np.concatenate(stale)} if index is not None else set(), refused


def read_again(cached: np.ndarray, name: str, seen: dict, index, manifest) -> np.ndarray:
    """(N,) bool: which of cached samples `cached` (global indices of source `name`, not kept by the pass) had their
    input read by the pass, which kept another sample of it (its content changed and was encoded again, or a video's
    clips changed): the input is there, the sample is replaced, not gone."""
    if not len(cached):
        return np.zeros(0, dtype=bool)
    read = {src for n, src in [*seen["new"].values(), *seen["moved"].values()] if n == name}
    by_source = manifest.index(name)  # a cached input kept under its own name: any of its samples marked
    out = np.zeros(len(cached), dtype=bool)
    for i, g in enumerate(cached.tolist()):
        src = index.source(g)
        others = by_source.global_index(by_source.find_every("sources", src))
        out[i] = src in read or any(seen["cached"][h] and h not in seen["moved"] for h in others.tolist())
    return out


def cache_schema(enc: Encoders, storage: torch.dtype, manifest, sources: list, cache: Path, control: bool = False) -> dict:
    """The fields of every sample: the encoders' schema (with the control latent's fields, for a ControlNet cache),
    or, for a cache written before flipped latents, loss masks or latent keys could be stored, its own (without
    them), in which no source may ask for `flip` or masks."""
    schema = enc.schema(storage, control)
    if enc.family.video:  # which clip of its input a sample is: (index, first frame, frames) at the family's frame rate
        schema[CLIP] = Field(torch.int32)
    if manifest is None:
        return schema
    flipped = set(enc.latent_spec().flipped_fields)
    if not flipped & set(manifest.schema):
        schema = {name: field for name, field in schema.items() if name not in flipped}
        asking = [s.name for s in sources if s.flip]
        if asking:
            raise ValueError(f"source {asking[0]!r} sets flip = true, but the cache at {cache} was built before flipped "
                             f"latents could be stored: write it into a new cache (--cache DIR)")
    for name in (MASK, LATENT_KEY):
        if name not in manifest.schema:
            del schema[name]
    asking = [s.name for s in sources if s.mask_mode]
    if asking and MASK not in schema:
        raise ValueError(f"source {asking[0]!r} asks for loss masks (--masks, masks = true, --alpha-mask), but the cache "
                         f"at {cache} was built before masks could be stored: write it into a new cache (--cache DIR)")
    return schema


def cached_latents(config: PrecomputeConfig, enc: Encoders, manifest, schema: dict) -> CachedLatents | None:
    """Where a changed input whose image did not change finds its latent fields: the cache as the run found it (None
    for a new cache, a repair, or a cache written before samples carried their latent key)."""
    if manifest is None or config.repair or LATENT_KEY not in manifest.schema:
        return None
    latent = enc.latent_spec()
    fields = [*latent.fields, *(n for n in latent.flipped_fields if n in schema), *(latent.control_fields if config.control else ()),
              *(n for n in REFERENCE_FIELDS if n in schema)]  # an edit sample's references: its latent key covers them
    return CachedLatents(config.cache, manifest.generation, fields)


def recorded_tables(config: PrecomputeConfig, manifest) -> dict | None:
    """The bucket table of every resolution the cache holds samples at (`manifest`, after this run) or this run cached
    at, for stage one's record; None for a cache of the preset's base resolution alone (its table is the
    fingerprint's)."""
    base = config.preset().base_resolution
    recorded = (CacheSpec.of(manifest).tables if manifest.extra.get("precompute") else None) or {}
    present = {tag or base for tag in manifest.resolutions()} | set(config.resolutions())
    tables = {r: recorded.get(r) or config.table(r) for r in sorted(present)}
    return tables if set(tables) != {base} else None


def check_tables(config: PrecomputeConfig, manifest) -> None:
    """Refuse to cache at a resolution whose recorded table differs from the one this run would use (its samples
    were bucketed otherwise, e.g. by another granularity)."""
    if manifest is None or not manifest.extra.get("precompute"):
        return
    recorded = CacheSpec.of(manifest, config.cache).tables or {}
    for resolution in config.resolutions():
        if resolution in recorded and recorded[resolution] != config.table(resolution):
            raise ValueError(f"--resolution {resolution}: the cache at {config.cache} holds samples on another bucket table "
                             f"for that resolution; write into a new directory (--cache DIR)")


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
    with ShardWriter(config.cache, manifest.fingerprint, manifest.schema, text_schema=manifest.text_schema) as writer:
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


def say_recorded(config: PrecomputeConfig, manifest, kept: list[str]) -> None:
    """Before anything is encoded: one line naming the recorded settings DATA as one source kept (`kept`, as flags),
    and a warning for every source whose cached samples this run caches without the loss masks or caption variants
    the cache records for it (a dataset file that no longer asks for them, or --no-masks / --caption-variants 1), or
    cuts with other clip choices than the cache records for it."""
    if kept:
        source = config.sources()[0]
        undo = [*(["--no-alpha-mask" if source.alpha_mask else "--no-masks"] if source.mask_mode else []),
                *(["--caption-variants 1"] if source.caption_variants > 1 else []),
                *(["--clip-extraction head"] if any(k.startswith("--clip-") for k in kept) else [])]
        print(f"{config.cache}: source {source.name!r} keeps the settings the cache records for it, which this run does "
              f"not give: {' '.join(kept)} (to change them, give them; to drop them, {', '.join(undo)})", file=sys.stderr)
    recorded, held = manifest.extra.get("sources", {}), manifest.datasets()
    for source in config.sources():
        record, samples = recorded.get(source.name) or {}, held.get(source.name, {}).get("samples", 0)
        lost = []
        if record.get("masks") and not source.mask_mode:
            lost.append("their loss masks (" + ("alpha_mask" if record.get("alpha_mask") else "masks") + ")")
        if record.get("caption_variants", 1) > source.caption_variants:
            lost.append(f"{record['caption_variants'] - source.caption_variants} of their {record['caption_variants']} "
                        f"caption variants")
        if lost and samples:
            how = (f"its [[source]] in {config.data} no longer asks for them" if source.from_file else
                   "this run's options drop them")
            print(f"warning: source {source.name!r}: its {samples} cached samples lose {' and '.join(lost)}: {how}; they "
                  f"are cached again without (their latents reused)", file=sys.stderr)
        cut = {k: record.get(k) for k in ("clip_extraction", "clips", "clip_stride", "clip_lengths") if k in record}
        now = {k: v for k, v in source.record().items() if k in ("clip_extraction", "clips", "clip_stride", "clip_lengths")}
        if "clip_extraction" in cut and cut != now and samples:
            how = (f"its [[source]] in {config.data} says otherwise" if source.from_file else "this run's options say "
                   "otherwise")
            said = lambda d: ", ".join(f"{k} = {v!r}" for k, v in d.items())  # noqa: E731
            print(f"warning: source {source.name!r}: its {samples} cached clips were cut with {said(cut)}; {how} "
                  f"({said(now)}): its videos are cut and encoded again, and the clips no longer cut are removed",
                  file=sys.stderr)


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


def store_decoder(writer: ShardWriter, enc: Encoders, preset: Preset, tables: dict | None = None) -> None:
    """Stage one's record (`shards.CacheSpec`): how training rebuilds the VAE decoder, and its weights when they
    exist nowhere else; a re-run that changes nothing commits nothing."""
    decoder, files = enc.decoder_recipe()
    for path, blob in files.items():
        role = f"decoder:{Path(path).name}"
        if writer.manifest.files.get(role, {}).get("sha256") != hashlib.sha256(blob).hexdigest():
            writer.add_file(role, path, blob)
    record = CacheSpec(enc.latent_spec(), enc.text_spec(), preset.family, preset.name, preset.base_resolution, decoder,
                       extra={"text_encoder": preset.text.name}, tables=tables).record()
    if writer.manifest.extra.get("precompute") != json.loads(json.dumps(record)):
        writer.set_extra("precompute", record)
