"""The options of a memory plan (`PlanConfig`): the trainer's model, memory and parallelism concerns, the batch
size, optimizer and EMA decay as the trainer takes them, and what only a plan asks. Light to import: the command
line is built from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from shards.options import check_options, help_of, opt
from train.config import (
    DataOptions,
    MemoryOptions,
    ModelOptions,
    ObjectiveOptions,
    Optimizer,
    OptimizerOptions,
    ParallelOptions,
    Preservation,
    TrainConfig,
    check_preservation,
    shared,
)

GiB = 2**30
# The planner also knows an optimizer no maintained library trains with (came-8bit), for comparison.
PlanOptimizer = Literal[Optimizer, Literal["came-8bit"]]


# dataclasses collects fields from the last base to the first: the model first, as in TrainConfig
@dataclass
class PlanConfig(ParallelOptions, MemoryOptions, ModelOptions):
    """A training setup to plan: the trainer's model, memory and parallelism options (the same fields, defaults and
    rules: `train.config`), the batch size, optimizer and EMA decay as the trainer takes them, and what only a plan
    asks: the bucket traced, the number of devices and their memory."""

    batch_size: int = shared(DataOptions, "batch_size")
    optimizer: PlanOptimizer = shared(OptimizerOptions, "optimizer", help=help_of(OptimizerOptions, "optimizer")
                                      + " Planning only: came-8bit (no maintained implementation to train with).")
    ema_decay: float = shared(OptimizerOptions, "ema_decay", help="EMA decay (0: no EMA; above 0: plan its shadow weights "
                                                                  "on --ema-device).")
    bucket: tuple[int, int] = opt((1024, 1024), "Bucket (height, width) in pixels to trace.")
    world_size: int = opt(1, "Number of devices.", at_least=1)
    text_tokens: int | None = opt(None, "Caption tokens to plan for (default: the preset's limit, as stage one caches "
                                        "them).", at_least=1)
    gpu_memory: float = opt(80 * GiB, "Memory of one device in bytes.", above=0)
    preservation: Preservation = shared(ObjectiveOptions, "preservation")

    def __post_init__(self) -> None:
        check_options(self)
        for concern in (ModelOptions, MemoryOptions, ParallelOptions):
            concern.check(self)
        check_preservation(self)

    @classmethod
    def of_run(cls, cfg: TrainConfig, **plan_only) -> PlanConfig:
        """The plan of training run `cfg`: its options this config shares, and `plan_only`'s (which win)."""
        names = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(cfg)}
        return cls(**{**{name: getattr(cfg, name) for name in names}, **plan_only})

    def ema_placement(self) -> str:
        """Where the EMA's shadow weights are: "off", "device" or "cpu"."""
        return "off" if self.ema_decay <= 0 else self.ema_device
