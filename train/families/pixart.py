"""PixArt-Σ: cross-attention over T5 tokens with a mask, DDPM with epsilon prediction and learned variance
channels, DPM-Solver sampling; diffusers' PixArtSigmaPipeline has no LoRA loader and no ControlNet."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from train.families.base import Family, ModelPreset, TokenRoute, masked_call

TINY = dict(
    sample_size=32, num_layers=2, attention_head_dim=16, num_attention_heads=2, in_channels=4, out_channels=8,
    patch_size=2, cross_attention_dim=32, caption_channels=32, norm_type="ada_norm_single", norm_elementwise_affine=False,
    norm_eps=1e-6, num_embeds_ada_norm=1000, activation_fn="gelu-approximate", attention_bias=True,
    use_additional_conditions=False, interpolation_scale=1,
)
# Parameter counts of the published encoder configs (diffusers 0.42.1 / transformers 5.23.0 modules).
ENCODERS = {"SDXL VAE (AutoencoderKL)": 83_653_863, "T5-v1.1-XXL encoder": 4_762_310_656}


class PixArt(Family):
    name = "pixart"
    title = "PixArt"
    transformer = "PixArtTransformer2DModel"
    pipeline = "PixArtSigmaPipeline"
    no_controlnet = ("PixArt-Sigma has no ControlNet in diffusers (no ControlNet model class or pipeline to load one), so "
                     "--controlnet trains the families that have one")

    def presets(self):
        return {
            "pixart-sigma-512": lambda: ModelPreset(
                "pixart-sigma-512", self.name, "PixArt-alpha/PixArt-Sigma-XL-2-512-MS", "pixart_sigma_xl2_512_transformer.json",
                "ddpm", "epsilon", base_resolution=512, encoder_parameters=ENCODERS),
            "pixart-sigma-1024": lambda: ModelPreset(
                "pixart-sigma-1024", self.name, "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS", "pixart_sigma_xl2_1024_transformer.json",
                "ddpm", "epsilon", encoder_parameters=ENCODERS),
            "tiny-pixart": lambda: ModelPreset("tiny-pixart", self.name, None, TINY, "ddpm", "epsilon", base_resolution=256,
                                               text_tokens=64),
        }

    def tread_route(self, model):
        """The image tokens of every block: their absolute position embedding was added before the first, the caption
        is the cross-attention's keys (another argument), and the timestep's modulation is one per sample."""
        return TokenRoute(self.blocks(model))

    def forward(self, model, config: Mapping, xt, t, batch, guidance):
        return masked_call(model, xt, t, batch, added_cond_kwargs={"resolution": None, "aspect_ratio": None})

    def save_adapter(self, directory: Path, state: dict[str, torch.Tensor], config, lora_format: str, fold: bool) -> Path:
        """peft's own layout (`adapter_config.json`, `adapter_model.safetensors`), loaded the way PixArt-Sigma's LoRA
        models are: `pipe.transformer = PeftModel.from_pretrained(pipe.transformer, DIR)`. Alpha stays in the config,
        which PeftModel reads: nothing is folded."""
        from train import lora

        return lora.save_peft(directory, state, config)

    def lora_usage(self, location: str, weight_name: str | None, component: str = "transformer",
                   subfolder: str | None = None) -> tuple[list[str], list[str]]:
        return ["from peft import PeftModel"], [f'pipe.transformer = PeftModel.from_pretrained(pipe.transformer, "{location}")']


FAMILY = PixArt()
