"""Memory plan of a training setup, from the real architecture, before anything is allocated.

The transformer is built on the meta device from the preset's config: parameters are counted
exactly, and one forward pass at the requested bucket and batch is traced with saved-tensor hooks,
so activation memory is what autograd actually keeps for the backward pass (deduplicated by storage);
with gradient checkpointing the backward runs too, recomputations included, and its peak of live
tensors counts. Weights (quantized ones at their kind's size, swapped blocks off the device),
gradients, optimizer states (per optimizer, from the parameter shapes) and the EMA are accounted per
rank, with FSDP sharding and CPU offload.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from shards import Bucket, bucket_table
from shards.options import DTYPE_BYTES, DTYPES, default_of
from train.config import TrainConfig, parse_checkpointing
from train import quant as quantization
from train.model import build_run_objective
from train.presets import get_preset, latent_channels, model_forward, text_width, transformer_blocks
from train.swap import checkpointed_forward, inner_tensors

GiB = 2**30
# What a card loses before the first tensor: the CUDA context (~0.3-0.5 GiB with torch's kernels), cuBLAS and cuDNN
# workspaces, and the caching allocator's rounding and fragmentation (`largest_batch_by_card`)
CARD_RESERVED = 0.75 * GiB


def _train(name: str):
    """The training run's default for option `name`: a plan describes a run, so it starts from the same values."""
    return field(default_factory=lambda: default_of(TrainConfig, name))


@dataclass
class PlanConfig:
    """A training setup to plan. Fields named like `TrainConfig`'s mean the same and default the same."""

    model: str
    batch_size: int = _train("batch_size")
    bucket: tuple[int, int] = (1024, 1024)
    precision: str = _train("precision")
    weights_dtype: str = _train("weights_dtype")
    optimizer: str = _train("optimizer")
    grad_checkpointing: str = _train("grad_checkpointing")  # off | all | every-K
    ema: str = "off"  # device | cpu | off: from --ema-decay and --ema-device
    world_size: int = 1
    parallel: str = "ddp"
    fsdp_cpu_offload: bool = _train("fsdp_cpu_offload")
    text_tokens: int | None = None  # caption tokens traced (the cache's limit; default the preset's)
    gpu_memory: float = 80 * GiB
    lora_rank: int = _train("lora_rank")  # 0: every weight trains; N: LoRA adapters of rank N on the frozen base
    lora_targets: tuple[str, ...] = ()  # default: the family's
    controlnet: bool = _train("controlnet")  # a ControlNet trains beside the frozen transformer (fp32, its states alone)
    controlnet_layers: int | None = None  # the ControlNet's blocks (default: the family's, as the trainer builds it)
    base_quant: str = _train("base_quant")  # none | int8 | fp8 | nf4: the frozen base's Linear weights
    blocks_to_swap: int = _train("blocks_to_swap")  # the last N blocks' frozen weights in CPU memory, recomputed in backward


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


def meta_model(name: str, dtype: torch.dtype = torch.float32, lora_rank: int = 0, lora_targets=(),
               adapter_dtype: torch.dtype = torch.float32, quant: str = "none"):
    """The preset's transformer on the meta device; with `lora_rank`, frozen, with adapters in `adapter_dtype`;
    with `quant`, its Linear weights quantized first (the rest in bf16), as the trainer loads them."""
    preset = get_preset(name)
    with _quiet_diffusers():
        with torch.device("meta"):
            model = preset.transformer_class.from_config(preset.transformer_config())
        model = model.to(dtype if quant == "none" else quantization.BASE_DTYPE)
        if quant != "none":
            quantization.quantize_meta(model, quant)
        if lora_rank:
            from train import lora

            with torch.device("meta"):
                lora.add_lora(model, lora.lora_config(preset.family, lora_rank, targets=list(lora_targets)), adapter_dtype)
        return preset, model


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers' warnings off: published configs carry keys a class ignores, and casting a model built from a config
    warns about fp32 modules it has none of; nothing for a user to act on."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)


def meta_controlnet(preset, transformer: torch.nn.Module, layers: int | None, dtype: torch.dtype = torch.float32):
    """The ControlNet the trainer builds beside `transformer` (`train.controlnet.build_controlnet`: `layers` blocks or
    the family's default), on the meta device, in `dtype`."""
    from train import controlnet

    with _quiet_diffusers():
        with torch.device("meta"):
            net = controlnet.build_controlnet(transformer, preset.family, layers=layers)
        return net.to(dtype)


class _FusedAttention(torch.autograd.Function):
    """What flash / memory-efficient attention keeps for backward: q, k, v, the output and the
    log-sum-exp per query (fp32) - never the (L x S) probabilities the meta device's math path would."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FusedAttention.apply(query, key, value)


_OBJECTIVE_BYTES: dict = {}  # the measurement starts the torch profiler (seconds): once per objective and channels


def objective_bytes(objective, in_channels: int, out_channels: int) -> tuple[float, float]:
    """`measure_objective_bytes`, remembered for the process by the objective's options and the channels."""
    import dataclasses

    options = (repr(objective) if dataclasses.is_dataclass(objective) else
               (type(objective).__name__, getattr(objective, "prediction", None), getattr(objective, "learned_variance", None)))
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
    w = torch.zeros(1, out_channels, 1, 1, requires_grad=True)
    batch = {"latents": latents, "bucket": (256, 256), "keys": ["k"] * 4}
    inside_model, kept = [False], {}

    def model_fn(xt, t, batch):
        inside_model[0] = True
        out = w.expand(xt.shape[0], out_channels, *xt.shape[2:]).clone()
        inside_model[0] = False
        return out

    def pack(tensor):
        if not inside_model[0]:
            kept[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        objective(model_fn, batch, torch.Generator().manual_seed(0))
    kept.pop(w.untyped_storage()._cdata, None)

    def step() -> None:
        loss, _ = objective(model_fn, batch, torch.Generator().manual_seed(0))
        loss.mean().backward()

    step()  # the scheduler's tables exist before the measured step
    peak = measure_peak(step, torch.device("cpu")) + latents.nbytes
    return (sum(kept.values()) + latents.nbytes) / latents.numel(), peak / latents.numel()


def trace_activations(model, preset, batch: int, bucket: tuple[int, int], text_tokens: int, dtype: torch.dtype,
                      every: int = 0, objective_per_element: tuple[float, float] | None = None, controlnet=None,
                      swapped: int = 0) -> dict:
    """Bytes autograd saves for backward in one forward pass (meta tensors, no memory used), and with checkpointing
    the peak of the backward pass that recomputes the checkpointed blocks, run on the meta device too.

    Returns the total, the largest block's share, and the peak with every `every`-th block checkpointed (0: none).
    `objective_per_element`: what the loss holds per latent element, at the end of the forward pass and at its peak
    (`objective_bytes`; default: the output in fp32 and the clean latents). `controlnet`: traced with a ControlNet
    beside the (frozen) transformer, as `train.controlnet.controlled_forward` runs them; its blocks count as blocks too.
    `swapped`: the transformer's last blocks are swapped, which recomputes them in backward whatever `every` says.
    Below fp32, matrix products run in `dtype` and LoRA layers copy their inputs as under the trainer's autocast."""
    cfg = model.config
    down = preset.latent_downsample
    c, h, w = latent_channels(preset.family, cfg), bucket[0] // down, bucket[1] // down
    x = torch.zeros(batch, c, h, w, device="meta", dtype=dtype)
    if preset.family == "sd3":  # CLIP's 77 tokens, the rest T5's; the joint width throughout
        clip = min(77, text_tokens)
        text = {"clip": torch.zeros(batch, clip, text_width(cfg), device="meta", dtype=dtype),
                "text": torch.zeros(batch, text_tokens - clip, text_width(cfg), device="meta", dtype=dtype),
                "pooled": torch.zeros(batch, cfg["pooled_projection_dim"], device="meta", dtype=dtype)}
    elif preset.family == "flux":  # every T5 token, and the pooled CLIP-L vector
        text = {"text": torch.zeros(batch, text_tokens, text_width(cfg), device="meta", dtype=dtype),
                "pooled": torch.zeros(batch, cfg["pooled_projection_dim"], device="meta", dtype=dtype)}
    else:
        text = {"text": torch.zeros(batch, text_tokens, text_width(cfg), device="meta", dtype=dtype),
                "text_mask": torch.ones(batch, text_tokens, device="meta", dtype=torch.bool)}
    if controlnet is not None:
        text["control"] = torch.zeros_like(x)  # the control latent, the latent's shape
    t = torch.full((batch,), 500.0, device="meta")

    saved: dict[int, int] = {}
    by_block: dict[int, int] = {}
    current = [-1]
    modules = [model] + ([controlnet] if controlnet is not None else [])
    weights = {st._cdata for m in modules for p in m.parameters() for st in _storages(p)}  # saved, but counted as weights

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in saved and storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
            by_block[current[0]] = by_block.get(current[0], 0) + storage.nbytes()
        return tensor

    hooks = []
    # the blocks `checkpoint_blocks` recomputes: every `every`-th of each module's, and the swapped ones
    counts = [len(transformer_blocks(m)) for m in modules]
    recomputed = [bool(every and j % every == every - 1) or (m is model and j >= counts[0] - swapped)
                  for m, n in zip(modules, counts) for j in range(n)]
    for i, block in enumerate(b for m in modules for b in transformer_blocks(m)):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(block.register_forward_hook(lambda m, a, o: current.__setitem__(0, -1)))
    autocast = _LowPrecisionMatmuls(dtype) if dtype != torch.float32 else contextlib.nullcontext()
    adapters = _fp32_adapters(model) if dtype != torch.float32 else []
    if controlnet is not None:
        from train.controlnet import controlled_forward

        forward = controlled_forward(model, controlnet, preset.family)
    else:
        forward = model_forward(model, preset.family, guidance=default_of(TrainConfig, "guidance_scale_train"))
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_sdpa  # the kernels training runs with on GPUs
    try:
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(x, t, text)
    finally:
        F.scaled_dot_product_attention = sdpa
    # What the loss holds while every activation is still saved: at the end of the forward pass, and at its peak
    # (its own backward runs before the model's); with the batch's clean latents.
    kept, peak = ((n * x.numel() for n in objective_per_element) if objective_per_element is not None
                  else (out.numel() * 4 + x.numel() * 4,) * 2)
    full = sum(saved.values()) + max(kept, peak)
    blocks = [v for k, v in by_block.items() if k >= 0]
    result = {"full": full, "block": max(blocks, default=0), "checkpointed": full}
    if any(recomputed):
        saved.clear()
        for block, again in zip([b for m in modules for b in transformer_blocks(m)], recomputed):
            if again:
                block.forward = checkpointed_forward(_within(autocast, block.forward))  # recomputed as it ran
                # the checkpoint holds the block's inputs for its recomputation, outside autograd's saved tensors
                hooks.append(block.register_forward_pre_hook(_hold_inputs(pack), with_kwargs=True))
        # Backward recomputes a checkpointed block once everything saved after it is freed, and then holds more than
        # what was saved before it, its inputs and its saved activations: its forward's temporaries (the residual
        # sums, gated and modulated tensors its Python locals keep until it returns, LoRA's fp32 input copies) at
        # the end of the recomputation, and the gradients of its intermediates as its backward runs. Rather than
        # model those per architecture, the backward runs here, recomputations and all, and every tensor created
        # since the forward began counts while it is alive: the peak of that, with the clean latents beside it.
        # Trained parameters' gradients count as gradients, apart, from the moment they are accumulated.
        live = _Lifetimes(weights | {st._cdata for v in (x, t, *text.values()) for st in _storages(v)})
        F.scaled_dot_product_attention = _fused_sdpa
        try:
            with autocast, live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(x, t, text)
            for hook in hooks:  # the counting of saved tensors is over; recomputations run the blocks again
                hook.remove()
            hooks = []
            backward_peak = 0
            if out.requires_grad:
                live.forget(out)  # the loss's backward frees the output: its gradient flows from there
                accumulated = [p.register_post_accumulate_grad_hook(lambda p: live.forget(p.grad))
                               for m in modules for p in m.parameters() if p.requires_grad]
                with live:
                    live.peak = live.bytes
                    torch.autograd.backward(out.sum())  # a sum's gradient is a broadcast scalar: no latent-sized seed
                backward_peak = live.peak
                for hook in accumulated:
                    hook.remove()
        finally:
            F.scaled_dot_product_attention = sdpa
        result["checkpointed"] = max(sum(saved.values()) + max(kept, peak), backward_peak + x.numel() * 4)
    for hook in hooks + adapters:
        hook.remove()
    return result


class _LowPrecisionMatmuls(torch.overrides.TorchFunctionMode):
    """Autocast's rule for matrix products, the same on every device: their inputs cast to the compute dtype. The
    trace runs on the meta device, which autocast does not cover; code that computes in fp32 on purpose (Sana's
    linear attention) then saves the compute-dtype copies that training saves, not its fp32 tensors. (Which other
    ops autocast runs in fp32 differs between devices: they keep the trace's dtype.)"""

    PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "linear", "einsum",
                "conv1d", "conv2d", "conv3d"}

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.PRODUCTS:
            def cast(v):
                return v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.dtype else v

            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return func(*args, **kwargs)


def _fp32_adapters(model: torch.nn.Module) -> list:
    """Hooks that make the traced LoRA layers copy their input as the trainer's fp32 adapters do under autocast: peft
    casts each adapted layer's input to the adapters' fp32, alive while they run, and autocast casts that back for
    lora_A, which saves the copy (with `_LowPrecisionMatmuls`). One copy per layer, then: the trace's adapters, in
    the compute dtype, would have q, k and v save their one shared input."""
    held: dict[torch.nn.Module, torch.Tensor] = {}

    def enter(layer, args):
        held[layer] = args[0].float()

    def leave(layer, args, out):
        del held[layer]

    hooks = []
    for layer in model.modules():
        lora_a = getattr(layer, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and len(lora_a):
            hooks += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
            hooks += [a.register_forward_pre_hook(lambda a, args, layer=layer: (held[layer],)) for a in lora_a.values()]
    return hooks


class _Lifetimes(TorchDispatchMode):
    """Bytes of the tensors alive, and their peak, over the ops run inside it: a storage an op creates counts from
    then until its last tensor is gone. Storages in `ignored` (weights, inputs) never count."""

    def __init__(self, ignored: set):
        super().__init__()
        self.ignored = ignored
        self.alive: dict[int, list[int]] = {}  # storage -> [bytes, tensors on it]
        self.bytes = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.ignored:
            return
        entry = self.alive.get(key)
        if entry is None:
            entry = self.alive[key] = [storage.nbytes(), 0]
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key).atexit = False

    def _release(self, key: int) -> None:
        entry = self.alive.get(key)
        if entry is not None:  # else forgotten
            entry[1] -= 1
            if not entry[1]:
                del self.alive[key]
                self.bytes -= entry[0]

    def forget(self, tensor: torch.Tensor) -> None:
        """`tensor`'s storage counts no longer."""
        entry = self.alive.pop(tensor.untyped_storage()._cdata, None)
        if entry is not None:
            self.bytes -= entry[0]


def _within(context, forward):
    """`forward` run inside `context`, also when its block is recomputed in backward (outside the trace's `with`)."""
    def run(*args, **kwargs):
        with context:
            return forward(*args, **kwargs)
    return run


def _hold_inputs(pack):
    """A forward pre-hook that counts a checkpointed block's tensor inputs as saved."""
    def hook(module, args, kwargs):
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    pack(tensor)
    return hook


def _storages(tensor: torch.Tensor) -> list:
    """The storages holding a tensor's data: its own, or a quantized tensor subclass's inner tensors'."""
    return [t.untyped_storage() for t in inner_tensors(tensor)]


def frozen_bytes(module: torch.nn.Module, quant: str, dtype_bytes: int) -> float:
    """Bytes of `module`'s frozen parameters: quantized Linear weights at their kind's size, the rest at `dtype_bytes`."""
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)} if quant != "none" else set()
    return sum(quantization.weight_bytes(quant, tuple(p.shape)) if id(p) in linear_weights else p.numel() * dtype_bytes
               for p in module.parameters() if not p.requires_grad)


def ema_placement(decay: float, device: str) -> str:
    """The plan's EMA ("off", "device" or "cpu") from the trainer's --ema-decay and --ema-device."""
    return "off" if decay <= 0 else device


def plan(pc: PlanConfig, objective=None) -> dict:
    """Bytes per component on one rank's device, the predicted peak, the verdict and the largest batch.

    `objective`: the run's (its memory is traced); default: the preset's with the trainer's default options."""
    wb = DTYPE_BYTES[pc.weights_dtype]
    compute = DTYPES[pc.precision]
    if (pc.lora_rank or pc.controlnet) and pc.parallel == "fsdp" and pc.world_size > 1:
        what = "LoRA trains" if pc.lora_rank else "A ControlNet trains"
        raise ValueError(f"{what} with the frozen base replicated on every GPU: plan it with --parallel ddp")
    if pc.lora_rank and pc.controlnet:
        raise ValueError("plan LoRA or a ControlNet, not both: the trainer trains one or the other")
    if pc.base_quant == "nf4" and pc.blocks_to_swap:
        raise ValueError("--blocks-to-swap with --base-quant nf4 is refused by the trainer (bitsandbytes' 4-bit weights carry "
                         "state the swap does not); plan one or the other")
    if (pc.base_quant != "none" or pc.blocks_to_swap) and not (pc.lora_rank or pc.controlnet):
        raise ValueError("--base-quant and --blocks-to-swap apply to the frozen base of a LoRA or ControlNet run: add "
                         "--lora-rank or --controlnet")
    # a ControlNet is built from the unquantized transformer, which is quantized after (as the trainer does)
    preset, model = meta_model(pc.model, DTYPES[pc.weights_dtype], pc.lora_rank, pc.lora_targets,
                               quant="none" if pc.controlnet else pc.base_quant)
    modules = [model]
    if pc.controlnet:  # the transformer frozen in the weights dtype; the ControlNet trains in fp32
        model.requires_grad_(False)
        modules.append(meta_controlnet(preset, model, pc.controlnet_layers))
        if pc.base_quant != "none":
            model.to(quantization.BASE_DTYPE)
            quantization.quantize_meta(model, pc.base_quant)
    blocks = transformer_blocks(model)
    if not 0 <= pc.blocks_to_swap <= len(blocks):
        raise ValueError(f"--blocks-to-swap {pc.blocks_to_swap}: {pc.model} has {len(blocks)} blocks")
    params = [p for m in modules for p in m.parameters()]
    trainable = [p for p in params if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    n_trainable = sum(p.numel() for p in trainable)
    n_buffers = sum(b.numel() for m in modules for b in m.buffers())
    shard = pc.world_size if pc.parallel == "fsdp" else 1
    on_device = 0.0 if pc.fsdp_cpu_offload else 1.0
    every = parse_checkpointing(pc.grad_checkpointing)
    # Full fine-tuning: every weight trains in the weights dtype. LoRA (ControlNet): the base is frozen in the weights
    # dtype and the adapters (the ControlNet: the only gradients, optimizer states and EMA) are fp32.
    tb = 4 if pc.lora_rank or pc.controlnet else wb
    # the frozen base: quantized Linear weights at their kind's size, the rest in bf16 (or in the weights dtype)
    fb = DTYPE_BYTES["bf16"] if pc.base_quant != "none" else wb
    swapped = [frozen_bytes(b, pc.base_quant, fb) for b in blocks[len(blocks) - pc.blocks_to_swap:]]
    frozen = sum(frozen_bytes(m, pc.base_quant, fb) for m in modules) - sum(swapped)
    components = {
        "weights": on_device * (frozen + n_trainable * tb) / shard + n_buffers * (fb if pc.base_quant != "none" else wb),
        "gradients": on_device * n_trainable * tb / shard,
        "optimizer states": on_device * optimizer_state_bytes(trainable, pc.optimizer, tb) / shard,
        "ema": n_trainable * 4 / shard if pc.ema == "device" else 0.0,
    }
    if swapped:  # the block the GPU is finishing, the one in use and the one arriving (`train.swap.BlockSwap`)
        components["swapped blocks in flight"] = max(sum(swapped[i:i + 3]) for i in range(max(1, len(swapped) - 2)))
    if pc.parallel == "fsdp" and pc.world_size > 1:
        # one block's full parameters gathered in the compute dtype, and the next prefetched
        block_params = max(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(model))
        components["fsdp all-gather buffers"] = 2 * block_params * DTYPE_BYTES[pc.precision]

    config = preset.transformer_config()
    if objective is None:
        objective = build_run_objective(TrainConfig(model=pc.model, lora_rank=pc.lora_rank), preset, config)
    channels = latent_channels(preset.family, config)
    per_element = objective_bytes(objective, channels, channels if preset.family == "flux" else config.get("out_channels") or channels)

    def activations(batch: int) -> float:
        _, m = meta_model(pc.model, compute, pc.lora_rank, pc.lora_targets, adapter_dtype=compute,
                          quant="none" if pc.controlnet else pc.base_quant)
        net = None
        if pc.controlnet:
            m.requires_grad_(False)
            net = meta_controlnet(preset, m, pc.controlnet_layers, compute)
            if pc.base_quant != "none":
                quantization.quantize_meta(m.to(quantization.BASE_DTYPE), pc.base_quant)
        a = trace_activations(m, preset, batch, pc.bucket, pc.text_tokens or preset.text_tokens, compute, every,
                              per_element, controlnet=net, swapped=pc.blocks_to_swap)
        return a["checkpointed"] if every or pc.blocks_to_swap else a["full"]

    act = activations(pc.batch_size)
    # activations grow linearly with the batch: the slope from two traces gives the largest batch
    per_sample = (activations(pc.batch_size + 1) - act) if pc.batch_size else act
    # autocast keeps a compute-dtype copy of each trained fp32 weight for the step (frozen ones are cast per use)
    if pc.precision != "fp32" and tb == 4 and pc.parallel != "fsdp":
        act += n_trainable * DTYPE_BYTES[pc.precision] / shard
    components["activations"] = act
    grads = components["gradients"]
    static = sum(v for k, v in components.items() if k not in ("activations", "gradients"))
    # Backward frees saved activations as it creates gradients: the step peaks at the larger of the two.
    peak = static + max(act, grads)
    def largest_batch(memory: float) -> int:
        room = memory - static
        if room < max(grads, act - per_sample * (pc.batch_size - 1)):  # not even one sample
            return 0
        return max(1, int(pc.batch_size + (room - act) // per_sample)) if per_sample > 0 else pc.batch_size

    # Per bucket of the preset's table: activations per sample scale with the bucket's pixels (every
    # layer is linear in the tokens with fused attention), so the traced slope is rescaled, not retraced.
    pixels = pc.bucket[0] * pc.bucket[1]
    by_bucket = {}
    for b in bucket_table(preset.base_resolution):
        scale = b.height * b.width / pixels
        room = pc.gpu_memory - static
        fixed = act - per_sample * pc.batch_size  # what does not grow with the batch (autocast copies, ...)
        n = int((room - fixed) // (per_sample * scale)) if per_sample > 0 and room > max(grads, fixed) else 0
        by_bucket[b.name] = max(n, 0)
    # What a trainer without a cache adds: the VAE and text encoder(s) resident, frozen, in bf16.
    encoders = {name: 2 * n for name, n in preset.encoder_parameters.items()}
    return {
        "config": {**asdict(pc), "bucket": f"{pc.bucket[0]}x{pc.bucket[1]}"},
        "encoders_resident": encoders,
        "peak_with_encoders_resident": peak + sum(encoders.values()),
        "parameters": n_params,
        "host_bytes": sum(swapped),
        "trainable_parameters": n_trainable,
        **({"controlnet_layers": modules[1].config.num_layers} if pc.controlnet else {}),
        "buffers": n_buffers,
        "bytes": components,
        "predicted_peak": peak,
        "fits": peak <= pc.gpu_memory,
        "largest_batch": largest_batch(pc.gpu_memory),
        "largest_batch_with_encoders_resident": largest_batch(pc.gpu_memory - sum(encoders.values())),
        # the same setup on the cards people train on (GiB as GPU memory is quoted), less what the CUDA context,
        # cuBLAS's workspace and the allocator's slack take before any tensor
        "largest_batch_by_card": {f"{g}GB": largest_batch(g * GiB - CARD_RESERVED) for g in (16, 24, 32, 40, 48, 80)},
        "largest_batch_per_bucket": by_bucket,
        "activation_bytes_per_sample": per_sample,
    }


def format_plan(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"{cfg['model']}: {result['parameters']:,} parameters ({result['buffers']:,} buffer values)"
        + (f", LoRA rank {cfg['lora_rank']}: {result['trainable_parameters']:,} trainable" if cfg["lora_rank"] else "")
        + (f", ControlNet of {result['controlnet_layers']} blocks: {result['trainable_parameters']:,} trainable, the "
           f"transformer frozen" if cfg["controlnet"] else "")
        + f"; batch {cfg['batch_size']} at "
        f"{cfg['bucket']}, {cfg['precision']} compute, "
        f"{cfg['weights_dtype'] + ' weights' if cfg['base_quant'] == 'none' else 'frozen base in ' + cfg['base_quant'] + ' (the rest bf16)'}"
        f"{', blocks swapped: the last ' + str(cfg['blocks_to_swap']) if cfg['blocks_to_swap'] else ''}, {cfg['optimizer']}, checkpointing "
        f"{cfg['grad_checkpointing']}, EMA {cfg['ema']}, {cfg['world_size']} rank(s) {cfg['parallel'] if cfg['world_size'] > 1 else ''}"
        f"{' + CPU offload' if cfg['fsdp_cpu_offload'] else ''}",
    ]
    for name, value in result["bytes"].items():
        lines.append(f"  {name:<24} {value / GiB:9.2f} GiB")
    lines.append(f"  {'predicted peak':<24} {result['predicted_peak'] / GiB:9.2f} GiB per device")
    if result["host_bytes"]:
        lines.append(f"  {'in pinned CPU memory':<24} {result['host_bytes'] / GiB:9.2f} GiB (the swapped blocks' frozen weights)")
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"  {verdict} in {cfg['gpu_memory'] / GiB:.0f} GiB; largest batch at {cfg['bucket']}: {result['largest_batch']}")
    per_bucket = result["largest_batch_per_bucket"]
    if per_bucket:
        shown = sorted(per_bucket.items(), key=lambda kv: Bucket.parse(kv[0]).aspect)
        picks = [shown[0], *[kv for kv in shown if Bucket.parse(kv[0]).aspect == 1.0][:1], shown[-1]]
        lines.append("  largest batch per bucket (estimated from the traced one): "
                     + ", ".join(f"{k}: {v}" for k, v in dict(picks).items()) + f" ... ({len(per_bucket)} buckets in --json)")
    if result["encoders_resident"]:
        resident = sum(result["encoders_resident"].values())
        names = " + ".join(f"{k} {v / GiB:.1f} GiB" for k, v in result["encoders_resident"].items())
        lines.append(f"  with the encoders resident in bf16, as trainers without a cache run ({names}): "
                     f"{result['peak_with_encoders_resident'] / GiB:.2f} GiB, largest batch "
                     f"{result['largest_batch_with_encoders_resident']}; the cache saves {resident / GiB:.2f} GiB per device")
    lines.append("  (activations traced at one forward on the meta device, and with checkpointing its backward's recomputations "
                 "too; backward frees activations as it makes gradients, so the peak counts the larger of the two)")
    return "\n".join(lines)


def parse_bytes(text: str) -> float:
    """'48GB', '80GiB', '24g' -> bytes (GB taken as GiB, as GPU memory is quoted)."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    if t and t[-1] in units:
        return float(t[:-1]) * units[t[-1]]
    return float(t)


def measure_peak(step, device: torch.device) -> int:
    """Peak bytes of tensors during `step()`: the CUDA allocator's peak, or on the CPU the torch
    profiler's memory timeline (every tensor alive at each instant, parameters and states included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    import json
    import tempfile

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
