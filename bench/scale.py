"""How the cache's costs grow with its size: shard commits, manifest load, the incremental decision, open readers.

For each size, a synthetic cache is built with `shards.ShardWriter`: small tiny-sana-like samples (~0.6 KB:
bf16 latent mean and std (4, h/8, w/8) in three buckets, ragged bf16 text (1-7 tokens, 16), int32 size),
16-hex-char keys, 30-char source paths, S samples per shard; the point is the number of samples and shards,
not bytes. One torch thread, warm page cache (everything was just written), on this machine, side by side:

- commit: wall time of `ShardWriter.commit` (the manifest's part of publishing one shard: its log file and
  fsyncs, a snapshot when one is due), its CPU time (this thread's: the library's own work, without the
  wait on the disk, whose fsync latency swings with what else the machine writes) and the bytes the process
  wrote meanwhile (/proc/self/io wchar), over the first W and the last W commits of the build, fsync ON.
  Between the two windows os.fsync is a no-op, so that 70k+ shards build in minutes (`--fsync-always`
  keeps it on); os.sync() runs before each window so its fsyncs do not pay for the bulk's writeback.
  publish = shard file + commit. snapshot: the writer's final manifest compacted once more (fsync on, into
  a scratch directory) and the gap between the last two snapshots the writer took; amortized = mean
  ordinary commit + snapshot / gap. kept: the snapshots on disk at the end (until `python -m shards gc`).
- load: `Cache(root)` in a fresh process: seconds, and peak RSS growth (VmHWM, reset just before).
- decide (stage one's incremental "nothing changed" run, `bench.scale_measure.measure_decide`): in a fresh
  process, the functions `precompute.run` uses: the manifest loaded, per source its sample index, the cache's key
  lookup (the skip set) and its stamp table; the rank's writer opened; a folder listing of every input looked up
  (`FolderDataset`, stamps given instead of os.stat) and read as a loader's worker reads it (`SourcesDataset`),
  each sorted by `EncodingPass.take`; rank 0's removals (`decide_removals`) and the final writer's removal. No
  shard is opened. Seconds (wall and this process's CPU: the machine may be shared), per input, and peak RSS
  growth (VmHWM reset just before; the listing itself is built before). GOAL: under 1 GB at 10 M inputs (per
  input: under 100 bytes; other sizes are judged by their bytes per input) and at most 2.6 us per input (the
  figure of the dict-based decision this replaced); the 100 M figures are those per input times 100 M.
- readers: in a fresh process, `Cache(root)` reads samples, fields copied out as a collate does: every sample
  in random order when there are at most --reads of them, else one random sample of every shard, shards in
  random order (so every shard is opened). Reported: the most shard readers open at once
  (`len(cache._readers)`) and the most mappings of .safetensors files (/proc/self/maps, every 32 reads and at
  the end), against vm.max_map_count.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shards  # noqa: E402
from bench.scale_build import build  # noqa: E402

torch.set_num_threads(1)

# Samples per shard of the default sizes: as many shards as the time budget allows, and more shards than
# vm.max_map_count at 1M. Other sizes: at most ~72k shards.
PER_SHARD = {10_000: 1, 100_000: 4, 1_000_000: 14}
DECIDE_US_GOAL = 2.6  # us per input: the dict-based decision's, at 10 M inputs
DECIDE_BYTES_GOAL = 1e9 / 10_000_000  # under 1 GB at 10 M inputs: 100 bytes per input


def in_child(func: str, *args, timeout: float = 1800) -> dict:
    """`func(*args)` of bench/scale_measure.py in a fresh Python process (its memory and mappings are its own)."""
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
            f"import bench.scale_measure as m; print(json.dumps(m.{func}(*{args!r})))")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        raise RuntimeError(f"{func}{args} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def print_tables(rows: list[dict], window: int, fsync_always: bool) -> None:
    ms, kb, mb = 1e3, 1 / 1024, 1 / 2**20
    print(f"\ncommit: per shard commit, median of the first/last {window} commits, fsync on"
          f"{' (the whole build)' if fsync_always else ' (off between the windows)'}; cpu = the library's own work, "
          f"wall = cpu + waiting on the disk; snapshot = one compaction of the final state")
    print(f"{'samples':>9} {'shards':>7} {'S':>3} | {'wall ms':>13} {'cpu ms':>11} {'max ms':>6} {'bytes':>5} | "
          f"{'snapshot s':>10} {'MB':>5} {'every':>5} | {'amortized':>15} | {'publish':>7} | {'kept':>10} | {'build':>5}")
    print(f"{'':>9} {'':>7} {'':>3} | {'start':>6} {'end':>6} {'start':>5} {'end':>5} {'end':>6} {'end':>5} | "
          f"{'':>10} {'':>5} {'':>5} | {'ms':>6} {'KB':>8} | {'ms end':>7} | {'n':>4} {'MB':>5} | {'s':>5}")
    for r in rows:
        s, e = r["start"], r["end"]
        print(f"{r['samples']:>9,} {r['shards']:>7,} {r['per_shard']:>3} | {s['commit_s_median'] * ms:>6.2f} {e['commit_s_median'] * ms:>6.2f} "
              f"{s['commit_cpu_s_median'] * ms:>5.2f} {e['commit_cpu_s_median'] * ms:>5.2f} {e['commit_s_max'] * ms:>6.0f} "
              f"{e['commit_bytes_median']:>5.0f} | {r['snapshot_s']:>10.2f} {r['snapshot_bytes'] * mb:>5.1f} {r['snapshot_gap']:>5} | "
              f"{e['amortized_s'] * ms:>6.2f} {e['amortized_bytes'] * kb:>8.1f} | {e['publish_s_median'] * ms:>7.2f} | "
              f"{r['snapshots_kept']:>4} {r['snapshots_kept_bytes'] * mb:>5.0f} | {r['build_s']:>5.0f}")
    print("\nload: Cache(root) in a fresh process")
    print(f"{'samples':>9} {'shards':>7} | {'load s':>7} {'peak MB':>8}")
    for r in rows:
        print(f"{r['samples']:>9,} {r['shards']:>7,} | {r['load_s']:>7.2f} {r['load_peak_bytes'] * mb:>8.0f}")
    print_decide(rows)
    print("\nreaders: Cache reads (fields copied out), random order; every sample, or one sample of every shard")
    print(f"{'samples':>9} {'shards':>7} | {'reads':>7} {'read s':>7} | {'max open readers':>16} {'max .safetensors maps':>21} {'vm.max_map_count':>16} | shards > max_map_count")
    for r in rows:
        print(f"{r['samples']:>9,} {r['shards']:>7,} | {r['reads']:>7,} {r['read_s']:>7.1f} | {r['max_open_readers']:>16} "
              f"{r['max_mapped']:>21} {r['max_map_count']:>16,} | {'yes, no failure' if r['shards'] > r['max_map_count'] else 'no'}")


def print_decide(rows: list[dict]) -> None:
    """The decide rows: seconds, us per input (wall and CPU), peak growth, each against its goal, and at 100 M."""
    mb = 1 / 2**20
    print("\ndecide: stage one's \"nothing changed\" decision by precompute.run's functions, fresh process (see the docstring)")
    print(f"{'samples':>11} {'shards':>7} | {'wall s':>7} {'cpu s':>6} | {'us/input wall':>13} {'cpu':>5} GOAL <= {DECIDE_US_GOAL} | "
          f"{'peak MB':>8} {'B/input':>7} GOAL < {DECIDE_BYTES_GOAL:.0f} | {'at 100 M':>16}")
    for r in rows:
        n = r["samples"]
        wall, cpu, peak = r["decide_s"] / n * 1e6, r["decide_cpu_s"] / n * 1e6, r["decide_peak_bytes"] / n
        print(f"{n:>11,} {r['shards']:>7,} | {r['decide_s']:>7.2f} {r['decide_cpu_s']:>6.2f} | {wall:>13.2f} {cpu:>5.2f} "
              f"{'PASS' if wall <= DECIDE_US_GOAL else 'MISS'} (cpu {'PASS' if cpu <= DECIDE_US_GOAL else 'MISS'}) | "
              f"{r['decide_peak_bytes'] * mb:>8.0f} {peak:>7.0f} {'PASS' if peak < DECIDE_BYTES_GOAL else 'MISS':>4} | "
              f"{(format(peak * 1e8 / 2**30, '5.1f') + ' GB ' + format(wall * 100, '5.0f') + ' s') if n >= 1_000_000 else '(n < 1 M)':>16}"
              f"  (stage: load {r['decide_load_s']:.1f} s, index "
              f"{r['decide_index_s']:.1f} s, inputs {r['decide_lookup_s']:.1f} s, removals {r['decide_finish_s']:.1f} s)")


def main(
    sizes: str = typer.Option("10000,100000,1000000", help="Cache sizes in samples, comma-separated; one cache each."),
    samples_per_shard: str = typer.Option("", help="Samples per shard for each size, comma-separated (default: 1, 4, 14 "
                                          "for 10k, 100k, 1M; ceil(n / 72000) for other sizes)."),
    window: int = typer.Option(300, help="Commits timed at the start and at the end of each build."),
    reads: int = typer.Option(20_000, help="Read every sample when a cache has at most this many; else one of every shard."),
    decide_seconds: float = typer.Option(60.0, help="Unused: the decide row always runs the whole decision (kept for scripts "
                                         "that pass it)."),
    fsync_always: bool = typer.Option(False, help="fsync during the whole build, not only the timed windows (slow)."),
    out: Path = typer.Option(None, help="Directory to build the caches in (default: a temp dir); each cache is deleted "
                             "once measured."),
    json_out: bool = typer.Option(False, "--json", help="Also print all results as one JSON object (the last line)."),
    decide_only: bool = typer.Option(False, help="Measure the decide row alone (no commit windows, load, readers or trainer "
                                      "rows): e.g. --decide-only --sizes 10000000 --samples-per-shard 10000."),
    keep: bool = typer.Option(False, help="Keep each cache in --out (required) as cache-N-S, and measure an existing one "
                              "there instead of building it again (its build time is then not reported)."),
    epoch_max: int = typer.Option(1_000_000, help="Read one whole epoch through the trainer's stream for the largest size up "
                                  "to this many samples (the mmap-limit case: 71k shards at 1M)."),
) -> None:
    t_run = time.perf_counter()
    ns = [int(s) for s in sizes.split(",")]
    pers = [int(s) for s in samples_per_shard.split(",")] if samples_per_shard else [PER_SHARD.get(n, math.ceil(n / 72_000)) for n in ns]
    if len(pers) != len(ns):
        raise typer.BadParameter(f"--samples-per-shard has {len(pers)} values for {len(ns)} sizes")
    if keep and out is None:
        raise typer.BadParameter("--keep needs --out DIR (where the caches are kept)")
    workdir = Path(out) if keep else Path(tempfile.mkdtemp(prefix="shards-scale-", dir=out))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"shards.FORMAT_VERSION {shards.FORMAT_VERSION}; {os.cpu_count()} CPUs, one torch thread, warm page cache (files just written); caches under {workdir}")
    rows = []
    try:
        for n, per in zip(ns, pers):
            root = workdir / f"cache-{n}-{per}"
            w = min(window, max(1, math.ceil(n / per) // 3))
            t = time.perf_counter()
            if keep and shards.exists(root):
                row, took = {"samples": n, "shards": math.ceil(n / per), "per_shard": per}, {"build": 0.0}
                print(f"{root}: kept from an earlier run, not built again", flush=True)
            else:
                row = build(root, n, per, w, fsync_always)
                took = {"build": row["build_s"], "sync + snapshot": time.perf_counter() - t - row["build_s"]}
            measures = [("decide", (n, decide_seconds))]
            if not decide_only:
                measures = [("load", ()), *measures, ("readers", (reads,)), ("trainer_start", ())]
            if not decide_only and n == max((m for m in ns if m <= epoch_max), default=None):
                measures.append(("epoch", ()))
            for name, args in measures:
                t = time.perf_counter()
                row |= in_child(f"measure_{name}", str(root), *args)
                took[name] = time.perf_counter() - t
            if not keep:
                t = time.perf_counter()
                shutil.rmtree(root)
                took["delete"] = time.perf_counter() - t
            rows.append(row | {"took_s": took})
            print(f"{n:,} samples in {row['shards']:,} shards, seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in took.items()),
                  flush=True)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if decide_only:
        print_decide(rows)
        print(f"\nwall time {time.perf_counter() - t_run:.0f} s")
        if json_out:
            print(json.dumps({"rows": rows}))
        return
    print_tables(rows, window, fsync_always)
    print("\ntrainer: start = open the cache, build the data order (train.order.BatchPlan), jump to the middle of an "
          "epoch and build that batch of 64 through the stream, in a fresh process; peak = its RSS growth. epoch = "
          "one whole epoch through the stream (the largest size up to --epoch-max).")
    for r in rows:
        line = (f"{r['samples']:>11,} samples {r['shards']:>9,} shards: start {r['start_s']:.2f} s, "
                f"{r['start_peak_bytes'] / 2**20:.0f} MB")
        if "epoch_s" in r:
            line += (f"; epoch of {r['epoch_samples']:,} samples in {r['epoch_s']:.0f} s, peak {r['epoch_peak_bytes'] / 2**20:.0f} MB, "
                     f"at most {r['epoch_max_mapped']:,} shard mappings, {r['epoch_read_ahead_shards']:,} shards read ahead "
                     f"({r['epoch_read_ahead_failed']} failed)")
        print(line)
    print(f"\nwall time {time.perf_counter() - t_run:.0f} s")
    if json_out:
        print(json.dumps({"window": window, "fsync_always": fsync_always, "rows": rows}))


if __name__ == "__main__":
    typer.run(main)
