"""Z-Image: a single-stream DiT (S3-DiT) over the Flux VAE's latents in 2 x 2 patches and the Qwen3 text encoder's
tokens of each caption, unpadded; flow matching with the fixed shift of its scheduler (6 for Z-Image, 3 for the
distilled Z-Image-Turbo), sampled as ZImagePipeline samples.

ZImagePipeline calls the transformer with lists: per sample a latent (C, 1, h, w) and its caption's valid tokens
(L_i, D), the timestep as 1 - sigma ((1000 - t) / 1000), and negates what it returns to get the velocity
noise - x_0 its scheduler steps with. `forward` makes exactly that call, so the objective stays the product's flow
matching on velocity.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from train.families.base import ATTENTION, TEXT_TOKENS, Family, ModelPreset

Z_IMAGE = "Tongyi-MAI/Z-Image"
Z_IMAGE_TURBO = "Tongyi-MAI/Z-Image-Turbo"
# Z-Image's features at CPU size: refiners, the main layers, QK-norm, 3-axis RoPE (the axes sum to the head width);
# the caption width is tiny-qwen3's hidden size
TINY = dict(
    all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
    norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
    axes_lens=[512, 64, 64],
)
# Parameter counts of the published encoder configs (diffusers 0.42.1 / transformers 5.24 modules): Z-Image's VAE is
# Flux.1's; its text encoder is Qwen3-4B as a Qwen3Model (no LM head)
ENCODERS = {"Flux VAE (AutoencoderKL)": 83_819_683, "Qwen3-4B (Qwen3Model)": 4_022_468_096}
# the feed-forward of every block (SwiGLU: w1 and w3 in, w2 out)
FEED_FORWARD = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
SEQ_MULTIPLE = 32  # the transformer pads the image's and each caption's tokens to a multiple of this


def pipeline_default(name: str):
    """A default of ZImagePipeline's `__call__` (how the stock pipeline samples when not told otherwise)."""
    from diffusers import ZImagePipeline

    return inspect.signature(ZImagePipeline.__call__).parameters[name].default


class ZImage(Family):
    name = "z-image"
    title = "Z-Image"
    transformer = "ZImageTransformer2DModel"
    pipeline = "ZImagePipeline"
    # diffusers' Z-Image LoRA trainers and loaders: attention q, k, v, out and the SwiGLU feed-forward of every block
    # (the refiners' too: the names match by suffix)
    lora_targets = ATTENTION + FEED_FORWARD
    no_controlnet = ("Z-Image's ControlNet (diffusers' ZImageControlNetModel) is not trained by this version; --controlnet "
                     "trains the families whose ControlNet it builds")
    no_tread = ("--tread: token routing is not built for Z-Image: its transformer joins each sample's image and caption "
                "tokens into one sequence of the sample's own length, padded per batch, before its main blocks, which the "
                "router, taking the image tokens from a block argument of their own, does not split; train Z-Image "
                "without --tread")

    def presets(self):
        # ZImagePipeline's default token limit is 512; both models were released in bf16 and their schedulers shift
        # by a fixed amount (use_dynamic_shifting false: the mu the pipeline computes is ignored)
        common = dict(released_dtype="bf16", encoder_parameters=ENCODERS, text_tokens=512)
        return {
            # the undistilled base: ZImagePipeline's own sampling defaults (steps, guidance)
            "z-image": lambda: ModelPreset("z-image", self.name, Z_IMAGE, "z_image_transformer.json", "flow", "flow",
                                           flow_shift=6.0, validation_steps=pipeline_default("num_inference_steps"),
                                           guidance_scale=pipeline_default("guidance_scale"), **common),
            # distilled for 8 function evaluations without guidance (its model card: guidance 0; its "9 steps" were 8
            # transformer calls before ZImagePipeline's sigmas ended at 1 / steps, as they do now)
            "z-image-turbo": lambda: ModelPreset("z-image-turbo", self.name, Z_IMAGE_TURBO, "z_image_transformer.json", "flow",
                                                 "flow", flow_shift=3.0, validation_steps=8, guidance_scale=0.0, **common),
            "tiny-z-image": lambda: ModelPreset("tiny-z-image", self.name, None, TINY, "flow", "flow", flow_shift=6.0,
                                                base_resolution=256, text_tokens=64, guidance_scale=5.0),
        }

    def blocks(self, model):
        return [*model.noise_refiner, *model.context_refiner, *model.layers]

    def latent_patch(self, config: Mapping) -> int:
        return config["all_patch_size"][0]

    def text_width(self, config: Mapping) -> int:
        return config["cap_feat_dim"]

    def image_tokens(self, config: Mapping, preset: ModelPreset, bucket: tuple[int, int]) -> int:
        tokens = super().image_tokens(config, preset, bucket)
        return tokens + (-tokens) % SEQ_MULTIPLE

    def example_batch(self, config, preset, bucket, batch, tokens, dtype, device="meta"):
        # every token valid: a batch without a mask (a mask's selection has no size on the meta device)
        out = super().example_batch(config, preset, bucket, batch, tokens, dtype, device)
        out.pop("text_mask")
        return out

    def forward(self, model, config: Mapping, xt, t, batch, guidance):
        text = batch["text"].to(xt.dtype)  # (B, L, D), padded to the batch's longest caption
        mask, lengths = batch.get("text_mask"), batch.get(TEXT_TOKENS)
        if mask is None:
            captions = list(text.unbind(0))
        elif lengths is not None:  # the collate's counts (a caption's valid tokens come first): nothing read off the device
            assert len(lengths) == len(text), f"{len(lengths)} caption lengths for {len(text)} captions"
            # copied out as the mask's selection copies them (the memory the dry run measures against the plan)
            captions = [tokens[:n].clone() for tokens, n in zip(text, lengths)]
        else:  # a batch built without them: the mask says, read off the device
            captions = [tokens[valid] for tokens, valid in zip(text, mask)]
        latents = list(xt.unsqueeze(2).unbind(0))  # B x (C, 1, h, w): one frame each
        out = model(latents, (1000 - t) / 1000, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)  # the transformer predicts x_0 - noise

    # --- validation: ZImagePipeline's sampler ---

    def set_timesteps(self, scheduler, objective, steps, pixels, device):
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), device=device)

    def denoise(self, forward, scheduler, latents, text, *, guidance, channels, autocast):
        """ZImagePipeline's loop: guidance only when the scale is above 0 (none for Turbo) and, with its defaults for
        `cfg_truncation` and `cfg_normalization`, on every step without renormalisation; the prompt alone otherwise."""
        truncation, normalization = pipeline_default("cfg_truncation"), pipeline_default("cfg_normalization")
        prompt = {k: v[1:] if isinstance(v, (torch.Tensor, tuple)) else v for k, v in text.items()}
        for t in scheduler.timesteps:
            guided = guidance > 0 and not (truncation is not None and (1000 - float(t)) / 1000 > truncation)
            with autocast:
                if guided:
                    pred = forward(torch.cat([latents, latents]), t.expand(2), text).float()
                else:
                    pred = forward(latents, t.expand(1), prompt).float()
            if guided:
                uncond, cond = pred[:, :channels].chunk(2)
                pred = self.combine(uncond, cond, guidance, normalization)
            latents = scheduler.step(pred, t, latents).prev_sample
        return latents

    def combine(self, uncond, cond, guidance, normalization: float = 0.0):
        """ZImagePipeline's guidance: the prompt's prediction pushed away from the null caption's by `guidance` times
        their difference (a scale of 0 is the prompt alone), its norm capped at `normalization` times the prompt's."""
        pred = cond + guidance * (cond - uncond)
        if normalization and float(normalization) > 0:
            limit = torch.linalg.vector_norm(cond) * float(normalization)
            norm = torch.linalg.vector_norm(pred)
            pred = torch.where(norm > limit, pred * (limit / norm), pred)
        return pred


FAMILY = ZImage()
