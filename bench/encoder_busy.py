"""Does stage one keep its encoder busy? Stage one's real pass with a simulated encoder of a given throughput.

Everything but the encoders is the real thing: the loader with its worker processes decoding generated PNG images,
the pass sorting and batching them per bucket, the background writer writing a real cache (fsync at commit). The
encoders are the preset's (tiny, real shapes) with their calls replaced (`SimulatedEncoders`): an image call takes
batch / `--rate` seconds of wall time, the first `--gil-share` of it holding the GIL (a busy Python loop: a CUDA encoder
launching its kernels from Python holds it, contending with the pass's thread), the rest asleep with the GIL released
as a call waiting on its device does, and returns the real tiny VAE's latents for its bucket, computed once; a text call returns the real tiny text encoder's
fields of its captions, computed once before the run (a sample's whole encoding is in its image call).

Rows, measured side by side in each round: the pass as it runs (the encoder on its own thread) and the serial pass
(the encoder called on the pass's thread between sorting, batching and checking: the pass before the encoder got a
thread), at `--rate`; the same two with the inputs decoded before the run (the loader hands them out at once: what
the pass alone gives); the overlapped pass at `--high-rate`, where a 2-core machine stops keeping up; and the loader
alone (what decoding can give, nothing encoded: the ceiling of the rows that decode, on a machine shared with
others). Each row gives the encoder's busy fraction (time inside encode calls / pass wall), samples/s achieved against
the rate, the encoder's idle time waiting on decoded inputs and on the writer, and the stage the summary names as the
bound.

Default run: 900 tiny images (~256 px), batch 16, 2 loader workers, 2 rounds: about 1.5 minutes.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import precompute.run  # noqa: E402
from bench.common import pin_threads  # noqa: E402
from precompute.config import DEFAULT_BATCH, PrecomputeConfig  # noqa: E402
from precompute.encode import Encoders, TextBatch  # noqa: E402
from precompute.encoding import EncodingPass  # noqa: E402
from precompute.sample_data import make_folder  # noqa: E402

GOAL_BUSY = 0.95


class SimulatedEncoders(Encoders):
    """The preset's encoders, their calls taking the time of an encoder of `rate` samples/s.

    Args:
        rate: samples per second of the simulated device: an image call of B images takes B / rate seconds.
        gil_share: the share of each image call spent holding the GIL (launching kernels from Python), first; the rest
            asleep with the GIL released (waiting on the device).
        *args, **kwargs: `Encoders`'.
    """

    def __init__(self, *args, rate: float, gil_share: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.rate, self.gil_share = rate, gil_share
        self.latents: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}  # an image's shape -> its latent fields
        self.texts: dict[tuple[str, bool], tuple[dict[str, torch.Tensor], bool]] = {}  # (caption, instruction) -> fields

    def warm(self, shapes: list[tuple[int, int]], captions: list[str]) -> None:
        """Compute, with the real tiny encoders, the latents of an image of each (height, width) and the captions'
        text fields, so that no call of the run computes anything."""
        for h, w in shapes:
            self.latent_of(torch.zeros(1, 3, h, w, dtype=torch.uint8))
        self.text_of(list(dict.fromkeys(captions)), True)

    def latent_of(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        shape = tuple(pixels.shape[1:])
        if shape not in self.latents:
            self.latents[shape] = super().encode_images(pixels[:1])
        return self.latents[shape]

    def text_of(self, captions: list[str], instruction: bool) -> None:
        missing = [c for c in dict.fromkeys(captions) if (c, instruction) not in self.texts]
        for i in range(0, len(missing), 64):
            part = missing[i : i + 64]
            batch = super().encode_text(part, instruction)
            self.texts.update({(c, instruction): (f, t) for c, f, t in zip(part, batch.fields, batch.truncated)})

    def encode_images(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        seconds = len(pixels) / self.rate
        launched, deadline = start + seconds * self.gil_share, start + seconds
        while time.perf_counter() < launched:  # the GIL held, as Python launching the encoder's kernels
            pass
        out = {name: t.expand(len(pixels), *t.shape[1:]).clone() for name, t in self.latent_of(pixels).items()}
        time.sleep(max(0.0, deadline - time.perf_counter()))  # the GIL released, as a call waiting on its device
        return out

    def encode_text(self, captions: list[str], instruction: bool = True, references=None) -> TextBatch:
        self.text_of(captions, instruction)  # nothing to compute after `warm` (the stored prompts aside)
        found = [self.texts[(c, instruction)] for c in captions]
        return TextBatch([f for f, _ in found], [t for _, t in found])


def one_run(data: Path, cache: Path, enc: SimulatedEncoders, model: str, *, overlap: bool, workers: int,
            batch_size: int, decoded: list[dict] | None = None) -> dict:
    """Stage one's run of `data` into a new `cache` with `enc` as its encoders; its summary (its printout dropped).
    With `decoded` (what the loader yields for `data`), the loader hands those out at once instead of decoding."""
    shutil.rmtree(cache, ignore_errors=True)
    loader = precompute.run.build_loader if decoded is None else lambda *a: iter(decoded)
    with (mock.patch.object(precompute.run, "Encoders", lambda *a, **k: enc),
          mock.patch.object(precompute.run, "EncodingPass", partial(EncodingPass, overlap=overlap)),
          mock.patch.object(precompute.run, "build_loader", loader), contextlib.redirect_stderr(io.StringIO())):
        return precompute.run.main(str(data), model, cache, workers=workers, batch_size=batch_size, storage_dtype="bf16",
                                   progress=False, log_seconds=3600)


def decode(data: Path, model: str, workers: int) -> tuple[list[dict], float]:
    """What stage one's loader yields for `data` (its worker processes reading, decoding and resizing), nothing
    encoded, and its samples/s."""
    config = PrecomputeConfig(str(data), model, Path(tempfile.mkdtemp(prefix="encoder-busy-loader-")), workers=workers)
    try:
        t0 = time.perf_counter()
        items = list(precompute.run.open_all_inputs(config, None, torch.device("cpu"), 0, 1).batches)
        return items, len(items) / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(config.cache, ignore_errors=True)


def figures(summary: dict, rate: float) -> dict:
    return {"busy": summary["encoder_busy_fraction"], "rate": summary["images_per_s"] / rate,
            "per_s": summary["images_per_s"], "data": summary["data_wait_fraction"],
            "writer": summary["writer_wait_fraction"], "writer_busy": summary["writer_busy_fraction"],
            "bound": summary["bound_by"]}


def main(
    rate: float = typer.Option(300.0, help="Samples per second of the simulated encoder (a GPU VAE at 1024 px "
                                           "encodes hundreds a second in batches)."),
    high_rate: float = typer.Option(1000.0, help="A higher rate for a last row, where this machine stops keeping up "
                                                 "(0: no such row)."),
    count: int = typer.Option(900, help="Generated images (~256 px PNGs) in each run."),
    batch_size: int = typer.Option(DEFAULT_BATCH["cuda"], help="Images per encoder call (stage one's --batch-size; "
                                                               "the default is its CUDA default)."),
    workers: int = typer.Option(2, help="Stage one's loader worker processes (--workers), each decoding images."),
    repeats: int = typer.Option(2, help="Rounds; each runs the overlapped and the serial pass back to back (figures: "
                                        "the median over rounds)."),
    gil_share: float = typer.Option(0.08, min=0.0, max=1.0, help="Share of each simulated encoder call spent holding "
                                    "the GIL (a busy Python loop), as a CUDA encoder does while Python launches its "
                                    "kernels; the rest of the call sleeps with the GIL released (waiting on the device). "
                                    "0: the whole call asleep."),
    model: str = typer.Option("tiny-sana", help="Preset whose shapes the simulated encoder returns."),
    threads: int = typer.Option(1, help="torch threads of the run's own process (the loader's workers use 1 each)."),
) -> None:
    threads_line = pin_threads(threads)
    work = Path(tempfile.mkdtemp(prefix="encoder-busy-bench-"))
    try:
        data = make_folder(work / "data", count)
        config = PrecomputeConfig(str(data), model)
        enc = SimulatedEncoders(config.preset(), torch.device("cpu"), rate=rate, gil_share=gil_share)
        enc.warm([(b.height, b.width) for b in config.policy().buckets],
                 [p.read_text(encoding="utf-8").strip() for p in sorted(data.glob("*.txt"))])
        run = partial(one_run, data, work / "cache", enc, model, workers=workers, batch_size=batch_size)
        run(overlap=True)  # warm-up: the loader's imports, the files' pages
        decoded, loader = decode(data, model, workers)
        rounds = []
        for _ in range(repeats):
            enc.rate = rate
            rounds.append({"overlapped": figures(run(overlap=True), rate), "serial": figures(run(overlap=False), rate),
                           "decoded": figures(run(overlap=True, decoded=decoded), rate),
                           "decoded_serial": figures(run(overlap=False, decoded=decoded), rate)})
            if high_rate:
                enc.rate = high_rate
                rounds[-1]["high"] = figures(run(overlap=True), high_rate)
        load = os.getloadavg()[0]
        rows = {name: {k: statistics.median(r[name][k] for r in rounds) if k != "bound" else
                       statistics.mode(r[name][k] for r in rounds) for k in rounds[0][name]} for name in rounds[0]}

        print(f"stage one's pass, simulated encoder ({model}'s shapes): {count} generated images, batch {batch_size}, "
              f"{workers} loader worker(s), bf16 cache; {gil_share:.0%} of each encoder call holding the GIL; {threads_line}; load average {load:.1f} at the end; {repeats} rounds: median")
        print(f"{'row':44s} {'busy':>6s} {'samples/s':>16s} {'data wait':>9s} {'writer wait':>11s} {'bound by':>9s}   goal")

        def line(label: str, row: dict, at: float, goal: str) -> None:
            print(f"{label:44s} {row['busy']:6.1%} {row['per_s']:6.0f} of {at:5.0f} {row['data']:9.1%} "
                  f"{row['writer']:11.1%} {row['bound']:>9s}   {goal}")

        # the busy fraction counts a call's late wake-up (a loaded CPU, the GIL) as busy: the samples/s must agree
        ok = min(rows["overlapped"]["busy"], rows["overlapped"]["rate"]) >= GOAL_BUSY
        line(f"encoder on its own thread, {rate:.0f}/s", rows["overlapped"], rate,
             f">= 95 % busy at {rate:.0f} samples/s on {os.cpu_count()} cores (and >= 95 % of the rate): "
             f"{'PASS' if ok else 'MISS'}")
        line(f"serial pass (before), {rate:.0f}/s", rows["serial"], rate, "the baseline")
        gain = statistics.median(r["overlapped"]["per_s"] / r["serial"]["per_s"] for r in rounds)
        print(f"{'  overlapped / serial samples/s':44s} {gain:6.2f} x")
        line(f"  inputs decoded before: own thread, {rate:.0f}/s", rows["decoded"], rate,
             "the pass alone (no loader): >= 95 %")
        line(f"  inputs decoded before: serial, {rate:.0f}/s", rows["decoded_serial"], rate, "the pass alone, before")
        if high_rate:
            line(f"encoder on its own thread, {high_rate:.0f}/s", rows["high"], high_rate, "where it stops keeping up")
        print(f"{'loader alone, ' + str(workers) + ' worker(s), nothing encoded':44s} {'':6s} {loader:6.0f} "
              f"samples/s: the most decoding gives on this machine now")
        print(f"the background writer was busy {rows['overlapped']['writer_busy']:.1%} of the overlapped pass at "
              f"{rate:.0f}/s (beside it, on its thread)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
