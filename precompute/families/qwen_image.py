"""Qwen-Image: its video VAE (AutoencoderKLQwenImage: a KL posterior, 16 channels, f8, images as one frame, normalised
per channel) and Qwen2.5-VL-7B's last hidden states, encoded as QwenImagePipeline encodes: its prompt template around
the caption, the template's first tokens dropped, the valid tokens kept (its transformer masks the padding)."""

from __future__ import annotations

import torch

from precompute.families import parts
from precompute.families.base import Family, Preset, TextEncoderSpec, TextSide, VaeSpec
from precompute.families.qwen_tokenizer import tiny_qwen_tokenizer
from shards import LatentSpec, TextSpec

# Published repository (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/, scheduler/).
QWEN_IMAGE = "Qwen/Qwen-Image"
# QwenImagePipeline's own limit on caption tokens when it generates (`max_sequence_length`'s default in __call__).
MAX_TOKENS = 512
# The published VAE's per-channel statistics (its config's latents_mean / latents_std), which the tiny VAE keeps.
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632,
                -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382,
               1.1253, 2.8251, 1.9160)


def pipeline_template() -> tuple[str, int]:
    """QwenImagePipeline's prompt template ("...{}...") and how many of its leading tokens the pipeline drops."""
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx


def check_template(tokenizer) -> None:
    """The pipeline drops a fixed number of leading tokens, meant to be its template's prefix: refuse a tokenizer that
    splits the prefix otherwise, since captions would lose their first tokens or keep part of the template."""
    template, drop = pipeline_template()
    prefix = template.split("{}")[0]
    n = len(tokenizer(prefix).input_ids)
    if n != drop:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) splits QwenImagePipeline's prompt template prefix into "
                         f"{n} tokens, but the pipeline drops {drop}: it is not Qwen-Image's tokenizer; give the "
                         f"published one (tokenizer/ of {QWEN_IMAGE})")


def tiny_tokenizer():
    """Qwen's tokenizer class, trained on the pipeline's template and the sample captions' words, so the template's
    prefix splits into exactly the tokens the pipeline drops (checked), as with the published tokenizer."""
    template, _ = pipeline_template()
    corpus = [template.format(" ".join(parts.TINY_WORDS))] * 8 + [" ".join(parts.TINY_WORDS)] * 4
    tokenizer = tiny_qwen_tokenizer(corpus)
    check_template(tokenizer)
    return tokenizer


def tiny_text_encoder(tokenizer):
    """Qwen2_5_VLForConditionalGeneration, the pipeline's class, 32 wide with 2 layers (and a one-block vision tower,
    which text encoding never runs); M-RoPE's sections sum to half the head width, as in the published model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None, eos_token_id=ids("<|im_end|>"),
                pad_token_id=ids("<|endoftext|>"),
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    return parts.seeded(lambda: Qwen2_5_VLForConditionalGeneration(config))


def tiny_vae():
    """AutoencoderKLQwenImage at CPU size: f8 (three spatial downsamplings), 16 channels, the published statistics."""
    from diffusers import AutoencoderKLQwenImage

    return parts.seeded(lambda: AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
        latents_mean=list(LATENTS_MEAN), latents_std=list(LATENTS_STD),
    ))


def channel_stats(latent: LatentSpec, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, C, 1, 1, 1) mean and inverse std, built as the Qwen-Image pipelines build them."""
    shape = (1, latent.channels, 1, 1, 1)
    mean = torch.tensor(latent.latents_mean).view(shape).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(latent.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inverse_std


class QwenImage(Family):
    name = "qwen-image"
    own_text_encoder = "Qwen2.5-VL-7B through Qwen-Image's prompt template (qwen2.5-vl-7b)"
    frame_axis = True  # the VAE takes images as one-frame videos (B, C, 1, H, W): the decoder recipe records it

    def presets(self) -> dict[str, Preset]:
        text = self.text_encoders()
        # The VAE and Qwen2.5-VL run in bf16 in the published pipeline; fp16 is not known to be safe for either.
        vae = VaeSpec("qwen-image", QWEN_IMAGE, cuda_dtype="bf16")
        return {
            "qwen-image": Preset("qwen-image", self.name, 1024, vae, text["qwen2.5-vl-7b"], QWEN_IMAGE),
            "tiny-qwen-image": Preset("tiny-qwen-image", self.name, 256, VaeSpec("qwen-image", None, cuda_dtype="bf16"),
                                      text["tiny-qwen2.5-vl"], None),
        }

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        return {"qwen2.5-vl-7b": TextEncoderSpec("qwen2.5-vl-7b", self.name, "qwen2.5-vl", QWEN_IMAGE, max_length=MAX_TOKENS),
                "tiny-qwen2.5-vl": TextEncoderSpec("tiny-qwen2.5-vl", self.name, "qwen2.5-vl", None, max_length=64)}

    # -- the image side --

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        if not repo:
            return tiny_vae()
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision)

    def latent_spec(self, vae) -> LatentSpec:
        """The posterior's mean and std, normalised per channel as the pipelines do: (z - mean) * (1 / std)."""
        cfg = vae.config
        return LatentSpec(int(cfg.z_dim), 2 ** len(cfg.temperal_downsample), 1.0, 0.0, "mean_std",
                          tuple(float(v) for v in cfg.latents_mean), tuple(float(v) for v in cfg.latents_std))

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        dist = vae.encode(x[:, :, None]).latent_dist  # one frame: (B, 3, 1, H, W) -> (B, C, 1, h, w)
        z, std = dist.mean.float(), dist.std.float()
        mean, inverse_std = channel_stats(latent, z)
        return {"latent_mean": ((z - mean) * inverse_std)[:, :, 0], "latent_std": (std * inverse_std)[:, :, 0]}

    # -- the text side --

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import QwenImagePipeline
        from transformers import Qwen2_5_VLForConditionalGeneration

        if repo:
            model, tokenizer = parts.load_pretrained_text(Qwen2_5_VLForConditionalGeneration, repo, spec.subfolder,
                                                          spec.tokenizer_subfolder, spec.revision, dtype)
            check_template(tokenizer)
        else:
            tokenizer = tiny_tokenizer()
            model = tiny_text_encoder(tokenizer)
        pipeline = QwenImagePipeline(scheduler=None, vae=None, text_encoder=model, tokenizer=tokenizer, transformer=None)
        # the template wraps every caption, the negative prompt's too: its digest goes into the fingerprint
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline,
                        instruction=[pipeline.prompt_template_encode, str(pipeline.prompt_template_encode_start_idx)])

    def text_spec(self, side: TextSide) -> TextSpec:
        # padded to the batch's longest caption, with a mask, as the pipeline pads a batch of prompts
        return TextSpec("masked", int(side.pipeline.text_encoder.config.text_config.hidden_size), side.spec.max_length)

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        """The pipeline's `encode_prompt` (template applied, its prefix dropped, cut to `max_length`), valid tokens
        only: it returns no mask when no caption of the batch is padded."""
        embeds, mask = side.pipeline.encode_prompt(captions, device=device, max_sequence_length=side.spec.max_length)
        embeds = embeds.float().cpu()  # (B, L, D)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool().cpu()
        return [{"text": e[m]} for e, m in zip(embeds, mask)]

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        pipeline = side.pipeline
        template, drop = pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx
        return [len(pipeline.tokenizer(template.format(c)).input_ids) - drop > side.spec.max_length for c in captions]


FAMILY = QwenImage()
