"""The trainer's data path from a cold cache: does the device wait for data, and does the order suit the disk?

A cache of Sana-1600M-size samples (bf16 latent (32, 32, 32) at 1024 px, bf16 Gemma-2 text (L, 2304), L
uniform in 120..300; ~1 MB each, 128 MiB shards as stage one writes them) is read the way training reads
it: `train.order.BatchPlan` (shards shuffled and grouped by --shuffle-shards, samples shuffled within a
group) and `train.data.BatchStream` (batches built by background threads, whole shards read ahead).
Every round drops the cache's pages first (cold: posix_fadvise DONTNEED) or reads them once before (warm);
rounds of each kind run side by side in one process with one torch thread.

- sequential: the cache's files read front to back in 8 MiB reads: what the disk gives (the baseline).
- trainer's reads: the shards in the order the trainer's read-ahead reads them (each window's shards, whole,
  in the epoch's shuffled order): the I/O pattern training puts on the disk, against the sequential read.
- trainer, flat out: one epoch through the stream with no step in between; throughput counts the bytes
  of the fields the batches hold (latents, valid text tokens), read/used is /proc/self/io's read_bytes
  over those bytes (1.00: every byte read once and used once).
- trainer, simulated step: the loop takes a batch, then a simulated device step of --step-ms: --step-cpu
  of it holds the GIL (Python busy, as kernel launches do) and the rest sleeps (the GPU computing, the GIL
  free). data wait = time spent waiting for batches / wall time; "steady" leaves out the first batch
  (the pipeline filling, part of start-up).
- process loader, simulated step: the same batches built by a `torch.utils.data.DataLoader` with one
  persistent worker process and the same prefetch (the alternative to threads), for the measured choice.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Stats, Timer, drop_pages, pin_threads, read_bytes, sana_samples_for, write_sana_cache  # noqa: E402

from shards import Cache  # noqa: E402
from train.data import BatchStream, Epoch, TrainingSamples, read_whole  # noqa: E402
from train.order import BatchPlan  # noqa: E402


def used_bytes(cache: Cache, indices: list[int]) -> int:
    """Bytes of the fields a batch of these samples holds as stored (views: nothing is read)."""
    return sum(cache[i]["latent"].nbytes + cache[i]["text"].nbytes for i in indices)


def simulated_step(step_s: float, cpu_fraction: float) -> None:
    end_busy = time.perf_counter() + step_s * cpu_fraction
    while time.perf_counter() < end_busy:  # holds the GIL
        pass
    time.sleep(step_s * (1 - cpu_fraction))


class PlannedBatches(torch.utils.data.Dataset):
    """Batch k of the plan, for a DataLoader worker process."""

    def __init__(self, samples: TrainingSamples, batches: list[list[int]]):
        self.samples, self.batches = samples, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> dict:
        return self.samples.batch(0, self.batches[k])


def shard_order(root: Path, args: dict) -> list[Path]:
    """The cache's shard files in the order an epoch first touches them."""
    cache = Cache(root)
    seen: dict[int, None] = {}
    for planned in BatchPlan.of(cache, args["batch"], seed=0, shuffle_shards=args["shuffle_shards"]).batches(0):
        seen.update((cache.locate(i)[0], None) for i in planned.indices)
    return [cache.path(j) for j in seen]


def run_stream(root: Path, args: dict, steps: int | None, step_s: float, cpu: float, loader: str, prepare) -> dict:
    cache = Cache(root)
    plan = BatchPlan.of(cache, args["batch"], seed=0, shuffle_shards=args["shuffle_shards"])
    samples = TrainingSamples(cache, 0, 0.0)
    n = plan.batches_per_epoch() if steps is None else min(steps, plan.batches_per_epoch())
    order = [p.indices for p, _ in zip(plan.batches(0), range(n))]
    sizes = Cache(root)  # its own: the trainer's checks digests, which reads the samples
    used = sum(used_bytes(sizes, b) for b in order)
    del sizes
    waits = []
    prepare()  # after the sizes were read: the pages dropped (cold) or read (warm) just before the round
    r0, t0 = read_bytes(), time.perf_counter()
    if loader == "thread":
        source = BatchStream(Epoch(0, plan, samples), workers=args["workers"], prefetch=args["prefetch"],
                             readahead=args["readahead"])
        batches = source
    else:
        source = torch.utils.data.DataLoader(PlannedBatches(samples, order), batch_size=None, num_workers=1,
                                             prefetch_factor=args["prefetch"], persistent_workers=True)
        batches = iter(source)
    for _ in range(n):
        w0 = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - w0)
        if step_s:
            simulated_step(step_s, cpu)
    wall = time.perf_counter() - t0
    r1 = read_bytes()
    if loader == "thread":
        source.close()
    return {"batches": n, "wall": wall, "used": used, "read": None if r0 is None or loader != "thread" else r1 - r0,
            "wait": sum(waits), "wait_steady": sum(waits[1:]), "first": waits[0], "p95": Stats.of(waits[1:]).p95}


def main(
    gib: float = typer.Option(0.5, help="Size of the synthetic cache (~1,030 Sana-size samples per GiB)."),
    cache: Path = typer.Option(None, help="Use this synthetic cache (written by an earlier run with --keep) instead of writing one."),
    keep: bool = typer.Option(False, help="Keep the synthetic cache and print its path."),
    batch: int = typer.Option(8, help="Samples per batch."),
    steps: int = typer.Option(0, help="Batches of the simulated-step rounds (0: a whole epoch, so that every shard read "
                                      "ahead is also used)."),
    step_ms: float = typer.Option(500.0, help="Simulated device step (ms)."),
    step_cpu: float = typer.Option(0.1, help="Share of the simulated step that holds the GIL (the step's own Python)."),
    workers: int = typer.Option(1, help="Batch-building threads of the stream (the trainer's --workers)."),
    prefetch: int = typer.Option(4, help="Batches kept ready (the trainer's --prefetch; also the process loader's)."),
    readahead: int = typer.Option(64, help="Batches looked ahead by the shard read-ahead (the trainer's --readahead)."),
    shuffle_shards: int = typer.Option(4, help="Shards shuffled together (the trainer's --shuffle-shards)."),
    rounds: int = typer.Option(1, help="Rounds of each measurement (each cold round drops the pages again)."),
    switch_ms: float = typer.Option(0.0, help="Python's thread switch interval (sys.setswitchinterval), 0: leave it (5 ms)."),
) -> None:
    header = pin_threads(1)
    if switch_ms:
        sys.setswitchinterval(switch_ms / 1000)
    header += f", GIL switch interval {sys.getswitchinterval() * 1000:.1f} ms"
    args = dict(batch=batch, workers=workers, prefetch=prefetch, readahead=readahead, shuffle_shards=shuffle_shards)
    tmp = None
    if cache is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-data-path-"))
        cache = tmp / "cache"
        t0 = time.perf_counter()
        write_sana_cache(cache, sana_samples_for(gib))
        print(f"wrote {cache} in {time.perf_counter() - t0:.0f} s")
    files = sorted(cache.rglob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    c = Cache(cache)
    print(f"{header}; cache: {len(c)} Sana-size samples (bf16), {len(files)} files, {total / 2**30:.2f} GiB, "
          f"{len(c.manifest.buckets())} buckets; batch {batch}, --shuffle-shards {shuffle_shards}, --workers {workers}, "
          f"--prefetch {prefetch}, --readahead {readahead}; simulated step {step_ms:.0f} ms ({step_cpu:.0%} holding the GIL)")
    buffer = bytearray(8 << 20)
    rows: dict[str, list] = {}
    for _ in range(rounds):
        for mode in ("cold", "warm"):
            def prepare():
                gc.collect()  # no reader of an earlier round keeps pages mapped (mapped pages are not dropped)
                if mode == "cold":
                    drop_pages(files)
                else:
                    for f in files:
                        read_whole(f, buffer)

            prepare()
            with Timer() as t:
                for f in files:
                    read_whole(f, buffer)
            rows.setdefault(f"{mode} sequential", []).append({"wall": t.s, "used": total, "read": t.read, "batches": 0})
            ordered = shard_order(cache, args)
            prepare()
            with Timer() as t:
                for f in ordered:
                    read_whole(f, buffer)
            rows.setdefault(f"{mode} trainer's reads", []).append({"wall": t.s, "used": total, "read": t.read, "batches": 0})
            rows.setdefault(f"{mode} trainer, flat out", []).append(run_stream(cache, args, None, 0.0, 0.0, "thread", prepare))
            for loader in ("thread", "process"):
                label = f"{mode} {'trainer' if loader == 'thread' else 'process loader'}, simulated step"
                rows.setdefault(label, []).append(run_stream(cache, args, steps or None, step_ms / 1000, step_cpu, loader, prepare))
    seq = {mode: Stats.of(r["used"] / r["wall"] for r in rows[f"{mode} sequential"]).median for mode in ("cold", "warm")}
    print(f"{'':38} {'MB/s used':>10} {'x seq':>6} {'read/used':>10} {'data wait':>10} {'steady':>8} {'1st batch':>10} {'p95 wait':>9}")
    for label, results in rows.items():
        mode = label.split()[0]
        rate = Stats.of(r["used"] / r["wall"] for r in results).median
        read = [r["read"] / r["used"] for r in results if r["read"] is not None]
        line = f"{label:38} {rate / 1e6:10.0f} {rate / seq[mode]:6.2f} {Stats.of(read).median if read else float('nan'):10.2f}"
        if "wait" in results[0]:
            wait = Stats.of(r["wait"] / r["wall"] for r in results).median
            steady = Stats.of(r["wait_steady"] / r["wall"] for r in results).median
            first = Stats.of(r["first"] for r in results).median
            p95 = Stats.of(r["p95"] for r in results).median
            line += f" {wait:10.2%} {steady:8.2%} {first * 1000:8.0f} ms {p95 * 1000:6.1f} ms"
        print(line)
    print("x seq: bytes used per second over the sequential read's bytes per second, same mode. data wait: share of the "
          "loop's wall time spent waiting for a batch; steady: without the first batch.")
    if tmp is not None and not keep:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    elif tmp is not None:
        print(f"kept {cache}")


if __name__ == "__main__":
    typer.run(main)
