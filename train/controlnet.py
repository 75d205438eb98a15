"""ControlNet training: a ControlNet beside the frozen transformer, conditioned on cached control latents.

The ControlNet is diffusers' own class for the family, so what trains here loads into the stock pipeline:
`SD3ControlNetModel` (SD3 / SD3.5, `StableDiffusion3ControlNetPipeline`) and `SanaControlNetModel` (Sana,
`SanaControlNetPipeline`). diffusers has no PixArt-Sigma ControlNet, so PixArt-Sigma is refused.

A new ControlNet starts as a copy of the transformer's first blocks with zero-initialised output projections
(and a zero input projection of the control latent), so at step 0 the controlled transformer predicts exactly
what the transformer alone does: SD3 through `SD3ControlNetModel.from_transformer` (as diffusers'
train_controlnet_sd3.py builds it), Sana by copying the patch embedding, timestep and caption embeddings and
the first N blocks (as Sana's ControlNet was built from Sana). `controlled_forward` runs ControlNet then
transformer as the family's ControlNet pipeline does, from a batch of the cache's text fields plus `control`,
the control latent as the cache stores it.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path
from typing import Callable

import torch

from shards import CacheSpec, LatentSpec
from train.checkpoint import CONTROLNET_DIR  # a checkpoint's and an export's ControlNet, in diffusers layout
from train.ema import load_shadow
from train.presets import ModelPreset, sd3_joint_tokens

# New ControlNets' depth: diffusers' train_controlnet_sd3.py (SD3ControlNetModel.from_transformer's default) and
# Sana's ControlNet (7 blocks of Sana's 20, SanaControlNetModel's default)
DEFAULT_LAYERS = {"sd3": 12, "sana": 7}
# Config entries a ControlNet shares with its transformer: the shapes of what passes between them
SHARED_CONFIG = {
    "sd3": ("in_channels", "patch_size", "num_attention_heads", "attention_head_dim", "joint_attention_dim",
            "caption_projection_dim", "pooled_projection_dim"),
    "sana": ("in_channels", "patch_size", "num_attention_heads", "attention_head_dim", "caption_channels",
             "cross_attention_dim", "num_cross_attention_heads", "cross_attention_head_dim", "mlp_ratio"),
}
NO_PIXART = ("PixArt-Sigma has no ControlNet in diffusers (no ControlNet model class or pipeline to load one), so "
             "--controlnet trains SD3 / SD3.5 and Sana only")


def controlnet_class(family: str) -> type:
    """diffusers' ControlNet class of a family; PixArt-Sigma and Flux are refused with the reason."""
    if family == "pixart":
        raise ValueError(NO_PIXART)
    if family == "flux":
        raise ValueError("--controlnet trains SD3 / SD3.5 and Sana ControlNets; Flux ControlNet training (FluxControlNetModel "
                         "beside the packed latents) is not built yet")
    from diffusers import SanaControlNetModel, SD3ControlNetModel

    return {"sd3": SD3ControlNetModel, "sana": SanaControlNetModel}[family]


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
    """The deepest ControlNet whose every block's residual reaches a transformer block.

    Sana adds residual k after block k + 1, so the last block takes none (N <= L - 1). SD3 adds residual
    int(i * N / L) to block i except the last (its text stream ends there), so every residual is taken when
    N <= L / 2."""
    return transformer_layers - 1 if family == "sana" else transformer_layers // 2


def default_layers(family: str, transformer_layers: int) -> int:
    """`DEFAULT_LAYERS`, or fewer for a transformer too shallow to take them (the tiny presets)."""
    return max(1, min(DEFAULT_LAYERS[family], max_layers(family, transformer_layers)))


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
            controlnet = _new_sd3(cls, transformer, layers) if family == "sd3" else _new_sana(cls, transformer, layers)
        zero = [n for n, p in controlnet.named_parameters()  # (a planner's ControlNet on the meta device has no values)
                if _is_output_projection(n) and p.device.type != "meta" and p.detach().abs().sum() > 0]
        assert not zero, f"a new ControlNet's output projections start at zero: {zero[:3]}"
    check_fits(controlnet, transformer, family)
    return controlnet  # fp32: built by from_config, or loaded with torch_dtype


def _new_sd3(cls, transformer: torch.nn.Module, layers: int) -> torch.nn.Module:
    # from_transformer writes num_layers into the config it is given: hand it a copy, not the transformer's.
    # force_zeros_for_pooled_projection False: the stock pipeline then feeds the ControlNet the pooled prompt and
    # the control latent with the VAE's shift, as the cache stores it and training feeds them.
    from diffusers.configuration_utils import FrozenDict

    config = {**transformer.config, "force_zeros_for_pooled_projection": False}
    source = types.SimpleNamespace(config=FrozenDict(config), **{name: getattr(transformer, name) for name in (
        "pos_embed", "time_text_embed", "context_embedder", "transformer_blocks")})
    return cls.from_transformer(source, num_layers=layers, num_extra_conditioning_channels=0)


def _new_sana(cls, transformer: torch.nn.Module, layers: int) -> torch.nn.Module:
    cfg = transformer.config
    unsupported = {k: cfg.get(k) for k, plain in (("guidance_embeds", False), ("qk_norm", None)) if cfg.get(k, plain) != plain}
    if unsupported:  # SanaControlNetModel's blocks and timestep embedding have neither
        raise ValueError(f"SanaControlNetModel cannot mirror this transformer ({unsupported}): its blocks and timestep "
                         f"embedding are Sana 1.0's")
    keys = set(inspect.signature(cls.__init__).parameters) - {"self"}  # the ControlNet's config entries
    controlnet = cls.from_config({**{k: v for k, v in cfg.items() if k in keys}, "num_layers": layers})
    for name in ("patch_embed", "time_embed", "caption_projection", "caption_norm"):
        _copy(getattr(transformer, name), getattr(controlnet, name), name)
    for i in range(layers):
        _copy(transformer.transformer_blocks[i], controlnet.transformer_blocks[i], f"transformer_blocks.{i}")
    return controlnet


def _copy(source: torch.nn.Module, target: torch.nn.Module, name: str) -> None:
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
    cn, tr = controlnet.config, transformer.config
    problems = [f"{k}: ControlNet {cn.get(k)}, transformer {tr.get(k)}" for k in SHARED_CONFIG[family] if cn.get(k) != tr.get(k)]
    if family == "sd3":
        if not cn.get("use_pos_embed", True) or cn.get("joint_attention_dim") is None:
            problems.append("it shares the transformer's patch embedding and reads no text (as SD3.5 Large's released "
                            "ControlNets do); only ControlNets with their own are trained here")
        if cn.get("extra_conditioning_channels", 0):
            problems.append(f"it takes {cn['extra_conditioning_channels']} extra conditioning channel(s) beside the latent "
                            f"(e.g. an inpainting mask); the cache holds the control latent alone")
    if cn.num_layers > max_layers(family, tr.num_layers):
        problems.append(f"{cn.num_layers} blocks: the transformer's {tr.num_layers} blocks take the residuals of at most "
                        f"{max_layers(family, tr.num_layers)}")
    if problems:
        raise ValueError(f"this {type(controlnet).__name__} does not fit the transformer:\n  " + "\n  ".join(problems))


def control_input(controlnet_config, family: str, control: torch.Tensor, latent: LatentSpec | None) -> torch.Tensor:
    """What the ControlNet receives, from the control latent as the cache stores it ((z - shift) * scaling).

    An SD3 ControlNet with `force_zeros_for_pooled_projection` (InstantX's) was trained on z * scaling, which is
    what its pipeline feeds it: the cached latent plus shift * scaling. Every other ControlNet takes it as is."""
    if family == "sd3" and controlnet_config.get("force_zeros_for_pooled_projection", True):
        if latent is None:
            raise ValueError("this ControlNet takes the control latent without the VAE's shift: pass the cache's LatentSpec")
        return control + latent.shift_factor * latent.scaling_factor
    return control


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
    width = getattr(transformer, "module", transformer).config.get("joint_attention_dim")

    def fn(xt, t, batch):
        control = control_input(config, family, batch["control"].to(xt.dtype), latent)
        if family == "sd3":
            text = sd3_joint_tokens(batch, width, xt.dtype)
            pooled = batch["pooled"].to(xt.dtype)
            # a ControlNet with force_zeros_for_pooled_projection gets zeros for the pooled prompt, as in its pipeline
            own_pooled = torch.zeros_like(pooled) if config.get("force_zeros_for_pooled_projection", True) else pooled
            residuals = controlnet(hidden_states=xt, controlnet_cond=control, conditioning_scale=scale, encoder_hidden_states=text,
                                   pooled_projections=own_pooled, timestep=t, return_dict=False)[0]
            return transformer(hidden_states=xt, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                               block_controlnet_hidden_states=residuals, return_dict=False)[0]
        text, mask = batch["text"].to(xt.dtype), batch["text_mask"].to(xt.dtype)
        residuals = controlnet(hidden_states=xt, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t,
                               controlnet_cond=control, conditioning_scale=scale, return_dict=False)[0]
        return transformer(hidden_states=xt, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t,
                           controlnet_block_samples=tuple(residuals), return_dict=False)[0]
    return fn


def load_checkpoint(ckpt: Path, family: str, ema_state: dict | None = None, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A checkpoint's ControlNet (`ckpt/controlnet`), with the EMA weights of `ema_state` when given."""
    controlnet = controlnet_class(family).from_pretrained(Path(ckpt) / CONTROLNET_DIR, torch_dtype=torch.float32)
    if ema_state is not None:
        load_shadow(controlnet, ema_state, ckpt)
    return controlnet if dtype is None else controlnet.to(dtype)
