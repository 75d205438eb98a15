"""Training step time from the cache vs. with encoders in the step vs. in-memory batches (the limit).

(a) the trainer's data path: memory-mapped shards, collate in the training process (or workers), prefetch;
(b) the same step with the (tiny) VAE and text encoder running inside it, as trainers without a cache do;
(c) the same batches already collated in memory: the limit.
(a) checks every sample against its stored digest, as the trainer does by default; (a0) is (a) without it.
Goals: a/c <= 1.02 (loader overhead <= 2 %), data wait < 1 % of step time.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from precompute.config import PrecomputeConfig  # noqa: E402
from precompute.encode import Encoders  # noqa: E402
from precompute.folders import list_folder, read_folder_entry  # noqa: E402
from precompute.images import prepare  # noqa: E402
from precompute.presets import get_preset as encoder_preset  # noqa: E402
from precompute.run import main as precompute  # noqa: E402
from precompute.sample_data import make_folder  # noqa: E402
from shards import Cache  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.data import BucketBatchSampler, Prefetcher, TrainingSamples, epoch_loader  # noqa: E402
from train.model import build_model, build_optimizer, build_run_objective, build_schedule  # noqa: E402
from train.presets import get_preset  # noqa: E402
from train.step import TrainStep  # noqa: E402


def main(
    model: str = typer.Option("tiny-sana", help="Preset."),
    steps: int = typer.Option(60, help="Steps per measurement."),
    batch_size: int = typer.Option(8, help="Batch size."),
    workers: int = typer.Option(0, help="DataLoader worker processes for (a); 0 reads in the training process (the trainer's default)."),
    repeats: int = typer.Option(5, help="Rounds; (a), (b), (c) alternate and each keeps its best."),
) -> None:
    torch.set_num_threads(1)  # the other core serves the loader worker
    work = Path(tempfile.mkdtemp(prefix="train-bench-"))
    try:
        data = make_folder(work / "data", 64)
        precompute(str(data), model, work / "cache", workers=0, progress=False)
        preset = get_preset(model)
        # the trainer's own step (fp32 here: the same dtype on every side of the comparison)
        cfg = TrainConfig(model=model, batch_size=batch_size, precision="fp32", caption_dropout=0.1)
        cpu = torch.device("cpu")
        net = build_model(cfg, preset, "none", 1, cpu, resume_from=None, state={}, say=lambda *a: None)
        optimizer = build_optimizer(cfg, net.params, cpu)
        trainer = TrainStep(cfg, net, build_run_objective(cfg, preset, preset.transformer_config()), optimizer,
                            build_schedule(cfg, optimizer), torch.amp.GradScaler("cpu", enabled=False), None, parallel="none",
                            rank=0, world=1, device=cpu)

        def step(batch: dict, k: int) -> None:
            trainer.accumulate(batch, k)
            trainer.update(k)

        cache = Cache(work / "cache")
        sampler = BucketBatchSampler(cache.ranges_by_bucket(), batch_size)
        dataset = TrainingSamples(work / "cache", 0, 0.1)
        epochs = [sampler(e) for e in range(steps // len(sampler(0)) + 2)]
        plan = [(e, b) for e, bs in enumerate(epochs) for b in bs][:steps]
        in_memory = [dataset.collate([dataset[(e, i)] for i in b]) for e, b in plan]

        # (b): pixels and captions of the same samples, encoded inside the step
        enc = Encoders(encoder_preset(model), torch.device("cpu"))
        policy = PrecomputeConfig(str(data), model).policy()
        by_key = {}
        for entry in list_folder(data).entries:
            it = prepare(read_folder_entry(entry), policy)
            by_key[it["key"]] = it
        raw = [[by_key[k] for k in batch["keys"]] for batch in in_memory]

        unchecked = TrainingSamples(work / "cache", 0, 0.1, check_digests=False)

        def run_a(data: TrainingSamples = dataset) -> tuple[float, float]:
            loader = epoch_loader(data, [b for _, b in plan], 0, workers, torch.device("cpu"))
            prefetch = Prefetcher(loader, torch.device("cpu"))  # starts the worker and fetches batch 0
            startup = prefetch.wait_s  # paid once per epoch, not per step
            t0 = time.perf_counter()
            for k, batch in enumerate(prefetch):
                step(batch, k)
            return time.perf_counter() - t0, prefetch.wait_s - startup

        def run_b() -> float:
            t0 = time.perf_counter()
            for k, (items, batch) in enumerate(zip(raw, in_memory)):
                latents = enc.encode_images(torch.stack([it["pixels"] for it in items]))
                text = enc.encode_text([it["captions"][0] for it in items])
                step({**batch, "latents": next(iter(latents.values()))}, k)
                del text
            return time.perf_counter() - t0

        def run_c() -> float:
            t0 = time.perf_counter()
            for k, batch in enumerate(in_memory):
                step(batch, k)
            return time.perf_counter() - t0

        run_c()  # warm up
        a = a0 = b = c = float("inf")
        wait, paired, digest_cost = 0.0, [], []
        for _ in range(repeats):
            ta, w = run_a()
            ta0, _ = run_a(unchecked)
            tc = run_c()
            paired.append(ta / tc)  # back to back: both see the same machine load
            digest_cost.append(ta / ta0)
            a0 = min(a0, ta0)
            if ta < a:
                a, wait = ta, w
            b, c = min(b, run_b()), min(c, tc)
        paired.sort()
        ms = lambda t: 1000 * t / steps  # noqa: E731
        print(f"{model}, batch {batch_size}, {steps} steps, {workers} loader worker(s), 1 compute thread, {repeats} rounds")
        print(f"(a) from the cache      {ms(a):7.1f} ms/step")
        print(f"(b) encoders in step    {ms(b):7.1f} ms/step   a/b = {a / b:.2f}")
        print(f"(c) in-memory batches   {ms(c):7.1f} ms/step   a/c = {a / c:.3f} best vs best, "
              f"{paired[len(paired) // 2]:.3f} median of back-to-back rounds (goal <= 1.02)")
        digest_cost.sort()
        print(f"(a0) without digest checks {ms(a0):4.1f} ms/step   a/a0 = {a / a0:.3f} best vs best, "
              f"{digest_cost[len(digest_cost) // 2]:.3f} median of back-to-back rounds")
        print(f"data wait in (a): {wait / a:.2%} of step time, after the loader's start-up (goal < 1 %)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
