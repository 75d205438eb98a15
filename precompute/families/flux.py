"""Flux.1: SD3's VAE architecture with its own shift and scaling, and CLIP-L's pooled output + T5 encoded as
FluxPipeline encodes (every T5 token kept, padding included: Flux attends to it without a mask)."""

from __future__ import annotations

from dataclasses import replace

import torch

from precompute.families import parts
from precompute.families.base import DROP_T5_REFUSED, Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from shards import LatentSpec, TextSpec

# Published repositories (diffusers layout: vae/, text_encoder{,_2}/, tokenizer{,_2}/, transformer/).
FLUX_DEV = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL = "black-forest-labs/FLUX.1-schnell"
# The tiny CLIP-L's width, its pooled output's: stage two's tiny Flux transformer takes it as pooled_projection_dim
# (and the tiny T5's, `parts.TINY_T5_WIDTH`, as joint_attention_dim).
TINY_POOLED_WIDTH = 24
PARTS = [("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")]  # CLIP-L, T5


class Flux(Family):
    name = "flux"
    padding = "all tokens kept"
    own_text_encoder = "CLIP-L + T5 (clip-l-t5)"

    def presets(self) -> dict[str, Preset]:
        # The Flux VAE is SD3's architecture and has no fp16 guarantee either (force_upcast): fp32 by default.
        # FLUX.1-schnell was trained with 256 T5 tokens.
        text = self.text_encoders()
        out = {name: Preset(name, self.name, 1024, VaeSpec("flux", repo), replace(text["clip-l-t5"], repo=repo, max_length=tokens), repo)
               for name, repo, tokens in (("flux-dev", FLUX_DEV, 512), ("flux-schnell", FLUX_SCHNELL, 256))}
        out["tiny-flux"] = Preset("tiny-flux", self.name, 256, VaeSpec("flux", None), text["tiny-clip-l-t5"], None)
        return out

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        # FluxPipeline's default T5 length is 512 tokens.
        return {"clip-l-t5": TextEncoderSpec("clip-l-t5", self.name, "flux", FLUX_DEV, max_length=512),
                "tiny-clip-l-t5": TextEncoderSpec("tiny-clip-l-t5", self.name, "flux", None, max_length=32)}

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        return parts.load_kl_vae(repo, spec.subfolder, spec.revision) if repo else parts.tiny_kl_vae(16, 0.3611, 0.1159)

    def latent_spec(self, vae) -> LatentSpec:
        return parts.kl_latent_spec(vae)

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        return parts.encode_kl(vae, x, latent)

    def text_subfolders(self, spec: TextEncoderSpec) -> list[tuple[str, str]]:
        return list(PARTS)

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import FluxPipeline
        from transformers import CLIPTextModel, T5EncoderModel

        (clip_dir, clip_tok_dir), (t5_dir, t5_tok_dir) = PARTS
        if repo:
            clip, clip_tok = parts.load_pretrained_text(CLIPTextModel, repo, clip_dir, clip_tok_dir, spec.revision, dtype)
            t5, t5_tok = parts.load_pretrained_text(T5EncoderModel, repo, t5_dir, t5_tok_dir, spec.revision, dtype)
        else:
            clip_tok, t5_tok = parts.tiny_clip_tokenizer(), parts.tiny_t5_tokenizer()
            clip, t5 = parts.tiny_clip(len(clip_tok), TINY_POOLED_WIDTH, projection=False), parts.tiny_t5(len(t5_tok))
        pipeline = FluxPipeline(transformer=None, scheduler=None, vae=None, text_encoder=clip, tokenizer=clip_tok,
                                text_encoder_2=t5, tokenizer_2=t5_tok)
        return TextSide(spec, {clip_dir: clip, t5_dir: t5}, {clip_tok_dir: clip_tok, t5_tok_dir: t5_tok}, pipeline)

    def text_spec(self, side: TextSide) -> TextSpec:
        # encoder_hidden_states = every T5 token, padding included (Flux has no text mask); pooled = CLIP-L's
        # pooled output, as wide as its hidden size (a CLIPTextModel)
        width, tokens = parts.text_width(side.modules["text_encoder_2"]), side.spec.max_length
        return TextSpec("flux", width, tokens, t5_tokens=tokens, pooled_width=side.modules["text_encoder"].config.hidden_size,
                        t5_width=width)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text", "pooled"]  # `text` (T5 tokens, D) padding included; `pooled` (1, D_pooled)

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        # (B, T5 tokens, D) every token, padding included; (B, D_pooled); the text ids are zeros, rebuilt in training
        t5, pooled, _ = side.pipeline.encode_prompt(captions, None, device=device, max_sequence_length=side.spec.max_length)
        return [{"text": t5[i].float().cpu(), "pooled": pooled[i : i + 1].float().cpu()} for i in range(len(captions))]

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        return parts.over_clip_or_t5_limit(side.tokenizers["tokenizer"], side.tokenizers["tokenizer_2"], captions,
                                           side.spec.max_length)

    def check_text_options(self, preset: Preset) -> None:
        if preset.text.drop_t5:
            raise ValueError(f"{DROP_T5_REFUSED}; Flux's text tokens are T5's alone (CLIP-L gives only the pooled vector)")

    def caption_elements(self, text: TextSpec) -> int:
        return text.t5_tokens * text.t5_width + text.pooled_width  # every T5 token, padding included, and the pooled vector


FAMILY = Flux()
