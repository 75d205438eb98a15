"""Flux.1: SD3's VAE architecture with its own shift and scaling, and CLIP-L's pooled output + T5 encoded as
FluxPipeline encodes (every T5 token kept, padding included: Flux attends to it without a mask).

FLUX.1 Kontext (an instruction-editing FLUX.1-dev) shares the VAE and text encoders; its presets take one reference
image, prepared as FluxKontextPipeline prepares the `image` it is given: resized to the preferred Kontext resolution
nearest its aspect ratio, and encoded to the posterior's mean normalised as the target latent."""

from __future__ import annotations

from dataclasses import replace

import torch

from precompute.families import parts
from precompute.families.base import DROP_T5_REFUSED, Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from shards import LatentSpec, TextSpec

# Published repositories (diffusers layout: vae/, text_encoder{,_2}/, tokenizer{,_2}/, transformer/).
FLUX_DEV = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL = "black-forest-labs/FLUX.1-schnell"
KONTEXT_DEV = "black-forest-labs/FLUX.1-Kontext-dev"
# tiny-flux1-kontext's reference sizes: FluxKontextPipeline's preferred resolutions (about one megapixel each) with
# both sides divided by this, so about 128 x 128 pixels. Every side of the table divides exactly: the same aspect
# ratios, so an image picks the same entry as with the real table, then snapped to multiples of 16 as the pipeline
# snaps (a square image: 128 x 128, 8 x 8 latent tokens after packing).
TINY_REFERENCE_DIVISOR = 8
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
        # FLUX.1 Kontext: FLUX.1-dev's VAE and encoders (its repository holds them too) and one reference image, which
        # its pipeline requires for an edit
        edit = dict(references=1, requires_references=True)
        out["flux1-kontext-dev"] = Preset("flux1-kontext-dev", self.name, 1024, VaeSpec("flux", KONTEXT_DEV),
                                          replace(text["clip-l-t5"], repo=KONTEXT_DEV, max_length=512), KONTEXT_DEV, **edit)
        out["tiny-flux1-kontext"] = replace(out["tiny-flux"], name="tiny-flux1-kontext", **edit)
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
                    instruction: bool = True, references=None) -> list[dict[str, torch.Tensor]]:
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

    # -- FLUX.1 Kontext's reference image -------------------------------------------------------------------------------

    def reference_resolutions(self, preset: Preset) -> list[tuple[int, int]]:
        """The (width, height) sizes FluxKontextPipeline resizes its `image` to, the one nearest its aspect ratio:
        the pipeline's own table, or for a tiny preset that table scaled down by `TINY_REFERENCE_DIVISOR`."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        if preset.vae.repo is None:
            return [(w // TINY_REFERENCE_DIVISOR, h // TINY_REFERENCE_DIVISOR) for w, h in PREFERRED_KONTEXT_RESOLUTIONS]
        return [(w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS]

    def prepare_reference(self, preset: Preset, image, index: int, count: int) -> dict[str, torch.Tensor]:
        """FluxKontextPipeline.__call__'s step 3 on its `image` (with `_auto_resize`, its default): the aspect ratio of
        the image's sides floored to multiples of 16, the preferred resolution nearest it, floored to multiples of 16
        (the VAE's 8 x the 2 x 2 packing), its image processor's resize (Lanczos) and preprocess to [-1, 1]."""
        if not preset.references:
            return super().prepare_reference(preset, image, index, count)
        processor = reference_processor(preset)
        height, width = processor.get_default_height_width(image)
        if not height or not width:
            raise ValueError(f"a reference image of {image.width}x{image.height} pixels: {preset.name} takes sides of at "
                             f"least {preset.granularity} pixels")
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in self.reference_resolutions(preset))
        multiple = preset.granularity
        width, height = width // multiple * multiple, height // multiple * multiple
        image = processor.resize(image, height, width)
        pixels = processor.preprocess(image, height, width)  # (1, 3, height, width) float32 in [-1, 1]
        return {"pixels": pixels[0].contiguous()}

    def encode_references(self, vae, x: torch.Tensor, latent: LatentSpec) -> torch.Tensor:
        """The posterior's mean, shifted and scaled (`_encode_vae_image`), one reference at a time in the memory layout
        the pipeline's image processor leaves its image in (channels last, from an H x W x 3 array): the same
        convolutions as the pipeline's give the same bits, where a batch or another layout differs in the last ones."""
        out = []
        for one in x.split(1):
            out.append(super().encode_references(vae, one.contiguous(memory_format=torch.channels_last), latent))
        return torch.cat(out).contiguous()  # (B, C, h, w)

    def reference_fingerprint(self, preset: Preset) -> dict:
        if not preset.references:
            return {}
        processor = reference_processor(preset)
        return {"resize": "FluxKontextPipeline: the preferred resolution nearest the aspect ratio",
                "resolutions_wh": [list(r) for r in self.reference_resolutions(preset)], "multiple_of": preset.granularity,
                "resample": processor.config.resample}


def reference_processor(preset: Preset):
    """FluxKontextPipeline's image processor: VaeImageProcessor with the VAE's scale factor times the 2 x 2 packing."""
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=preset.granularity)


FAMILY = Flux()
