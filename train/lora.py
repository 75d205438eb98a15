"""LoRA fine-tuning: low-rank adapters on a frozen transformer, with peft as diffusers integrates it.

Only the adapters train; they stay in fp32 while the frozen base may be bf16 (diffusers'
`cast_training_params`). Checkpoints and exports hold the adapters alone, in the format the family's
stock pipeline loads:

- SD3, Sana and Flux: `pytorch_lora_weights.safetensors` (keys `transformer.<module>.lora_A.weight`, the
  LoRA config in the file's metadata), loaded with `pipe.load_lora_weights(DIR)`. When alpha differs from the rank,
  the scale alpha / rank is folded into lora_B and the metadata says alpha = rank, so loaders that ignore the
  metadata (ComfyUI on diffusers keys) apply the trained strength too; checkpoints may keep the scale unfolded.
- Flux, `lora_format="kohya"`: `pytorch_lora_weights_kohya.safetensors` in kohya's sd-scripts layout (Black Forest
  Labs' module names, `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` / `.lora_up.weight` / `.alpha`),
  which ComfyUI, sd-scripts and diffusers' FluxPipeline load.
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
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"
PEFT_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# "diffusers" is the layout the family's stock diffusers pipeline loads (PixArt-Sigma's: peft's, through PeftModel)
FORMATS = {"pixart": ("diffusers",), "sana": ("diffusers",), "sd3": ("diffusers",), "flux": ("diffusers", "kohya")}
# in a folded file's header: the alpha and rank the adapters trained with, so `read_adapter` can undo the fold
FOLDED = "cachedit_lora_scale_folded"

# Flux's modules under the names of Black Forest Labs' checkpoint, as kohya's sd-scripts and ComfyUI name them
# (lora_unet_double_blocks_<i>_<name>, lora_unet_single_blocks_<i>_<name>) and as diffusers'
# _convert_kohya_flux_lora_to_diffusers maps them back. Module path in a diffusers block -> BFL name.
KOHYA_FLUX = {
    "transformer_blocks": ("double_blocks", {
        "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj", "ff.net.0.proj": "img_mlp_0",
        "ff.net.2": "img_mlp_2", "ff_context.net.0.proj": "txt_mlp_0", "ff_context.net.2": "txt_mlp_2",
        "norm1.linear": "img_mod_lin", "norm1_context.linear": "txt_mod_lin"}),
    "single_transformer_blocks": ("single_blocks", {"proj_out": "linear2", "norm.linear": "modulation_lin"}),
}
# BFL fuses these into one Linear whose output stacks theirs: (parts, their widths in units of the attention width)
KOHYA_FLUX_FUSED = {
    "transformer_blocks": {"img_attn_qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), (1, 1, 1)),
                           "txt_attn_qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), (1, 1, 1))},
    # linear1 also holds the MLP's input projection, 4x wide in every Flux transformer (diffusers' mlp_ratio)
    "single_transformer_blocks": {"linear1": (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (1, 1, 1, 4))},
}


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
    except ValueError as e:
        if "not found in the base model" not in str(e):  # peft's words when no module matched the targets
            raise
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


def save_adapter(directory: Path, family: str, state: dict[str, torch.Tensor], config, lora_format: str = "diffusers",
                 fold: bool = True) -> Path:
    """Write the adapters into `directory` (created) for other tools to load at their trained strength.

    Args:
        directory: where the file goes.
        family: the model family ("pixart", "sana", "sd3", "flux").
        state: adapter weights by module path (`<module>.lora_A.weight`), as `adapter_state` returns them.
        config: the adapters' peft LoraConfig (rank, alpha, targets).
        lora_format: "diffusers", the family's stock-pipeline layout; "kohya" (Flux), kohya's sd-scripts layout.
        fold: in the diffusers layout, with alpha != rank, fold alpha / rank into lora_B and write alpha = rank.
            Checkpoints pass False: their weights then resume bit for bit (`read_adapter` undoes a fold exactly
            only when alpha / rank is a power of two).

    Returns:
        The file written.
    """
    if lora_format not in FORMATS[family]:
        raise ValueError(f"LoRA format {lora_format!r}: {family} adapters are written as {', '.join(FORMATS[family])}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if lora_format == "kohya":
        from safetensors.torch import save_file

        metadata = {"format": "pt", "ss_base_model_version": "flux1", "ss_network_module": "networks.lora_flux",
                    "ss_network_dim": str(config.r), "ss_network_alpha": f"{config.lora_alpha:g}"}
        save_file(kohya_flux_state(state, config.r, config.lora_alpha), directory / KOHYA_FILE, metadata=metadata)
        return directory / KOHYA_FILE
    if family == "pixart":  # alpha stays in adapter_config.json, which PeftModel reads
        from safetensors.torch import save_file

        config.save_pretrained(directory)
        save_file({PEFT_PREFIX + k: v for k, v in state.items()}, directory / PEFT_FILE, metadata={"format": "pt"})
        return directory / PEFT_FILE
    metadata = json.loads(json.dumps(config.to_dict(), default=_jsonable))
    scale = config.lora_alpha / config.r
    folding = fold and scale != 1
    if folding:  # delta W = B A alpha / r = (B alpha / r) A at alpha = r, for loaders that read alpha and those that don't
        state = {k: v * scale if ".lora_B." in k else v for k, v in state.items()}
        metadata["lora_alpha"] = config.r
    _pipeline_class(family).save_lora_weights(directory, transformer_lora_layers=state,
                                              transformer_lora_adapter_metadata=metadata)
    if folding:  # diffusers' header, plus what was folded
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        path = directory / DIFFUSERS_FILE
        with safe_open(path, "pt") as f:
            header = f.metadata()
        header[FOLDED] = json.dumps({"lora_alpha": config.lora_alpha, "r": config.r})
        save_file(load_file(path), path, metadata=header)
    return directory / DIFFUSERS_FILE


def kohya_flux_state(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """Flux adapters in kohya's layout: `lora_unet_<BFL module>.lora_down.weight` (A), `.lora_up.weight` (B) and
    `.alpha`. Where BFL fuses modules (q, k, v; a single block's q, k, v and MLP input), down stacks the parts' A
    (n r rows, zeros for a part not adapted), up is block-diagonal in their B, and alpha is n alpha, so that
    up down alpha_n / (n r) is every part's B A alpha / r and diffusers' converter splits them back exactly."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        module, _, kind = key.rpartition(".lora_")
        modules.setdefault(module, {})[kind.removesuffix(".weight")] = value
    out, fused = {}, {}
    for module, weights in modules.items():
        blocks, _, rest = module.partition(".")
        index, _, path = rest.partition(".")
        if blocks not in KOHYA_FLUX or not index.isdigit():
            raise ValueError(f"{module}: kohya's Flux layout names the transformer blocks' layers only; "
                             f"export in the diffusers format")
        prefix, names = KOHYA_FLUX[blocks]
        name = f"lora_unet_{prefix}_{index}_"
        if path in names:
            out |= {name + names[path] + ".lora_down.weight": weights["A"], name + names[path] + ".lora_up.weight": weights["B"],
                    name + names[path] + ".alpha": torch.tensor(float(alpha))}
            continue
        group = next((g for g, (parts, _) in KOHYA_FLUX_FUSED[blocks].items() if path in parts), None)
        if group is None:
            raise ValueError(f"{module}: no layer of kohya's Flux layout holds it; export in the diffusers format")
        fused.setdefault((name + group, blocks, group), {})[path] = weights
    for (name, blocks, group), found in fused.items():
        parts, widths = KOHYA_FLUX_FUSED[blocks][group]
        part, weights = next(iter(found.items()))
        width = weights["B"].shape[0] // widths[parts.index(part)]  # the attention width
        down = torch.zeros(len(parts) * rank, weights["A"].shape[1], dtype=weights["A"].dtype)  # (n r, in)
        up = torch.zeros(sum(widths) * width, len(parts) * rank, dtype=weights["B"].dtype)  # (out, n r)
        row = 0
        for i, (part, w) in enumerate(zip(parts, widths)):
            if part in found:
                down[i * rank:(i + 1) * rank] = found[part]["A"]
                up[row:row + w * width, i * rank:(i + 1) * rank] = found[part]["B"]
            row += w * width
        out |= {name + ".lora_down.weight": down, name + ".lora_up.weight": up,
                name + ".alpha": torch.tensor(float(alpha) * len(parts))}
    return out


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """Adapter weights by module path from the diffusers or peft layout `save_adapter` writes, as they trained:
    a scale folded into lora_B is divided out."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    directory = Path(directory)
    if (directory / DIFFUSERS_FILE).exists():
        state = load_file(directory / DIFFUSERS_FILE)
        with safe_open(directory / DIFFUSERS_FILE, "pt") as f:
            folded = (f.metadata() or {}).get(FOLDED)
        if folded:
            trained = json.loads(folded)
            scale = trained["lora_alpha"] / trained["r"]
            state = {k: v / scale if ".lora_B." in k else v for k, v in state.items()}
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
