"""Device-to-host synchronisations per optimizer step, every family's tiny preset, and the training loop.

A synchronisation makes the host wait until the GPU has run every kernel queued before it: the queue drains, and the
next kernels start only after the host has launched them again. The goal is one per optimizer step, the read of the
gradient norm (is it finite?), which also brings every rank's stop and damaged-batch flags; no micro-batch waits.

Counted on this CPU by `bench.sync_counter.SyncCounter` (its docstring says what counts: what
`torch.cuda.set_sync_debug_mode` reports on CUDA, reads of tensors that would live on the device and blocking copies
to it), over `--steps` optimizer steps of `--grad-accum` micro-batches of two samples (64 x 64, captions of 8 and 5
tokens, one reference for edit presets, 5 frames for video), the first step left out (it may copy a table to the
device once: a rotary cache, the DDPM schedule).

(a) per family: `train.step.TrainStep` (forward and backward per micro-batch, clipping, AdamW) on the preset's tiny
    transformer, fp32.
(b) the loop: `python -m train` in this process on a tiny-sana cache stage one builds here (8 images), grad
    accumulation 2, logging and checkpoints off but for the last step: the data's damage and the signals agreed in
    the step's read, metrics summed on the device. `tests/stage_two/test_syncs.py` also runs it in two processes
    under torchrun (DDP, gloo).

Step time with and without the synchronisations is not measured: on a CPU the "device" is the host, so a read waits
for nothing and removing it saves nothing here. On a GPU each one stalls the host until the queue drains (the launch
of the next kernels is then on the critical path); the step times printed are the CPU's, for scale only.

Default run: every tiny preset, 3 steps of 2 micro-batches, and (b): about a minute.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import pin_threads  # noqa: E402
from bench.sync_counter import SyncCounter  # noqa: E402
from shards import Bucket  # noqa: E402
from train.families import PRESETS, get_family, get_preset  # noqa: E402
from train.families.base import TextInput  # noqa: E402

GOAL = 1  # synchronisations per optimizer step
THE_READ = "train/distributed.py"  # where the step's one read is made (`train.distributed.read_step`)


def step_batch(name: str, grad_accum: int = 2, **options) -> tuple:
    """A tiny preset's model and trainer (`TrainStep`, fp32, AdamW, or the `TrainConfig` `options` given) and a batch of
    two samples as the data path gives it: random latents, two captions of 8 and 5 tokens collated by the family's layout
    (masked where it masks), one reference for an edit preset, 5 frames for a video family."""
    from train.config import TrainConfig
    from train.model import build_ema, build_model, build_optimizer, build_run_objective, build_schedule
    from train.step import TrainStep

    torch.manual_seed(0)
    preset = get_preset(name)
    family, config = get_family(preset.family), preset.transformer_config()
    cfg = TrainConfig(**{"model": name, "batch_size": 2, "precision": "fp32", "grad_accum": grad_accum, **options})
    cpu = torch.device("cpu")
    net = build_model(cfg, preset, "none", 1, cpu, resume_from=None, state={}, say=lambda *a: None)
    optimizer = build_optimizer(cfg, net.params, cpu)
    trainer = TrainStep(cfg, net, build_run_objective(cfg, preset, config), optimizer, build_schedule(cfg, optimizer),
                        torch.amp.GradScaler("cpu", enabled=cfg.precision == "fp16"), build_ema(cfg, net.params, cpu),
                        parallel="none", rank=0, world=1, device=cpu)
    bucket = Bucket(64, 64, 5 if family.temporal_downsample else 0)
    batch = family.example_batch(config, preset, bucket, 2, 8, torch.float32, "cpu",
                                 **({"references": 1} if preset.references else {}))
    g = torch.Generator().manual_seed(1)
    batch = {k: torch.randn(v.shape, generator=g) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in batch.items()}
    if type(family.text).collate is TextInput.collate:  # the masked layout: captions of 8 and 5 tokens
        batch.update(family.text.collate(None, [{"text": batch["text"][0]}, {"text": batch["text"][1, :5]}]))
    batch.update(keys=["a", "b"], bucket=tuple(bucket) if bucket.frames else (bucket.height, bucket.width))
    return net, trainer, batch


def syncs_per_step(net, trainer, batch, steps: int = 3, count: bool = True) -> tuple[list[list[str]], list[float]]:
    """The synchronisations of each optimizer step (`trainer.cfg.grad_accum` micro-batches of `batch`, handed over as the
    prefetcher hands them: `train.data.to_device`), and each step's seconds (`count` False: without the counter)."""
    from train.data import to_device

    counter = SyncCounter()
    counter.mark([*net.params, *net.module.parameters(), *net.module.buffers()])
    syncs, seconds = [], []
    with counter if count else _nothing():
        for k in range(steps):
            before, t0 = len(counter), time.perf_counter()
            for _ in range(trainer.cfg.grad_accum):
                trainer.accumulate(to_device(batch, torch.device("cpu")), k)
            trainer.update(k)
            seconds.append(time.perf_counter() - t0)
            syncs.append([str(s) for s in counter.syncs[before:]])
    return syncs, seconds


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def counted_main() -> None:
    """`python -m train` with its arguments from the command line, counting synchronisations (this process's, on its
    main thread): writes RUN_DIR/syncs-rank<R>.json, the syncs of each step after the first, from one update's end to
    the next's (the loop's work between steps included)."""
    from train.__main__ import main
    from train.step import TrainStep

    counter, marks = SyncCounter(), []
    accumulate, update = TrainStep.accumulate, TrainStep.update

    def counting_accumulate(self, batch, step):
        if not marks:  # the model is built: its tensors live on the device
            counter.mark([*self.model.params, *self.model.module.parameters(), *self.model.module.buffers()])
            marks.append(len(counter))
        return accumulate(self, batch, step)

    def counting_update(self, step):
        done = update(self, step)
        marks.append(len(counter))
        return done

    TrainStep.accumulate, TrainStep.update = counting_accumulate, counting_update
    try:
        with counter:
            main()
    except SystemExit as e:
        if e.code:
            raise
    finally:
        TrainStep.accumulate, TrainStep.update = accumulate, update
        steps = [[str(s) for s in counter.syncs[a:b]] for a, b in zip(marks[1:], marks[2:])]
        run = Path(sys.argv[sys.argv.index("--run-dir") + 1])
        (run / f"syncs-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(steps))


def loop_syncs(work: Path, steps: int, grad_accum: int) -> list[list[str]]:
    """(b): a tiny-sana cache built by stage one in `work`, then `python -m train` on it in this process, counted."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    argv, said = sys.argv, io.StringIO()
    sys.argv = ["train", "--cache", str(work / "cache"), "--run-dir", str(work / "run"), "--model", "tiny-sana", "--precision",
                "fp32", "--no-validate", "--no-progress", "--steps", str(steps), "--grad-accum", str(grad_accum),
                "--batch-size", "2", "--log-every", str(steps + 1), "--checkpoint-every", "0", "--workers", "1"]
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):  # stage one's and the trainer's reports
            precompute(str(make_folder(work / "data", count=8)), "tiny-sana", work / "cache", workers=0, progress=False)
            counted_main()
    except BaseException:
        print(said.getvalue(), file=sys.stderr)
        raise
    finally:
        sys.argv = argv
    return json.loads((work / "run" / "syncs-rank0.json").read_text())


def row(label: str, per_step: list[list[str]], extra: str = "") -> bool:
    """One row: the most syncs of a step after the first, against the goal; where they are when it is missed."""
    worst = max((len(s) for s in per_step), default=0)
    ok = bool(per_step) and all(len(s) == GOAL and THE_READ in s[0] for s in per_step)
    print(f"{label:<44} {worst:>3} per step   GOAL {GOAL} per optimizer step   {'PASS' if ok else 'MISS'}{extra}")
    if not ok:
        for s in sorted({x for step in per_step for x in step}):
            print(f"{'':<6}{s}")
    return ok


def main(
    presets: str = typer.Option(",".join(p for p in PRESETS if p.startswith("tiny-")),
                                help="Comma-separated presets to count (a tiny preset builds in a second on a CPU)."),
    steps: int = typer.Option(3, min=2, help="Optimizer steps per preset; the first is left out of the count."),
    grad_accum: int = typer.Option(2, min=1, help="Micro-batches per optimizer step."),
    loop: bool = typer.Option(True, help="Also count (b), the training loop on a tiny-sana cache stage one builds here "
                                         "(about 20 s)."),
    threads: int = typer.Option(1, help="torch threads."),
    workdir: Path = typer.Option(None, help="Where to build (b)'s cache and run (default: the system's temp dir; removed "
                                            "after)."),
) -> None:
    print(pin_threads(threads))
    print(f"syncs per optimizer step of {grad_accum} micro-batches, steps 2-{steps} (step 1 may copy tables once); "
          f"counted on the CPU as CUDA would have them (bench/sync_counter.py)")
    t_run, ok = time.perf_counter(), True
    for name in [p.strip() for p in presets.split(",") if p.strip()]:
        if name not in PRESETS:
            raise typer.BadParameter(f"--presets: unknown preset {name!r}; choose among {', '.join(PRESETS)}")
        net, trainer, batch = step_batch(name, grad_accum)
        syncs, _ = syncs_per_step(net, trainer, batch, steps)
        _, seconds = syncs_per_step(net, trainer, batch, 2, count=False)
        ok &= row(f"(a) {name}", syncs[1:], f"   (CPU step {seconds[-1] * 1000:.0f} ms)")
    if loop:
        work = Path(tempfile.mkdtemp(prefix="syncs-", dir=workdir))
        try:
            ok &= row(f"(b) loop, tiny-sana, steps 2-{steps + 1}", loop_syncs(work, steps + 1, grad_accum))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print("step time with / without the syncs: not measurable on a CPU (its device is the host: a read waits for "
          "nothing); on a GPU each sync drains the queue before the host launches the next kernels")
    print(f"wall time {time.perf_counter() - t_run:.0f} s; {'all PASS' if ok else 'some MISS'}")


if __name__ == "__main__":
    typer.run(main)
