"""The transformer a run holds and what trains beside it, built one way for the trainer (on its device, from the
weights) and for the memory planner (on the meta device, from the config): quantized or not, with LoRA adapters or a
ControlNet, and which of its blocks the block swap keeps in CPU memory and gradient checkpointing recomputes.

The options come from `train.config` (`ModelOptions` and `MemoryOptions`: a `TrainConfig` or a `PlanConfig`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from shards.options import DTYPES
from train import quant as quantization
from train.families.base import ModelPreset
from train.presets import transformer_blocks

# load(dtype, quant) -> the transformer in `dtype`, its Linear weights quantized as `quant` says (None: not)
Load = Callable[[torch.dtype, "str | None"], torch.nn.Module]


@dataclass
class FrozenBase:
    """`transformer`: frozen but for its LoRA adapters (`adapter`: their peft config, on `adapted_layers` layers) or,
    full fine-tuning, all trainable; `controlnet`: the ControlNet trained beside it (fp32), or None."""

    transformer: torch.nn.Module
    controlnet: torch.nn.Module | None = None
    adapter: object | None = None
    adapted_layers: int = 0


def build_frozen(cfg, preset: ModelPreset, load: Load, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, adapter_dtype: torch.dtype = torch.float32,
                 controlnet_of: Callable | None = None, seed: int = 0) -> FrozenBase:
    """The run's transformer in --weights-dtype (a quantized base: its Linear weights quantized, the rest bf16) with
    what trains of it: everything, LoRA adapters in `adapter_dtype`, or a ControlNet beside it.

    Args:
        cfg: the run's or the plan's options (`ModelOptions`, `MemoryOptions`).
        load: builds the transformer (from the weights on the trainer's side, `meta_loader` on the planner's).
        dtype: the transformer's dtype (default --weights-dtype; the planner traces in the compute dtype).
        device: where adapters and a new ControlNet are built ("meta": shapes without values).
        controlnet_of: transformer -> the ControlNet to train (a resumed one); default a new one (or
            --pretrained-controlnet) from `train.controlnet.build_controlnet`.
    """
    dtype = dtype or DTYPES[cfg.weights_dtype]
    quant = None if cfg.base_quant == "none" else cfg.base_quant
    place = torch.device(device) if device is not None else contextlib.nullcontext()
    if cfg.controlnet:
        return _with_controlnet(cfg, preset, load, dtype, quant, place, controlnet_of, seed)
    transformer = load(dtype, quant)
    if not cfg.lora_rank:
        return FrozenBase(transformer)
    from train import lora

    adapter = lora.lora_config(preset.family, cfg.lora_rank, cfg.lora_alpha, list(cfg.lora_targets), cfg.lora_dropout,
                               adapter=cfg.adapter, factor=cfg.lokr_factor, decompose_both=cfg.lokr_decompose_both)
    with place:
        layers = lora.add_lora(transformer, adapter, adapter_dtype, seed=seed)
    return FrozenBase(transformer, adapter=adapter, adapted_layers=layers)


def _with_controlnet(cfg, preset: ModelPreset, load: Load, dtype: torch.dtype, quant: str | None, place,
                     controlnet_of: Callable | None, seed: int) -> FrozenBase:
    from train import controlnet

    # a new ControlNet copies the transformer's first blocks from its weights as released, before the base is quantized
    # (the copy's source in the quantized base's own dtype, not a 4-byte --weights-dtype)
    copies = controlnet_of is None and not cfg.pretrained_controlnet
    transformer = load(quantization.BASE_DTYPE if copies and quant else dtype, None if copies else quant)
    transformer.requires_grad_(False)
    if controlnet_of is not None:
        net = controlnet_of(transformer)
    else:
        with place:
            net = controlnet.build_controlnet(transformer, preset.family, layers=cfg.controlnet_layers,
                                              pretrained=cfg.pretrained_controlnet, seed=seed)
    if copies and quant:
        del transformer
        transformer = load(dtype, quant)
        transformer.requires_grad_(False)
    return FrozenBase(transformer, net)


def load_meta(preset: ModelPreset, dtype: torch.dtype, quant: str | None) -> torch.nn.Module:
    """The preset's transformer from its config on the meta device, quantized as the trainer loads it
    (`train.quant.quantize_meta`), the rest in bf16 (a `paired` preset: both experts)."""
    if preset.paired:
        from train.experts import Experts

        high, low = (load_meta(replace(preset, paired=False), dtype, quant) for _ in preset.experts)
        return Experts(high, low, preset.expert_boundary * 1000, preset.experts)
    with quiet_diffusers():
        with torch.device("meta"):
            model = preset.transformer_class.from_config(preset.transformer_config())
        model = model.to(dtype if quant is None else quantization.BASE_DTYPE)
    if quant is not None:
        quantization.quantize_meta(model, quant)
    return model


def meta_loader(preset: ModelPreset) -> Load:
    """`load` for `build_frozen` on the meta device."""
    return functools.partial(load_meta, preset)


def swapped_blocks(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """The last `count` blocks, whose frozen weights --blocks-to-swap keeps in CPU memory."""
    resident = transformer_blocks(model)
    if count > len(resident):
        raise ValueError(f"--blocks-to-swap {count}: the transformer has {len(resident)} blocks; choose at most that")
    return resident[len(resident) - count:]


def recomputed_blocks(model: torch.nn.Module, every: int, swapped: int = 0) -> list[torch.nn.Module]:
    """The blocks the backward pass recomputes: every `every`-th (--grad-checkpointing every-K; 0: none) and the
    `swapped` last ones (the block swap checkpoints the blocks it swaps)."""
    chosen = transformer_blocks(model)
    return [b for j, b in enumerate(chosen) if (every and j % every == every - 1) or j >= len(chosen) - swapped]


@contextlib.contextmanager
def quiet_diffusers():
    """diffusers' warnings off: published configs carry keys a class ignores, and casting a model built from a config
    warns about fp32 modules it has none of; nothing for a user to act on."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)
