"""PixArt-Σ: the SDXL VAE (a KL posterior, 4 channels, f8) and T5-XXL, encoded as PixArtSigmaPipeline encodes."""

from __future__ import annotations

import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from shards import LatentSpec, TextSpec

# Published repository (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/).
ENCODERS = "PixArt-alpha/pixart_sigma_sdxlvae_T5_diffusers"
SDXL_SCALING = 0.13025


class PixArt(Family):
    name = "pixart"

    def presets(self) -> dict[str, Preset]:
        # The SDXL VAE overflows in fp16 (hence fp32 on CUDA by default); so does T5.
        t5 = self.text_encoders()
        vae = VaeSpec("kl", ENCODERS)
        return {
            "pixart-sigma-512": Preset("pixart-sigma-512", self.name, 512, vae, t5["t5-xxl"], "PixArt-alpha/PixArt-Sigma-XL-2-512-MS"),
            "pixart-sigma-1024": Preset("pixart-sigma-1024", self.name, 1024, vae, t5["t5-xxl"], "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"),
            "tiny-pixart": Preset("tiny-pixart", self.name, 256, VaeSpec("kl", None), t5["tiny-t5"], None),
        }

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        return {"t5-xxl": TextEncoderSpec("t5-xxl", self.name, "t5", ENCODERS),
                "tiny-t5": TextEncoderSpec("tiny-t5", self.name, "t5", None, max_length=64)}

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        return parts.load_kl_vae(repo, spec.subfolder, spec.revision) if repo else parts.tiny_kl_vae(4, SDXL_SCALING)

    def latent_spec(self, vae) -> LatentSpec:
        return parts.kl_latent_spec(vae)

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        return parts.encode_kl(vae, x, latent)

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import PixArtSigmaPipeline
        from transformers import T5EncoderModel

        if repo:
            model, tokenizer = parts.load_pretrained_text(T5EncoderModel, repo, spec.subfolder, spec.tokenizer_subfolder,
                                                          spec.revision, dtype)
        else:
            tokenizer = parts.tiny_t5_tokenizer()
            model = parts.tiny_t5(len(tokenizer))
        pipeline = PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=model, vae=None, transformer=None, scheduler=None)
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline)

    def text_spec(self, side: TextSide) -> TextSpec:
        # padded to the batch's longest caption, with a mask
        return TextSpec("masked", parts.text_width(side.pipeline.text_encoder), side.spec.max_length)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        return parts.encode_masked(side.pipeline, captions, device, side.spec.max_length)

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        return parts.over_limit(side.pipeline.tokenizer, captions, side.spec.max_length)


FAMILY = PixArt()
