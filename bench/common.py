"""What every benchmark shares: pinned threads, cold page cache, I/O counters, Sana-size caches, timing stats.

Every benchmark calls `pin_threads()` first and prints what it returns in its header, so a figure always says
how many threads produced it. Cold rounds call `drop_pages(files)` before they start: the files' pages leave
the page cache and the next read comes from the device, which `read_bytes()` (the process's
/proc/self/io counter) confirms.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, also when run as bench/x.py
from precompute.config import PrecomputeConfig  # noqa: E402
from shards import CacheSpec, Field, LatentSpec, Prompt, ShardWriter, TextSpec, prompt_key  # noqa: E402

# Sana 1600M at 1024 px: DC-AE f32c32 latents (32, H/32, W/32) and Gemma-2 2B embeddings (L, 2304), both bf16
SANA_LATENT = (32, 32, 32)
SANA_TEXT_WIDTH = 2304
SANA_TOKENS = (120, 300)  # a caption's valid tokens, uniform in this range (300 is Sana's limit)
SANA_BUCKETS = ((1024, 1024), (832, 1216), (1216, 832))
SANA_SCALING_FACTOR = 0.41407  # DC-AE f32c32's, recorded like stage one records it
# Stage one's shard size target (`--max-shard-mb`), so the benchmarks read shards of the size users get
SHARD_BYTES = next(f.default for f in dataclasses.fields(PrecomputeConfig) if f.name == "max_shard_mb") << 20


def pin_threads(n: int = 1) -> str:
    """Fix torch's intra-op and inter-op thread counts, and OMP/MKL's for child processes.

    Args:
        n: threads for each pool.

    Returns:
        One line for the benchmark's header, e.g. "threads: torch intra-op 1, inter-op 1 (2 CPUs)".
    """
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # only settable before the first inter-op work; the line below says what it is
        pass
    return (f"threads: torch intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()} "
            f"({os.cpu_count()} CPUs)")


def _files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return out


def drop_pages(paths: Iterable[str | os.PathLike]) -> int:
    """Evict files from the page cache: fsync (dirty pages cannot be dropped), then POSIX_FADV_DONTNEED.

    Args:
        paths: files, or directories (every file under them).

    Returns:
        The bytes of the files whose pages were dropped (their sizes; pages that were not cached count too).
    """
    total = 0
    for path in _files(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def read_bytes() -> int | None:
    """Bytes this process (all its threads) caused to be read from storage so far: /proc/self/io's read_bytes.
    Page-cache hits do not count. None where the counter is unavailable (benchmarks then print "n/a")."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def sana_sample(i: int, bucket: tuple[int, int], tokens: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One sample of stage one's Sana schema with random values (distinct per sample, finite)."""
    h, w = bucket
    text = torch.randn(tokens, SANA_TEXT_WIDTH, generator=g).bfloat16()  # (L, 2304)
    return {
        "latent": torch.randn(SANA_LATENT[0], h // 32, w // 32, generator=g).bfloat16(),  # (32, H/32, W/32)
        "text": text,
        "text_lengths": torch.tensor([tokens], dtype=torch.int32),
        "original_size": torch.tensor([h, w], dtype=torch.int32),
        "crop": torch.tensor([0, 0], dtype=torch.int32),
        "source": torch.frombuffer(bytearray(f"images/{i // 10_000:05d}/{i:09d}.jpg".encode()), dtype=torch.uint8),
    }


def write_sana_cache(root: str | os.PathLike, samples: int, *, buckets: tuple[tuple[int, int], ...] = SANA_BUCKETS,
                     samples_per_shard: int | None = None, shard_bytes: int = SHARD_BYTES, seed: int = 0) -> Path:
    """Write a cache of Sana-1600M-size samples with `shards.ShardWriter`, as stage one lays it out.

    Stage one's schema for Sana (bf16 `latent` (32, H/32, W/32), ragged bf16 `text` (L, 2304) with L uniform
    in 120..300, `text_lengths`, `original_size`, `crop`, `source`), a fingerprint that `shards.CacheSpec`
    reads (DC-AE latents, Gemma-2 text, masked layout), stage one's record (family sana) and the cached empty
    caption, so the trainer's data path reads it. Values are random: meaningless but different per sample.
    Samples cycle through the buckets; each bucket's shard is published at `shard_bytes` (stage one's target,
    ~130 samples at 128 MiB) or at `samples_per_shard`.

    Args:
        root: the cache directory (must not hold a cache yet).
        samples: how many samples (~1.0 MB each on average: 1 GiB is ~1,030 samples).
        buckets: (height, width) in pixels, multiples of 32.
        samples_per_shard: publish a shard at this many samples (default: only by `shard_bytes`).
        shard_bytes: publish a shard at this many bytes.
        seed: of the values and the caption lengths.

    Returns:
        `root`, which opens as `shards.Cache` and passes `python -m shards verify`.
    """
    root = Path(root)
    latent = LatentSpec(SANA_LATENT[0], 32, SANA_SCALING_FACTOR, 0.0, "deterministic")
    text = TextSpec("masked", SANA_TEXT_WIDTH, SANA_TOKENS[1])
    fingerprint = {
        "vae": {"class": "AutoencoderDC", "source": "bench (random values)", **latent.fingerprint()},
        "text_encoder": {"name": "gemma-2-2b", "source": "bench (random values)", **text.fingerprint()},
        "bench": {"seed": seed},
    }
    storage = torch.bfloat16
    schema = {
        "latent": Field(storage),
        "text": Field(storage, ragged=True),
        "text_lengths": Field(torch.int32, ragged=True),
        "original_size": Field(torch.int32),
        "crop": Field(torch.int32),
        "source": Field(torch.uint8, ragged=True),
    }
    g = torch.Generator().manual_seed(seed)
    with ShardWriter(root, fingerprint, schema, max_shard_bytes=shard_bytes,
                     max_shard_samples=samples_per_shard or 100_000, check_finite=False) as writer:  # randn is finite
        for i in range(samples):
            tokens = int(torch.randint(SANA_TOKENS[0], SANA_TOKENS[1] + 1, (), generator=g))
            bucket = buckets[i % len(buckets)]
            key = f"{i * 0x9E3779B97F4A7C15 % 2**64:016x}"  # unique, hash-like
            writer.write(key, bucket, sana_sample(i, bucket, tokens, g), source=f"images/{i:09d}.jpg")
        empty = {"text": torch.randn(SANA_TOKENS[0], SANA_TEXT_WIDTH, generator=g).bfloat16()}
        writer.add_prompts({prompt_key(""): Prompt("", empty)}, {"text": schema["text"]})
        writer.set_extra("precompute", CacheSpec(latent, text, "sana", "sana-1600m", 1024, None,
                                                 extra={"text_encoder": "gemma-2-2b"}).record())
    return root


def sana_samples_for(gib: float) -> int:
    """Samples of `write_sana_cache` that make about `gib` GiB (mean sample: latent 64 KB at 1024 px, text
    210 x 2304 bf16)."""
    mean = 2 * (SANA_LATENT[0] * (1024 * 1024 + 2 * 832 * 1216) // 3 // 1024 + sum(SANA_TOKENS) / 2 * SANA_TEXT_WIDTH)
    return max(1, round(gib * 2**30 / mean))


@dataclasses.dataclass
class Stats:
    """Summary of repeated measurements."""

    n: int
    median: float
    p95: float
    best: float  # the smallest
    worst: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        v = sorted(values)
        if not v:
            raise ValueError("no measurements")
        return cls(len(v), statistics.median(v), v[min(len(v) - 1, round(0.95 * (len(v) - 1)))], v[0], v[-1])


class Timer:
    """`with Timer() as t: ...` then `t.s` (wall seconds); `t.read` is read_bytes() over the block (None if unknown)."""

    def __enter__(self) -> Timer:
        self._r0, self._t0 = read_bytes(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self._t0
        r1 = read_bytes()
        self.read = None if r1 is None or self._r0 is None else r1 - self._r0


def fmt_bytes_ratio(num: int | None, den: int) -> str:
    """num / den with two decimals, or "n/a" when the counter is unavailable."""
    return "n/a" if num is None else f"{num / den:.2f}"
