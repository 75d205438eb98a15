"""The trackers a run reports to besides `metrics.jsonl` (--report-to): TensorBoard in RUN/tensorboard and wandb in
RUN/wandb. Both are optional installs, checked by `require` on every rank before the first step."""

from __future__ import annotations

import importlib
import json
import secrets
from pathlib import Path

from shards.atomic import atomic_write_bytes
from shards.options import install_extra
from train.video import SHEET

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}  # --report-to name: what it imports


def require(names: list[str]) -> None:
    """Raise a ValueError (the CLI's message for a wrong option) naming the extra to install if a tracker in `names`
    is not installed."""
    for name in names:
        try:
            importlib.import_module(MODULES[name])
        except ImportError as e:
            raise ValueError(f"--report-to {name}: {name} is not installed; {install_extra(name)} "
                             f"({e})") from e


class Trackers:
    """The run's trackers: its scalars, validation grids and config, at the step they belong to.

    Args:
        names: the trackers (`--report-to`): "tensorboard", "wandb".
        run: the run directory.
        step: the step the run starts at (0: a new run); a resumed run continues the wandb run whose id is kept in
            RUN/wandb/run-id (wandb keeps the first values it was sent for a step that is redone).
        project: wandb's project.
        name: the run's name in the trackers.
        config: the run's options, as saved with its checkpoints.
    """

    def __init__(self, names: list[str], run: Path, step: int, *, project: str, name: str, config: dict):
        self.tensorboard = self.wandb = None
        self.wandb_step = step  # wandb drops rows logged at a step before the last one
        self.grids, self.grids_row = [], None  # the grids (step, path) logged to wandb's row `grids_row`
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run redoes the steps after its checkpoint: TensorBoard hides what it had logged for them
            self.tensorboard = SummaryWriter(str(run / "tensorboard"), purge_step=step + 1)
            self.tensorboard.add_text("config", "```json\n" + json.dumps(config, indent=2) + "\n```", step)
        if "wandb" in names:
            import wandb

            if wandb.run is not None:  # left open by a run of this process that raised
                wandb.run.finish(exit_code=1)
            self.wandb = wandb.init(project=project, name=name, dir=str(run), config=config, resume="allow",
                                    id=wandb_id(run / "wandb", fresh=step == 0), allow_val_change=True)
            # grids are decoded in the background and arrive after later steps' scalars: their own x-axis
            self.wandb.define_metric("validation_step")
            self.wandb.define_metric("validation", step_metric="validation_step")
            self.wandb.define_metric("validation_videos", step_metric="validation_step")

    def log(self, scalars: dict[str, float], step: int, group: str = "train") -> None:
        """Scalars of `step` under `group/` ("train", or "eval" for the held-out loss)."""
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(f"{group}/{name}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{group}/{name}": value for name, value in scalars.items()}, step=step)
            self.wandb_step = max(self.wandb_step, step)

    def image(self, path: str, step: int) -> None:
        """A validation grid (a PNG file) sampled at `step`; a contact sheet of videos, and to wandb the videos (the mp4
        files beside it) too (TensorBoard's add_video would need moviepy: the sheet stands for them there)."""
        if self.tensorboard is not None:
            import numpy as np
            from PIL import Image

            grid = np.asarray(Image.open(path).convert("RGB"))  # (H, W, 3)
            self.tensorboard.add_image("validation", grid, step, dataformats="HWC")
        if self.wandb is not None:
            import wandb

            # a late grid joins the row of the last step logged, at times with another grid: a row holds every grid
            # it was given (a key logged twice at a step keeps its last value)
            row = max(step, self.wandb_step)
            self.grids = self.grids + [(step, path)] if self.grids_row == row else [(step, path)]
            self.grids_row = row
            videos = sorted(Path(path).parent.glob("*.mp4")) if Path(path).name == SHEET else []
            self.wandb.log({"validation": [wandb.Image(p, caption=f"step {s}") for s, p in self.grids],
                            **({"validation_videos": [wandb.Video(str(v), caption=f"step {step}: {v.stem}", format="mp4")
                                                      for v in videos]} if videos else {}),
                            "validation_step": step}, step=row)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def wandb_id(directory: Path, fresh: bool) -> str:
    """The run's wandb id, kept in `directory`/run-id so that a resumed run continues the same wandb run; `fresh`: a
    run starting over gets a new one."""
    path = directory / "run-id"
    if not fresh and path.exists():
        return path.read_text().strip()
    directory.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(4)
    atomic_write_bytes(path, run_id.encode())
    return run_id
