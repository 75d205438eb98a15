"""Random-access sample reads from a cache vs. a sequential read of the same bytes.

The sequential read (the files' bytes copied into a buffer, page cache warm) is the physical limit
on this machine; random access must materialise each sample the way a DataLoader's collate does
(every field copied out of the memory map into fresh memory), in a shuffled order across shards.
Goal: random access >= 0.8 of the limit. Also measured in the same rounds: random reads that check every
sample against its stored digest (blake2b-128 of the sample's bytes, what training does by default) vs.
the same reads unchecked, at Sana-size samples.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shards import Cache, Field, ShardWriter  # noqa: E402

# Sana-1600M-like samples: a DC-AE latent (32, 32, 32) at 1024 px and Gemma-2 embeddings (L, 2304)
# trimmed to their valid tokens, both bf16.
SCHEMA = {"latent": Field(torch.bfloat16), "text": Field(torch.bfloat16, ragged=True)}
BUCKETS = [(1024, 1024), (832, 1216), (1216, 832)]


def build(root: Path, gib: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    budget, written, i = gib * (1 << 30), 0, 0
    with ShardWriter(root, {"bench": 1}, SCHEMA) as w:
        while written < budget:
            h, wd = BUCKETS[i % len(BUCKETS)]
            tokens = rng.randint(20, 300)
            latent = torch.full((32, h // 32, wd // 32), float(i % 97), dtype=torch.bfloat16)
            text = torch.full((tokens, 2304), float(i % 89), dtype=torch.bfloat16)
            w.write(f"{i:08d}", (h, wd), {"latent": latent, "text": text})
            written += latent.numel() * 2 + text.numel() * 2
            i += 1
    return i


def sequential(files: list[Path]) -> tuple[int, float]:
    buf = bytearray(16 << 20)
    total, t0 = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - t0


def random_access(cache: Cache, order: list[int]) -> tuple[int, float]:
    total, t0 = 0, time.perf_counter()
    for i in order:
        for t in cache[i].fields.values():
            total += t.clone().numel() * t.element_size()
    return total, time.perf_counter() - t0


def main(
    gib: float = typer.Option(2.0, help="Size of the benchmark cache in GiB."),
    repeats: int = typer.Option(5, help="Rounds; each measures both back to back. Reported: best vs. best and the median of the rounds' ratios."),
    workdir: Path = typer.Option(None, help="Where to build the cache (default: a temp dir, removed after)."),
) -> None:
    root = Path(tempfile.mkdtemp(prefix="shards-bench-", dir=workdir))
    try:
        t0 = time.perf_counter()
        n = build(root, gib)
        cache = Cache(root)
        files = [root / s.path for s in cache.shards]
        print(f"cache: {n} samples, {len(files)} shards, {cache.manifest.num_bytes / 2**30:.2f} GiB, built in {time.perf_counter() - t0:.1f}s")
        sequential(files)  # warm the page cache
        order = list(range(len(cache)))
        random.Random(0).shuffle(order)
        # This machine is shared and its memory bandwidth drifts: the two run back to back in each round,
        # so a round's ratio compares like with like. Each round reopens the cache: the mapping's page
        # faults are paid every time.
        rounds, checked = [], []
        for _ in range(repeats):
            b, t = sequential(files)
            rb, rt = random_access(Cache(root), order)
            cb, ct = random_access(Cache(root, check_digests=True), order)
            rounds.append((b / t, rb / rt))
            checked.append((rb / rt, cb / ct))
        seq, rnd = max(r[0] for r in rounds), max(r[1] for r in rounds)
        ratios = sorted(r / q for q, r in rounds)
        print(f"sequential read (limit): {seq / 2**30:6.2f} GiB/s (best of {repeats})")
        print(f"random sample reads:     {rnd / 2**30:6.2f} GiB/s  ({rnd * n / cache.manifest.num_bytes:,.0f} samples/s)")
        print(f"ratio random/sequential: {rnd / seq:.2f} best vs. best, {ratios[len(ratios) // 2]:.2f} median of paired rounds "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}; goal >= 0.80)")
        plain, digest = max(c[0] for c in checked), max(c[1] for c in checked)
        costs = sorted(c[1] / c[0] for c in checked)
        sample = cache.manifest.num_bytes / n  # bytes per sample
        print(f"with digest checks:      {digest / 2**30:6.2f} GiB/s  checked/unchecked {digest / plain:.2f} best vs. best, "
              f"{costs[len(costs) // 2]:.2f} median; {1e3 * (sample / digest - sample / plain):.2f} ms more per "
              f"{sample / 2**20:.2f} MiB sample")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
