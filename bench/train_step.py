"""Training step time from the cache vs. in-memory batches (the limit), and what encoders in the step would cost.

The cache: Sana-1600M-size samples (`bench.common.write_sana_cache`: bf16 latent (32, H/32, W/32) at 1024 px,
bf16 Gemma-2 text (120-300, 2304), ~1 MB each), `--gib` of them, so the data path moves real bytes. The model:
the trainer's own step (`train.step.TrainStep`: objective, backward, clipping, AdamW) on a
SanaTransformer2DModel with the cache's channels (32 latent, 2304 caption, patch 1: ~1,000 image tokens) and a
`--transformer` width/depth small enough for this CPU; fp32 compute.

(a)  the trainer's data path: `train.data.BatchStream` over `train.data.BatchPlan`'s order (epoch = round),
     `--workers` background threads building batches while the step runs, digests checked (its default);
     the first batch (the stream's start-up, paid once per run) is left out of the time;
(a0) (a) without digest checks;
(c)  the same batches, collated in memory before the clock starts: the limit, no data path at all;
(b)  (c) plus, in every step, the tiny-sana preset's VAE and text encoder (random weights) encoding a batch of
     256-px images and their captions. These encoders are toys: (b) measured here says nothing about real
     encoders. The real-size a/b is estimated from FLOP counts, printed below the table.
warm: the cache's files are read just before the run (the page cache holds them: RAM > cache); cold: their
pages are dropped before the run (`bench.common.drop_pages`). read MB: bytes the process read from storage
during the run (/proc/self/io, every thread); read/used: that per byte of the samples the run's batches hold.
The data path's read-ahead thread reads what the next `readahead` batches need, so a short cold run reads far
more than its own batches: the start-up cost of an epoch, which over a whole epoch (`--steps` = batches per
epoch) comes down to each byte read about once.

Ratios to (c) are medians over the rounds of each run's ratio to a run of (c) right beside it (alternately
before and after; rows rotated). Goals: a/c <= 1.02 warm (the data path hidden behind the step), data wait
< 1 % of step time.

Real sizes: a trainer without a cache runs the encoders' forward for every sample of every step. With FLOPs
counted by torch.utils.flop_counter.FlopCounterMode on the `meta` device (no weights): transformer step = 3 x
forward (backward ~ 2 x forward) at 1024 px for one sample; encoders = forward of the VAE encoder on one
1024 x 1024 image + the text encoder(s) on one caption at the preset's token limit (a transformer LM's forward is
~ 2 x non-embedding parameters x tokens + attention, which the count includes). Estimated a/b = step / (step +
encoders), i.e. the same FLOP rate for both, and the cached data path costing nothing beside the step (what (a)
vs (c) measures).

Default run: 'small' transformer (~0.3 s/step), 1 GiB cache, 4 rounds of 8 steps per row, ~2.5-3 minutes. Full size:
`--transformer medium --gib 4 --steps 60 --rounds 5` (~25 minutes); `--steps` up to the batches per epoch (printed)
makes a cold run read each shard once.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import Stats, drop_pages, pin_threads, read_bytes, sana_samples_for, write_sana_cache  # noqa: E402
from precompute.config import PrecomputeConfig  # noqa: E402
from precompute.encode import Encoders  # noqa: E402
from precompute.folders import list_folder, read_folder_entry  # noqa: E402
from precompute.images import prepare  # noqa: E402
from precompute.presets import get_preset as encoder_preset  # noqa: E402
from precompute.sample_data import make_folder  # noqa: E402
from shards import Cache  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data import BatchStream, Epoch, TrainingSamples  # noqa: E402
from train.families import get_preset  # noqa: E402
from train.families.base import ModelPreset  # noqa: E402
from train.families.sana import TINY as TINY_SANA  # noqa: E402
from train.model import build_model, build_optimizer, build_run_objective, build_schedule  # noqa: E402
from train.order import BatchPlan  # noqa: E402
from train.step import TrainStep  # noqa: E402

# SanaTransformer2DModel sizes: (width, layers, head dim). A step at batch 4 on one thread of this machine's CPU:
# tiny ~0.1 s, small ~0.35 s, medium ~0.9 s, large ~1.7 s. Sana 1600M is (2240, 20, 32).
TRANSFORMERS = {"tiny": (32, 2, 16), "small": (128, 2, 32), "medium": (256, 2, 32), "large": (256, 4, 32)}
ENCODER_CONFIGS = Path(__file__).resolve().parents[1] / "precompute" / "configs"


def bench_preset(size: str) -> ModelPreset:
    """A Sana-family preset of the tiny preset's class and options, at `size`, taking the cache's latents and text."""
    width, layers, head = TRANSFORMERS[size]
    config = {**TINY_SANA, "in_channels": 32, "out_channels": 32, "caption_channels": 2304, "patch_size": 1,
              "num_layers": layers, "num_attention_heads": width // head, "attention_head_dim": head,
              "num_cross_attention_heads": width // head, "cross_attention_head_dim": head,
              "cross_attention_dim": width}
    return ModelPreset(f"bench-sana-{size}", "sana", None, config, "flow", "flow", flow_shift=3.0, base_resolution=1024,
                       latent_downsample=32)


# ---- the trainer's data path: the only code here that depends on train.data's API ---------------------------

def data_path(cfg: TrainConfig, cache_dir: Path, epoch: int, check_digests: bool) -> contextlib.AbstractContextManager:
    """The trainer's batches of `epoch`, as train/loop.py builds them: a `BatchStream` (background threads,
    `cfg.workers`, `cfg.prefetch`, `cfg.readahead`) over `BatchPlan`'s order. Iterate it for collated batches;
    `.wait_s` is the time the consumer waited."""
    samples = TrainingSamples(cache_dir, cfg.seed, cfg.caption_dropout, check_digests=check_digests)
    plan = BatchPlan.of(samples.cache, cfg.batch_size, seed=cfg.seed, remainder=cfg.remainder,
                        shuffle_shards=cfg.shuffle_shards)
    return BatchStream(Epoch(epoch, plan, samples), workers=cfg.workers, prefetch=cfg.prefetch, readahead=cfg.readahead)


def planned_batches(cfg: TrainConfig, cache_dir: Path, epoch: int, steps: int) -> tuple[list[dict], int]:
    """The first `steps` batches `data_path` yields for `epoch`, collated now, and the bytes of their samples."""
    samples = TrainingSamples(cache_dir, cfg.seed, cfg.caption_dropout, check_digests=False)
    plan = BatchPlan.of(samples.cache, cfg.batch_size, seed=cfg.seed, remainder=cfg.remainder,
                        shuffle_shards=cfg.shuffle_shards)
    planned = [p.indices for _, p in zip(range(steps), plan.batches(epoch))]
    used = sum(t.nbytes for indices in planned for i in indices for t in samples.cache[i].fields.values())
    return [samples.batch(epoch, indices) for indices in planned], used


# ---- real sizes ----------------------------------------------------------------------------------------------

def real_estimates(configs: Path) -> list[tuple[str, float, dict[str, float]]]:
    """Per real preset: transformer step FLOPs for one 1024-px sample, and encoder forward FLOPs per sample."""
    import diffusers
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    diffusers.utils.logging.set_verbosity_error()  # PixArt's config carries keys the class ignores
    meta = torch.device("meta")

    def load(name: str) -> dict:
        d = json.loads((configs / name).read_text())
        return {k: v for k, v in d.items() if not k.startswith("_") and k not in ("architectures", "model_type")}

    def flops(build, *args, **kwargs) -> float:
        with meta:
            module = build()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            module(*args, **kwargs)
        return float(counter.get_total_flops())

    def t(*shape):
        return torch.empty(*shape, device=meta)

    def ids(n: int):
        return {"input_ids": torch.zeros(1, n, dtype=torch.long, device=meta)}

    def vae(cls, name: str) -> float:
        with meta:
            module = cls.from_config(load(name))
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            module.encode(t(1, 3, 1024, 1024))
        return float(counter.get_total_flops())

    def transformer(preset: str, **inputs) -> float:
        p = get_preset(preset)
        return 3 * flops(lambda: p.transformer_class.from_config(p.transformer_config()), **inputs)

    gemma = transformers.Gemma2Config(**load("gemma2_2b_text.json"))
    t5 = transformers.T5Config(**load("t5_v1_1_xxl_text.json"))
    clip_l, clip_g = (transformers.CLIPTextConfig(**load(f)) for f in ("clip_l_text.json", "clip_g_text.json"))
    t5_300 = flops(lambda: transformers.T5EncoderModel(t5), **ids(300))
    sd3_text = {"CLIP-L (77 tok)": flops(lambda: transformers.CLIPTextModelWithProjection(clip_l), **ids(77)),
                "CLIP-G (77 tok)": flops(lambda: transformers.CLIPTextModelWithProjection(clip_g), **ids(77)),
                "T5-XXL (256 tok)": flops(lambda: transformers.T5EncoderModel(t5), **ids(256))}
    sd3 = dict(encoder_hidden_states=t(1, 77 + 256, 4096), pooled_projections=t(1, 2048), timestep=t(1))
    return [
        ("Sana 1600M", transformer("sana-1600m", hidden_states=t(1, 32, 32, 32), encoder_hidden_states=t(1, 300, 2304),
                                   timestep=t(1), encoder_attention_mask=torch.ones(1, 300, device=meta)),
         {"DC-AE f32c32 encoder": vae(diffusers.AutoencoderDC, "sana_dcae_vae.json"),
          "Gemma-2 2B (300 tok)": flops(lambda: transformers.Gemma2Model(gemma), **ids(300))}),
        ("PixArt-Sigma 1024", transformer("pixart-sigma-1024", hidden_states=t(1, 4, 128, 128),
                                          encoder_hidden_states=t(1, 300, 4096), timestep=t(1),
                                          added_cond_kwargs={"resolution": None, "aspect_ratio": None}),
         {"SDXL VAE encoder": vae(diffusers.AutoencoderKL, "sdxl_vae.json"), "T5-XXL (300 tok)": t5_300}),
        ("SD3.5 Large", transformer("sd35-large", hidden_states=t(1, 16, 128, 128), **sd3),
         {"SD3 VAE encoder": vae(diffusers.AutoencoderKL, "sd3_vae.json"), **sd3_text}),
    ]


def main(
    transformer: str = typer.Option("small", help="Transformer size, Sana class: " + ", ".join(
        f"{k} (width {w}, {n} layers)" for k, (w, n, _) in TRANSFORMERS.items()) + "."),
    steps: int = typer.Option(8, help="Steps per measurement (one round runs every row)."),
    batch_size: int = typer.Option(4, help="Samples per batch (one bucket each, as the trainer batches)."),
    gib: float = typer.Option(1.0, help="Size of the synthetic cache in GiB (~1,030 samples per GiB)."),
    workers: int = typer.Option(1, help="Background threads of the trainer's data path that build batches (the "
                                        "trainer's --workers; 0 builds each batch in the step's thread)."),
    rounds: int = typer.Option(4, help="Rounds; every row runs once per round, back to back; epoch = round."),
    mode: str = typer.Option("both", help="Page cache for (a): warm, cold or both."),
    encoders: bool = typer.Option(True, help="Measure (b), with the tiny-sana preset's toy encoders."),
    estimate: bool = typer.Option(True, help="Print the real-size a/b estimate from FLOP counts (~15 s)."),
    encoder_configs: Path = typer.Option(ENCODER_CONFIGS, help="Directory of the published encoder configs "
                                         "(sana_dcae_vae.json, gemma2_2b_text.json, ...) for the estimate."),
    threads: int = typer.Option(1, help="torch threads of the step (the data path's threads come on top)."),
    workdir: Path = typer.Option(None, help="Where to build the cache (default: the system's temp dir; "
                                            "removed after)."),
) -> None:
    threads_line = pin_threads(threads)
    if transformer not in TRANSFORMERS:
        raise typer.BadParameter(f"--transformer {transformer!r}: choose {', '.join(TRANSFORMERS)}")
    if mode not in ("warm", "cold", "both"):
        raise typer.BadParameter(f"--mode {mode!r}: choose warm, cold or both")
    modes = ["warm", "cold"] if mode == "both" else [mode]
    work = Path(tempfile.mkdtemp(prefix="train-step-", dir=workdir))
    try:
        cache_dir = write_sana_cache(work / "cache", sana_samples_for(gib))
        cache = Cache(cache_dir)
        files = [cache.path(j) for j in range(len(cache.shards))]
        preset = bench_preset(transformer)
        # the trainer's defaults for the data path; fp32: the same dtype on every side of the comparison
        cfg = TrainConfig(model="tiny-sana", batch_size=batch_size, precision="fp32", caption_dropout=0.1,
                          workers=workers)
        cpu = torch.device("cpu")
        net = build_model(cfg, preset, "none", 1, cpu, resume_from=None, state={}, say=lambda *a: None)
        optimizer = build_optimizer(cfg, net.params, cpu)
        trainer = TrainStep(cfg, net, build_run_objective(cfg, preset, preset.transformer_config()), optimizer,
                            build_schedule(cfg, optimizer), torch.amp.GradScaler("cpu", enabled=False), None,
                            parallel="none", rank=0, world=1, device=cpu)
        params = sum(p.numel() for p in net.params)

        def step(batch: dict, k: int) -> None:
            trainer.accumulate(batch, k)
            trainer.update(k)

        in_memory = {r: planned_batches(cfg, cache_dir, r, steps) for r in range(rounds)}
        used = {r: u for r, (_, u) in in_memory.items()}

        # (b): images and captions for the toy encoders
        enc = raw = None
        if encoders:
            data = make_folder(work / "data", 4 * batch_size)
            enc = Encoders(encoder_preset("tiny-sana"), cpu)
            policy = PrecomputeConfig(str(data), "tiny-sana").policy()
            items = [prepare(read_folder_entry(e), policy) for e in list_folder(data).entries]
            by_bucket: dict = {}
            for it in items:
                by_bucket.setdefault(it["bucket"], []).append(it)
            raw = [b[i:i + batch_size] for b in by_bucket.values()
                   for i in range(0, len(b) - batch_size + 1, batch_size)]

        def run_a(r: int, check: bool) -> tuple[float, float]:
            with data_path(cfg, cache_dir, r, check) as stream:
                first = next(stream)
                startup = stream.wait_s
                t0 = time.perf_counter()
                step(first, 0)
                for k, batch in zip(range(1, steps), stream):
                    step(batch, k)
                return time.perf_counter() - t0, stream.wait_s - startup, startup

        def run_c(r: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            for k, batch in enumerate(in_memory[r][0]):
                step(batch, k)
            return time.perf_counter() - t0, 0.0, 0.0

        def run_b(r: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            for k, batch in enumerate(in_memory[r][0]):
                images = raw[k % len(raw)]
                # outputs dropped: only their cost counts
                enc.encode_images(torch.stack([it["pixels"] for it in images]))
                enc.encode_text([it["captions"][0] for it in images])
                step(batch, k)
            return time.perf_counter() - t0, 0.0, 0.0

        rows = {"(c) in-memory batches": ("-", run_c)}
        for m in modes:
            rows[f"(a) from the cache, {m}"] = (m, lambda r: run_a(r, True))
            rows[f"(a0) no digest checks, {m}"] = (m, lambda r: run_a(r, False))
        if encoders:
            rows["(b) (c) + toy encoders"] = ("-", run_b)
        run_c(0)  # warm-up: allocator, first-call costs
        limit = "(c) in-memory batches"

        def measure(name: str, r: int) -> tuple:
            m, fn = rows[name]
            if m == "cold":
                drop_pages(files)
            elif m == "warm":  # every page of the cache into the page cache
                for f in files:
                    with open(f, "rb", buffering=0) as fh:
                        while fh.read(8 << 20):
                            pass
            r0 = read_bytes()
            t, wait, startup = fn(r)
            r1 = read_bytes()
            return t, wait, None if r0 is None else r1 - r0, r, startup

        # The machine's speed drifts within seconds (shared): every row runs right beside its own run of (c),
        # alternately before and after it, and its ratio is to that run.
        results: dict[str, list] = {name: [] for name in rows}  # (s, data wait, bytes read, round, start-up, (c) s)
        for r in range(rounds):
            names = [n for n in rows if n != limit]
            names = names[r % len(names):] + names[: r % len(names)]
            for j, name in enumerate(names):
                pair = [limit, name] if (r + j) % 2 == 0 else [name, limit]
                out = {n: measure(n, r) for n in pair}
                results[name].append((*out[name], out[limit][0]))
                results[limit].append((*out[limit], out[limit][0]))

        sizes = {h: cache.manifest.buckets()[h].samples for h in cache.manifest.buckets()}
        width, layers, _ = TRANSFORMERS[transformer]
        print(f"train step: SanaTransformer2DModel '{transformer}' (width {width}, {layers} layers, {params / 1e6:.2f}M "
              f"parameters), batch {batch_size}, {steps} steps per row, {rounds} rounds; fp32 compute, bf16 cache")
        print(f"cache: {len(cache)} Sana-size samples in {len(files)} shards, "
              f"{cache.manifest.num_bytes / 2**30:.2f} GiB "
              f"({', '.join(f'{b.name}: {n}' for b, n in sizes.items())}); {threads_line}; data path: {workers} "
              f"background thread(s), prefetch {cfg.prefetch}, readahead {cfg.readahead} batches")
        print(f"a run: {steps} batches = {steps * batch_size} samples, {Stats.of(used.values()).median / 1e6:.0f} MB "
              f"of the cache's {BatchPlan.of(cache, batch_size).batches_per_epoch()} batches per epoch")
        print(f"{'row':32s} {'ms/step':>8s} {'x (c)':>6s} {'range':>11s} {'data wait':>9s} {'start ms':>8s} "
              f"{'read MB':>8s} {'read/used':>9s}")
        for name, res in results.items():
            ms = Stats.of(1000 * t / steps for t, *_ in res)
            ratio = Stats.of(t / tc for t, *_, tc in res)
            is_a = name.startswith("(a")
            wait = f"{Stats.of(w / t for t, w, *_ in res).median:9.1%}" if is_a else f"{'':9s}"
            start = f"{Stats.of(1000 * s for _, _, _, _, s, _ in res).median:8.0f}" if is_a else f"{'':8s}"
            reads = [b for _, _, b, *_ in res]
            read_mb = "n/a" if None in reads else f"{Stats.of(reads).median / 1e6:.0f}"
            per_used = "n/a" if None in reads else f"{Stats.of(b / used[r] for _, _, b, r, *_ in res).median:.2f}"
            print(f"{name:32s} {ms.median:8.1f} {ratio.median:6.3f} {ratio.best:5.3f}-{ratio.worst:<5.3f} {wait} "
                  f"{start} {read_mb:>8s} {per_used:>9s}")
        if encoders:
            a, b = (Stats.of(t for t, *_ in results[name]).median
                    for name in (f"(a) from the cache, {modes[0]}", "(b) (c) + toy encoders"))
            print(f"a/b = {a / b:.2f} ({modes[0]}) with tiny-sana's toy encoders at 256 px: not what real encoders "
                  f"cost; see below.")

        if estimate:
            if not encoder_configs.is_dir():
                print(f"real-size estimate: n/a (no encoder configs at {encoder_configs}; pass --encoder-configs DIR)")
                return
            print("real sizes, per 1024-px sample, FLOPs counted on the meta device (FlopCounterMode): "
                  "step = 3 x transformer forward; encoders = forward; a/b = step / (step + encoders)")
            print(f"{'model':18s} {'step TFLOP':>10s} {'encoders TFLOP':>14s} {'a/b':>5s}  encoders")
            for model, step_flops, encs in real_estimates(encoder_configs):
                total = sum(encs.values())
                parts = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in encs.items())
                print(f"{model:18s} {step_flops / 1e12:10.2f} {total / 1e12:14.2f} "
                      f"{step_flops / (step_flops + total):5.2f}  {parts}")
            print("Sana's pipeline also prepends its ~1,060-character complex human instruction to every caption: "
                  "more Gemma tokens than counted here, so its a/b is lower still. LoRA or frozen-base steps cost less "
                  "than 3 x forward.")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
