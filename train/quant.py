"""A quantized frozen base: the transformer's Linear weights stored in 8 or 4 bits while LoRA adapters or a ControlNet
train beside it, as diffusers loads quantized models.

- int8: torchao's weight-only int8 (`Int8WeightOnlyConfig`: one byte per weight, an fp32 scale per output row),
  through diffusers' `TorchAoConfig`. Runs anywhere torch does, the CPU included.
- fp8: torchao's weight-only float8 e4m3 (`Float8WeightOnlyConfig`, a per-row scale), the same way.
- nf4: bitsandbytes' 4-bit NormalFloat with double quantization and bf16 compute (QLoRA), through diffusers'
  `BitsAndBytesConfig`. CUDA only.

Every `nn.Linear` is quantized (the libraries' default, and what diffusers' QLoRA recipes train): the blocks hold
over 98 % of the weights, the embedders and the output layer the rest. Norms, biases and embeddings stay in bf16.
The adapters stay fp32 and train as on an unquantized base; torchao's weight-only linear keeps a bf16 copy of each
weight it multiplied for the backward pass, so a quantized base saves memory with gradient checkpointing (the copy
lives while one block is recomputed), and almost none without it (the memory plan shows both).
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
from pathlib import Path

import torch

from shards.options import install_extra

KINDS = ("int8", "fp8", "nf4")
# the dtype of everything the quantization leaves (norms, biases, embeddings): what torchao's and bitsandbytes'
# kernels compute in
BASE_DTYPE = torch.bfloat16


def check_supported(kind: str, device: torch.device) -> None:
    """Refuse a kind this device cannot train with, saying why and what would."""
    if kind not in KINDS:
        raise ValueError(f"--base-quant {kind}: choose none, {', '.join(KINDS)}")
    if kind != "nf4":
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("torchao")
        except PackageNotFoundError:
            found = None
        if found is None or tuple(int(x) for x in found.split(".")[:2] if x.isdigit()) < (0, 15):
            raise ValueError(f"--base-quant {kind} needs torchao 0.15 or later (found {found or 'none'}): "
                             f"{install_extra('quant')}")
        return
    if device.type != "cuda":
        raise ValueError("--base-quant nf4 runs bitsandbytes' 4-bit kernels, which need a CUDA GPU; on this machine use "
                         "--base-quant int8 or fp8 (torchao's weight-only kinds run on the CPU too)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(f"--base-quant nf4 needs bitsandbytes: {install_extra('quant')}") from None


def quantization_config(kind: str):
    """diffusers' quantization config of `kind`, for `from_pretrained(..., quantization_config=...)`."""
    with quiet_import():
        if kind == "nf4":
            from diffusers import BitsAndBytesConfig

            return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=BASE_DTYPE)
        from diffusers import TorchAoConfig
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

        return TorchAoConfig({"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[kind]())


def load(cls, path: str | Path, subfolder: str | None, kind: str) -> torch.nn.Module:
    """`cls.from_pretrained` with `kind`'s quantization: Linear weights quantized as they load, the rest in bf16."""
    with quiet_import():
        model = cls.from_pretrained(path, subfolder=subfolder, torch_dtype=BASE_DTYPE, quantization_config=quantization_config(kind))
    cast_inputs_as_autocast(model)
    return model


def cast_inputs_as_autocast(model: torch.nn.Module) -> int:
    """Make the quantized Linear layers take the input autocast would give them; returns how many.

    Their linear is a `__torch_function__` override, which runs before autocast sees the call, and computes in the
    input's dtype: after a LayerNorm (an fp32 op under autocast) that is fp32, so the layer would compute and output
    fp32, twice the activation memory of the bf16 layer it replaces. Under autocast each such layer's input is cast to
    the autocast dtype, as autocast casts a Linear's. bitsandbytes' 4-bit layers compute in their compute dtype but
    return (and cast their bias to) the input's dtype: the same cast keeps them bf16 too."""
    def cast(module, args):
        x = args[0]
        kind = x.device.type
        if x.is_floating_point() and torch.is_autocast_enabled(kind) and x.dtype != torch.get_autocast_dtype(kind):
            return (x.to(torch.get_autocast_dtype(kind)), *args[1:])
        return None

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and is_quantized(m.weight)]
    for layer in layers:
        layer.register_forward_pre_hook(cast)
    return len(layers)


def quantize_fresh(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A model built from its config (seeded weights), quantized through the same `from_pretrained` path as released
    weights: written to a temporary directory and loaded back."""
    with tempfile.TemporaryDirectory(prefix="cachedit-quant-") as tmp:
        model.save_pretrained(tmp)
        return load(type(model), tmp, None, kind)


def weight_bytes(kind: str, shape: tuple[int, ...]) -> float:
    """Bytes a quantized Linear weight of `shape` (out, in) takes on the device, its scales included."""
    rows, n = shape[0], math.prod(shape)
    if kind == "int8":  # int8 values, an fp32 scale and an int8 zero point per output row
        return n + 5 * rows
    if kind == "fp8":  # float8 values, an fp32 scale per output row
        return n + 4 * rows
    if kind == "nf4":  # 4-bit values; double quantization: a uint8 absmax per 64 values, an fp32 one per 256 of those
        return n / 2 + math.ceil(n / 64) + 4 * math.ceil(n / (64 * 256))
    raise ValueError(f"unknown quantization {kind!r}")


def quantize_meta(model: torch.nn.Module, kind: str) -> None:
    """Quantize a model on the meta device in place with the kind's torchao config, so a traced forward keeps what
    the real one keeps (weight-only linears save a dequantized copy for backward). bitsandbytes' 4-bit linear
    saves no weight copy (it dequantizes again in backward), so nf4 traces as the unquantized model does."""
    if kind == "nf4":
        return
    with quiet_import():
        from torchao.quantization import quantize_

        quantize_(model, quantization_config(kind).get_apply_tensor_subclass())


def quantized_linears(model: torch.nn.Module) -> int:
    """How many Linear layers hold quantized weights (torchao tensor subclasses or bitsandbytes' 4-bit parameters)."""
    return sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) and is_quantized(m.weight))


def is_quantized(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "Params4bit" or (type(tensor) not in (torch.Tensor, torch.nn.Parameter)
                                                     and hasattr(tensor, "__tensor_flatten__"))


@contextlib.contextmanager
def quiet_import():
    """torchao announces at import each optional CUDA kernel library it cannot load (on a CPU machine, all of them)
    and torch warns about its enum registrations; none is anything a user can act on."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
