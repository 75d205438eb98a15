"""The cache as the trainer opens it: the same generation on every rank, registered for `shards gc`, checked
against the model before any weights load, its files checked before the run starts, damage stopping the run.
A cache in object storage (`--cache s3://...`) is read through a local directory of downloaded shards."""

from __future__ import annotations

import hashlib
import logging
import weakref
from pathlib import Path

from shards import Bucket, Cache, CorruptSample, DamagedCache, FormatError, RemoteCache, open_cache, register_reader
from shards.reader import REPAIR
from shards.remote import repair_hint
from shards.verify import file_sha256
from train import distributed
from train.families import get_family
from train.families.base import ModelPreset

log = logging.getLogger("train")


def open_generation(cache_root: Path | str, run: Path, is_main: bool, generation: int | None = None, *,
                    local_cache: Path | None = None, local_cache_gb: float = 100.0) -> Cache:
    """The cache at `generation` (default: the newest rank 0 sees), the same on every rank, registered by rank 0
    so that `python -m shards gc` keeps its files for this run. A URL is opened as a `shards.RemoteCache` whose
    shards are kept in `local_cache`, at most `local_cache_gb` GiB of them."""
    def open_at(gen: int | None) -> Cache:
        return open_cache(cache_root, gen, local_dir=local_cache, limit_bytes=int(local_cache_gb * 2**30))

    cache, error = None, None
    if is_main:
        try:
            cache = open_at(generation)
        except (FormatError, FileNotFoundError) as e:  # every rank stops with rank 0's reason, none waits for it
            error = e
    generation, error = distributed.rank0_value((cache.generation if cache is not None else None, error))
    if error is not None:
        raise error
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
    """Stop before loading weights when the cache cannot feed this model, naming the fields: the cache's
    family, latent and text layout against what the preset's transformer config takes (`Family.cache_problems`)."""
    try:
        spec = cache.spec
    except DamagedCache:  # a damaged file says how to restore it
        raise
    except FormatError as e:  # not written by stage one: say which model to build it for
        raise FormatError(f"{e} MODEL={preset.name}") from None
    family = get_family(preset.family)
    patch = family.latent_patch(config)
    problems = family.cache_problems(spec, config)
    for bucket in cache.manifest.buckets():
        _, h, w = spec.latent.shape(bucket.height, bucket.width)
        if h % patch or w % patch:
            problems.append(f"bucket {bucket}: latent {h}x{w} is not a multiple of patch size {patch}")
    if problems:
        built = f" (built for {spec.preset})" if spec.preset else ""
        raise ValueError(
            f"the cache {cache.location}{built} does not fit model {preset.name}:\n  " + "\n  ".join(problems)
            + f"\nBuild a cache for it with --model {preset.name}: python -m precompute DATA --model {preset.name} --cache "
            f"{cache.root}-{preset.name} (make precompute DATA=... MODEL={preset.name} CACHE={cache.root}-{preset.name})"
            + (f", or train the model it was built for: --model {spec.preset}" if spec.preset and spec.preset != preset.name else "")
        )


def check_cache_files(cache: Cache, is_main: bool, files: tuple[str, ...] = ()) -> None:
    """Every shard of the generation exists with its listed size: rank 0 stats each once, or lists the bucket's
    directories for a cache in object storage (ranks share the storage, so one pass serves all), and every rank
    stops alike. `files`: roles of the cache's other files (`"prompts"`, `"decoder"` for all of the decoder's)
    about to be read, checked against the size and sha256 the manifest lists (a bucket's were when mirrored)."""
    problems = distributed.rank0_value(cache.check_files() if is_main else None)
    if problems:
        listed = "; ".join(f"{path}: {what}" for path, what in problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CorruptSample(f"{len(problems)} shard(s) of {cache.location} (generation "
                            f"{cache.generation}) are missing or damaged: {listed}. {repair_command(cache)}")
    damaged = distributed.rank0_value(damaged_files(cache, files) if is_main and not isinstance(cache, RemoteCache) else None)
    if damaged:
        raise DamagedCache(damaged)


_checked: set = set()  # (path, sha256) of auxiliary files this process found sound: each is hashed once


def damaged_files(cache: Cache, roles: tuple[str, ...]) -> str | None:
    """What is wrong with the cache's files of these roles (None: nothing), with how to restore them."""
    wanted = [(role, entry) for role, entry in sorted(cache.manifest.files.items())
              if role in roles or ("decoder" in roles and role.startswith("decoder:"))]
    problems = []
    for role, entry in wanted:
        path = cache.root / entry["path"]
        if (str(path), entry["sha256"]) in _checked:
            continue
        if not path.is_file():
            problems.append((role, f"{path} is missing"))
        elif path.stat().st_size != entry["bytes"]:
            problems.append((role, f"{path} is {path.stat().st_size} bytes, the manifest lists {entry['bytes']}"))
        elif file_sha256(path) != entry["sha256"]:
            problems.append((role, f"{path} does not match the sha256 the manifest lists (modified or damaged)"))
        else:
            _checked.add((str(path), entry["sha256"]))
    if not problems:
        return None
    restore = []
    if any(role == "prompts" for role, _ in problems):
        restore.append(f"the prompt embeddings (the empty caption and the validation prompts) are re-encoded by "
                       f"`python -m precompute prompts {cache.root} --prompt TEXT ...` (every validation prompt) or by "
                       f"re-running stage one on the cache with the DATA and options that built it")
    if any(role.startswith("decoder:") for role, _ in problems):
        restore.append(f"the VAE decoder's weights are stored again by re-running stage one on the cache "
                       f"(`python -m precompute DATA --model {cache.spec.preset or 'MODEL'} --cache {cache.root}`, the DATA "
                       f"and options that built it; nothing already encoded is encoded again), or train with --no-validate")
    return (f"{'; '.join(what for _, what in problems)}. To restore: {'; '.join(restore)}. `python -m shards verify "
            f"{cache.root}` lists every damaged file.")


# A cache's content at one generation, for the checkpoints of the runs that read it (see `cache_identity`).
_identities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_identity(cache: Cache) -> str:
    """The sha256 of the generation's shard table (every shard's path and sha256, in order): which samples a data
    cursor counts through. A later generation of the same cache keeps the one it was read at; another dataset
    encoded with the same models (the same fingerprint) has another."""
    if cache not in _identities:
        h = hashlib.sha256()
        for entry in cache.manifest.shards:
            h.update(f"{entry.path}\0{entry.sha256}\n".encode())
        _identities[cache] = h.hexdigest()
    return _identities[cache]


def check_same_caches(path: Path, saved: dict, caches: list[Cache]) -> None:
    """Refuse to continue checkpoint `path`'s data cursor over other samples than it counted: each cache, opened
    at the generation the checkpoint read, must hold the shards it held then (a cache grown by later commits
    does; those join at the next epoch)."""
    for k, (entry, cache) in enumerate(zip(saved.get("caches") or [saved], caches)):
        was = entry.get("cache_shards_sha256")
        if was is None or was == cache_identity(cache):  # checkpoints written before it was recorded are not checked
            continue
        where = entry.get("cache_root") or entry.get("cache_url") or "another cache"
        number = f" (--cache number {k + 1})" if len(caches) > 1 else ""
        raise ValueError(
            f"{path} was trained from {where} at generation {entry.get('cache_generation')}; {cache.location}{number} holds "
            f"other shards at that generation: another dataset encoded with the same models, or the cache rebuilt. Its "
            f"data position means nothing here. Resume with the cache it was trained from (--cache {where}), or start a "
            f"new run from this cache (another --run-dir, or --resume '').")


def until_damaged(batches, damaged: list):
    """The batches, until one holds a sample that fails its digest (or a cache file turns out damaged): the error
    goes into `damaged` and the iteration ends (the caller checkpoints and stops)."""
    try:
        yield from batches
    except DamagedCache as e:
        damaged.append(e)


def largest_bucket(cache: Cache) -> Bucket:
    """The bucket of the most pixels per sample: a frame's pixels times its frames for a clip (its longest clips)."""
    return max(cache.manifest.buckets(), key=lambda b: (b.pixels * max(b.frames, 1), b))
