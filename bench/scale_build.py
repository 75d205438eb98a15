"""The synthetic caches of the scale benchmark (bench/scale.py): small tiny-sana-like samples under hash-like keys,
written shard by shard with `shards.ShardWriter`, the commits of the first and last windows timed."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shards import Field, ShardWriter  # noqa: E402
from shards.generations import compact  # noqa: E402
from shards.layout import SNAPSHOT_DIR  # noqa: E402
from shards.log import snapshots  # noqa: E402

SCHEMA = {
    "latent_mean": Field(torch.bfloat16),
    "latent_std": Field(torch.bfloat16),
    "text": Field(torch.bfloat16, ragged=True),
    "original_size": Field(torch.int32),
}
FINGERPRINT = {"vae": {"id": "bench-vae", "scaling_factor": 0.13025}, "text_encoder": {"id": "bench-t5", "max_length": 300}}
BUCKETS = [(64, 64), (48, 80), (80, 48)]
REAL_FSYNC = os.fsync


def key(i: int) -> str:
    return f"{i * 0x9E3779B97F4A7C15 % 2**64:016x}"  # an odd multiplier mod 2^64: unique, hash-like


def source(i: int) -> str:
    return f"images/{i // 10_000:05d}/{i:09d}.jpg"


def stamp(i: int) -> int:
    return (i * 0x2545F4914F6CDD1D) % 2**63


def set_fsync(on: bool) -> None:
    os.fsync = REAL_FSYNC if on else (lambda fd: None)


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def build_pool() -> dict[tuple[int, int], list[dict[str, torch.Tensor]]]:
    """Per bucket, 7 samples (text of 1-7 tokens) reused under fresh keys."""
    g = torch.Generator().manual_seed(0)
    pool = {}
    for h, w in BUCKETS:
        pool[(h, w)] = [{"latent_mean": torch.randn(4, h // 8, w // 8, generator=g).bfloat16(),  # (4, h/8, w/8)
                         "latent_std": torch.rand(4, h // 8, w // 8, generator=g).bfloat16(),
                         "text": torch.randn(tokens, 16, generator=g).bfloat16(),  # (L, 16)
                         "original_size": torch.tensor([h, w], dtype=torch.int32)} for tokens in range(1, 8)]
    return pool


def build(root: Path, n: int, per_shard: int, window: int, fsync_always: bool) -> dict:
    """Write n samples, shard k holding samples [k S, (k+1) S) of bucket k % 3, so shard k is generation k;
    time the commits of shards [1, 1 + window) and the last `window`."""
    count = math.ceil(n / per_shard)
    windows = {"start": range(1, 1 + window), "end": range(count - window, count)}
    records: dict[str, list[dict]] = {"start": [], "end": []}
    current: dict[str, tuple[float, float, int]] = {}
    phase = None
    pool = build_pool()
    t_build = time.perf_counter()
    writer = ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=per_shard)

    def timed(fn, name):
        def call(*args, **kwargs):
            if phase is None:
                return fn(*args, **kwargs)
            b0, c0, t0 = written_bytes(), time.thread_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            current[name] = (time.perf_counter() - t0, time.thread_time() - c0, written_bytes() - b0)
            return out
        return call

    writer.commit, writer._flush_slot = timed(writer.commit, "commit"), timed(writer._flush_slot, "publish")
    try:
        for k in range(count):
            phase = next((p for p, r in windows.items() if k in r), None)
            if phase and k == windows[phase].start:
                os.sync()  # the bulk's dirty pages are written back now, not by the window's fsyncs
            set_fsync(phase is not None or fsync_always)
            bucket = BUCKETS[k % len(BUCKETS)]
            for i in range(k * per_shard, min(n, (k + 1) * per_shard)):
                writer.write(key(i), bucket, pool[bucket][i % 7], source=source(i), stamp=stamp(i))
            if k == count - 1 and n % per_shard:
                writer.flush()  # the last shard, partial
            if phase:
                records[phase].append(dict(current))
                current.clear()
        phase = None
        writer.finish()
    finally:
        set_fsync(True)
        writer.close()
    assert writer.manifest.generation == count - 1, "one commit per shard"
    build_s = time.perf_counter() - t_build

    # One more snapshot of the final state, as the writer takes them (fsync on), into a scratch directory:
    # the cache itself keeps the log tail a reader replays.
    os.sync()
    scratch = root.parent / f"{root.name}-snapshot"
    scratch.mkdir()
    b0, t0 = written_bytes(), time.perf_counter()
    compact(scratch, writer.manifest)
    snap_s, snap_b = time.perf_counter() - t0, written_bytes() - b0
    shutil.rmtree(scratch)
    taken = snapshots(root)
    gap = taken[-1] - taken[-2] if len(taken) > 1 else count

    out = {"samples": n, "shards": count, "per_shard": per_shard, "build_s": build_s, "snapshot_s": snap_s,
           "snapshot_bytes": snap_b, "snapshot_gap": gap, "snapshots_kept": len(taken),
           "snapshots_kept_bytes": sum(p.stat().st_size for p in (root / SNAPSHOT_DIR).glob("*.safetensors"))}
    for name, recs in records.items():
        commit_s, commit_cpu, commit_b = ([r["commit"][m] for r in recs] for m in range(3))
        # commits that took a snapshot write far more than the median one; the amortized figure counts
        # snapshots once, through snapshot / gap
        ordinary = [(s, b) for s, b in zip(commit_s, commit_b) if b < 10 * statistics.median(commit_b)]
        out[name] = {"commits": len(recs), "commit_s_median": statistics.median(commit_s),
                     "commit_s_max": max(commit_s), "commit_cpu_s_median": statistics.median(commit_cpu), "commit_bytes_median": statistics.median(commit_b),
                     "publish_s_median": statistics.median(r["publish"][0] for r in recs),
                     "amortized_s": statistics.fmean(s for s, _ in ordinary) + snap_s / gap,
                     "amortized_bytes": statistics.fmean(b for _, b in ordinary) + snap_b / gap}
    return out
