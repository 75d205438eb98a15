"""LoRA fine-tuning: low-rank adapters on a frozen transformer, with peft as diffusers integrates it.

Only the adapters train; they stay in fp32 while the frozen base may be bf16 (diffusers'
`cast_training_params`). Checkpoints and exports hold the adapters alone, in the format the family's
stock pipeline loads:

- SD3, Sana and Flux: `pytorch_lora_weights.safetensors` (keys `transformer.<module>.lora_A.weight`, the
  LoRA config in the file's metadata), loaded with `pipe.load_lora_weights(DIR)`.
- PixArt-Sigma: diffusers' PixArtSigmaPipeline has no LoRA loader, so the adapter is written in peft's
  own layout (`adapter_config.json`, `adapter_model.safetensors`) and loaded the way PixArt-Sigma's
  LoRA models are: `pipe.transformer = PeftModel.from_pretrained(pipe.transformer, DIR)`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

# Attention projections (query, key, value, output); SD3 adds the text stream's projections of its
# joint attention. Names match by suffix, so SD3.5's second attention (attn2) is included.
ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
DEFAULT_TARGETS = {
    "pixart": ATTENTION,
    "sana": ATTENTION,
    "sd3": ATTENTION + TEXT_STREAM,
    # diffusers' train_dreambooth_lora_flux.py: both streams' attention (q, k, v of the single-stream blocks too, which
    # have no output projection) and the double-stream blocks' feed-forwards, image and text
    "flux": ATTENTION + TEXT_STREAM + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
}
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
PEFT_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def lora_config(family: str, rank: int, alpha: float | None = None, targets: list[str] | None = None, dropout: float = 0.0):
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"LoRA rank {rank}: choose at least 1")
    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=dropout,
                      target_modules=list(targets or DEFAULT_TARGETS[family]), init_lora_weights="gaussian")


def add_lora(model: torch.nn.Module, config, adapter_dtype: torch.dtype = torch.float32, seed: int = 0) -> int:
    """Freeze `model`, add the adapters of `config` in `adapter_dtype` (fp32 to train them; the memory
    planner traces them in the autocast dtype), initialised from `seed`; returns the number of adapted layers."""
    from diffusers.training_utils import cast_training_params
    from peft import inject_adapter_in_model

    model.requires_grad_(False)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # on a torchao-quantized base peft warns that it could not merge into the quantized weights; nothing
            # merges into them (an export merges onto the unquantized base)
            warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass")
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model, adapter_name="default")
    except ValueError as e:  # no module matched the targets
        raise ValueError(f"--lora-targets {','.join(sorted(config.target_modules))}: {e}") from None
    cast_training_params(model, dtype=adapter_dtype)  # adapters train in fp32 whatever the base's dtype
    return sum(1 for name, _ in model.named_modules() if name.endswith("lora_A"))


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by module path (`<module>.lora_A.weight`), detached, on the CPU."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state, adapter_name="default")
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{source}: the adapter does not match this model's LoRA layers "
                         f"(unexpected {sorted(result.unexpected_keys)[:3]}, missing {sorted(missing)[:3]})")


def save_adapter(directory: Path, family: str, state: dict[str, torch.Tensor], config) -> Path:
    """Write the adapter in the family's stock-pipeline format into `directory` (created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if family == "pixart":
        from safetensors.torch import save_file

        config.save_pretrained(directory)
        save_file({PEFT_PREFIX + k: v for k, v in state.items()}, directory / PEFT_FILE, metadata={"format": "pt"})
        return directory / PEFT_FILE
    pipeline = _pipeline_class(family)
    metadata = json.loads(json.dumps(config.to_dict(), default=_jsonable))
    pipeline.save_lora_weights(directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)
    return directory / DIFFUSERS_FILE


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """Adapter weights by module path from either format `save_adapter` writes."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / DIFFUSERS_FILE).exists():
        state = load_file(directory / DIFFUSERS_FILE)
        prefix = "transformer."
    elif (directory / PEFT_FILE).exists():
        state = load_file(directory / PEFT_FILE)
        prefix = PEFT_PREFIX
    else:
        raise FileNotFoundError(f"{directory} holds no LoRA adapter ({DIFFUSERS_FILE} or {PEFT_FILE})")
    return {k.removeprefix(prefix): v for k, v in state.items()}


def merge_adapters(model: torch.nn.Module) -> int:
    """Fold every adapter into its layer's weight (W + scale * B A) and drop the LoRA layers, leaving the
    plain architecture; returns how many layers were merged."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
            merged += 1
    return merged


def _pipeline_class(family: str):
    from diffusers import FluxPipeline, SanaPipeline, StableDiffusion3Pipeline

    return {"sana": SanaPipeline, "sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[family]


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)
