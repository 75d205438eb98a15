"""Transformer presets: the model stage two trains, by the same names stage one builds caches for.

Real presets start from the published weights (`from_pretrained`, subfolder `transformer`) or, with
`--from-scratch`, build the published architecture (`train/configs/*.json`) with fresh weights.
`tiny-*` presets are the same classes at CPU size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class ModelPreset:
    """What stage two trains.

    Args:
        family: must match the cache's family (recorded by stage one).
        repo: Hub id or local directory of the released model (diffusers layout), loaded by default; None
            for tiny presets (seeded random weights).
        config: the transformer config for from-scratch training (dict, or a file in train/configs).
        objective: "flow" (rectified flow) or "ddpm".
        prediction: "flow" (velocity), "epsilon" or "v_prediction".
        flow_shift: timestep shift at the preset's base resolution (Sana 3.0).
        dynamic_shift: the shift follows the image's sequence length as FluxPipeline's `calculate_shift` defines mu
            (shift = exp(mu)) instead of `flow_shift`.
        base_resolution: pixels of the square bucket the shift refers to.
        released_dtype: the precision the released weights were trained in (fp16, bf16).
        latent_downsample: pixels per latent pixel of the family's VAE (for planning memory per bucket).
        encoder_parameters: parameter counts of the VAE and text encoder(s) stage one uses, by name, from the
            published configs: what a trainer without a cache keeps resident (the memory planner's comparison).
        validation_steps, guidance_scale: how validation samples by default (`--validation-steps`, `--guidance-scale`):
            20 steps at classifier-free guidance 4.5; FLUX.1-dev its distilled guidance 3.5 (FluxPipeline's default),
            FLUX.1-schnell 4 steps (what it was distilled for) and no guidance.
    """

    name: str
    family: Literal["pixart", "sana", "sd3", "flux"]
    repo: str | None
    config: dict | str
    objective: Literal["flow", "ddpm"]
    prediction: str
    flow_shift: float = 1.0
    dynamic_shift: bool = False
    base_resolution: int = 1024
    released_dtype: str | None = None
    latent_downsample: int = 8
    encoder_parameters: dict = field(default_factory=dict)
    text_tokens: int = 300  # the most caption tokens it sees: stage one's limit (SD3: CLIP's 77 + T5's); the planner's default
    revision: str | None = None  # Hub revision of `repo` (None: its default branch)
    validation_steps: int = 20
    guidance_scale: float = 4.5

    @property
    def transformer_class(self):
        from diffusers import FluxTransformer2DModel, PixArtTransformer2DModel, SanaTransformer2DModel, SD3Transformer2DModel

        return {"pixart": PixArtTransformer2DModel, "sana": SanaTransformer2DModel, "sd3": SD3Transformer2DModel,
                "flux": FluxTransformer2DModel}[self.family]

    def transformer_config(self) -> dict:
        cfg = self.config if isinstance(self.config, dict) else json.loads((CONFIGS / self.config).read_text())
        return {k: v for k, v in cfg.items() if not k.startswith("_")}


TINY_PIXART = dict(
    sample_size=32, num_layers=2, attention_head_dim=16, num_attention_heads=2, in_channels=4, out_channels=8,
    patch_size=2, cross_attention_dim=32, caption_channels=32, norm_type="ada_norm_single", norm_elementwise_affine=False,
    norm_eps=1e-6, num_embeds_ada_norm=1000, activation_fn="gelu-approximate", attention_bias=True,
    use_additional_conditions=False, interpolation_scale=1,
)
# SD3.5-medium's features at CPU size: QK RMS-norm and one dual-attention (MMDiT-X) block.
TINY_SD3 = dict(
    sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=24, pos_embed_max_size=48, qk_norm="rms_norm",
    dual_attention_layers=(0,),
)
# Flux.1-dev's features at CPU size: double- and single-stream blocks, 3-axis RoPE (the axes sum to the head width),
# the guidance embedding; the text and pooled widths of tiny-sd3's encoders.
TINY_FLUX = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
TINY_SANA = dict(
    in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_cross_attention_heads=2,
    cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32, mlp_ratio=2.5, patch_size=1, sample_size=32,
)

# Parameter counts of the published encoder configs (diffusers 0.42.1 / transformers 5.23.0 modules).
PIXART_ENCODERS = {"SDXL VAE (AutoencoderKL)": 83_653_863, "T5-v1.1-XXL encoder": 4_762_310_656}
SANA_ENCODERS = {"DC-AE f32c32 (AutoencoderDC)": 312_250_275, "Gemma-2-2B": 2_614_341_888}
SD3_ENCODERS = {"SD3 VAE (AutoencoderKL)": 83_819_683, "CLIP-L": 123_650_304, "CLIP-G": 694_659_840,
                "T5-v1.1-XXL encoder": 4_762_310_656}
# Flux.1: its VAE is SD3's architecture (16 channels, no quant convs; its own weights, shift and scaling); CLIP-L
# without the projection (CLIPTextModel)
FLUX_ENCODERS = {"Flux VAE (AutoencoderKL)": 83_819_683, "CLIP-L": 123_060_480, "T5-v1.1-XXL encoder": 4_762_310_656}

PRESETS: dict[str, Callable[[], ModelPreset]] = {
    "pixart-sigma-512": lambda: ModelPreset("pixart-sigma-512", "pixart", "PixArt-alpha/PixArt-Sigma-XL-2-512-MS",
                                            "pixart_sigma_xl2_512_transformer.json", "ddpm", "epsilon", base_resolution=512,
                                            encoder_parameters=PIXART_ENCODERS),
    "pixart-sigma-1024": lambda: ModelPreset("pixart-sigma-1024", "pixart", "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
                                             "pixart_sigma_xl2_1024_transformer.json", "ddpm", "epsilon",
                                             encoder_parameters=PIXART_ENCODERS),
    "sana-600m": lambda: ModelPreset("sana-600m", "sana", "Efficient-Large-Model/Sana_600M_1024px_diffusers",
                                     "sana_600m_transformer.json", "flow", "flow", flow_shift=3.0, released_dtype="fp16",
                                     latent_downsample=32, encoder_parameters=SANA_ENCODERS),
    "sana-1600m": lambda: ModelPreset("sana-1600m", "sana", "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers",
                                      "sana_1600m_transformer.json", "flow", "flow", flow_shift=3.0, released_dtype="bf16",
                                      latent_downsample=32, encoder_parameters=SANA_ENCODERS),
    # SD3 / SD3.5: joint attention over CLIP-L + CLIP-G + T5 tokens, pooled CLIP projections; trained in bf16
    "sd3-medium": lambda: ModelPreset("sd3-medium", "sd3", "stabilityai/stable-diffusion-3-medium-diffusers",
                                      "sd3_medium_transformer.json", "flow", "flow", flow_shift=3.0, encoder_parameters=SD3_ENCODERS,
                                      released_dtype="fp16", text_tokens=77 + 256),
    "sd35-medium": lambda: ModelPreset("sd35-medium", "sd3", "stabilityai/stable-diffusion-3.5-medium",
                                       "sd35_medium_transformer.json", "flow", "flow", flow_shift=3.0, encoder_parameters=SD3_ENCODERS,
                                       released_dtype="bf16", text_tokens=77 + 256),
    "sd35-large": lambda: ModelPreset("sd35-large", "sd3", "stabilityai/stable-diffusion-3.5-large",
                                      "sd35_large_transformer.json", "flow", "flow", flow_shift=3.0, encoder_parameters=SD3_ENCODERS,
                                      released_dtype="bf16", text_tokens=77 + 256),
    # Flux.1: double- then single-stream blocks over every T5 token (no mask) and the packed 2x2 latent patches;
    # pooled CLIP-L. dev is guidance-distilled (guidance embedding) and shifts by the image's sequence length;
    # schnell is timestep-distilled and samples unshifted (its scheduler: shift 1, no dynamic shifting).
    "flux-dev": lambda: ModelPreset("flux-dev", "flux", "black-forest-labs/FLUX.1-dev", "flux_dev_transformer.json", "flow",
                                    "flow", dynamic_shift=True, encoder_parameters=FLUX_ENCODERS, released_dtype="bf16",
                                    text_tokens=512, validation_steps=28, guidance_scale=3.5),  # FluxPipeline's defaults
    "flux-schnell": lambda: ModelPreset("flux-schnell", "flux", "black-forest-labs/FLUX.1-schnell",
                                        "flux_schnell_transformer.json", "flow", "flow",
                                        encoder_parameters=FLUX_ENCODERS, released_dtype="bf16", text_tokens=256,
                                        validation_steps=4, guidance_scale=0.0),
    "tiny-pixart": lambda: ModelPreset("tiny-pixart", "pixart", None, TINY_PIXART, "ddpm", "epsilon", base_resolution=256,
                                       text_tokens=64),
    "tiny-sana": lambda: ModelPreset("tiny-sana", "sana", None, TINY_SANA, "flow", "flow", flow_shift=3.0, base_resolution=256,
                                     text_tokens=64),
    "tiny-sd3": lambda: ModelPreset("tiny-sd3", "sd3", None, TINY_SD3, "flow", "flow", flow_shift=3.0, base_resolution=256,
                                    text_tokens=77 + 32),
    "tiny-flux": lambda: ModelPreset("tiny-flux", "flux", None, TINY_FLUX, "flow", "flow", dynamic_shift=True, base_resolution=256,
                                     text_tokens=32, guidance_scale=3.5),
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class Weights:
    """Where a run's transformer weights come from, as the start-up log and the checkpoints record it.

    Args:
        kind: "hub" (a Hub repository, resolved to a local snapshot), "local" (a directory) or "fresh"
            (random initialisation from the config, seeded).
        source: the Hub id or the directory; for "fresh", what was initialised.
        revision: the Hub revision asked for (None: the default branch).
        commit: the Hub commit the snapshot holds.
        path: the local directory `from_pretrained` reads (the snapshot, or `source`).
    """

    kind: Literal["hub", "local", "fresh"]
    source: str
    revision: str | None = None
    commit: str | None = None
    path: str | None = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"{self.source} (revision {self.revision or 'main'}, commit {self.commit or 'unknown'})"
        if self.kind == "local":
            return f"local directory {self.source}"
        return self.source

    def to_json(self) -> dict:
        return {"kind": self.kind, "source": self.source, "revision": self.revision, "commit": self.commit}


def resolve_weights(preset: "ModelPreset", pretrained: str | None = None, revision: str | None = None,
                    from_scratch: bool = False, seed: int = 0) -> Weights:
    """The weights a run starts from: `pretrained` (a directory or Hub id), else the preset's released
    weights; fresh seeded ones for tiny presets or with `from_scratch`.

    A Hub id is resolved to a local snapshot first (downloading `transformer/` only, or finding it in the
    Hugging Face cache when offline), so an unreachable Hub fails at once with what to do, never hangs.
    """
    if from_scratch or (pretrained is None and preset.repo is None):
        what = "the published config" if preset.repo else f"the {preset.name} config"
        return Weights("fresh", f"fresh weights from {what} (seed {seed})")
    source = pretrained or preset.repo
    local = Path(source).expanduser()
    if local.is_dir():
        return Weights("local", str(local.resolve()), path=str(local.resolve()))
    if pretrained and (pretrained.startswith((".", "/", "~")) or pretrained.count("/") != 1):
        raise ValueError(f"--pretrained {pretrained}: no such directory (a Hub id has the form owner/name)")
    revision = revision or (preset.revision if source == preset.repo else None)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    local_copy = (f"Download it where the Hub is reachable (huggingface-cli download {source} --include 'transformer/*' "
                  f"--local-dir DIR) and pass --pretrained DIR, or train from random initialisation with --from-scratch.")
    try:
        path = snapshot_download(source, revision=revision, allow_patterns=["transformer/*"])
    except GatedRepoError:
        raise ValueError(f"{source} is gated on the Hub: accept its licence on huggingface.co and log in "
                         f"(huggingface-cli login), or {local_copy[0].lower()}{local_copy[1:]}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"{source} (revision {revision or 'main'}) was not found on the Hub ({type(e).__name__}); check the "
                         f"id, or pass --pretrained DIR for a local copy") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ValueError(f"cannot load the transformer of {source} (revision {revision or 'main'}): the Hub is unreachable or "
                         f"offline and no copy is in the Hugging Face cache ({type(e).__name__}). {local_copy}") from None
    return Weights("hub", source, revision, commit=Path(path).name, path=path)


def build_transformer(preset: ModelPreset, weights: Weights | str | None, seed: int,
                      dtype: torch.dtype = torch.float32, quant: str | None = None) -> torch.nn.Module:
    """The transformer in `dtype`: from `weights` (a `resolve_weights` result, or a directory or Hub id),
    or fresh seeded weights from the preset's config when `weights` is None or fresh. `quant` ("int8", "fp8",
    "nf4"; None: none): its Linear weights quantized as they load (`train.quant`), the rest in bf16."""
    from train import quant as quantization

    cls = preset.transformer_class
    if isinstance(weights, str):
        weights = resolve_weights(preset, weights)
    if weights is not None and weights.kind != "fresh":
        path = Path(weights.path)
        subfolder = "transformer" if (path / "transformer").is_dir() or not (path / "config.json").exists() else None
        if quant:
            return quantization.load(cls, path, subfolder, quant)
        return cls.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls.from_config(preset.transformer_config())
    if quant:
        return quantization.quantize_fresh(model, quant)
    return model if dtype == torch.float32 else model.to(dtype)


def text_width(config) -> int:
    """Width of the text embeddings the transformer consumes."""
    return config["joint_attention_dim"] if "joint_attention_dim" in config else config["caption_channels"]


def latent_channels(family: str, config) -> int:
    """Channels of the cached latent the transformer takes (Flux's in_channels count the 2 x 2 packed patch)."""
    return config["in_channels"] // 4 if family == "flux" else config["in_channels"]


def latent_patch(family: str, config) -> int:
    """Latent pixels per side of one image token: the patch size, or Flux's 2 x 2 packing."""
    return 2 if family == "flux" else config.get("patch_size", 1)


def transformer_blocks(model) -> list[torch.nn.Module]:
    """The transformer's repeated blocks in order: `transformer_blocks`, then Flux's single-stream blocks."""
    return list(model.transformer_blocks) + list(getattr(model, "single_transformer_blocks", []))


def model_forward(model, family: str, guidance: float | None = None):
    """The family's call signature as (noisy latents, timesteps, batch) -> prediction. `guidance`: the value of
    Flux.1-dev's guidance embedding (models without one take none)."""
    config = getattr(model, "module", model).config  # through a DDP wrapper

    def fn(xt, t, batch):
        if family == "sd3":  # joint attention over all tokens, no mask; pooled CLIP projections
            return model(hidden_states=xt, encoder_hidden_states=sd3_joint_tokens(batch, config.joint_attention_dim, xt.dtype),
                         pooled_projections=batch["pooled"].to(xt.dtype), timestep=t, return_dict=False)[0]
        if family == "flux":
            return flux_forward(model, config, xt, t, batch, guidance)
        kwargs = {"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}} if family == "pixart" else {}
        return model(hidden_states=xt, encoder_hidden_states=batch["text"].to(xt.dtype), encoder_attention_mask=batch["text_mask"].to(xt.dtype),
                     timestep=t, return_dict=False, **kwargs)[0]
    return fn


def flux_forward(model, config, xt: torch.Tensor, t: torch.Tensor, batch: dict, guidance: float | None) -> torch.Tensor:
    """Flux.1 as FluxPipeline calls it: the latents packed into 2 x 2 patches (B, h/2 * w/2, 4C) with their position
    ids, every T5 token with zero ids, the pooled CLIP-L vector, the timestep as sigma (t / 1000) and, for guidance-
    distilled models, the guidance (B,); the prediction unpacked to (B, C, h, w)."""
    from diffusers import FluxPipeline

    b, c, h, w = xt.shape
    packed = FluxPipeline._pack_latents(xt, b, c, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, xt.device, xt.dtype)  # (h/2 * w/2, 3)
    text = batch["text"].to(xt.dtype)  # (B, L, D): every token, padding included
    txt_ids = torch.zeros(text.shape[1], 3, device=xt.device, dtype=xt.dtype)
    g = None
    if config.guidance_embeds:
        if guidance is None:
            raise ValueError("this Flux transformer embeds a guidance value (FLUX.1-dev): give one (--guidance-scale-train)")
        g = torch.full((b,), float(guidance), device=xt.device, dtype=torch.float32)
    out = model(hidden_states=packed, encoder_hidden_states=text, pooled_projections=batch["pooled"].to(xt.dtype),
                timestep=t / 1000, img_ids=img_ids, txt_ids=txt_ids, guidance=g, return_dict=False)[0]
    return FluxPipeline._unpack_latents(out, h, w, 1)  # sizes given in latent pixels: a scale factor of 1


def sd3_joint_tokens(batch: dict, width: int, dtype: torch.dtype) -> torch.Tensor:
    """SD3's text input as StableDiffusion3Pipeline.encode_prompt builds it: CLIP-L and CLIP-G tokens
    zero-padded to the joint width, then the T5 tokens (zeros when the cache dropped T5). (B, 77 + L, width)"""
    clip = batch["clip"].to(dtype)
    clip = torch.nn.functional.pad(clip, (0, width - clip.shape[-1]))
    if "text" in batch:
        t5 = batch["text"].to(dtype)
    else:
        t5 = clip.new_zeros(clip.shape[0], batch["t5_zeros"], width)
    return torch.cat([clip, t5], dim=1)
