"""Stable Diffusion 3 / 3.5: a 16-channel KL VAE with a shift factor, and CLIP-L + CLIP-G + T5 encoded as
StableDiffusion3Pipeline encodes (T5 may be left out, as the pipeline does with `text_encoder_3=None`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from shards import LatentSpec, TextSpec

# Published repositories (diffusers layout: vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/, transformer/).
SD3_MEDIUM = "stabilityai/stable-diffusion-3-medium-diffusers"
SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"
SD35_LARGE = "stabilityai/stable-diffusion-3.5-large"
# (tiny CLIP width or 0 for T5, model subfolder, tokenizer subfolder), in pipeline order. CLIP-L is the narrower of
# the two (768 and 1280 in the published models).
PARTS = [(8, "text_encoder", "tokenizer"), (16, "text_encoder_2", "tokenizer_2"), (0, "text_encoder_3", "tokenizer_3")]


class SD3(Family):
    name = "sd3"
    # SD3 attends to every token without a mask: only CLIP's zero padding to the joint width is trimmed
    padding = "clip width trimmed; all tokens kept"
    own_text_encoder = "CLIP-L + CLIP-G + T5 (clip-l-g-t5)"

    def presets(self) -> dict[str, Preset]:
        # The SD3 VAE has no fp16 guarantee (its config asks for upcasting): fp32 by default.
        # The transformer's learned positions cover pos_embed_max_size tokens a side (2x2 patches of an 8x VAE: 16 px
        # each), and a table's widest bucket (4:1) is twice its resolution wide: the largest resolution whose every
        # bucket fits (192 positions: 1536; SD3.5 Medium's 384: 2048, the largest table; the tiny model's 48: 384).
        text = self.text_encoders()
        out = {name: Preset(name, self.name, 1024, VaeSpec("sd3", repo), replace(text["clip-l-g-t5"], repo=repo), repo,
                            max_resolution=largest)
               for name, repo, largest in (("sd3-medium", SD3_MEDIUM, 1536), ("sd35-medium", SD35_MEDIUM, 2048),
                                           ("sd35-large", SD35_LARGE, 1536))}
        out["tiny-sd3"] = Preset("tiny-sd3", self.name, 256, VaeSpec("sd3", None), text["tiny-clip-l-g-t5"], None,
                                 max_resolution=384)
        return out

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        # StableDiffusion3Pipeline's default T5 length is 256 tokens (SD3.5 was also trained with 256).
        return {"clip-l-g-t5": TextEncoderSpec("clip-l-g-t5", self.name, "sd3", SD35_LARGE, max_length=256),
                "tiny-clip-l-g-t5": TextEncoderSpec("tiny-clip-l-g-t5", self.name, "sd3", None, max_length=32)}

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        return parts.load_kl_vae(repo, spec.subfolder, spec.revision) if repo else parts.tiny_kl_vae(16, 1.5305, 0.0609)

    def latent_spec(self, vae) -> LatentSpec:
        return parts.kl_latent_spec(vae)

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        return parts.encode_kl(vae, x, latent)

    def text_subfolders(self, spec: TextEncoderSpec) -> list[tuple[str, str]]:
        return [(model, tokenizer) for _, model, tokenizer in (PARTS[:2] if spec.drop_t5 else PARTS)]

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        modules, tokenizers = {}, {}
        for width, subfolder, tokenizer_subfolder in PARTS[:2] if spec.drop_t5 else PARTS:
            if repo:
                model, tokenizer = parts.load_pretrained_text(CLIPTextModelWithProjection if width else T5EncoderModel, repo,
                                                              subfolder, tokenizer_subfolder, spec.revision, dtype)
            elif width:
                tokenizer = parts.tiny_clip_tokenizer()
                model = parts.tiny_clip(len(tokenizer), width, projection=True)
            else:
                tokenizer = parts.tiny_t5_tokenizer()
                model = parts.tiny_t5(len(tokenizer))
            modules[subfolder], tokenizers[tokenizer_subfolder] = model, tokenizer
        pipeline = StableDiffusion3Pipeline(
            transformer=None, scheduler=None, vae=None,
            text_encoder=modules["text_encoder"], tokenizer=tokenizers["tokenizer"],
            text_encoder_2=modules["text_encoder_2"], tokenizer_2=tokenizers["tokenizer_2"],
            text_encoder_3=modules.get("text_encoder_3"), tokenizer_3=tokenizers.get("tokenizer_3"),
        )
        return TextSide(spec, modules, tokenizers, pipeline)

    def text_spec(self, side: TextSide) -> TextSpec:
        # encoder_hidden_states = cat(pad(clip, to the joint width), T5 tokens, dim=tokens); a dropped T5 is as many
        # zero tokens, as StableDiffusion3Pipeline with text_encoder_3=None uses
        spec, clips = side.spec, [side.modules[k].config for k in ("text_encoder", "text_encoder_2")]
        width = None if spec.drop_t5 else parts.text_width(side.modules["text_encoder_3"])
        return TextSpec("sd3_joint", width, spec.max_length, clip_tokens=parts.CLIP_TOKENS, t5_tokens=spec.max_length,
                        t5_stored=not spec.drop_t5, clip_width=sum(c.hidden_size for c in clips),
                        pooled_width=sum(c.projection_dim for c in clips), t5_width=width)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        # `clip` (77, D_clip): CLIP-L and CLIP-G side by side without the zero padding to the joint width;
        # `pooled` (1, D_pooled); `text` (T5 tokens, D) unless T5 is dropped
        return ["clip", "pooled"] + ([] if spec.drop_t5 else ["text"])

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        pipeline, spec = side.pipeline, side.spec
        if spec.drop_t5:
            # encode_prompt needs the transformer's joint width for the zero T5 tokens; the CLIP half is
            # the pipeline's own per-encoder call, concatenated as encode_prompt does.
            (clip_l, pooled_l), (clip_g, pooled_g) = (
                pipeline._get_clip_prompt_embeds(captions, device=device, clip_model_index=i) for i in (0, 1)
            )
            clip, pooled, t5 = torch.cat([clip_l, clip_g], dim=-1), torch.cat([pooled_l, pooled_g], dim=-1), None
        else:
            joint, _, pooled, _ = pipeline.encode_prompt(captions, None, None, device=device, do_classifier_free_guidance=False,
                                                         max_sequence_length=spec.max_length)
            clip_width = self.text_spec(side).clip_width
            clip, t5 = joint[:, :parts.CLIP_TOKENS, :clip_width], joint[:, parts.CLIP_TOKENS:]
        out = []
        for i in range(len(captions)):
            fields = {"clip": clip[i].float().cpu(), "pooled": pooled[i : i + 1].float().cpu()}
            if t5 is not None:
                fields["text"] = t5[i].float().cpu()
            out.append(fields)
        return out

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        return parts.over_clip_or_t5_limit(side.tokenizers["tokenizer"], side.tokenizers.get("tokenizer_3"), captions,
                                           side.spec.max_length)

    def check_text_options(self, preset: Preset) -> None:
        pass  # T5 may be dropped

    def caption_elements(self, text: TextSpec) -> int:
        # every token is kept: CLIP's 77 and T5's whole length
        return text.clip_tokens * text.clip_width + text.pooled_width + (text.t5_tokens * text.t5_width if text.t5_stored else 0)


FAMILY = SD3()
