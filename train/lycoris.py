"""Adapters in the LyCORIS layout (`adapter_lycoris.safetensors`), which ComfyUI, LyCORIS and kohya's tools load: one
file, each adapted layer named `<prefix>_<module path, dots as underscores>` (`Family.lycoris_prefix`, LyCORIS' wrapper
names a diffusers transformer's layers `lycoris_...`) with its weights under LyCORIS' names:

- LoRA: `.lora_down.weight` (peft's A), `.lora_up.weight` (B), `.alpha`; delta W = up down alpha / rank.
- DoRA: LoRA's, plus `.dora_scale`, the magnitude per output row, shaped (out, 1) (LyCORIS' `wd_on_out`).
- LoHa: `.hada_w1_a`, `.hada_w1_b`, `.hada_w2_a`, `.hada_w2_b`, `.alpha`; delta W = (w1_a w1_b) * (w2_a w2_b) alpha / rank.
- LoKr: `.lokr_w1` or its factors `.lokr_w1_a`, `.lokr_w1_b`; `.lokr_w2` or `.lokr_w2_a`, `.lokr_w2_b`; `.alpha`;
  delta W = kron(w1, w2) alpha / rank. LyCORIS and ComfyUI apply alpha / rank only where a factor is decomposed (the
  rank is its inner size) and 1 where both are whole matrices; peft always applies alpha / rank, so there the scale is
  folded into lokr_w1 and alpha written as the rank.

Files follow kohya's header (`ss_network_module` lycoris.kohya, `ss_network_dim`, `ss_network_alpha`,
`ss_network_args` with LyCORIS' algo). `read` takes such a file back to peft's state, for `--init-lora`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

LYCORIS_FILE = "adapter_lycoris.safetensors"
# in the header: the run's adapter type, rank, alpha and LoKr shape, so `read` rebuilds the adapters exactly
ADAPTER = "cachedit_adapter"
# a peft state key: <module>.<part>
PART = re.compile(r"^(.*)\.(lora_A\.weight|lora_B\.weight|lora_magnitude_vector|lokr_w[12](?:_[ab])?|lokr_t2|hada_w[12]_[ab]|hada_t[12])$")
# LyCORIS layer names other trainers write for a diffusers transformer, which ComfyUI maps too
PREFIXES = ("lycoris_", "lora_transformer_", "lora_unet_", "transformer_")


def modules(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft's state (`<module>.lora_A.weight`, `<module>.lokr_w1`, ...) grouped by module: {module: {part: tensor}}."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = PART.match(key)
        if match is None:
            raise ValueError(f"{key}: not a LoRA, DoRA, LoKr or LoHa weight")
        grouped.setdefault(match[1], {})[match[2]] = value
    return grouped


def save(directory: Path, state: dict[str, torch.Tensor], kind: str, rank: int, alpha: float, prefix: str,
         shape: dict | None = None) -> Path:
    """Write adapters (peft's state) of type `kind` (`--adapter`), `rank` and `alpha` into `directory` in the LyCORIS
    layout, layers named `<prefix>_...`; `shape`: LoKr's {factor, decompose_both}. Returns the file."""
    from safetensors.torch import save_file

    args = {"algo": "lora" if kind in ("lora", "dora") else kind, **({"dora_wd": True} if kind == "dora" else {})}
    shape = shape or {}
    metadata = {"format": "pt", "ss_network_module": "lycoris.kohya", "ss_network_dim": str(rank),
                "ss_network_alpha": f"{alpha:g}", "ss_network_args": json.dumps({**args, **shape}),
                ADAPTER: json.dumps({"adapter": kind, "r": rank, "alpha": alpha, **shape})}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(lycoris_state(state, kind, rank, alpha, prefix), directory / LYCORIS_FILE, metadata=metadata)
    return directory / LYCORIS_FILE


def lycoris_state(state: dict[str, torch.Tensor], kind: str, rank: int, alpha: float, prefix: str) -> dict[str, torch.Tensor]:
    """peft's state in LyCORIS' names, each layer's delta as LyCORIS and ComfyUI compute it equal to peft's."""
    out = {}
    for module, parts in modules(state).items():
        name = f"{prefix}_{module.replace('.', '_')}"
        written_alpha = alpha
        if kind in ("lora", "dora"):
            down = parts["lora_A.weight"]
            out |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": parts["lora_B.weight"]}
            if "lora_magnitude_vector" in parts:  # (out,) -> (out, 1[, 1, 1]): normalised per output row
                out[f"{name}.dora_scale"] = parts["lora_magnitude_vector"].reshape(-1, *[1] * (down.dim() - 1))
        elif kind == "loha":
            if "hada_t1" in parts:
                raise ValueError(f"{module}: LoHa with Tucker factors (a convolution) is not written in the LyCORIS layout")
            out |= {f"{name}.{part}": value for part, value in parts.items()}
        else:
            if "lokr_t2" in parts:
                raise ValueError(f"{module}: LoKr with a Tucker factor (a convolution) is not written in the LyCORIS layout")
            out |= {f"{name}.{part}": value for part, value in parts.items()}
            if "lokr_w1" in parts and "lokr_w2" in parts:  # both whole: the loaders' scale is 1, peft's alpha / rank
                out[f"{name}.lokr_w1"] = parts["lokr_w1"] * (alpha / rank)
                written_alpha = rank
        out[f"{name}.alpha"] = torch.tensor(float(written_alpha))
    return out


def applied_scale(kind: str, parts: dict[str, torch.Tensor], alpha: float | None) -> tuple[float, int | None]:
    """(the scale LyCORIS and ComfyUI apply to a layer's product, the rank its shapes show (None: not shown)) for a
    layer's weights in LyCORIS' names (`lora_down.weight`, `lokr_w1`, ...)."""
    if kind == "lora":
        rank = parts["lora_down.weight"].shape[0]
    elif kind == "loha":
        rank = parts["hada_w1_b"].shape[0]
    else:  # the inner size of a decomposed factor, the one of w2 before w1's (ComfyUI's order)
        rank = (parts["lokr_w2_b"].shape[0] if "lokr_w2_b" in parts else parts["lokr_w1_b"].shape[0] if "lokr_w1_b" in parts
                else None)
    return (1.0 if alpha is None or rank is None else alpha / rank), rank


def read(path: Path, names: dict[str, str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A LyCORIS-layout file back as peft's state: ({adapter, r, alpha, factor, decompose_both}, state), the state
    scaled so that peft's alpha / r applies the file's deltas. `names`: module path with underscores -> module path,
    of the model's layers. Refuses, naming them, layers no module of the model has."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        header = f.metadata() or {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        layer, _, part = key.partition(".")
        layers.setdefault(layer, {})[part] = value
    unmatched = [layer for layer in layers if module_of(layer, names) is None]
    if unmatched:
        raise ValueError(f"{path}: {len(unmatched)} of its {len(layers)} layers name no module of this model "
                         f"(e.g. {', '.join(sorted(unmatched)[:4])}): it was trained for another model or names its layers "
                         f"another way")
    kinds = {kind_of(parts, layer, path) for layer, parts in layers.items()}
    if len(kinds) != 1:
        raise ValueError(f"{path} mixes adapter types ({', '.join(sorted(kinds))}); --init-lora takes one type")
    kind = kinds.pop()
    saved = json.loads(header[ADAPTER]) if ADAPTER in header else {}
    scales = {layer: applied_scale(kind, parts, parts["alpha"].item() if "alpha" in parts else None) for layer, parts in layers.items()}
    ranks = {rank for _, rank in scales.values() if rank is not None}
    if saved:
        rank = saved["r"]
    elif header.get("ss_network_dim"):
        rank = int(header["ss_network_dim"])
    elif len(ranks) == 1:
        rank = ranks.pop()
    else:
        raise ValueError(f"{path}: its layers have ranks {sorted(ranks) or 'its shapes do not show'}; --init-lora takes "
                         f"adapters of one rank, which the file's header (ss_network_dim) or shapes must give")
    alpha = float(saved.get("alpha", header.get("ss_network_alpha") or rank))
    dora = any("dora_scale" in parts for parts in layers.values())
    state = {}
    for layer, parts in layers.items():
        module, scale = module_of(layer, names), scales[layer][0]
        ratio = scale / (alpha / rank)  # the file's scale in the factor peft scales by alpha / r
        state |= peft_parts(module, kind, parts, ratio, path)
    info = {"adapter": "dora" if dora else kind, "r": rank, "alpha": alpha,
            "factor": saved.get("factor", json.loads(header.get("ss_network_args") or "{}").get("factor", -1)),
            "decompose_both": saved.get("decompose_both", False)}
    return info, state


def module_of(layer: str, names: dict[str, str]) -> str | None:
    for prefix in PREFIXES:
        if layer.startswith(prefix) and layer[len(prefix):] in names:
            return names[layer[len(prefix):]]
    return None


def kind_of(parts: dict[str, torch.Tensor], layer: str, path: Path) -> str:
    if "lora_down.weight" in parts:
        return "lora"
    if any(p.startswith("hada_") for p in parts):
        return "loha"
    if any(p.startswith("lokr_") for p in parts):
        return "lokr"
    raise ValueError(f"{path}: {layer} holds {', '.join(sorted(parts))}: not LoRA, DoRA, LoKr or LoHa weights")


def peft_parts(module: str, kind: str, parts: dict[str, torch.Tensor], ratio: float, path: Path) -> dict[str, torch.Tensor]:
    """One layer's weights in peft's names, the factor peft scales multiplied by `ratio`."""
    scaled = lambda t: t if ratio == 1 else t * ratio  # noqa: E731
    if kind == "lora":
        out = {f"{module}.lora_A.weight": parts["lora_down.weight"], f"{module}.lora_B.weight": scaled(parts["lora_up.weight"])}
        if "dora_scale" in parts:
            scale = parts["dora_scale"]
            if scale.shape[0] != parts["lora_up.weight"].shape[0] or scale.numel() != scale.shape[0]:
                raise ValueError(f"{path}: {module}'s dora_scale {tuple(scale.shape)} is not one magnitude per output row "
                                 f"(LyCORIS' wd_on_out), the DoRA peft trains")
            out[f"{module}.lora_magnitude_vector"] = scale.reshape(-1)
        return out
    if "hada_t1" in parts or "lokr_t2" in parts:
        raise ValueError(f"{path}: {module} has Tucker factors (a convolution's), which --init-lora does not take")
    first = "hada_w1_a" if kind == "loha" else "lokr_w1" if "lokr_w1" in parts else "lokr_w1_a"
    return {f"{module}.{part}": scaled(value) if part == first else value for part, value in parts.items() if part != "alpha"}
