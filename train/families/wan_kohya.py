"""Wan adapters in musubi-tuner's layout (`pytorch_lora_weights_kohya.safetensors`), which ComfyUI loads and diffusers'
WanPipeline.load_lora_weights converts: the original Wan checkpoint's module names with "." as "_",
`lora_unet_blocks_0_self_attn_q.lora_down.weight` / `.lora_up.weight` / `.alpha`, as musubi-tuner's networks/lora_wan.py
names every Linear of a block."""

from __future__ import annotations

from pathlib import Path

import torch

# A block's layers: diffusers' path -> the original checkpoint's (diffusers' scripts/convert_wan_to_diffusers.py renames
# them the other way; _convert_musubi_wan_lora_to_diffusers reads them back)
BLOCK_LAYERS = {
    "attn1.to_q": "self_attn_q", "attn1.to_k": "self_attn_k", "attn1.to_v": "self_attn_v", "attn1.to_out.0": "self_attn_o",
    "attn2.to_q": "cross_attn_q", "attn2.to_k": "cross_attn_k", "attn2.to_v": "cross_attn_v", "attn2.to_out.0": "cross_attn_o",
    "attn2.add_k_proj": "cross_attn_k_img", "attn2.add_v_proj": "cross_attn_v_img",
    "ffn.net.0.proj": "ffn_0", "ffn.net.2": "ffn_2",
}


def save(directory: Path, state: dict[str, torch.Tensor], config) -> Path:
    """Write the adapters (`<module>.lora_A.weight` -> tensor, trained with peft LoraConfig `config`) into `directory` in
    musubi-tuner's layout; returns the file."""
    from safetensors.torch import save_file

    from train.lora import KOHYA_FILE

    metadata = {"format": "pt", "ss_network_module": "networks.lora_wan", "ss_network_dim": str(config.r),
                "ss_network_alpha": f"{config.lora_alpha:g}"}
    converted = kohya_state(state, config.lora_alpha)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(converted, directory / KOHYA_FILE, metadata=metadata)
    return directory / KOHYA_FILE


def kohya_state(state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """`lora_unet_blocks_<i>_<layer>.lora_down.weight` (A), `.lora_up.weight` (B) and `.alpha`, per adapted layer."""
    out = {}
    for key, value in state.items():
        module, _, kind = key.rpartition(".lora_")
        blocks, _, rest = module.partition(".")
        index, _, path = rest.partition(".")
        if blocks != "blocks" or not index.isdigit() or path not in BLOCK_LAYERS:
            raise ValueError(f"{module}: musubi-tuner's Wan layout names the Linear layers of the transformer's blocks "
                             f"only ({', '.join(BLOCK_LAYERS)}); export in the diffusers format")
        name = f"lora_unet_blocks_{index}_{BLOCK_LAYERS[path]}"
        part = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}.get(kind)
        if part is None:
            raise ValueError(f"{key}: musubi-tuner's layout holds plain LoRA (lora_A, lora_B); export in the diffusers format")
        out[f"{name}.{part}"] = value
        out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


def read(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The inverse of `kohya_state`: adapters in musubi-tuner's Wan layout as peft's state by diffusers' module path
    (`<module>.lora_A.weight`, `.lora_B.weight`) and each module's alpha, whichever of a block's layers it holds.
    Raises ValueError saying which key is not in the layout."""
    from train.lora import kohya_layers

    layers, _ = kohya_layers(tensors, header)
    paths = {name: path for path, name in BLOCK_LAYERS.items()}
    state, alphas = {}, {}
    for layer, parts in layers.items():
        index, _, name = layer.removeprefix("blocks_").partition("_")
        if not layer.startswith("blocks_") or not index.isdigit() or name not in paths:
            raise ValueError(f"lora_unet_{layer} names no layer of a block of musubi-tuner's Wan layout")
        module = f"blocks.{index}.{paths[name]}"
        state |= {f"{module}.lora_A.weight": parts["down"], f"{module}.lora_B.weight": parts["up"]}
        alphas[module] = float(parts["alpha"])
    return state, alphas
