"""The planner's trace: what autograd keeps of one training forward pass, and the peak of its backward pass, on the
meta device (shapes, no memory), with the kernels and autocast rules training runs with on GPUs."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from train.data import batch_tensors
from train.families import get_family
from train.frozen import recomputed_blocks
from train.objectives import CLEAN_FIRST_FRAME
from train.presets import transformer_blocks
from train.swap import checkpointed_forward, inner_tensors


def trace_activations(model, preset, batch: int, bucket: tuple[int, int], text_tokens: int, dtype: torch.dtype,
                      every: int = 0, objective_per_element: tuple[float, float] | None = None, controlnet=None,
                      swapped: int = 0, references: tuple[int, tuple[int, int]] | None = None,
                      first_frame: bool = False) -> dict:
    """Bytes autograd saves for backward in one forward pass (meta tensors, no memory used), and with checkpointing
    the peak of the backward pass that recomputes the checkpointed blocks, run on the meta device too.

    Returns the total, the largest block's share, and the peak with every `every`-th block checkpointed (0: none).
    `objective_per_element`: what the loss holds per latent element, at the end of the forward pass and at its peak
    (`objective_bytes`; default: the output in fp32 and the clean latents). `controlnet`: traced with a ControlNet
    beside the (frozen) transformer, as `train.controlnet.controlled_forward` runs them; its blocks count as blocks too.
    `swapped`: the transformer's last blocks are swapped, which recomputes them in backward whatever `every` says.
    `references`: an edit preset's (count, (height, width) pixels) of each sample's references (`example_inputs`).
    `first_frame`: a batch of clips whose first latent frame is clean (`CLEAN_FIRST_FRAME`: image-to-video by it).
    Below fp32, matrix products run in `dtype` and LoRA layers copy their inputs as under the trainer's autocast."""
    family = get_family(preset.family)
    inputs = example_inputs(family, model, preset, bucket, batch, text_tokens, dtype, references)  # zeros, meta device
    x = inputs["latents"]  # (B, C, h, w)
    if first_frame and x.dim() == 5 and x.shape[2] > 1:
        inputs[CLEAN_FIRST_FRAME] = torch.ones(batch, dtype=torch.bool, device=x.device)
    if controlnet is not None:
        inputs["control"] = torch.zeros_like(x)  # the control latent, the latent's shape
    t = torch.full((batch,), 500.0, device="meta")

    modules = [model] + ([controlnet] if controlnet is not None else [])
    every_block = [b for m in modules for b in transformer_blocks(m)]
    saved = _SavedTensors({st._cdata for m in modules for p in m.parameters() for st in _storages(p)})
    hooks = []
    for i, block in enumerate(every_block):
        hooks.append(block.register_forward_pre_hook(functools.partial(saved.enter, i)))
        hooks.append(block.register_forward_hook(saved.leave))
    autocast = _LowPrecisionMatmuls(dtype) if dtype != torch.float32 else contextlib.nullcontext()
    adapters = _fp32_adapters(model) if dtype != torch.float32 else []
    if controlnet is not None:
        from train.controlnet import controlled_forward

        forward = controlled_forward(model, controlnet, preset.family)
    else:
        forward = functools.partial(_family_forward, family, model, preset.train_guidance)
    with _fused_attention(), autocast, torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
        out = forward(x, t, inputs)
    # What the loss holds while every activation is still saved: at the end of the forward pass, and at its peak
    # (its own backward runs before the model's); with the batch's clean latents.
    kept, peak = ((n * x.numel() for n in objective_per_element) if objective_per_element is not None
                  else (out.numel() * 4 + x.numel() * 4,) * 2)
    full = saved.total() + max(kept, peak)
    result = {"full": full, "block": saved.largest_block(), "checkpointed": full}
    # the blocks the trainer's checkpointing recomputes: every `every`-th of each module's, and the swapped ones
    recomputed = recomputed_blocks(model, every, swapped) + (recomputed_blocks(controlnet, every) if controlnet is not None else [])
    if recomputed:
        saved.clear()
        for block in recomputed:
            block.forward = checkpointed_forward(_within(autocast, block.forward))  # recomputed as it ran
            # the checkpoint holds the block's inputs for its recomputation, outside autograd's saved tensors
            hooks.append(block.register_forward_pre_hook(functools.partial(_hold_inputs, saved), with_kwargs=True))
        # Backward recomputes a checkpointed block once everything saved after it is freed, and then holds more than
        # what was saved before it, its inputs and its saved activations: its forward's temporaries (the residual
        # sums, gated and modulated tensors its Python locals keep until it returns, LoRA's fp32 input copies) at
        # the end of the recomputation, and the gradients of its intermediates as its backward runs. Rather than
        # model those per architecture, the backward runs here, recomputations and all, and every tensor created
        # since the forward began counts while it is alive: the peak of that, with the clean latents beside it.
        # Trained parameters' gradients count as gradients, apart, from the moment they are accumulated.
        live = _Lifetimes(saved.weights | {st._cdata for v in (t, *batch_tensors(inputs)) for st in _storages(v)})
        with _fused_attention():
            with autocast, live, torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
                out = forward(x, t, inputs)
            for hook in hooks:  # the counting of saved tensors is over; recomputations run the blocks again
                hook.remove()
            hooks = []
            backward_peak = _backward_peak(out, modules, live)
        result["checkpointed"] = max(saved.total() + max(kept, peak), backward_peak + x.numel() * 4)
    for hook in hooks + adapters:
        hook.remove()
    return result


def trace_base_forward(model, preset, batch: int, bucket: tuple[int, int], text_tokens: int, dtype: torch.dtype,
                       references: tuple[int, tuple[int, int]] | None = None) -> int:
    """Peak bytes of the tensors output preservation's forward creates (meta tensors, no memory used): the base model,
    its LoRA adapters off, without gradients, so nothing is saved for backward; what counts is what is alive at once
    (a block's temporaries, the residual stream, the prediction it returns and the step keeps as its target)."""
    from train.lora import adapters_off

    family = get_family(preset.family)
    inputs = example_inputs(family, model, preset, bucket, batch, text_tokens, dtype, references)  # zeros, meta device
    t = torch.full((batch,), 500.0, device="meta")
    weights = {st._cdata for p in model.parameters() for st in _storages(p)}
    live = _Lifetimes(weights | {st._cdata for v in (t, *batch_tensors(inputs)) for st in _storages(v)})
    autocast = _LowPrecisionMatmuls(dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with _fused_attention(), autocast, adapters_off(model), torch.no_grad(), live:
        out = family.forward(model, model.config, inputs["latents"], t, inputs, preset.train_guidance)
        out.float()  # the objective's copy of the target, beside the prediction
    return live.peak


def trace_flops(model, preset, batch: int, bucket: tuple[int, int], text_tokens: int, dtype: torch.dtype, every: int = 0,
                swapped: int = 0, references: tuple[int, tuple[int, int]] | None = None) -> dict:
    """Floating-point operations (torch's FlopCounterMode, on the meta device) of output preservation's forward (the
    base model, adapters off, no gradients) and of the training step's passes: its forward, its backward and the
    recomputation of the blocks checkpointing or the block swap recompute (`every`, `swapped`). Installs the
    recomputation on `model`'s blocks: give it a model built for this."""
    from torch.utils.flop_counter import FlopCounterMode

    from train.lora import adapters_off

    family = get_family(preset.family)
    inputs = example_inputs(family, model, preset, bucket, batch, text_tokens, dtype, references)
    t = torch.full((batch,), 500.0, device="meta")
    guidance = preset.train_guidance
    counter = FlopCounterMode(display=False)
    with counter, adapters_off(model), torch.no_grad():
        family.forward(model, model.config, inputs["latents"], t, inputs, guidance)
    base = counter.get_total_flops()
    for block in recomputed_blocks(model, every, swapped):
        block.forward = checkpointed_forward(block.forward)
    counter = FlopCounterMode(display=False)
    with counter:
        out = family.forward(model, model.config, inputs["latents"], t, inputs, guidance)
        torch.autograd.backward(out.sum())
    return {"base_forward": base, "step": counter.get_total_flops()}


def example_inputs(family, model, preset, bucket, batch: int, text_tokens: int, dtype: torch.dtype,
                   references: tuple[int, tuple[int, int]] | None) -> dict:
    """The family's example batch (`Family.example_batch`), an edit preset's with `references` = (count, (height,
    width) pixels) of each sample's references (None: the family's defaults)."""
    extra = {}
    if preset.references and references is not None:
        extra = {"references": references[0], "reference_size": references[1]}
    return family.example_batch(model.config, preset, bucket, batch, text_tokens, dtype, **extra)


def _family_forward(family, model, guidance: float, xt: torch.Tensor, t: torch.Tensor, batch: dict) -> torch.Tensor:
    return family.forward(model, model.config, xt, t, batch, guidance)


def _backward_peak(out: torch.Tensor, modules: list, live: _Lifetimes) -> int:
    """The peak of live tensors while backward runs from `out`; trained parameters' gradients are not counted."""
    if not out.requires_grad:
        return 0
    live.forget(out)  # the loss's backward frees the output: its gradient flows from there
    accumulated = [p.register_post_accumulate_grad_hook(live.forget_grad)
                   for m in modules for p in m.parameters() if p.requires_grad]
    with live:
        live.peak = live.bytes
        torch.autograd.backward(out.sum())  # a sum's gradient is a broadcast scalar: no latent-sized seed
    for hook in accumulated:
        hook.remove()
    return live.peak


class _SavedTensors:
    """Bytes of the storages autograd saves for backward (each once), in total and by the block running; the
    storages of `weights` count as weights, not here."""

    def __init__(self, weights: set):
        self.weights = weights
        self.saved: dict[int, int] = {}
        self.by_block: dict[int, int] = {}
        self.block = -1

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.saved and storage._cdata not in self.weights:
            self.saved[storage._cdata] = storage.nbytes()
            self.by_block[self.block] = self.by_block.get(self.block, 0) + storage.nbytes()
        return tensor

    def enter(self, index: int, module, args) -> None:
        self.block = index

    def leave(self, module, args, output) -> None:
        self.block = -1

    def total(self) -> int:
        return sum(self.saved.values())

    def largest_block(self) -> int:
        return max((v for k, v in self.by_block.items() if k >= 0), default=0)

    def clear(self) -> None:
        self.saved.clear()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


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


@contextlib.contextmanager
def _fused_attention():
    """Attention as the kernels training runs with on GPUs compute it (`_FusedAttention`)."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
class _LowPrecisionMatmuls(torch.overrides.TorchFunctionMode):
    """Autocast's rule for matrix products, the same on every device: their inputs cast to the compute dtype. The
    trace runs on the meta device, which autocast does not cover; code that computes in fp32 on purpose (a linear
    attention's sums) then saves the compute-dtype copies that training saves, not its fp32 tensors. (Which other
    ops autocast runs in fp32 differs between devices: they keep the trace's dtype.)"""

    PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "linear", "einsum",
                "conv1d", "conv2d", "conv3d"}

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.PRODUCTS:
            args, kwargs = tree_map(self.cast, args), tree_map(self.cast, kwargs)
        return func(*args, **kwargs)

    def cast(self, v):
        return v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.dtype else v


def _fp32_adapters(model: torch.nn.Module) -> list:
    """Hooks that make the traced LoRA layers copy their input as the trainer's fp32 adapters do under autocast: peft
    casts each adapted layer's input to the adapters' fp32, alive while they run, and autocast casts that back for
    lora_A, which saves the copy (with `_LowPrecisionMatmuls`). One copy per layer, then: the trace's adapters, in
    the compute dtype, would have q, k and v save their one shared input."""
    held = _HeldInputs()
    hooks = []
    for layer in model.modules():
        lora_a = getattr(layer, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict) and len(lora_a):
            hooks += [layer.register_forward_pre_hook(held.enter), layer.register_forward_hook(held.leave)]
            hooks += [a.register_forward_pre_hook(functools.partial(held.give, layer)) for a in lora_a.values()]
    return hooks


class _HeldInputs:
    """The fp32 copy of each adapted layer's input, alive while the layer runs, fed to its adapters."""

    def __init__(self):
        self.held: dict[torch.nn.Module, torch.Tensor] = {}

    def enter(self, layer, args) -> None:
        self.held[layer] = args[0].float()

    def leave(self, layer, args, out) -> None:
        del self.held[layer]

    def give(self, layer, adapter, args) -> tuple:
        # the layer's input only: DoRA also runs lora_A on an identity matrix, for the norm of the adapted weight
        held = self.held[layer]
        return (held,) if args[0].shape == held.shape else args


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

    def forget_grad(self, parameter: torch.Tensor) -> None:
        """A post-accumulate-grad hook: a trained parameter's gradient counts as a gradient, not here."""
        self.forget(parameter.grad)


def _within(context, forward):
    """`forward` run inside `context`, also when its block is recomputed in backward (outside the trace's `with`)."""
    return functools.partial(_run_within, context, forward)


def _run_within(context, forward, *args, **kwargs):
    with context:
        return forward(*args, **kwargs)


def _hold_inputs(saved: _SavedTensors, module, args, kwargs) -> None:
    """A forward pre-hook that counts a checkpointed block's tensor inputs as saved."""
    for value in (*args, *kwargs.values()):
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor):
                saved.pack(tensor)


def _storages(tensor: torch.Tensor) -> list:
    """The storages holding a tensor's data: its own, or a quantized tensor subclass's inner tensors'."""
    return [t.untyped_storage() for t in inner_tensors(tensor)]

