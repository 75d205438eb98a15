"""The shard writer against an MDS-style sequential write of the same samples, and where a shard's writing time goes.

Sana-1600M-size samples (`bench.common.sana_sample`: bf16 DC-AE latent (32, H/32, W/32) in three 1024-px buckets, bf16
Gemma-2 text (L, 2304) with L uniform in 120..300, ~1.0 MB per sample, random finite values) are made once, held in
memory, and written by each row into a fresh directory in the same round, one row after the other:

(i)   MDS-style sequential write: what MosaicML Streaming's `MDSWriter` does with its default options (no compression,
      no hashes), at its leanest: each sample's fields serialised to bytes (`numpy().tobytes()`, a copy), a shard's
      samples joined into one buffer (a copy) and written with one file write per shard, a shard closed at the size
      limit of the other rows (`--shard-mib`, stage one's 128 MiB); an index written at the end. NO fsync: MDS does
      not fsync, the file is in the page cache when the row ends. No digest, no check of the values.
(i')  (i) + an fsync of each shard file: the device's own cost, which (ii) pays.
(ii)  `shards.ShardWriter` with every guarantee: NaN/Inf check of every floating field, a blake2b digest per sample,
      the sha256 of every shard file in the manifest, each shard published atomically (temp name, fsync, rename,
      fsync of the directory) and committed to the log (fsynced) after it; a fresh cache.
(iii) the real `MDSWriter` (mosaicml-streaming, not a dependency of this project), when it imports from `--mds-path`
      (`pip install --target /tmp/mds mosaicml-streaming --no-deps` and its compression modules, without torchvision;
      its package `__init__`, which imports the vision datasets, is skipped): bf16 fields as `ndarray:uint16` (numpy
      has no bfloat16), int32 ones as `ndarray:int32`, the source path as `bytes`; no compression, no hashes, no fsync.

Every row starts after `os.sync()` (no writeback of an earlier row runs during it) and its files are deleted after it.
In each round (ii) runs back to back with (i) and with (iii), in the order (i), (ii), (iii), (i') or its reverse (every
other round). Reported: MB/s of sample field bytes (10^6 bytes a second, the same bytes for every row; median and range
over the rounds), the process's CPU seconds (all its threads; the kernel's writeback threads not counted), and the
paired ratios: each round's (ii) / (i), (ii) / (iii) and (ii) / (i'), their median and min-max over the rounds. Goals:
(ii) / (i) >= 1.00, the writer at least as fast as MDS's sequential write while it checks, hashes and fsyncs, and
(ii) / (iii) >= 1.00 against the real MDSWriter. A goal PASSes when every round's ratio reaches it, MISSes when none
does, and is INCONCLUSIVE when the rounds straddle it or the machine is loaded by other processes: its 1-minute load
average before the run, or after it less this benchmark's own CPU use, above the machine's cores (both printed).
Writes go to the page cache; fsync is said per row.

The breakdown (`--breakdown`) times one shard's parts one at a time (so they add up; the writer overlaps some): the
writer before this version (each field's `torch.isfinite(t).all()`; the fields stacked and concatenated; the tensors
copied into bytes by `safetensors.torch.save`; the header made canonical, another copy of the file; a blake2b digest
per sample; the file's sha256; the file written and fsynced) against this one (one sum per field, a NaN or an Inf
makes it non-finite; no copy: the file is laid out as views of the samples' tensors; the same per-sample digests, on the
writer's hashing threads, timed from their start to the last one's end and nothing else; the file's sha256 on a third
thread, beside the write and the fsync), then the whole shard through `ShardWriter`.

Threads are pinned (`--threads`, torch intra- and inter-op; the writer's hashing threads are its own). Default run:
1 GiB (~1,030 samples, 1.07 GB), 3 rounds, about a minute and a half on 2 cores (two with row (iii)).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import SANA_BUCKETS, SANA_TOKENS, SHARD_BYTES, Stats, pin_threads, sana_sample, sana_samples_for  # noqa: E402
from shards import Field, ShardWriter  # noqa: E402
from shards.atomic import atomic_write_bytes  # noqa: E402
from shards.buckets import Bucket  # noqa: E402
from shards.encode import HASH_THREADS, _digests, check_sample, encode_shard, finite, hash_threads  # noqa: E402
from shards.schema import sample_digest  # noqa: E402

SCHEMA = {  # stage one's for Sana (`bench.common.write_sana_cache`)
    "latent": Field(torch.bfloat16),
    "text": Field(torch.bfloat16, ragged=True),
    "text_lengths": Field(torch.int32, ragged=True),
    "original_size": Field(torch.int32),
    "crop": Field(torch.int32),
    "source": Field(torch.uint8, ragged=True),
}
Sample = tuple[str, tuple[int, int], dict[str, torch.Tensor]]


def make_samples(n: int, seed: int) -> list[Sample]:
    """`n` Sana-size samples (key, bucket, fields), cycling through the buckets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = int(torch.randint(SANA_TOKENS[0], SANA_TOKENS[1] + 1, (), generator=g))
        bucket = SANA_BUCKETS[i % len(SANA_BUCKETS)]
        out.append((f"{i * 0x9E3779B97F4A7C15 % 2**64:016x}", bucket, sana_sample(i, bucket, tokens, g)))
    return out


def field_bytes(samples: list[Sample]) -> int:
    return sum(t.nbytes for _, _, fields in samples for t in fields.values())


def as_bytes(t: torch.Tensor) -> bytes:
    """A field serialised to bytes as MDS's ndarray encoding does (`tobytes`, a copy); bf16 through a 16-bit view."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def mds_style(samples: list[Sample], out: Path, shard_bytes: int, fsync: bool) -> None:
    """Row (i) (and (i') with `fsync`): per bucket, samples serialised to bytes, a shard's joined and written at once."""
    out.mkdir()
    pending: dict[tuple[int, int], list[bytes]] = {}
    sizes: dict[tuple[int, int], int] = {}
    shards = []

    def flush(bucket):
        data = b"".join(pending.pop(bucket))
        sizes.pop(bucket)
        name = f"shard.{len(shards):05d}.mds"
        with open(out / name, "wb") as f:
            f.write(data)
            if fsync:
                os.fsync(f.fileno())
        shards.append({"basename": name, "bytes": len(data)})

    for key, bucket, fields in samples:
        parts = [as_bytes(t) for t in fields.values()]
        pending.setdefault(bucket, []).extend(parts)
        sizes[bucket] = sizes.get(bucket, 0) + sum(map(len, parts))
        if sizes[bucket] >= shard_bytes:
            flush(bucket)
    for bucket in list(pending):
        flush(bucket)
    (out / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))


def ours(samples: list[Sample], out: Path, shard_bytes: int) -> None:
    """Row (ii): `ShardWriter` with its defaults (check_finite on), a fresh cache."""
    with ShardWriter(out, {"bench": "writer"}, SCHEMA, max_shard_bytes=shard_bytes) as w:
        for key, bucket, fields in samples:
            w.write(key, bucket, fields)


def import_mds(path: Path | None):
    """The real `MDSWriter` from `path` (its package `__init__` skipped), or None with why not."""
    if path is None or not (path / "streaming").is_dir():
        return None, f"no mosaicml-streaming at {path} (--mds-path)"
    sys.path.insert(0, str(path))
    try:
        for name in ("streaming", "streaming.base", "streaming.base.format"):
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__path__ = [str(path / name.replace(".", "/"))]
                sys.modules[name] = module
        return importlib.import_module("streaming.base.format.mds.writer").MDSWriter, ""
    except Exception as e:  # an incomplete install: the row is left out, saying why
        return None, f"mosaicml-streaming at {path} does not import ({type(e).__name__}: {e})"


def real_mds(mds_writer, samples: list[Sample], out: Path, shard_bytes: int) -> None:
    """Row (iii): the real MDSWriter, default options (no compression, no hashes), one dataset per bucket as (ii)."""
    columns = {"latent": "ndarray:uint16", "text": "ndarray:uint16", "text_lengths": "ndarray:int32",
               "original_size": "ndarray:int32", "crop": "ndarray:int32", "source": "bytes"}
    writers = {}
    try:
        for key, bucket, fields in samples:
            if bucket not in writers:
                writers[bucket] = mds_writer(columns=columns, out=str(out / f"{bucket[0]}x{bucket[1]}"), size_limit=shard_bytes)
            writers[bucket].write({name: (t.view(torch.int16).numpy().view("uint16") if t.dtype == torch.bfloat16 else
                                          t.numpy().tobytes() if name == "source" else t.numpy()) for name, t in fields.items()})
    finally:
        for w in writers.values():
            w.finish()


def one_shard(samples: list[Sample], shard_bytes: int) -> list[Sample]:
    """The samples of the first shard of the first bucket: what (ii) writes as one file."""
    first, out, size = samples[0][1], [], 0
    for s in samples:
        if s[1] == first and size < shard_bytes:
            out.append(s)
            size += sum(t.nbytes for t in s[2].values())
    return out


MDS_STYLE, MDS_STYLE_FSYNC = "(i) MDS-style write, no fsync", "(i') MDS-style write + fsync"  # the rows' names
OURS, REAL_MDS = "(ii) ShardWriter, all guarantees", "(iii) MDSWriter (streaming)"
Cost = tuple[float, float]  # (wall seconds, CPU seconds of the process: every thread)


def verdict(ratio: Stats, goal: float, others_load: float, cores: int) -> str:
    """PASS when every round's ratio reaches `goal`, MISS when none does; INCONCLUSIVE when other processes loaded the
    machine (their load average above its cores: the rows then measure the scheduler) or the rounds disagree."""
    if others_load > cores:
        return f"INCONCLUSIVE (machine loaded: load average {others_load:.1f} on {cores} cores)"
    if ratio.best < goal <= ratio.worst:
        return f"INCONCLUSIVE (the rounds' ratios {ratio.best:.2f}-{ratio.worst:.2f} straddle {goal:.2f})"
    return "PASS" if ratio.best >= goal else "MISS"


def breakdown(samples: list[Sample], workdir: Path) -> list[tuple[str, Cost | None, Cost | None]]:
    """One shard's parts, each timed alone: (part, cost before, cost now); None where a version has no such part."""
    bucket = Bucket(*samples[0][1])
    items = [(key, fields, "", 0) for key, _, fields in samples]
    shapes = check_sample(samples[0][0], bucket, samples[0][2], SCHEMA, {}, False)[0]

    def timed(fn: Callable):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        return out, (time.perf_counter() - t, time.process_time() - c)

    def plus(a: Cost, b: Cost) -> Cost:
        return a[0] + b[0], a[1] + b[1]

    rows = []
    _, old = timed(lambda: [bool(torch.isfinite(t).all()) for _, f, _, _ in items for t in f.values() if t.is_floating_point()])
    _, new = timed(lambda: [finite(t) for _, f, _, _ in items for t in f.values() if t.is_floating_point()])
    rows.append(("finite check (isfinite per field -> one sum)", old, new))
    tensors, old = timed(lambda: {
        name: torch.cat([f[name] for _, f, _, _ in items]) if spec.ragged else torch.stack([f[name] for _, f, _, _ in items])
        for name, spec in SCHEMA.items()})
    rows.append(("stack / cat the fields (a copy)", old, None))
    from safetensors.torch import save

    data, old = timed(lambda: save(tensors, metadata={"format": "bench"}))

    def reheader():  # what `serialize` did: the header re-emitted, the file copied around it
        (n,) = struct.unpack("<Q", data[:8])
        header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
        return data[:8] + header + b" " * (n - len(header)) + data[8 + n:]

    rows.append(("safetensors save (a copy into bytes)", old, None))
    data, old = timed(reheader)
    rows.append(("canonical header (another copy)", old, None))
    encoded, new = timed(lambda: encode_shard(bucket, items, SCHEMA, shapes, "0" * 64, 0)[0])
    list(encoded.buffers())  # its digests, started by `encode_shard`, done before the next part is timed
    rows.append(("lay out the file: header + views (starts the digests)", None, new))
    _, old = timed(lambda: [sample_digest(k, f) for k, f, _, _ in items])
    threads = hash_threads(sum(t.nbytes for _, f, _, _ in items for t in f.values()))
    _, new = timed(lambda: (lambda d: d if isinstance(d, bytes) else d.result())(_digests(items, threads)))  # as the writer
    rows.append((f"blake2b per sample (1 thread -> {threads or 'no'} hashing threads)", old, new))
    _, old = timed(lambda: hashlib.sha256(data).hexdigest())
    rows.append(("sha256 of the file (now beside the write, next row)", old, None))
    path = workdir / "breakdown.safetensors"
    _, old = timed(lambda: atomic_write_bytes(path, data))
    path.unlink()
    encoded = encode_shard(bucket, items, SCHEMA, shapes, "0" * 64, 0)[0]
    list(encoded.buffers())  # digests done: what is timed is the write, with the sha256 beside it
    _, new = timed(lambda: (atomic_write_bytes(path, encoded), encoded.sha256))
    path.unlink()
    rows.append(("write + fsync + rename (now + sha256 beside it)", old, new))
    out = workdir / "breakdown-cache"
    _, end_to_end = timed(lambda: ours(samples, out, 1 << 40))
    shutil.rmtree(out)
    total_old, total_new = (0.0, 0.0), (0.0, 0.0)
    for _, old, new in rows:
        total_old, total_new = plus(total_old, old or (0.0, 0.0)), plus(total_new, new or (0.0, 0.0))
    rows.append(("sum of the parts", total_old, total_new))
    rows.append(("ShardWriter end to end: one shard, with its commit", None, end_to_end))
    return rows


def main(
    gib: float = typer.Option(1.0, help="Bytes of samples to write per row, in GiB (~1,030 Sana-size samples per GiB); "
                                        "they are held in memory."),
    rounds: int = typer.Option(3, help="Rounds; each runs every row once, (ii) beside (i) and (iii), the order reversed "
                                       "every other round. Reported: medians and the rounds' paired ratios."),
    shard_mib: int = typer.Option(SHARD_BYTES >> 20, help="Shard size limit of every row, in MiB (stage one's "
                                                          "--max-shard-mb by default)."),
    threads: int = typer.Option(1, help="torch intra-op and inter-op threads (the writer's hashing threads are its own)."),
    seed: int = typer.Option(0, help="Seed of the samples' values and caption lengths."),
    mds_path: Path = typer.Option(Path("/tmp/mds"), help="Where mosaicml-streaming is installed (pip install --target "
                                                         "DIR mosaicml-streaming --no-deps, plus brotli, python-snappy, "
                                                         "cramjam, zstd, catalogue) for row (iii); skipped when it does "
                                                         "not import."),
    show_breakdown: bool = typer.Option(True, "--breakdown/--no-breakdown", help="Also time one shard's parts, before "
                                                                                 "and after the streaming writer."),
    workdir: Path = typer.Option(None, help="Directory to write in (default: the system's temp dir); removed at the end. "
                                            "Its device is the one fsync waits for."),
) -> None:
    threads_line = pin_threads(threads)
    load_before, cores = os.getloadavg()[0], os.cpu_count() or 1
    wall0, cpu0 = time.perf_counter(), time.process_time()
    shard_bytes = shard_mib << 20
    n = sana_samples_for(gib)
    t0 = time.perf_counter()
    samples = make_samples(n, seed)
    size = field_bytes(samples)
    made_s = time.perf_counter() - t0
    mds_writer, why_not = import_mds(mds_path)
    rows: dict[str, Callable[[Path], None]] = {
        MDS_STYLE: lambda out: mds_style(samples, out, shard_bytes, fsync=False),
        MDS_STYLE_FSYNC: lambda out: mds_style(samples, out, shard_bytes, fsync=True),
        OURS: lambda out: ours(samples, out, shard_bytes),
    }
    fsyncs = {MDS_STYLE: "no", MDS_STYLE_FSYNC: "yes", OURS: "yes"}
    if mds_writer is not None:
        rows[REAL_MDS] = lambda out: real_mds(mds_writer, samples, out, shard_bytes)
        fsyncs[REAL_MDS] = "no"
    root = Path(tempfile.mkdtemp(prefix="bench-writer-", dir=workdir))
    try:
        names = list(rows)
        # (ii) runs back to back with (i) and with (iii) in every round, so each round's ratios compare rows that met the
        # same machine; the order reverses from round to round
        order = [name for name in (MDS_STYLE, OURS, REAL_MDS, MDS_STYLE_FSYNC) if name in rows]
        ours(samples[: len(SANA_BUCKETS)], root / "warm-up", shard_bytes)  # imports and first touches, unmeasured
        shutil.rmtree(root / "warm-up")
        seconds: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for k in range(rounds):
            for name in order if k % 2 == 0 else order[::-1]:
                out = root / f"round{k}-{names.index(name)}"
                os.sync()  # no writeback of an earlier row during this one
                t, c = time.perf_counter(), time.process_time()
                rows[name](out)
                seconds[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
                shutil.rmtree(out)
        parts = breakdown(one_shard(samples, shard_bytes), root) if show_breakdown else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]
    own = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    others_load = max(load_before, load_after - own)  # the load before the run is others' alone

    print(f"shard writer: {n} Sana-size samples, {size / 2**30:.2f} GiB of fields ({size / n / 1e6:.2f} MB/sample: bf16 "
          f"latent (32, H/32, W/32) + bf16 text (120-300, 2304)), made in {made_s:.0f} s; shards of {shard_mib} MiB")
    print(f"{threads_line}; the writer's hashing threads: {HASH_THREADS}; {rounds} rounds; files in {root} "
          f"(page cache, then the device where fsync is yes)")
    print(f"the machine's load average (1 min): {load_before:.1f} before, {load_after:.1f} after, of which this benchmark "
          f"~{own:.1f} (its CPU seconds per second); {cores} cores. Other processes take the cores the hashing threads "
          f"would use (with none free, the writer pays its two hashes in full); above {cores}, a verdict is INCONCLUSIVE")
    if mds_writer is None:
        print(f"row (iii) left out: {why_not}")
    print("rows (i), (ii) and (iii) run back to back in each round (order reversed every other round); a ratio is the "
          "median of the rounds' own ratios, with their min-max")
    print(f"{'row':36s} {'fsync':>5s} {'MB/s':>7s} {'range':>11s} {'s':>6s} {'CPU s':>6s}")
    rate = {name: [size / s / 1e6 for s in seconds[name]] for name in names}
    for name in names:
        r = Stats.of(rate[name])
        print(f"{name:36s} {fsyncs[name]:>5s} {r.median:7.0f} {r.best:5.0f}-{r.worst:<5.0f} {Stats.of(seconds[name]).median:6.2f} "
              f"{Stats.of(cpu[name]).median:6.2f}")
    def paired(other: str) -> Stats:
        return Stats.of(a / b for a, b in zip(rate[OURS], rate[other]))

    ratio, ratio_sync = paired(MDS_STYLE), paired(MDS_STYLE_FSYNC)
    print(f"(ii) / (i)   = {ratio.median:.2f} (rounds {ratio.best:.2f}-{ratio.worst:.2f})   GOAL writer >= MDS-style sequential "
          f"write (ratio >= 1.00): {verdict(ratio, 1.0, others_load, cores)}")
    if REAL_MDS in rate:
        real = paired(REAL_MDS)
        print(f"(ii) / (iii) = {real.median:.2f} (rounds {real.best:.2f}-{real.worst:.2f})   GOAL writer >= the real MDSWriter "
              f"(ratio >= 1.00): {verdict(real, 1.0, others_load, cores)}")
    print(f"(ii) / (i')  = {ratio_sync.median:.2f} (rounds {ratio_sync.best:.2f}-{ratio_sync.worst:.2f})   (both fsync)")
    if parts:
        shard = sum(t.nbytes for _, _, f in one_shard(samples, shard_bytes) for t in f.values())
        print(f"one shard's parts, each timed alone ({shard / 2**20:.0f} MiB of fields; GB/s = 10^9 field bytes a wall "
              f"second; CPU s: the process's, every thread):")
        print(f"{'part':54s} {'before s':>9s} {'GB/s':>6s} {'CPU s':>6s}   {'now s':>6s} {'GB/s':>6s} {'CPU s':>6s}")
        for part, old, new in parts:
            cells = [f"{c[0]:9.3f} {shard / c[0] / 1e9:6.2f} {c[1]:6.3f}" if c else f"{'-':>9s} {'':6s} {'':6s}" for c in (old, new)]
            print(f"{part:54s} {cells[0]}   {cells[1][3:]}")


if __name__ == "__main__":
    typer.run(main)
