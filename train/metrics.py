"""What a run reports: `metrics.jsonl` (the record; a resumed run rewrites it from its step), the trackers asked for
(TensorBoard, wandb), validation grids, `loss.png` at the end (the held-out loss beside the training loss), and memory
reports on request."""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from shards.atomic import atomic_write_bytes
from train import distributed
from train.objectives import TIMESTEP_BINS
from train.trackers import Trackers, require

log = logging.getLogger("train")
SCALARS = ("loss", "smoothed_loss", "lr", "grad_norm", "samples_per_s", "data_wait", "peak_memory")


def grid_step(path: Path) -> int:
    """The step a validation grid was sampled at, from its path: RUN/samples-stepNNNNNNNN.png, or a contact sheet of
    videos, RUN/samples/NNNNNNNN/contact-sheet.png."""
    if path.stem.startswith("samples-step"):
        return int(path.stem.removeprefix("samples-step"))
    return int(path.parent.name)


class Metrics:
    """The run's numbers, aggregated per logging window across ranks; rank 0 writes them.

    Args:
        run: the run directory.
        step: the step the run starts at (a resumed run's metrics after it are dropped: they are redone).
        smoothed: the debiased moving average of the loss as (sum, n), carried across resumes.
        report_to: the trackers rank 0 also reports to (`--report-to`); every rank checks they are installed.
        project: the trackers' project (wandb's).
        run_name: the run's name in the trackers (default: the run directory's name).
        run_config: the run's options, sent to the trackers.
        classes: the run draws from class sources (`is_reg`): every record reports the class and instance losses.
    """

    def __init__(self, run: Path, step: int, smoothed: list, *, is_main: bool, device: torch.device,
                 precision: str, data_wait: float = 0.0, drawn: dict | None = None, report_to: list[str] | None = None,
                 project: str = "cachedit", run_name: str | None = None, run_config: dict | None = None,
                 classes: bool = False):
        report_to = list(report_to or [])
        require(report_to)  # on every rank, so that all stop together
        self.run, self.is_main, self.device, self.precision = run, is_main, device, precision
        self.smooth_sum, self.smooth_n = smoothed
        self.drawn: Counter[str] = Counter(drawn or {})  # samples trained on per source, over the whole run
        self.classes = classes  # (or a class batch was seen: from then on)
        self.losses: list[tuple[int, float]] = []
        self.grids: list[str] = []
        self.file = self.trackers = None
        self.logged_step, self.step_s = step, 0.0  # the last window's end and its seconds per step (the ETA)
        if is_main:
            if report_to:  # opened first: a tracker that fails to start leaves metrics.jsonl as it was
                self.trackers = Trackers(report_to, run, step, project=project, config=run_config or {},
                                         name=run_name or run.resolve().name)
            truncate_metrics(run / "metrics.jsonl", step)
            self.file = open(run / "metrics.jsonl", "a")
        self._new_window(data_wait)

    def _new_window(self, data_wait: float) -> None:
        # sums kept on the device, read once per window: no step waits for the device to report a loss
        self.loss, self.n, self.samples, self.wait = torch.zeros((), device=self.device), 0, 0, data_wait
        self.bins = torch.zeros(2, TIMESTEP_BINS, device=self.device)  # loss sum and count per timestep bin
        # class batches' (DreamBooth's class images) losses before their weight, and the other batches' losses
        self.parts, self.part_n = torch.zeros(2, device=self.device), [0, 0]
        self.t0 = time.perf_counter()

    @property
    def smoothed(self) -> list:
        """The smoothed loss as (sum, n): the mean over ranks of each rank's moving average (equal to the moving
        average of the global batch's loss, the average being linear). Every rank calls this together."""
        total = distributed.sum_across([float(self.smooth_sum)], self.device)[0] / distributed.world_size()
        return [total, self.smooth_n]

    def add(self, loss: torch.Tensor, per_sample: torch.Tensor, t: torch.Tensor, samples: int, source: str = "",
            class_loss: torch.Tensor | None = None) -> None:
        """One micro-batch: `loss` is this rank's mean, `per_sample` and `t` its samples', `samples` the global count,
        drawn from `source` (every rank's slice of a global batch comes from the same one); `class_loss`: a class
        batch's mean loss before its prior_loss_weight (None: not a class batch)."""
        self.drawn[source] += samples
        part = 0 if class_loss is None else 1
        self.parts[part] += (loss if class_loss is None else class_loss).float()
        self.part_n[part] += 1
        self.classes = self.classes or class_loss is not None
        self.smooth_sum, self.smooth_n = 0.95 * self.smooth_sum + 0.05 * loss.float(), self.smooth_n + 1
        self.loss, self.n, self.samples = self.loss + loss.float(), self.n + 1, self.samples + samples
        which = (t.detach().float() * TIMESTEP_BINS).long().clamp(0, TIMESTEP_BINS - 1)
        self.bins[0].index_add_(0, which, per_sample.detach().float())
        self.bins[1].index_add_(0, which, torch.ones_like(which, dtype=torch.float32))

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (validation) out of the window's throughput."""
        self.t0 += seconds

    def log(self, step: int, lr: float, grad_norm: float, data_wait: float, held: dict | None = None) -> dict:
        """Close the window at `step` (every rank calls this: losses and timestep bins are summed across ranks).
        `data_wait`: seconds the run has waited for data so far; `held`: the held-out loss computed at `step`
        (`train.evaluate.Evaluator.run`), recorded with it."""
        elapsed = time.perf_counter() - self.t0
        world = distributed.world_size()
        local = [float(self.loss), float(self.smooth_sum), *self.bins.flatten().tolist(), *self.parts.tolist()]  # one read
        flat = distributed.sum_across(local, self.device)
        sums, counts = flat[2 : 2 + TIMESTEP_BINS], flat[2 + TIMESTEP_BINS : 2 + 2 * TIMESTEP_BINS]
        # every rank's micro-batches are of the same kind (a global batch comes from one source): counts are alike
        parts = {name: flat[2 + 2 * TIMESTEP_BINS + k] / world / n if n else None
                 for k, (name, n) in enumerate(zip(("instance_loss", "class_loss"), self.part_n))}
        mean = flat[0] / world / max(self.n, 1)
        record = {
            "step": step, "loss": mean, "smoothed_loss": flat[1] / world / (1 - 0.95**self.smooth_n),  # over ~20 micro-batches
            "lr": lr, "grad_norm": grad_norm, "samples_per_s": self.samples / elapsed,
            "data_wait": (data_wait - self.wait) / elapsed, "peak_memory": peak_memory(self.device),
            "loss_by_timestep": [s / c if c else None for s, c in zip(sums, counts)],
            "precision": self.precision, "samples_by_source": dict(self.drawn),
            **(held or {}),
            **(parts if self.classes else {}),  # the class loss unweighted; `loss` is what trained, weighted
        }
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.trackers is not None:
            self.trackers.log({name: record[name] for name in (*SCALARS, *parts) if record.get(name) is not None}, step)
            if held:  # eval/loss, and eval/loss/SOURCE with several sources
                self.trackers.log({"loss": held["eval_loss"], **{f"loss/{name}": value for name, value in
                                                                 held.get("eval_loss_by_source", {}).items()}}, step, "eval")
        self.losses.append((step, mean))
        self.step_s, self.logged_step = elapsed / max(step - self.logged_step, 1), step
        self._new_window(data_wait)
        return record

    def report_grids(self, done: list[tuple[str, str]]) -> None:
        """Validation grids the background decoder finished: ("ok", path) or (status, message)."""
        for status, message in done:
            if status != "ok":
                log.warning("validation grid failed: %s", message)
                continue
            self.grids.append(message)
            tqdm.write(f"validation samples: {message}")
            if self.trackers is not None:
                self.trackers.image(message, grid_step(Path(message)))

    def close(self, plot: bool = True) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
        if plot and self.is_main:
            plot_losses(self.run)

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None


def progress_line(record: dict, steps: int, step_s: float) -> str:
    """The plain line a run prints every --log-every steps where no progress bar is shown (a log file, a pipe):
    `record` is `Metrics.log`'s, `step_s` the seconds per step of its window (the ETA, validation left out)."""
    eta = int(max(steps - record["step"], 0) * step_s)
    held = f"  eval loss {record['eval_loss']:.4f}" if record.get("eval_loss") is not None else ""
    return (f"step {record['step']}/{steps}  loss {record['loss']:.4f}  smoothed {record['smoothed_loss']:.4f}{held}  "
            f"lr {record['lr']:.2e}  {record['samples_per_s']:.1f} samples/s  data wait {record['data_wait']:.0%}  "
            f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}")


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps up to `step` (the resumed one; 0: none), written atomically."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


def _logged_step(line: str) -> float:
    """The step of a metrics line; a line torn by a crash counts as after every checkpoint (it is dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return psutil.Process().memory_info().rss


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def write_memory_report(path: Path, device: torch.device, step: int) -> None:
    """The allocator's `memory_summary()` on CUDA; the process's memory figures on the CPU."""
    if device.type == "cuda":
        text = torch.cuda.memory_summary(device)
    else:
        info = psutil.Process().memory_full_info()
        text = "\n".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in info._asdict().items())
    path.write_text(f"step {step}\n{text}\n")
    print(f"memory report written to {path}")


def plot_losses(run: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], alpha=0.4, label="loss")
    ax.plot([r["step"] for r in rows], [r["smoothed_loss"] for r in rows], label="smoothed")
    held = [r for r in rows if r.get("eval_loss") is not None]
    if held:  # the held-out loss: the same loss at fixed timesteps and noise, on samples never trained on
        ax.plot([r["step"] for r in held], [r["eval_loss"] for r in held], marker="o", label="held-out (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(str(run))
    ax.legend()
    fig.tight_layout()
    fig.savefig(run / "loss.png", dpi=100)
    plt.close(fig)
