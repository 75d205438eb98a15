"""What each part of a training step costs the planner: optimizer states and frozen weights from the parameter
shapes, and what the objective holds per latent element, measured through the real objective on the CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import warnings

import torch

from train import quant as quantization


def optimizer_state_bytes(params: list[torch.Tensor], optimizer: str, weight_bytes: int) -> int:
    """Bytes of optimizer state for `params`, as each optimizer allocates it."""
    total = 0
    for p in params:
        n, shape = p.numel(), tuple(p.shape)
        if optimizer in ("adamw", "adamw-bf16"):  # exp_avg, exp_avg_sq in the parameter's dtype
            total += 2 * n * weight_bytes
        elif optimizer == "adamw-8bit":  # two uint8 moments + one fp32 absmax per 256-value block each
            total += 2 * n + 2 * 4 * math.ceil(n / 256)
        elif optimizer in ("came", "came-8bit"):  # came_pytorch: factored second moments for >= 2-D parameters
            # came-8bit: the full-size first moment in 8-bit blocks (as bitsandbytes stores Adam's), the
            # factored rows and columns unchanged. Planning only: no maintained implementation trains with it.
            first = (n + 4 * math.ceil(n / 256)) if optimizer == "came-8bit" else n * weight_bytes
            if len(shape) >= 2:
                rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
                total += first + (2 * rows + 2 * cols) * weight_bytes  # exp_avg, sq row/col, residual row/col
            else:
                total += first + n * weight_bytes
        elif optimizer == "adafactor":  # transformers' Adafactor without first moment
            if len(shape) >= 2:
                total += (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * weight_bytes
            else:
                total += n * weight_bytes
        else:
            raise ValueError(f"optimizer {optimizer!r}: choose adamw, adamw-bf16, adamw-8bit, came, came-8bit or adafactor")
    return total


def frozen_bytes(module: torch.nn.Module, quant: str, dtype_bytes: int) -> float:
    """Bytes of `module`'s frozen parameters: quantized Linear weights at their kind's size, the rest at `dtype_bytes`."""
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)} if quant != "none" else set()
    return sum(quantization.weight_bytes(quant, tuple(p.shape)) if id(p) in linear_weights else p.numel() * dtype_bytes
               for p in module.parameters() if not p.requires_grad)


_OBJECTIVE_BYTES: dict = {}  # the measurement starts the torch profiler (seconds): once per objective and channels


def objective_bytes(objective, in_channels: int, out_channels: int) -> tuple[float, float]:
    """`measure_objective_bytes`, remembered for the process by the objective's options and the channels."""
    options = (repr(objective) if dataclasses.is_dataclass(objective) else
               (type(objective).__name__, getattr(objective, "prediction", None), getattr(objective, "learned_variance", None),
                getattr(objective, "masked_loss", False)))
    key = (options, in_channels, out_channels)
    if key not in _OBJECTIVE_BYTES:
        _OBJECTIVE_BYTES[key] = measure_objective_bytes(objective, in_channels, out_channels)
    return _OBJECTIVE_BYTES[key]


def measure_objective_bytes(objective, in_channels: int, out_channels: int) -> tuple[float, float]:
    """What the objective holds per latent element, the model's output and the clean latents included: (kept for
    backward at the end of the forward pass, peak during its forward and backward). Measured through the real
    objective on a CPU batch with a stand-in model: flow matching holds a few latent-sized tensors, DDPM with a
    learned variance dozens (its VLB terms)."""
    latents = torch.zeros(4, in_channels, 32, 32)
    batch = {"latents": latents, "bucket": (256, 256), "keys": ["k"] * 4}
    if getattr(objective, "masked_loss", False):  # the loss mask's bytes and its product with the loss
        batch["mask"] = torch.full((4, 1, 32, 32), 255, dtype=torch.uint8)
    model = _StandIn(out_channels)
    with torch.autograd.graph.saved_tensors_hooks(model.pack, _unpack):
        objective(model, batch, torch.Generator().manual_seed(0))
    model.kept.pop(model.weight.untyped_storage()._cdata, None)
    step = _ObjectiveStep(objective, model, batch)
    step()  # the scheduler's tables exist before the measured step
    peak = cpu_peak(step) + latents.nbytes
    return (sum(model.kept.values()) + latents.nbytes) / latents.numel(), peak / latents.numel()


class _StandIn:
    """A model for the objective to call: one trained value per output channel; records the storages autograd saves
    outside it (`pack`), which are the objective's."""

    def __init__(self, out_channels: int):
        self.weight = torch.zeros(1, out_channels, 1, 1, requires_grad=True)
        self.inside = False
        self.kept: dict[int, int] = {}

    def __call__(self, xt: torch.Tensor, t: torch.Tensor, batch: dict) -> torch.Tensor:
        self.inside = True
        out = self.weight.expand(xt.shape[0], self.weight.shape[1], *xt.shape[2:]).clone()
        self.inside = False
        return out

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.inside:
            self.kept[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor


@dataclasses.dataclass
class _ObjectiveStep:
    objective: object
    model: _StandIn
    batch: dict

    def __call__(self) -> None:
        loss, _ = self.objective(self.model, self.batch, torch.Generator().manual_seed(0))
        loss.mean().backward()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def cpu_peak(step) -> int:
    """Peak bytes of tensors during `step()` on the CPU: the torch profiler's memory timeline (every tensor alive at
    each instant, parameters and states included)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                  with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # its CUDA successor has no CPU counterpart
        path = f"{tmp}/timeline.json"
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    return int(max(sum(row) for row in sizes))


@contextlib.contextmanager
def _quiet_stderr():
    """The CPU profiler's native layer prints a line to the process's stderr at each start and stop; those lines
    say nothing to a user, so file descriptor 2 points at /dev/null meanwhile (Python's own errors still raise)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
