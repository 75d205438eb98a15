"""The cache as the trainer opens it: the same generation on every rank, registered for `shards gc`, checked
against the model before any weights load, its files checked before the run starts, damage stopping the run.
A cache in object storage (`--cache s3://...`) is read through a local directory of downloaded shards."""

from __future__ import annotations

import logging
from pathlib import Path

from shards import Bucket, Cache, CorruptSample, FormatError, RemoteCache, open_cache, register_reader
from shards.reader import REPAIR
from shards.remote import repair_hint
from train import distributed
from train.presets import ModelPreset, latent_channels, latent_patch, text_width

log = logging.getLogger("train")


def open_generation(cache_root: Path | str, run: Path, is_main: bool, generation: int | None = None, *,
                    local_cache: Path | None = None, local_cache_gb: float = 100.0) -> Cache:
    """The cache at `generation` (default: the newest rank 0 sees), the same on every rank, registered by rank 0
    so that `python -m shards gc` keeps its files for this run. A URL is opened as a `shards.RemoteCache` whose
    shards are kept in `local_cache`, at most `local_cache_gb` GiB of them."""
    def open_at(gen: int | None) -> Cache:
        return open_cache(cache_root, gen, local_dir=local_cache, limit_bytes=int(local_cache_gb * 2**30))

    cache = open_at(generation) if is_main else None
    generation = distributed.rank0_value(cache.generation if is_main else None)
    if is_main and isinstance(cache, RemoteCache):  # nothing is written to a bucket
        log.info("%s is in object storage: `python -m shards gc` on it cannot see that %s reads generation %d",
                 cache_root, run, generation)
    elif is_main and not register_reader(cache_root, run, generation):
        log.warning("%s is read-only for this run: `python -m shards gc` on it cannot know that %s reads generation %d",
                    cache_root, run, generation)
    return cache if is_main else open_at(generation)


def saved_generations(saved: dict, count: int) -> list[int | None]:
    """The generation each of a run's `count` caches was read at by the checkpoint `saved` (None: the newest)."""
    if not saved:
        return [None] * count
    recorded = [entry.get("cache_generation") for entry in saved.get("caches") or [saved]]
    return (recorded + [None] * count)[:count]


def check_same_encoders(caches: list[Cache]) -> None:
    """Several caches train one model only if their latents and text mean the same: the same family, VAE and text
    encoder (bucket tables and sources may differ, e.g. a 512 and a 1024 cache)."""
    first = caches[0]
    for other in caches[1:]:
        problems = [f"{what}: {first.location} has {a}, {other.location} has {b}" for what, a, b in (
            ("family", first.spec.family, other.spec.family),
            ("VAE", first.fingerprint.get("vae"), other.fingerprint.get("vae")),
            ("text encoder", first.fingerprint.get("text_encoder"), other.fingerprint.get("text_encoder")),
            ("storage dtype", first.fingerprint.get("storage_dtype"), other.fingerprint.get("storage_dtype"))) if a != b]
        if problems:
            raise ValueError("these caches cannot train one run; their latents or embeddings differ:\n  " + "\n  ".join(problems))


def repair_command(cache: Cache) -> str:
    """How to repair the cache's damaged shards (for a bucket: on the directory it was copied from)."""
    return repair_hint(cache.location) if isinstance(cache, RemoteCache) else REPAIR.format(root=cache.root)


def check_cache(preset: ModelPreset, cache: Cache, config: dict) -> None:
    """Stop before loading weights when the cache cannot feed this model, naming the fields."""
    try:
        spec = cache.spec
    except FormatError as e:  # not written by stage one: say which model to build it for
        raise FormatError(f"{e} MODEL={preset.name}") from None
    latent, text = spec.latent, spec.text
    patch = latent_patch(preset.family, config)
    problems = []
    if spec.family and spec.family != preset.family:
        problems.append(f"family: cache {spec.family!r}, model {preset.family!r}")
    if latent.channels != latent_channels(preset.family, config):
        what = "in_channels / 4 (2 x 2 packed)" if preset.family == "flux" else "in_channels"
        problems.append(f"latent channels: cache {latent.channels}, model {what} {latent_channels(preset.family, config)}")
    if (text.layout == "flux") != (preset.family == "flux"):
        problems.append(f"text layout: cache {text.layout!r}, " + ("Flux takes 'flux' (every T5 token and CLIP-L's pooled vector)"
                                                                  if preset.family == "flux" else f"model {preset.family}"))
    elif text.layout == "flux":
        if text.t5_width != config["joint_attention_dim"]:
            problems.append(f"T5 width: cache {text.t5_width}, model joint_attention_dim {config['joint_attention_dim']}")
        if text.pooled_width != config["pooled_projection_dim"]:
            problems.append(f"pooled width: cache {text.pooled_width}, model pooled_projection_dim {config['pooled_projection_dim']}")
    elif text.layout == "sd3_joint":
        if text.clip_width > config["joint_attention_dim"]:
            problems.append(f"CLIP width: cache {text.clip_width}, over the model's joint width {config['joint_attention_dim']}")
        if text.pooled_width != config["pooled_projection_dim"]:
            problems.append(f"pooled width: cache {text.pooled_width}, model pooled_projection_dim {config['pooled_projection_dim']}")
        if text.t5_width not in (None, config["joint_attention_dim"]):
            problems.append(f"T5 width: cache {text.t5_width}, model joint_attention_dim {config['joint_attention_dim']}")
    elif text.width != text_width(config):
        problems.append(f"text width: cache {text.width}, model {text_width(config)}")
    for bucket in cache.manifest.buckets():
        _, h, w = latent.shape(bucket.height, bucket.width)
        if h % patch or w % patch:
            problems.append(f"bucket {bucket}: latent {h}x{w} is not a multiple of patch size {patch}")
    if problems:
        raise ValueError(
            f"the cache {cache.location} does not fit model {preset.name}:\n  " + "\n  ".join(problems)
            + f"\nBuild a matching cache: make precompute DATA=... MODEL={preset.name} CACHE={cache.root}-{preset.name}"
        )


def check_cache_files(cache: Cache, is_main: bool) -> None:
    """Every shard of the generation exists with its listed size: rank 0 stats each once, or lists the bucket's
    directories for a cache in object storage (ranks share the storage, so one pass serves all), and every rank
    stops alike."""
    problems = distributed.rank0_value(cache.check_files() if is_main else None)
    if problems:
        listed = "; ".join(f"{path}: {what}" for path, what in problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CorruptSample(f"{len(problems)} shard(s) of {cache.location} (generation "
                            f"{cache.generation}) are missing or damaged: {listed}. {repair_command(cache)}")


def until_damaged(batches, damaged: list):
    """The batches, until one holds a sample that fails its digest: the error goes into `damaged` and the
    iteration ends (the caller checkpoints and stops)."""
    try:
        yield from batches
    except CorruptSample as e:
        damaged.append(e)


def largest_bucket(cache: Cache) -> Bucket:
    return max(cache.manifest.buckets(), key=lambda b: (b.height * b.width, b))
