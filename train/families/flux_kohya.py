"""Flux adapters in kohya's sd-scripts layout (`pytorch_lora_weights_kohya.safetensors`): Black Forest Labs' module
names, `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` / `.lora_up.weight` / `.alpha`, which ComfyUI,
sd-scripts and diffusers' FluxPipeline load."""

from __future__ import annotations

from pathlib import Path

import torch

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


def save(directory: Path, state: dict[str, torch.Tensor], config) -> Path:
    """Write the adapters (`<module>.lora_A.weight` -> tensor, trained with peft LoraConfig `config`) into
    `directory` in kohya's layout; returns the file."""
    from safetensors.torch import save_file

    from train.lora import KOHYA_FILE

    metadata = {"format": "pt", "ss_base_model_version": "flux1", "ss_network_module": "networks.lora_flux",
                "ss_network_dim": str(config.r), "ss_network_alpha": f"{config.lora_alpha:g}"}
    converted = kohya_state(state, config.r, config.lora_alpha)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(converted, directory / KOHYA_FILE, metadata=metadata)
    return directory / KOHYA_FILE


def kohya_state(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
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


def read(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The inverse of `kohya_state`, at any width: adapters in kohya's Flux layout as peft's state by diffusers' module
    path (`<module>.lora_A.weight`, `.lora_B.weight`) and each module's alpha. A fused layer (BFL's q, k, v; a single
    block's linear1) is split as `kohya_state` writes it where its down has a rank per part and up is block-diagonal
    (a part whose factors are all zero was not adapted); kohya's own fused layer (one rank for all its parts) gives each
    part its rows of up beside the whole down, as diffusers' converter reads it. Raises ValueError saying which key
    is not in the layout."""
    from train.lora import kohya_layers

    layers, rank = kohya_layers(tensors, header)
    plain = {(prefix, name): f"{blocks}.{{}}.{path}" for blocks, (prefix, names) in KOHYA_FLUX.items() for path, name in names.items()}
    fused = {(KOHYA_FLUX[blocks][0], group): (blocks, *shape) for blocks, groups in KOHYA_FLUX_FUSED.items()
             for group, shape in groups.items()}
    where = {}
    for layer in layers:
        prefix, _, rest = layer.partition("_blocks_")
        index, _, name = rest.partition("_")
        if not index.isdigit() or ((prefix + "_blocks", name) not in plain and (prefix + "_blocks", name) not in fused):
            raise ValueError(f"lora_unet_{layer} names no layer of a double or single block of kohya's Flux layout")
        where[layer] = (prefix + "_blocks", int(index), name)
    if rank is None:  # without the header's: the rank of the layers kohya keeps unfused, where they agree
        ranks = {layers[k]["down"].shape[0] for k, (p, _, n) in where.items() if (p, n) in plain}
        rank = ranks.pop() if len(ranks) == 1 else None
    state, alphas = {}, {}
    for layer, (prefix, index, name) in where.items():
        down, up, alpha = layers[layer]["down"], layers[layer]["up"], float(layers[layer]["alpha"])
        if (prefix, name) in plain:
            module = plain[prefix, name].format(index)
            state |= {f"{module}.lora_A.weight": down, f"{module}.lora_B.weight": up}
            alphas[module] = alpha
            continue
        blocks, parts, widths = fused[prefix, name]
        if up.shape[0] % sum(widths):
            raise ValueError(f"lora_unet_{layer}: lora_up has {up.shape[0]} rows, not a multiple of the {sum(widths)} "
                             f"attention widths of {', '.join(parts)}")
        width, rows, n = up.shape[0] // sum(widths), down.shape[0], len(parts)
        bounds = [0]
        for w in widths:  # each part's rows of up
            bounds.append(bounds[-1] + w * width)
        split = rows == n * rank if rank is not None else rows % n == 0 and _block_diagonal(up, bounds, rows // n)
        for i, part in enumerate(parts):
            module = f"{blocks}.{index}.{part}"
            if split:
                a, b = down[i * rows // n:(i + 1) * rows // n], up[bounds[i]:bounds[i + 1], i * rows // n:(i + 1) * rows // n]
                if not a.any() and not b.any():  # a part `kohya_state` wrote as zeros: not adapted
                    continue
                state |= {f"{module}.lora_A.weight": a.contiguous(), f"{module}.lora_B.weight": b.contiguous()}
                alphas[module] = alpha / n
            else:
                state |= {f"{module}.lora_A.weight": down, f"{module}.lora_B.weight": up[bounds[i]:bounds[i + 1]].contiguous()}
                alphas[module] = alpha
    return state, alphas


def _block_diagonal(up: torch.Tensor, bounds: list[int], rank: int) -> bool:
    """`up` (out, n rank) is zero outside part i's rows bounds[i]:bounds[i + 1] by its columns i rank:(i + 1) rank."""
    mask = torch.ones_like(up, dtype=torch.bool)
    for i in range(len(bounds) - 1):
        mask[bounds[i]:bounds[i + 1], i * rank:(i + 1) * rank] = False
    return not up[mask].any()
