"""The options of a memory plan (`PlanConfig`): the trainer's model, memory and parallelism concerns, the batch
size, optimizer and EMA decay as the trainer takes them, and what only a plan asks. Light to import: the command
line is built from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from shards.buckets import Bucket
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
    check_first_frame,
    check_preservation,
    shared,
)

GiB = 2**30
# What a card loses before the first tensor: the CUDA context (~0.3-0.5 GiB with torch's kernels), cuBLAS and cuDNN
# workspaces, and the caching allocator's rounding and fragmentation (`largest_batch_by_card`, `--gpu-memory`)
CARD_RESERVED = 0.75 * GiB
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
    bucket: tuple[int, ...] = opt((1024, 1024), "Bucket to trace: (height, width) in pixels, or a clip's (height, width, "
                                                "frames) (a `shards.Bucket`).")
    world_size: int = opt(1, "Number of devices.", at_least=1)
    text_tokens: int | None = opt(None, "Caption tokens to plan for (default: the preset's limit, as stage one caches "
                                        "them).", at_least=1)
    gpu_memory: float = opt(80 * GiB - CARD_RESERVED, "Bytes tensors may take on one device: a card's memory less what the "
                                                      "CUDA context and workspaces take (`card_memory`).", above=0)
    preservation: Preservation = shared(ObjectiveOptions, "preservation")
    i2v_probability: float = shared(ObjectiveOptions, "i2v_probability")  # above 0: traced with a timestep per token
    references: int | None = opt(None, "Edit presets: reference images per sample, their tokens concatenated to the "
                                       "target's (default: 1; at most the preset's limit; 0: a text-to-image sample of a "
                                       "model that takes both).", at_least=0)
    device: Literal["cuda", "cpu"] = opt("cuda", "Where the run trains: cuda (a card of --gpu-memory), or cpu (what the plan "
                                                 "counts as device memory is host memory too, in the host figures).")
    ranks_per_node: int | None = opt(None, "Ranks (processes, one per GPU) on each node: a node's host memory holds this "
                                           "many ranks' (default: --world-size, all on one node).", at_least=1)
    workers: int = shared(DataOptions, "workers")
    prefetch: int = shared(DataOptions, "prefetch")
    readahead: int = shared(DataOptions, "readahead")
    reference_size: str | None = opt(None, "Edit presets: each reference image's size HxW in pixels, e.g. 1024x1024 "
                                           "(default: the traced bucket's aspect ratio at the preset's reference area, as "
                                           "its pipeline prepares an input image, sides multiples of one image token).")

    def __post_init__(self) -> None:
        check_options(self)
        if len(self.bucket) not in (2, 3) or min(self.bucket[:2]) < 1 or min(self.bucket[2:], default=0) < 0:
            raise ValueError(f"bucket {self.bucket!r}: give (height, width) or a clip's (height, width, frames), sides at "
                             f"least 1 pixel (frames 0: an image)")
        for concern in (ModelOptions, MemoryOptions, ParallelOptions):
            concern.check(self)
        check_preservation(self)
        check_first_frame(self)
        self.check_references()
        if self.ranks_per_node is not None and self.ranks_per_node > self.world_size:
            raise ValueError(f"--ranks-per-node {self.ranks_per_node}: more than the --world-size {self.world_size} ranks")

    @classmethod
    def of_run(cls, cfg: TrainConfig, **plan_only) -> PlanConfig:
        """The plan of training run `cfg`: its options this config shares, and `plan_only`'s (which win)."""
        names = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(cfg)}
        return cls(**{**{name: getattr(cfg, name) for name in names}, **plan_only})

    def check_references(self) -> None:
        """--references and --reference-size plan an edit preset's references: refused for another preset, beyond the
        preset's limit, or for a size that is not HxW."""
        from train.families import get_preset

        given = [flag for flag, value in (("--references", self.references), ("--reference-size", self.reference_size))
                 if value is not None]
        limit = get_preset(self.model, self.expert).references
        if given and not limit:
            raise ValueError(f"{' and '.join(given)}: {self.model} takes no reference images (an edit preset does); leave "
                             f"{'them' if len(given) > 1 else 'it'} out")
        if self.references is not None and self.references > limit:
            raise ValueError(f"--references {self.references}: {self.model} takes at most {limit} reference image(s)")
        if self.reference_size is not None:
            try:
                size = Bucket.parse(self.reference_size)
            except ValueError:
                size = None
            if size is None or size.frames or min(size.height, size.width) < 1:
                raise ValueError(f"--reference-size {self.reference_size!r}: give a reference image's size in pixels as "
                                 f"HxW, e.g. 1024x1024")

    def planned_references(self, family, config, preset) -> tuple[int, tuple[int, int]] | None:
        """(count, (height, width) pixels) of the references each sample of an edit preset is planned with; None for
        a preset that takes none."""
        if not preset.references:
            return None
        size = Bucket.parse(self.reference_size) if self.reference_size else None
        return (1 if self.references is None else self.references,
                (size.height, size.width) if size else family.reference_size(config, preset, self.traced))

    @property
    def traced(self) -> Bucket:
        """The bucket traced, as a `shards.Bucket` (frames 0: an image)."""
        return Bucket(*self.bucket)

    @property
    def node_ranks(self) -> int:
        """Ranks whose host memory one node holds."""
        return self.ranks_per_node or self.world_size

    def ema_placement(self) -> str:
        """Where the EMA's shadow weights are: "off", "device" or "cpu"."""
        return "off" if self.ema_decay <= 0 else self.ema_device


GPU_MEMORY_HELP = (f"The memory of one card as it is sold and as the README's per-card table (largest_batch_by_card) names "
                   f"it: 16GB, 16GiB, 16G and 16 all mean a 16 GB card (GB counted as GiB, as GPU memory is quoted). The "
                   f"plan leaves {CARD_RESERVED / GiB:g} GiB of it to the CUDA context, cuBLAS's workspace and the "
                   f"allocator's slack, as the table does: --gpu-memory 16GB plans with {16 - CARD_RESERVED / GiB:g} GiB "
                   f"for tensors.")


def card_memory(text: str) -> float:
    """The bytes tensors may take on a card of `text` memory ('16GB', '16GiB', '16g' or '16': GB counted as GiB,
    as GPU memory is quoted; 'M', 'T' likewise), less `CARD_RESERVED`."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"m": 2**20, "g": 2**30, "t": 2**40}
    try:
        size = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t) * GiB
    except ValueError:
        raise ValueError(f"--gpu-memory {text!r}: give the card's memory, e.g. 16GB, 24GiB or 80") from None
    if size > 4 * 2**40:  # 4 TiB: no card has it; a bare byte count (as --gpu-memory once took) is the likely mistake
        raise ValueError(f"--gpu-memory {text!r}: no card has {size / GiB:,.0f} GiB; give its memory as sold, e.g. 16GB "
                         f"(a bare number is GiB, not bytes)")
    if not size > CARD_RESERVED:  # also NaN
        raise ValueError(f"--gpu-memory {text!r}: a card must have more than the {CARD_RESERVED / GiB:g} GiB the CUDA "
                         f"context and workspaces take; give its memory, e.g. 16GB")
    return size - CARD_RESERVED
