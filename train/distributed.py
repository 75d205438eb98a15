"""Data parallel training under `torchrun`: DDP, or FSDP2 (`fully_shard`) per transformer block.

Everything here is PyTorch's own engine; this module only finds the blocks to shard from the model
instance (never a hard-coded class name), applies the user's sharding options, and offers the few
collectives the loop needs. One process without torchrun needs none of it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist

from train import families


def setup() -> tuple[int, int, int, torch.device]:
    """(rank, world size, local rank, device); starts the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return int(os.environ.get("RANK", "0")), world, local_rank, device


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def sum_across(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum over ranks (identity in one process)."""
    if not dist.is_initialized():
        return values
    # copied from pinned memory without waiting for the device (the read after the sum is the one wait)
    t = torch.tensor(values, dtype=torch.float64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    dist.all_reduce(t)
    return t.tolist()


def any_across(flag: bool | torch.Tensor, device: torch.device) -> bool:
    """True on every rank when it is true on any: ranks take the same branch around collectives. A flag computed on
    the device is read once, after the all-reduce. This waits for the device: the training step's flags ride its one
    read instead (`read_step`)."""
    if not dist.is_initialized():
        return bool(flag)
    t = torch.zeros(1, device=device)
    t[0] = flag if isinstance(flag, torch.Tensor) else float(flag)  # a fill on the device, no copy from the host
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def read_step(norm: torch.Tensor, flags: dict[str, bool | torch.Tensor], device: torch.device) -> tuple[float, dict[str, bool]]:
    """The training step's one read of the device: the gradient norm, as it is on this rank (every rank's is the same:
    the gradients were reduced), and `flags` (host booleans or 0-dim device tensors), each true on every rank when it is
    true on any (one all-reduce of a few numbers, no read of its own).

    Returns:
        (the norm as a float, the agreed flags by name).
    """
    raised = torch.zeros(len(flags), dtype=torch.float64, device=device)
    for i, flag in enumerate(flags.values()):
        if isinstance(flag, torch.Tensor):
            raised[i] = flag  # a copy on the device
        elif flag:
            raised[i] = 1.0  # a fill: no copy from the host
    if dist.is_initialized():
        dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    if norm.device == raised.device:
        values = torch.cat([norm.detach().reshape(1).to(torch.float64), raised]).tolist()  # the one read
        grad_norm, agreed = values[0], values[1:]
    else:  # a norm computed on the host (FSDP's CPU offload): read where it is, the flags on their own
        grad_norm, agreed = float(norm), raised.tolist()
    return grad_norm, {name: value > 0 for name, value in zip(flags, agreed)}


def rank0_value(value):
    """Rank 0's `value` on every rank (picklable; a plain return in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def find_blocks(model: torch.nn.Module, override: str | None = None) -> list[torch.nn.Module]:
    """The modules to shard one by one: the repeated blocks in `model.transformer_blocks` (they are
    the model's `_no_split_modules`), or every module whose class is named `override`."""
    if override:
        found = [m for m in model.modules() if type(m).__name__ == override]
        if not found:
            counts = Counter(type(m).__name__ for m in model.modules())
            repeated = sorted(n for n, c in counts.items() if c > 1)
            no_split = list(getattr(model, "_no_split_modules", None) or [])
            raise ValueError(f"--fsdp-block {override!r} matches no module of {type(model).__name__}; its block classes "
                             f"(_no_split_modules) are {no_split}, classes that repeat are {repeated}")
        return found
    try:
        blocks = families.family_of_module(model).blocks(model)
    except ValueError:  # no family's transformer: its own block classes
        blocks = []
    if not blocks:
        no_split = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in no_split]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no transformer_blocks and no _no_split_modules; name the block class with --fsdp-block")
    return blocks


def shard(model: torch.nn.Module, blocks: list[torch.nn.Module], *, reshard_after_forward: bool,
          param_dtype: torch.dtype | None, cpu_offload: bool) -> torch.nn.Module:
    """FSDP2: each block, then the root, sharded over all ranks. Parameters become DTensors."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # Inputs keep their dtypes: by default FSDP casts them to param_dtype, which would round the flow timestep
    # sigma * 1000 to bf16 (999.7 -> 1000); autocast decides the compute dtype per op as in one process.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None, cast_forward_inputs=False)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    # The transformers return a reshaped (view) output; the objective never modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def full_value(t):
    """A plain tensor from a DTensor (e.g. a gradient norm under FSDP)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
