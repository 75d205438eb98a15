"""`--init-lora`: adapters a run starts from, read from any layout a user brings: diffusers' (LoRA, DoRA), peft's (any
type), the LyCORIS layout (any type), the family's own (kohya's, as `--lora-format kohya` writes it; `Family.read_lora`),
or another trainer's that the family's pipeline converts (kohya's sd-scripts layouts and others, through diffusers'
`lora_state_dict`), checked against the model's modules and loaded into the run's adapters at the file's deltas."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from train.lora import DIFFUSERS_FILE, FOLDED, KOHYA_FILE, PEFT_FILE, PEFT_PREFIX, adapted_modules, adapter_kind, alpha_of


@dataclass(frozen=True)
class InitAdapter:
    """Adapters a run starts from (`--init-lora`): their type (one of ADAPTERS), rank, alpha and LoKr shape, and
    their weights as peft's state, scaled so that alpha / rank applies the file's deltas."""

    adapter: str
    rank: int
    alpha: float
    factor: int
    decompose_both: bool
    state: dict

    @property
    def modules(self) -> list[str]:
        """The adapted modules' paths."""
        from train import lycoris

        return sorted(lycoris.modules(self.state))


def read_init(path: Path, preset) -> InitAdapter:
    """The adapters of `--init-lora PATH` for the transformer of `preset`, from any layout: diffusers' (a directory
    or `pytorch_lora_weights.safetensors`; DoRA too), peft's (a directory with `adapter_config.json`; any type), the
    LyCORIS layout (any type), the family's own (kohya's, `Family.read_lora`) or another trainer's that the family's
    pipeline converts (`lora_state_dict`: kohya's sd-scripts layouts and others, LoRA).
    Refuses a file with layers that name no module of the model, naming them."""
    try:
        path = Path(path).expanduser().resolve()
        found = path.exists()
    except (OSError, ValueError) as e:  # a path no file system holds (a NUL in it), a loop of links
        raise ValueError(f"--init-lora {str(path)!r}: {e}") from None
    if not found:
        raise ValueError(f"--init-lora {path}: no such file or directory")
    if path.is_dir() and not (path / "adapter_config.json").exists():
        from train import lycoris

        found = [path / n for n in (DIFFUSERS_FILE, lycoris.LYCORIS_FILE, KOHYA_FILE) if (path / n).exists()]
        found = found or sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            raise ValueError(f"--init-lora {path}: a directory with {len(found)} LoRA files; name the file")
        path = found[0]
    stat = path.stat()
    return _read_init(str(path), stat.st_mtime_ns, stat.st_size, preset.name)


@functools.lru_cache(maxsize=1)  # the options' check reads the file for its rank and modules, the model build again
def _read_init(file: str, mtime: int, size: int, preset_name: str) -> InitAdapter:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from train import lycoris
    from train.families import get_family, get_preset

    path, preset = Path(file), get_preset(preset_name)
    names = module_names(preset)
    if path.is_dir():
        init = _peft_init(path)
    else:
        with safe_open(path, "pt") as f:
            keys, header = list(f.keys()), f.metadata() or {}
        if any(".lora_A." in k or ".lora_B." in k for k in keys):
            init = _diffusers_init(path, load_file(path), header)
        elif any(lycoris.module_of(k.partition(".")[0], names) for k in keys):
            info, state = lycoris.read(path, names)
            init = InitAdapter(info["adapter"], info["r"], info["alpha"], info["factor"], info["decompose_both"], state)
        else:
            init = _other_init(path, load_file(path), header, get_family(preset.family), keys, set(names.values()))
    known = set(names.values())
    unmatched = [m for m in init.modules if m not in known]
    if unmatched:
        raise ValueError(f"--init-lora {path}: {len(unmatched)} of its {len(init.modules)} adapted layers name no module of "
                         f"this {preset.name} transformer (e.g. {', '.join(unmatched[:4])}): it adapts another model")
    return init


def _other_init(path: Path, tensors: dict[str, torch.Tensor], header: dict, family, keys: list[str],
                modules: set[str]) -> InitAdapter:
    """A LoRA file in another layout: the family's own (kohya's, as its export writes them: read as written, so a
    round trip gives back the adapters bit for bit), else what diffusers' converters of the family's pipeline make of
    it (kohya's and other trainers' layouts, alpha folded into the weights); `modules`: the transformer's layers."""
    try:
        own = family.read_lora(tensors, header)
    except ValueError as e:
        own, why = None, f"not {family.title}'s kohya layout: {e}"
    else:
        why = f"{family.title} writes no layout of its own"
    if own is not None:
        return _lora_init(path, *own)
    pipeline = family.pipeline_class()
    try:
        converted = pipeline.lora_state_dict(tensors)
    except Exception as e:  # diffusers' own words on what it could not convert
        raise ValueError(f"--init-lora {path}: neither diffusers', peft's nor the LyCORIS layout; {why}; and "
                         f"{pipeline.__name__}.lora_state_dict does not convert it ({cause(e)}). Its keys: "
                         f"{', '.join(keys[:4])}") from None
    converted = converted[0] if isinstance(converted, tuple) else converted
    # diffusers' converters name some of the transformer's layers without its prefix (kohya's `img_in` becomes
    # `x_embedder.lora_A.weight`), which its own loader then drops: they are the transformer's
    converted = {f"transformer.{k}" if k.partition(".lora_")[0] in modules else k: v for k, v in converted.items()}
    return _diffusers_init(path, converted, {})


def cause(e: BaseException) -> str:
    """An exception as a message can quote it: its type and words, or, raised without words (a bare assert), where
    it was raised and the line that raised it."""
    import traceback

    if str(e):
        return f"{type(e).__name__}: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return f"{type(e).__name__} without a message"
    last = frames[-1]
    return f"{type(e).__name__} without a message at {Path(last.filename).name}:{last.lineno} in {last.name}: {last.line}"


def _lora_init(path: Path, state: dict[str, torch.Tensor], alphas: dict[str, float]) -> InitAdapter:
    """LoRA read from a family's own layout (peft's state by module path, each module's alpha): one rank and one alpha
    for all its layers."""
    ranks = {v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"--init-lora {path}: its layers have ranks {sorted(ranks)}; it takes adapters of one rank")
    values = sorted(set(alphas.values()))
    # a fused layer's alpha is its parts' alpha times their number, in float32: equal to theirs within rounding
    if not values or values[-1] - values[0] > 1e-6 * abs(values[-1]):
        raise ValueError(f"--init-lora {path}: its layers have alphas {values[:4]}; it takes adapters of one rank and alpha")
    return InitAdapter("lora", ranks.pop(), max(values, key=list(alphas.values()).count), -1, False, state)


def module_names(preset) -> dict[str, str]:
    """The transformer's layers an adapter can sit on: {path with underscores: path} (built on the meta device)."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # published configs carry keys the class ignores
    try:
        with torch.device("meta"):
            model = preset.transformer_class.from_config(preset.transformer_config())
    finally:
        diffusers_logging.set_verbosity(level)
    return {name.replace(".", "_"): name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


def _peft_init(directory: Path) -> InitAdapter:
    from peft import PeftConfig
    from safetensors.torch import load_file

    config = PeftConfig.from_pretrained(str(directory))
    if config.peft_type.value not in ("LORA", "LOKR", "LOHA"):
        raise ValueError(f"--init-lora {directory}: a {config.peft_type.value} adapter; it takes LoRA, DoRA, LoKr or LoHa")
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        raise ValueError(f"--init-lora {directory}: its rank or alpha differs between layers (rank_pattern, alpha_pattern); "
                         f"it takes adapters of one rank and alpha")
    if not (directory / PEFT_FILE).exists():
        raise ValueError(f"--init-lora {directory}: {PEFT_FILE} is missing beside adapter_config.json")
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(directory / PEFT_FILE).items()}
    return InitAdapter(adapter_kind(config), config.r, float(alpha_of(config)), getattr(config, "decompose_factor", -1),
                       getattr(config, "decompose_both", False), state)


def _diffusers_init(path: Path, state: dict[str, torch.Tensor], header: dict) -> InitAdapter:
    """LoRA (or DoRA) in diffusers' keys (`transformer.<module>.lora_A.weight`): rank from the shapes, alpha from the
    header diffusers writes (or a fold `save_diffusers` recorded), the rank without one."""
    stray = [k for k in state if not k.startswith("transformer.")]
    if stray:
        raise ValueError(f"--init-lora {path}: it adapts other models than the transformer ({', '.join(stray[:4])}); "
                         f"a run trains the transformer's adapters alone")
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    ranks = {v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"--init-lora {path}: its layers have ranks {sorted(ranks)}; it takes adapters of one rank")
    rank = ranks.pop()
    saved = json.loads(header.get("lora_adapter_metadata") or "{}")
    if saved.get("transformer.rank_pattern") or saved.get("transformer.alpha_pattern"):
        raise ValueError(f"--init-lora {path}: its rank or alpha differs between layers; it takes adapters of one rank and alpha")
    alpha = float(saved.get("transformer.lora_alpha", rank))
    if header.get(FOLDED):  # written with alpha / rank folded into lora_B: as trained
        trained = json.loads(header[FOLDED])
        alpha = float(trained["lora_alpha"])
        state = rescale(state, "lora", rank / alpha)
    dora = any(k.endswith(".lora_magnitude_vector") for k in state)
    return InitAdapter("dora" if dora else "lora", rank, alpha, -1, False, state)


def rescale(state: dict[str, torch.Tensor], kind: str, ratio: float) -> dict[str, torch.Tensor]:
    """`state` with each layer's delta times `ratio`, through the factor its product is linear in (LoRA's B, LoKr's
    w1, LoHa's w1_a); `kind` one of ADAPTERS."""
    if ratio == 1:
        return state
    scaled = {"lora": (".lora_B.weight",), "dora": (".lora_B.weight",), "lokr": (".lokr_w1", ".lokr_w1_a"), "loha": (".hada_w1_a",)}[kind]
    return {k: v * ratio if k.endswith(scaled) else v for k, v in state.items()}


def load_init(model: torch.nn.Module, init: InitAdapter, config, source) -> int:
    """Start the adapters of `model` (peft config `config`) from `init`, at its deltas whatever alpha this run has;
    returns how many adapted layers the file does not hold (they start as new ones)."""
    from peft import set_peft_model_state_dict

    state = rescale(init.state, adapter_kind(config), (init.alpha / init.rank) / (alpha_of(config) / config.r))
    _read_init.cache_clear()  # read for the options' check and this build; not held for the run
    try:
        result = set_peft_model_state_dict(model, state, adapter_name="default")
    except RuntimeError as e:  # torch's "size mismatch for <key>: ..." lines
        mismatched = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
        raise ValueError(f"--init-lora {source}: its weights are shaped unlike this run's adapters "
                         f"({'; '.join(mismatched[:2]) or e}); leave --lokr-factor and --lokr-decompose-both to the file") from None
    if result.unexpected_keys:
        raise ValueError(f"--init-lora {source}: it adapts layers this run does not (e.g. "
                         f"{', '.join(sorted(result.unexpected_keys)[:4])}); adapt them too (--lora-targets) or leave "
                         f"--lora-targets to the file")
    held = set(init.modules)
    return sum(1 for name, _ in adapted_modules(model) if name not in held)
