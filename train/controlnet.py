"""ControlNet training: a ControlNet beside the frozen transformer, conditioned on cached control latents.

The ControlNet is diffusers' own class for the family (`Family.controlnet`), so what trains here loads into the
stock ControlNet pipeline; a family without one is refused with the reason (`Family.no_controlnet`).

A new ControlNet starts as a copy of the transformer's first blocks with zero-initialised output projections
(and a zero input projection of the control latent), so at step 0 the controlled transformer predicts exactly
what the transformer alone does (`ControlNet.new`). `controlled_forward` runs ControlNet then transformer as the
family's ControlNet pipeline does, from a batch of the cache's text fields plus `control`, the control latent as
the cache stores it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shards import CacheSpec, LatentSpec
from train.checkpoint import CONTROLNET_DIR  # a checkpoint's and an export's ControlNet, in diffusers layout
from train.ema import load_shadow
from train.families import get_family
from train.families.base import ControlNet, ModelPreset


def hooks(family: str) -> ControlNet:
    """A family's ControlNet (`Family.controlnet`); a family without one is refused with the reason."""
    kind = get_family(family)
    if kind.controlnet is None:
        raise ValueError(kind.no_controlnet)
    return kind.controlnet


def controlnet_class(family: str) -> type:
    """diffusers' ControlNet class of a family; a family without one is refused with the reason."""
    return hooks(family).model_class()


def check_cache(preset: ModelPreset, spec: CacheSpec, location: str) -> None:
    """Refuse before any weights load: a family without a ControlNet, or a cache without control latents."""
    controlnet_class(preset.family)
    if spec.control is None:
        raise ValueError(f"--controlnet trains from control latents, and the cache {location} holds none. Build a cache "
                         f"with them with stage one's --control (each image NAME.png with its control image "
                         f"NAME.control.png beside it): python -m precompute DATA --model {preset.name} --cache CACHE --control")
    missing = [f for f in spec.latent.control_fields if f not in spec.control.get("fields", spec.latent.control_fields)]
    if missing:
        raise ValueError(f"the cache {location} records control fields {spec.control.get('fields')}, not {list(missing)}; "
                         f"rebuild it with this version of stage one's --control")


def max_layers(family: str, transformer_layers: int) -> int:
    """The deepest ControlNet whose every block's residual reaches a transformer block (`ControlNet.max_layers`)."""
    return hooks(family).max_layers(transformer_layers)


def default_layers(family: str, transformer_layers: int) -> int:
    """The family's default depth (`ControlNet.default_layers`), or fewer for a transformer too shallow to take them
    (the tiny presets)."""
    return max(1, min(hooks(family).default_layers, max_layers(family, transformer_layers)))


def build_controlnet(transformer: torch.nn.Module, family: str, *, layers: int | None = None, pretrained: str | None = None,
                     seed: int = 0) -> torch.nn.Module:
    """The ControlNet a run trains, in fp32: new from `transformer` (its first `layers` blocks, default
    `default_layers`), or `pretrained` (a directory or Hub id; its `controlnet/` subfolder if it has one). Either
    way it is checked to fit the transformer (`check_fits`). Under `torch.device("meta")` with a transformer on
    the meta device, a new one is built without values (for counting parameters and tracing)."""
    cls = controlnet_class(family)
    if pretrained is not None:
        if layers is not None:
            raise ValueError("--controlnet-layers sets a new ControlNet's depth; --pretrained-controlnet has its own")
        controlnet = load_pretrained(family, pretrained)
    else:
        depth = transformer.config.num_layers
        layers = layers if layers is not None else default_layers(family, depth)
        if not 1 <= layers <= max_layers(family, depth):
            raise ValueError(f"--controlnet-layers {layers}: this transformer has {depth} blocks and takes the residuals "
                             f"of at most {max_layers(family, depth)} ControlNet blocks")
        with torch.random.fork_rng(devices=[]):  # whatever is not copied from the transformer is seeded
            torch.manual_seed(seed)
            controlnet = hooks(family).new(cls, transformer, layers)
        zero = [n for n, p in controlnet.named_parameters()  # (a planner's ControlNet on the meta device has no values)
                if _is_output_projection(n) and p.device.type != "meta" and p.detach().abs().sum() > 0]
        assert not zero, f"a new ControlNet's output projections start at zero: {zero[:3]}"
    check_fits(controlnet, transformer, family)
    return controlnet  # fp32: built by from_config, or loaded with torch_dtype


def copy_weights(source: torch.nn.Module, target: torch.nn.Module, name: str) -> None:
    """Copy `source`'s weights into `target`, which must have the same structure (names and shapes)."""
    have, want = source.state_dict(), target.state_dict()
    differ = sorted(set(have) ^ set(want)) + [k for k in set(have) & set(want) if have[k].shape != want[k].shape]
    if differ:
        raise ValueError(f"the ControlNet's {name} does not match the transformer's ({', '.join(differ[:4])}): "
                         f"it cannot start as a copy of this transformer")
    target.load_state_dict(have)


def _is_output_projection(name: str) -> bool:
    """The zero-initialised layers: the residual projections per block, and the control latent's input."""
    return name.startswith(("controlnet_blocks.", "input_block.", "pos_embed_input."))


def load_pretrained(family: str, source: str) -> torch.nn.Module:
    """A released or earlier ControlNet: a directory or Hub id, its `controlnet/` subfolder when it has one."""
    cls = controlnet_class(family)
    local = Path(source).expanduser()
    if local.is_dir():
        sub = CONTROLNET_DIR if (local / CONTROLNET_DIR / "config.json").exists() else None
        return cls.from_pretrained(local, subfolder=sub, torch_dtype=torch.float32)
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ValueError(f"--pretrained-controlnet {source}: no such directory (a Hub id has the form owner/name)")
    errors = []
    for sub in (CONTROLNET_DIR, None):
        try:
            return cls.from_pretrained(source, subfolder=sub, torch_dtype=torch.float32)
        except (OSError, ValueError) as e:  # diffusers raises OSError for a missing file or an unreachable Hub
            errors.append(f"{sub or 'top level'}: {type(e).__name__}")
    raise ValueError(f"cannot load a {cls.__name__} from {source} ({'; '.join(errors)}): check the id, log in for a gated "
                     f"repository, or download it (huggingface-cli download {source} --local-dir DIR) and pass "
                     f"--pretrained-controlnet DIR")


def check_fits(controlnet: torch.nn.Module, transformer: torch.nn.Module, family: str) -> None:
    """Refuse a ControlNet whose inputs, widths or depth do not fit the transformer, naming what differs."""
    cn, tr, kind = controlnet.config, transformer.config, hooks(family)
    problems = [f"{k}: ControlNet {cn.get(k)}, transformer {tr.get(k)}" for k in kind.shared_config if cn.get(k) != tr.get(k)]
    problems += kind.problems(cn, tr)
    if cn.num_layers > max_layers(family, tr.num_layers):
        problems.append(f"{cn.num_layers} blocks: the transformer's {tr.num_layers} blocks take the residuals of at most "
                        f"{max_layers(family, tr.num_layers)}")
    if problems:
        raise ValueError(f"this {type(controlnet).__name__} does not fit the transformer:\n  " + "\n  ".join(problems))


def controlled_forward(transformer: torch.nn.Module, controlnet: torch.nn.Module, family: str, *, scale: float = 1.0,
                       latent: LatentSpec | None = None) -> Callable:
    """(noisy latents, timesteps, batch) -> the transformer's prediction with the ControlNet's residuals, as the
    family's stock ControlNet pipeline computes it.

    Args:
        transformer, controlnet: the modules to call (either may be a DDP wrapper).
        scale: the ControlNet's conditioning scale (the pipeline's `controlnet_conditioning_scale`).
        latent: the cache's latent spec (its VAE shift and scaling; needed by ControlNets that take the control
            latent unshifted, see `control_input`).

    The batch holds the cache's text fields as `TextLayout.collate` builds them and `control` (B, C, h, w), the
    control latent as the cache stores it.
    """
    config = getattr(controlnet, "module", controlnet).config  # through a DDP wrapper
    kind = hooks(family)

    def fn(xt, t, batch):
        control = kind.control_input(config, batch["control"].to(xt.dtype), latent)
        return kind.forward(transformer, controlnet, config, xt, t, batch, control, scale)
    return fn


def load_checkpoint(ckpt: Path, family: str, ema_state: dict | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A checkpoint's ControlNet (`ckpt/controlnet`), with the EMA weights of `ema_state` when given."""
    controlnet = controlnet_class(family).from_pretrained(Path(ckpt) / CONTROLNET_DIR, torch_dtype=torch.float32)
    if ema_state is not None:
        load_shadow(controlnet, ema_state, ckpt)
    return controlnet if dtype is None else controlnet.to(dtype)
