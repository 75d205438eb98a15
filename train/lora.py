"""Adapter fine-tuning: LoRA, DoRA, LoKr or LoHa adapters on a frozen transformer, with peft's implementations (as
diffusers integrates LoRA; `--adapter`).

Only the adapters train; they stay in fp32 while the frozen base may be bf16 (diffusers'
`cast_training_params`). Checkpoints and exports hold the adapters alone, in the format the family's
stock pipeline loads (`Family.save_adapter`, in one of `Family.lora_formats`):

- "diffusers" by default: `pytorch_lora_weights.safetensors` (keys `transformer.<module>.lora_A.weight`, the
  LoRA config in the file's metadata), loaded with `pipe.load_lora_weights(DIR)`. When alpha differs from the rank,
  the scale alpha / rank is folded into lora_B and the metadata says alpha = rank, so loaders that ignore the
  metadata (ComfyUI on diffusers keys) apply the trained strength too; checkpoints may keep the scale unfolded.
- peft's own layout (`adapter_config.json`, `adapter_model.safetensors`) for a pipeline without a LoRA loader,
  loaded with `pipe.transformer = PeftModel.from_pretrained(pipe.transformer, DIR)`.
- "kohya" where the family writes it: `pytorch_lora_weights_kohya.safetensors` in kohya's sd-scripts layout.
- "lycoris": one file in the layout ComfyUI and LyCORIS load (`train.lycoris`), for every adapter type.

DoRA is peft's LoRA with `use_dora` (a magnitude vector beside A and B) and is written as LoRA is; LoKr and LoHa, which
diffusers' LoRA loader does not take, go to peft's own layout in place of diffusers'.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from train import families

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"
PEFT_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# in a folded file's header: the alpha and rank the adapters trained with, so `read_adapter` can undo the fold
FOLDED = "cachedit_lora_scale_folded"

# `--adapter`: lora and dora are peft's LoRA (dora with use_dora), lokr and loha its LyCORIS types
ADAPTERS = ("lora", "dora", "lokr", "loha")
TITLES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}
# what names an adapter's weights in a module's state (`<module>.lora_A.weight`, `<module>.lokr_w1`, `<module>.hada_w1_a`)
ADAPTER_PARTS = ("lora_", "lokr_", "hada_")


def lora_config(family: str, rank: int, alpha: float | None = None, targets: list[str] | None = None, dropout: float = 0.0,
                adapter: str = "lora", factor: int = -1, decompose_both: bool = False):
    """peft's config of a run's adapters: `adapter` one of ADAPTERS (LoraConfig, with use_dora for "dora"; LoKrConfig;
    LoHaConfig), `targets` (default: the family's, `Family.lora_targets`), alpha default the rank; `factor` and
    `decompose_both` shape LoKr's Kronecker factors (LyCORIS' factor and decompose_both)."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if rank < 1:
        raise ValueError(f"LoRA rank {rank}: choose at least 1")
    if adapter not in ADAPTERS:
        raise ValueError(f"--adapter {adapter!r}: choose one of {', '.join(ADAPTERS)}")
    alpha = alpha if alpha is not None else rank
    targets = list(targets or families.get_family(family).lora_targets)
    if adapter in ("lora", "dora"):
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, init_lora_weights="gaussian",
                          use_dora=adapter == "dora")
    if dropout:
        raise ValueError(f"--lora-dropout {dropout:g} drops the input of LoRA and DoRA adapters; {adapter} has none: drop it")
    if adapter == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, decompose_factor=factor, decompose_both=decompose_both)
    return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)


def adapter_kind(config) -> str:
    """The `--adapter` a peft config trains (one of ADAPTERS)."""
    if config.peft_type.value == "LORA":
        return "dora" if config.use_dora else "lora"
    return config.peft_type.value.lower()


def alpha_of(config) -> float:
    """The adapters' alpha (their output is scaled by alpha / rank), whatever their type."""
    return config.lora_alpha if config.peft_type.value == "LORA" else config.alpha


def kind_title(config) -> str:
    return TITLES[adapter_kind(config)]


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
    return sum(1 for _ in adapted_modules(model))


def adapted_modules(model: torch.nn.Module):
    """(path, layer) of every adapted layer (peft's tuner layers)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return ((name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer))


def layer_names(model: torch.nn.Module, blocks: list[torch.nn.Module], limit: int = 12) -> str:
    """The adapted layers of `model` as `--lora-targets` names them, for a log line: each one's path inside its block
    (one of `blocks`, the family's: `blocks.3.attn1.to_q` -> `attn1.to_q`), a layer outside them by its whole path;
    sorted, the first `limit` of them and how many more. (peft rewrites a config's long list of target paths into the
    shortest suffixes that pick the same layers, such as "2" for `ffn.net.2`: no names to show a user.)"""
    inside = {id(block) for block in blocks}
    prefixes = [name + "." for name, module in model.named_modules() if id(module) in inside]
    names = set()
    for name, _ in adapted_modules(model):
        name = name.removeprefix(next((p for p in prefixes if name.startswith(p)), ""))
        names.add(".".join(part for part in name.split(".") if not part.startswith("_")))  # wrappers' (_orig_mod)
    names = sorted(names)
    return ", ".join(names) if len(names) <= limit else f"{', '.join(names[:limit])} and {len(names) - limit} more"


def state_key(parameter: str) -> str:
    """The `adapter_state` key of a trainable parameter's name (`<module>.lora_A.default.weight` -> `<module>.lora_A.weight`,
    `<module>.lokr_w1.default` -> `<module>.lokr_w1`, DoRA's `<module>.lora_magnitude_vector.default.weight` ->
    `<module>.lora_magnitude_vector`)."""
    key = parameter.replace(".default", "")
    return key.removesuffix(".weight") if key.endswith(".lora_magnitude_vector.weight") else key


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """peft's `disable_adapter()` for adapters injected into `model` (no PeftModel wraps it): inside, every LoRA layer
    computes its base layer alone; after, the adapters are on and trainable again. The weights are untouched."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by module path (`<module>.lora_A.weight`), detached, on the CPU."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state, adapter_name="default")
    missing = [k for k in getattr(result, "missing_keys", []) if any(part in k for part in ADAPTER_PARTS)]
    if result.unexpected_keys or missing:
        raise ValueError(f"{source}: the adapter does not match this model's adapter layers "
                         f"(unexpected {sorted(result.unexpected_keys)[:3]}, missing {sorted(missing)[:3]})")


def save_adapter(directory: Path, family: str, state: dict[str, torch.Tensor], config, lora_format: str = "diffusers",
                 fold: bool = True) -> Path:
    """Write the adapters into `directory` (created) for other tools to load at their trained strength.

    Args:
        directory: where the file goes.
        family: the model family's name (`Family.name`).
        state: adapter weights by module path (`<module>.lora_A.weight`), as `adapter_state` returns them.
        config: the adapters' peft config (`lora_config`: type, rank, alpha, targets).
        lora_format: "diffusers", the family's stock-pipeline layout (peft's for LoKr and LoHa), or another of its
            `Family.lora_formats` ("lycoris" for all).
        fold: in the diffusers layout, with alpha != rank, fold alpha / rank into lora_B and write alpha = rank.
            Checkpoints pass False: their weights then resume bit for bit (`read_adapter` undoes a fold exactly
            only when alpha / rank is a power of two).

    Returns:
        The file written.
    """
    kind = families.get_family(family)
    if lora_format not in kind.lora_formats:
        raise ValueError(f"LoRA format {lora_format!r}: {family} adapters are written as {', '.join(kind.lora_formats)}")
    if lora_format == "lycoris":
        from train import lycoris

        shape = {"factor": config.decompose_factor, "decompose_both": config.decompose_both} if adapter_kind(config) == "lokr" else None
        return lycoris.save(Path(directory), state, adapter_kind(config), config.r, alpha_of(config), kind.lycoris_prefix, shape)
    adapter = adapter_kind(config)
    if lora_format != "diffusers" and adapter != "lora":
        raise ValueError(f"LoRA format {lora_format}: it holds plain LoRA adapters; write {adapter} adapters as diffusers "
                         f"(the pipeline's layout) or lycoris (ComfyUI's and LyCORIS')")
    if adapter in ("lokr", "loha"):  # diffusers' LoRA loader takes LoRA alone: peft's own layout, which PeftModel loads
        return save_peft(Path(directory), state, config)
    written = kind.save_adapter(Path(directory), state, config, lora_format, fold)
    # None: the family's pipeline loads the file its own save_lora_weights writes
    return written if written is not None else save_diffusers(Path(directory), kind.pipeline_class(), state, config, fold)


def save_diffusers(directory: Path, pipeline: type, state: dict[str, torch.Tensor], config, fold: bool) -> Path:
    """The adapters as `pipeline.save_lora_weights` writes them (`pytorch_lora_weights.safetensors`), with alpha / rank
    folded into lora_B when `fold` (see `save_adapter`)."""
    directory.mkdir(parents=True, exist_ok=True)
    metadata = json.loads(json.dumps(config.to_dict(), default=_jsonable))
    scale = config.lora_alpha / config.r
    folding = fold and scale != 1
    if folding:  # delta W = B A alpha / r = (B alpha / r) A at alpha = r, for loaders that read alpha and those that don't
        state = {k: v * scale if ".lora_B." in k else v for k, v in state.items()}
        metadata["lora_alpha"] = config.r
    pipeline.save_lora_weights(directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)
    if folding:  # diffusers' header, plus what was folded
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        path = directory / DIFFUSERS_FILE
        with safe_open(path, "pt") as f:
            header = f.metadata()
        header[FOLDED] = json.dumps({"lora_alpha": config.lora_alpha, "r": config.r})
        save_file(load_file(path), path, metadata=header)
    return directory / DIFFUSERS_FILE


def save_peft(directory: Path, state: dict[str, torch.Tensor], config) -> Path:
    """The adapters in peft's own layout (`adapter_config.json`, `adapter_model.safetensors`), which
    `PeftModel.from_pretrained` loads; alpha stays in the config."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file({PEFT_PREFIX + k: v for k, v in state.items()}, directory / PEFT_FILE, metadata={"format": "pt"})
    return directory / PEFT_FILE


def kohya_layers(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> tuple[dict[str, dict[str, torch.Tensor]], int | None]:
    """kohya's LoRA keys (`lora_unet_<layer>.lora_down.weight`, `.lora_up.weight`, `.alpha`) by layer, the prefix
    removed: ({layer: {"down": A, "up": B, "alpha": alpha}}, the rank the header records (`ss_network_dim`) or None). An
    absent alpha is the layer's rank, as kohya's tools read it. Raises ValueError naming a key of another kind (another
    prefix, DoRA's `dora_scale`, LoKr's or LoHa's weights)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        layer, _, part = key.partition(".")
        part = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}.get(part)
        if not layer.startswith("lora_unet_") or part is None:
            raise ValueError(f"{key} is no lora_unet_<layer>.lora_down.weight, .lora_up.weight or .alpha")
        layers.setdefault(layer.removeprefix("lora_unet_"), {})[part] = value
    for layer, parts in layers.items():
        if "down" not in parts or "up" not in parts:
            missing = "lora_down.weight" if "down" not in parts else "lora_up.weight"
            raise ValueError(f"lora_unet_{layer} has no {missing}")
        if parts["down"].dim() != 2 or parts["up"].dim() != 2 or parts["up"].shape[1] != parts["down"].shape[0]:
            raise ValueError(f"lora_unet_{layer}: lora_down {tuple(parts['down'].shape)} and lora_up {tuple(parts['up'].shape)} "
                             f"are not the factors of one Linear layer's LoRA")
        parts.setdefault("alpha", torch.tensor(float(parts["down"].shape[0])))
    rank = header.get("ss_network_dim", "")
    return layers, int(rank) if rank.isdigit() else None


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


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)
