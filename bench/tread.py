"""TREAD token routing (`--tread`): training step time and FLOPs with and without routing, side by side, and the loss
of a short run both ways.

Models: Flux and Wan transformers of the tiny presets' classes, deep and wide enough that the blocks dominate the step
(`MODELS`: Flux 2 double- + 6 single-stream blocks, width 128; Wan 6 blocks, width 128), at more tokens than the tiny
presets train on: Flux at --flux-size px (384: a 48 x 48 latent, 576 packed image tokens beside 32 text tokens), Wan
on clips of 17 frames at --wan-size px (192: 5 latent frames x 12 x 12 = 720 video tokens; 512 zero-filled text
tokens, the pipelines' length). Random weights (seeded), random latents and captions of the caches' shapes.

(a) step time: the trainer's own step (`train.step.TrainStep`: objective, forward, backward, clipping, AdamW; fp32) on
    the same in-memory batch, one model built with --route and one without (the same weights). Each round runs --steps
    steps of each, alternately first; the ratio is the median over rounds of routed / unrouted seconds. Goal: < 1 at
    ratio 0.5 (TREAD's report: 20-40 % faster on image DiTs, about 2x on Wan; at these widths attention and the
    per-token layers are a smaller share of a step than at 1-14B parameters, and the gather/scatter costs more).
(b) FLOPs: torch.utils.flop_counter.FlopCounterMode over one micro-batch's forward and backward (`accumulate`), routed
    over unrouted. Expected about the token-work estimate 1 - ratio x (routed blocks / blocks) (attention's quadratic
    term makes the routed blocks cheaper still, the layers outside the blocks dearer); goal: within 0.05 above it.
(c) loss: two training runs (`train.loop.train`) of the Flux model from one stage-one cache of --images tiny-flux
    images at 256 px (256 image tokens), the same seed, samples and noise, --run-steps steps each, with and without
    --route; reported: the final smoothed training loss (the routed run's is of routed forwards) and the held-out loss
    (a quarter of the images held out, 8 fixed timesteps, every token: comparable both ways), with the wall time of
    each run. Routing may raise the loss at equal steps; the goal row asks for a held-out loss within 10 % of the
    unrouted run's at equal steps and says PASS or MISS as it comes out.

Default run: about 1.5 minutes on this machine's CPU with one thread (`bench.common.pin_threads`).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import pin_threads  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.families import PRESETS, get_family  # noqa: E402
from train.families.base import ModelPreset  # noqa: E402
from train.families.flux import TINY as TINY_FLUX  # noqa: E402
from train.families.wan import TINY as TINY_WAN  # noqa: E402
from train.model import build_model, build_optimizer, build_run_objective, build_schedule  # noqa: E402
from train.step import TrainStep  # noqa: E402
from train.tread import parse_routes, resolve_routes  # noqa: E402

# The tiny presets' configs (their encoders' widths, so the Flux one trains from a tiny-flux cache), deeper and wider
MODELS = {
    "flux": ModelPreset("bench-flux", "flux", None, {**TINY_FLUX, "num_layers": 2, "num_single_layers": 6,
                                                     "attention_head_dim": 32, "num_attention_heads": 4,
                                                     "axes_dims_rope": (8, 12, 12)},
                        "flow", "flow", dynamic_shift=True, base_resolution=256, text_tokens=32, train_guidance=1.0),
    "wan": ModelPreset("bench-wan", "wan", None, {**TINY_WAN, "num_attention_heads": 4, "attention_head_dim": 32,
                                                  "ffn_dim": 512, "num_layers": 6, "rope_max_seq_len": 64},
                       "flow", "flow", flow_shift=3.0, base_resolution=256, text_tokens=64),
}


def batch_of(preset: ModelPreset, bucket: tuple, size: int, seed: int = 0) -> dict:
    """A collated batch of `size` samples of `bucket` with random latents and text (the family's fields and shapes)."""
    family = get_family(preset.family)
    fields = family.example_batch(preset.transformer_config(), preset, bucket, size, preset.text_tokens, torch.float32,
                                  "cpu")
    g = torch.Generator().manual_seed(seed)
    batch = {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else torch.ones_like(v)
             for k, v in fields.items()}
    return {**batch, "bucket": bucket[:2], "keys": [f"k{i}" for i in range(size)]}


def trainer(preset: ModelPreset, route: str | None) -> TrainStep:
    """The trainer's step on the preset's transformer (seed 0: the same weights with and without routing)."""
    cpu = torch.device("cpu")
    cfg = TrainConfig(model="tiny-flux" if preset.family == "flux" else "tiny-wan", precision="fp32", tread=route,
                      caption_dropout=0.0)
    model = build_model(cfg, preset, "none", 1, cpu, resume_from=None, state={}, say=lambda *a: None)
    optimizer = build_optimizer(cfg, model.params, cpu)
    return TrainStep(cfg, model, build_run_objective(cfg, preset, preset.transformer_config()), optimizer,
                     build_schedule(cfg, optimizer), torch.amp.GradScaler("cpu", enabled=False), None, parallel="none",
                     rank=0, world=1, device=cpu)


def flops(step: TrainStep, batch: dict) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step.accumulate(batch, 0)
    step.rewind()
    return counter.get_total_flops()


def step_ratio(plain: TrainStep, routed: TrainStep, batch: dict, steps: int, rounds: int) -> tuple[float, float, float]:
    """Median over rounds of routed / unrouted time for `steps` steps each (alternately first); and the median
    seconds per step of each."""
    def run(step: TrainStep) -> float:
        t0 = time.perf_counter()
        for k in range(steps):
            step.accumulate(batch, k)
            step.update(k)
        return time.perf_counter() - t0

    run(plain), run(routed)  # warm-up: allocator, first-call costs
    ratios, a, b = [], [], []
    for r in range(rounds):
        if r % 2:
            tr, tp = run(routed), run(plain)
        else:
            tp, tr = run(plain), run(routed)
        ratios.append(tr / tp)
        a.append(tp / steps)
        b.append(tr / steps)
    return statistics.median(ratios), statistics.median(a), statistics.median(b)


def token_estimate(route: str, depth: int) -> float:
    """1 - ratio x routed blocks / blocks, summed over the routes: the share of the blocks' per-token work left."""
    return 1 - sum(ratio * (end - start + 1) / depth for ratio, start, end in resolve_routes(parse_routes(route), depth))


def row(name: str, figure: str, goal: str, ok: bool) -> None:
    print(f"{name:44s} {figure:34s} GOAL {goal:44s} {'PASS' if ok else 'MISS'}")


def loss_runs(work: Path, route: str, images: int, steps: int, batch_size: int) -> dict:
    """Two runs of the Flux bench model from one tiny-flux cache, without and with `route`: final smoothed loss,
    held-out loss, wall seconds."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder
    from train.loop import train

    data = make_folder(work / "data", count=images)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its report
        precompute(str(data), "tiny-flux", work / "cache", workers=0, progress=False)
    PRESETS["bench-flux"] = lambda: MODELS["flux"]  # the trainer looks the preset up by name
    out = {}
    for name, tread in (("unrouted", None), ("routed", route)):
        run = work / name
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's start-up report and progress lines
            train(TrainConfig(model="bench-flux", cache=[str(work / "cache")], run=run, steps=steps, batch_size=batch_size,
                              workers=0, progress=False, log_every=steps, checkpoint_every=0, lr=3e-4, precision="fp32",
                              validate=False, eval_fraction=0.25, eval_every=0, eval_timesteps=8, tread=tread, seed=0))
        seconds = time.perf_counter() - t0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in rows if r.get("smoothed_loss") is not None][-1]
        held = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
        out[name] = {"smoothed": last["smoothed_loss"], "held_out": held[-1] if held else float("nan"), "seconds": seconds}
    return out


def main(
    route: str = typer.Option("0.5:2:-2", help="The --tread routes measured (RATIO:START:END[,...]; see python -m train "
                                               "--help)."),
    flux_size: int = typer.Option(384, help="Flux's square bucket in pixels for (a) and (b) (384: 576 image tokens; 1024: "
                                            "4,096, FLUX.1's own size)."),
    wan_size: int = typer.Option(192, help="Wan's square bucket in pixels of the 17-frame clips for (a) and (b) (192: 720 "
                                           "video tokens)."),
    batch_size: int = typer.Option(1, help="Samples per step in (a) and (b)."),
    steps: int = typer.Option(3, help="Steps of each model per round in (a)."),
    rounds: int = typer.Option(4, help="Rounds of (a); its ratio is their median."),
    images: int = typer.Option(16, help="Images of the tiny-flux cache of (c) (a quarter held out)."),
    run_steps: int = typer.Option(100, help="Steps of each training run of (c); 0 leaves (c) out."),
    run_batch_size: int = typer.Option(4, help="Batch size of the runs of (c)."),
    threads: int = typer.Option(1, help="torch threads."),
    workdir: Path = typer.Option(None, help="Where (c) builds its cache and runs (default: the system's temp dir; removed "
                                            "after)."),
) -> None:
    threads_line = pin_threads(threads)
    parse_routes(route)  # the syntax, before anything runs
    print(f"TREAD --tread {route}; {threads_line}; fp32; batch {batch_size}; {rounds} rounds x {steps} steps per model")
    buckets = {"flux": (flux_size, flux_size), "wan": (wan_size, wan_size, 17)}
    for name, preset in MODELS.items():
        family, config = get_family(preset.family), preset.transformer_config()
        batch = batch_of(preset, buckets[name], batch_size)
        plain, routed = trainer(preset, None), trainer(preset, route)
        depth = len(family.tread_route(plain.model.module).blocks)
        tokens = family.image_tokens(config, preset, buckets[name])
        params = sum(p.numel() for p in plain.model.params)
        print(f"{name}: {family.transformer}, {depth} blocks, {params / 1e6:.1f}M parameters, bucket "
              f"{'x'.join(map(str, buckets[name]))}: {tokens} image tokens")
        ratio, ms_plain, ms_routed = step_ratio(plain, routed, batch, steps, rounds)
        row(f"(a) {name} step time routed / unrouted", f"{ratio:.3f} ({ms_routed * 1e3:.0f} / {ms_plain * 1e3:.0f} ms)",
            "< 1 at ratio 0.5", ratio < 1)
        f_plain, f_routed = flops(plain, batch), flops(routed, batch)
        expected = token_estimate(route, depth)
        row(f"(b) {name} FLOPs routed / unrouted", f"{f_routed / f_plain:.3f} ({f_routed / 1e9:.1f} / {f_plain / 1e9:.1f} "
            f"GFLOP)", f"<= {expected + 0.05:.3f} (token estimate {expected:.3f})", f_routed / f_plain <= expected + 0.05)
    if run_steps:
        work = Path(tempfile.mkdtemp(prefix="tread-", dir=workdir))
        try:
            runs = loss_runs(work, route, images, run_steps, run_batch_size)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        u, r = runs["unrouted"], runs["routed"]
        print(f"(c) flux runs: {run_steps} steps of batch {run_batch_size} from {images} tiny-flux images at 256 px, seed 0, "
              f"lr 3e-4; held-out: a quarter of the images, 8 fixed timesteps, every token")
        print(f"    unrouted: smoothed loss {u['smoothed']:.4f}, held-out loss {u['held_out']:.4f}, run {u['seconds']:.1f} s")
        print(f"    routed:   smoothed loss {r['smoothed']:.4f}, held-out loss {r['held_out']:.4f}, run {r['seconds']:.1f} s")
        print("    (run times: one run each, start-up and the held-out evaluation included, not alternated: (a) is the "
              "step-time figure)")
        row("(c) flux held-out loss routed / unrouted", f"{r['held_out'] / u['held_out']:.3f} at equal steps",
            "<= 1.10", r["held_out"] <= 1.10 * u["held_out"])


if __name__ == "__main__":
    typer.run(main)
