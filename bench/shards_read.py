"""The cache format's read path, page cache warm and cold, against a sequential read of the same files.

A synthetic cache of Sana-1600M-size samples (`bench.common.write_sana_cache`: bf16 DC-AE latent (32, H/32, W/32)
in three 1024-px buckets, bf16 Gemma-2 text (L, 2304) with L uniform in 120..300, ~1.0 MB per sample, in
shards of stage one's 128 MiB target) is read four ways, in the same rounds, one after the other:

(i)   sequential: every shard file of the cache read front to back with os.read into one 8 MiB buffer
      (`--block-mib`), no parsing. This is the physical limit of the storage (cold) or of a page-cache copy
      (warm), and the baseline of every ratio.
(ii)  stored order: `shards.Cache(root)[i]` for i = 0, 1, ... (shard by shard, as committed), every field of
      the sample copied out of the memory map into fresh memory (`clone`), as a collate does.
(iii) random order: the same, i in one uniformly random permutation of the whole cache (fixed seed): one
      sample per shuffled index across all shards, today's per-sample random access.
(iv)  random order with digests: (iii) with `check_digests=True` (blake2b-128 of every sample's bytes compared
      with the stored one), the trainer's default; (iii) is `--no-check-digests`.
(v)   sparse random: the first 1/`--sparse` of (iii)'s order only. Over a whole pass of a cache that fits in
      RAM, the pages the kernel reads around a sample (mmap read-around: the device's read_ahead_kb, printed
      in the header) are used later by other samples, so (iii) reads each byte once; a cache many times
      larger than the page cache loses them first. (v) shows that case: samples scattered over the whole
      cache, their neighbours mostly not read.

Warm: the files are read once (unmeasured) before the round's warm rows, so every page is in the page cache;
what is measured is the mapping's page faults, the parsing and the copies. Cold: `drop_pages` (fsync +
POSIX_FADV_DONTNEED on every file of the cache) before each cold row, so its bytes come from the device.
Every row opens a fresh `Cache`, so mapping costs are paid every time. Threads are pinned (`--threads`).

Reported per row and mode: MB/s (10^6 bytes of fields copied, or of file bytes for (i), per second; median of
the rounds), the ratio to (i) of the same mode (every row runs right beside its own run of (i), alternately
before and after it; the median of those paired ratios), and read/used: bytes the process read from storage
(/proc/self/io read_bytes) per byte of fields copied out, 1.00 when every byte read is used; warm rows show ~0,
confirming the page cache served them.

Default run: 1 GiB, 5 rounds, under 2 minutes. Full size: `--gib 8 --rounds 7` (needs 8 GiB of free RAM for warm
rows, ~15 minutes). Cold figures swing with the device and whatever else uses it; compare the ranges.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import Stats, drop_pages, pin_threads, read_bytes, sana_samples_for, write_sana_cache  # noqa: E402
from shards import Cache  # noqa: E402


def sequential(files: list[Path], block: int) -> int:
    """Read every file front to back; returns the bytes read."""
    buf = bytearray(block)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:  # unbuffered: readinto is one read(2) of the whole buffer
            while n := f.readinto(buf):
                total += n
    return total


def samples(cache: Cache, order: list[int]) -> int:
    """Read samples in `order`, every field copied out as a collate does; returns the bytes copied."""
    total = 0
    for i in order:
        for t in cache[i].fields.values():
            total += t.clone().nbytes
    return total


def read_ahead_kb(path: Path) -> str:
    """The readahead window of the block device holding `path` (a partition's is its disk's), or "n/a"."""
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (sysfs / "queue", sysfs / ".." / "queue"):
        try:
            return (queue / "read_ahead_kb").read_text().strip()
        except OSError:
            continue
    return "n/a"


def main(
    gib: float = typer.Option(1.0, help="Size of the synthetic cache in GiB (~1,030 Sana-size samples per GiB). "
                                        "Warm rows need it to fit in the page cache."),
    rounds: int = typer.Option(5, help="Rounds; each runs every row in every mode back to back. Reported: medians."),
    mode: str = typer.Option("both", help="warm, cold or both."),
    check_digests: bool = typer.Option(True, help="Also measure random reads with digest checks, row (iv)."),
    sparse: int = typer.Option(16, help="Row (v) reads 1/SPARSE of the samples in random order (0: no row (v))."),
    threads: int = typer.Option(1, help="torch intra-op and inter-op threads."),
    block_mib: int = typer.Option(8, help="Buffer of the sequential read (i), in MiB."),
    seed: int = typer.Option(0, help="Seed of the cache's values and of the random order."),
    workdir: Path = typer.Option(None, help="Directory to build the cache in (default: the system's temp dir); "
                                            "it is removed at the end. Its device is the one cold rows measure."),
) -> None:
    threads_line = pin_threads(threads)
    if mode not in ("warm", "cold", "both"):
        raise typer.BadParameter(f"--mode {mode!r}: choose warm, cold or both")
    modes = ["warm", "cold"] if mode == "both" else [mode]
    root = Path(tempfile.mkdtemp(prefix="shards-read-", dir=workdir))
    try:
        t0 = time.perf_counter()
        write_sana_cache(root / "cache", sana_samples_for(gib), seed=seed)
        cache = Cache(root / "cache")
        files = [cache.path(j) for j in range(len(cache.shards))]
        size = sum(f.stat().st_size for f in files)
        n = len(cache)
        build_s = time.perf_counter() - t0
        order = list(range(n))
        random.Random(seed).shuffle(order)
        rows = {
            "(i) sequential os.read": lambda: sequential(files, block_mib << 20),
            "(ii) stored order, Cache[i]": lambda: samples(Cache(root / "cache"), list(range(n))),
            "(iii) random order, Cache[i]": lambda: samples(Cache(root / "cache"), order),
        }
        if check_digests:
            rows["(iv) random order + digests"] = lambda: samples(Cache(root / "cache", check_digests=True), order)
        if sparse:
            few = order[: max(1, n // sparse)]
            rows[f"(v) random, 1/{sparse} of samples"] = lambda: samples(Cache(root / "cache"), few)

        seq = "(i) sequential os.read"

        def measure(m: str, name: str) -> tuple[float, int, int | None]:
            if m == "cold":
                gc.collect()  # no mapping of an earlier row left: mapped pages are not dropped
                drop_pages(files)
            r0, t = read_bytes(), time.perf_counter()
            used = rows[name]()
            t = time.perf_counter() - t
            r1 = read_bytes()
            return t, used, None if r0 is None else r1 - r0

        # The device's speed drifts within seconds here (shared host): every row runs right beside its own run of
        # (i), alternately before and after it, and its ratio is to that run.
        results = {(m, r): [] for m in modes for r in rows}  # (seconds, bytes used, bytes read, MB/s of its (i))
        for k in range(rounds):
            names = [r for r in rows if r != seq]
            names = names[k % len(names):] + names[: k % len(names)]  # rotated: no row always runs first
            for m in modes:
                if m == "warm":
                    sequential(files, block_mib << 20)  # every page into the page cache
                for j, name in enumerate(names):
                    pair = [seq, name] if (k + j) % 2 == 0 else [name, seq]
                    out = {r: measure(m, r) for r in pair}
                    base = out[seq][1] / out[seq][0] / 1e6
                    results[(m, seq)].append((*out[seq], base))
                    results[(m, name)].append((*out[name], base))

        print(f"shards read path: {n} samples in {len(files)} shards, {size / 2**30:.2f} GiB "
              f"({size / n / 1e6:.2f} MB/sample: bf16 latent (32, H/32, W/32) + bf16 text (120-300, 2304)), "
              f"built in {build_s:.0f} s")
        print(f"{threads_line}; {rounds} rounds; modes: {', '.join(modes)} (cold: pages dropped before each row); "
              f"dtype bf16; cache at {root}, device read_ahead_kb {read_ahead_kb(root)}")
        print(f"{'row':32s} {'mode':5s} {'MB/s':>8s} {'range':>13s} {'x (i)':>6s} {'read/used':>9s} {'samples/s':>10s}")
        for m in modes:
            for name in rows:
                res = results[(m, name)]
                rate = Stats.of(u / t / 1e6 for t, u, _, _ in res)
                ratio = Stats.of(u / t / 1e6 / base for t, u, _, base in res)
                reads = [r for _, _, r, _ in res]
                per_used = "n/a" if None in reads else f"{Stats.of(r / u for _, u, r, _ in res).median:.2f}"
                per_s = "" if name == seq else f"{Stats.of(u / t / (size / n) for t, u, _, _ in res).median:10,.0f}"
                print(f"{name:32s} {m:5s} {rate.median:8.0f} {rate.best:6.0f}-{rate.worst:<6.0f} {ratio.median:6.2f} "
                      f"{per_used:>9s} {per_s:>10s}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
