"""Wan 2.1 / 2.2: video. Clips through AutoencoderKLWan (a causal video VAE: a KL posterior, normalised per channel;
16 channels, 8x spatial and 4x temporal for the Wan 2.1 VAE, 48 channels and 16x spatial for the Wan 2.2 VAE of
TI2V-5B), umT5-XXL encoded by WanPipeline's own `encode_prompt` and stored trimmed (the pipeline zero-fills each
caption past its length to 512 tokens, so stage two rebuilds it exactly), and for image-to-video presets what
WanImageToVideoPipeline computes from a clip's first frame: its conditioning latent and mask, and for Wan 2.1 I2V the
CLIP vision embedding."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from precompute.families import parts
from precompute.families.base import (
    Family,
    FirstFrameSide,
    ImageEncoderSpec,
    Preset,
    TextEncoderSpec,
    TextSide,
    VaeSpec,
)
from precompute.families.qwen_image import channel_stats
from shards import Bucket, LatentSpec, TextSpec
from shards.buckets import ASPECT_RATIO_1024

# Published repositories (diffusers layout: vae/, text_encoder/, tokenizer/, transformer/ (and transformer_2/ for the
# A14B experts), scheduler/; Wan 2.1 I2V adds image_encoder/ and image_processor/).
WAN21_T2V_1_3B = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN21_T2V_14B = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
WAN21_I2V_480P = "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
WAN21_I2V_720P = "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"
WAN22_T2V_A14B = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
WAN22_I2V_A14B = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
WAN22_TI2V_5B = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
# WanPipeline's and WanImageToVideoPipeline's `max_sequence_length` when they generate.
MAX_TOKENS = 512
TINY_TOKENS = 64
# The tiny CLIP vision encoder's width and input size (the published one: 1280 wide, 224 px, 257 tokens).
TINY_IMAGE_WIDTH, TINY_IMAGE_SIZE, TINY_IMAGE_PATCH = 32, 32, 8
# --resolution 480 and 720 are the 480p and 720p areas; any other resolution is a square's side, as for images.
AREAS = {480: (480, 832), 720: (720, 1280)}
# The sizes the released models generate at, by resolution and granularity: each is a bucket of that resolution's
# table (with its transpose) even where the 1024 table's aspect ratios, scaled, round beside it (16:9 at 720p scales
# to 720x1264; TI2V-5B's 32-px tokens make its 720p 704x1280).
PUBLISHED_SIZES = {(480, 16): (480, 832), (480, 32): (480, 832), (720, 16): (720, 1280), (720, 32): (704, 1280)}
# The Wan 2.2 VAE (TI2V-5B): its published config, diffusers' `AutoencoderKLWan` defaults otherwise (dim_mult
# [1, 2, 4, 4], two residual blocks, temporal downsampling in the last two stages).
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
    scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
                  0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                  -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
                  -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
)


def tiny_vae():
    """AutoencoderKLWan at CPU size with the Wan 2.1 VAE's geometry: 16 channels, 8x spatial (three downsamplings),
    4x temporal, the published per-channel statistics (the class defaults)."""
    from diffusers import AutoencoderKLWan

    return parts.seeded(lambda: AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                                 temperal_downsample=[False, True, True]))


def tiny_text_encoder(vocab_size: int):
    """UMT5EncoderModel, the pipeline's class, `parts.TINY_T5_WIDTH` wide with 2 layers."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, d_model=parts.TINY_T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        feed_forward_proj="gated-gelu", is_encoder_decoder=False, dropout_rate=0.0)
    return parts.seeded(lambda: UMT5EncoderModel(config))


def tiny_image_encoder():
    """CLIPVisionModel, WanImageToVideoPipeline's class: 32 px images in 8 px patches (17 tokens), 32 wide."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=TINY_IMAGE_WIDTH, intermediate_size=2 * TINY_IMAGE_WIDTH, num_hidden_layers=3,
                              num_attention_heads=2, image_size=TINY_IMAGE_SIZE, patch_size=TINY_IMAGE_PATCH,
                              projection_dim=TINY_IMAGE_WIDTH)
    return parts.seeded(lambda: CLIPVisionModel(config))


def tiny_image_processor():
    """CLIPImageProcessor as the published one is set up (shortest side resized, centre crop, OpenAI CLIP's
    normalisation), at the tiny encoder's size."""
    from transformers import CLIPImageProcessor

    side = TINY_IMAGE_SIZE
    return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def set_tiling(vae, height: int, width: int) -> None:
    """Encode frames of this size tiled or whole (`TILE_ABOVE_PIXELS`)."""
    if height * width > TILE_ABOVE_PIXELS:
        vae.enable_tiling()
    else:
        vae.disable_tiling()


def clip_table(resolution: int, granularity: int) -> tuple[Bucket, ...]:
    """The 1024 table's aspect ratios at an area of `resolution`² (480p: 480 x 832; 720p: 720 x 1280), each side
    rounded to a multiple of `granularity`, with the released models' own sizes in place of the scaled buckets nearest
    them; ordered by aspect ratio as the published tables are."""
    height, width = AREAS.get(resolution, (resolution, resolution))
    scale = math.sqrt(height * width) / 1024

    def side(pixels: float) -> int:
        return max(granularity, math.floor(pixels * scale / granularity + 0.5) * granularity)

    buckets = list(dict.fromkeys(Bucket(side(b.height), side(b.width)) for b in ASPECT_RATIO_1024))
    if (resolution, granularity) in PUBLISHED_SIZES:
        h, w = PUBLISHED_SIZES[resolution, granularity]
        for size in (Bucket(h, w), Bucket(w, h)):
            if size not in buckets:  # in place of the scaled bucket of the nearest aspect ratio
                nearest = min(buckets, key=lambda b: abs(math.log(b.aspect / size.aspect)))
                buckets[buckets.index(nearest)] = size
    return tuple(sorted(buckets, key=lambda b: b.aspect))


# Frames with more pixels than any bucket of the 720p tables are encoded in overlapping spatial tiles (AutoencoderKLWan's
# enable_tiling: 256-px tiles at a 192-px stride, blended), which bounds the encoder's memory at any frame size; up to
# 720p a clip is encoded whole, exactly as the stock pipelines encode it. Time needs no tiling: AutoencoderKLWan._encode
# already runs the encoder causally over the first frame and then 4 frames at a time, carrying a 2-frame feature cache,
# so memory does not grow with the clip's length. Traced on the meta device (every tensor alive at once counted), the
# Wan 2.1 VAE's encoder holds at most 6.8 GiB for a 720x1280 clip of 81 frames in bf16 (13.0 in fp32), about what it
# holds for 17: with umT5-XXL beside it (10.6 GiB in bf16) a 720p x 81-frame clip encodes whole on a 24 GB card
# (tests/stage_one/test_wan_precompute.py).
TILE_ABOVE_PIXELS = max(b.pixels for granularity in (16, 32) for b in clip_table(720, granularity))


class Wan(Family):
    name = "wan"
    padding = "trimmed; zero-filled to max_length"
    own_text_encoder = "umT5-XXL through WanPipeline.encode_prompt (umt5-xxl)"
    frame_axis = True  # the VAE takes (B, C, T, H, W) and the cache keeps T: the decoder recipe records it
    video = True
    frame_rate = 16.0
    temporal_downsample = 4
    frame_buckets = (1, 17, 33, 49, 81)

    def presets(self) -> dict[str, Preset]:
        text = self.text_encoders()
        # On CUDA the VAE encodes in bf16 by default, as Qwen-Image's VAE of the same architecture does here: in fp32
        # (the pipelines' examples, --vae-dtype fp32) a 720p clip's encoder needs 13.0 GiB beside umT5's 10.6, more
        # than a 24 GB card holds (6.8 in bf16); 480p fits in fp32 (5.6). The CLIP image encoder runs in fp32, as the
        # I2V pipeline's example loads it, umT5 in bf16 (it overflows in fp16).
        wan21_vae, wan22_vae = VaeSpec("wan2.1", None, cuda_dtype="bf16"), VaeSpec("wan2.2", None, cuda_dtype="bf16")

        def real(name, repo, base, vae=wan21_vae, i2v=False, clip=False, **kw):
            image = ImageEncoderSpec("clip-vit-h", repo, cuda_dtype="fp32") if clip else None
            return Preset(name, self.name, base, replace(vae, repo=repo), replace(text["umt5-xxl"], repo=repo), repo,
                          max_resolution=1024, image_to_video=i2v, image_encoder=image, **kw)

        out = {p.name: p for p in (
            real("wan2.1-t2v-1.3b", WAN21_T2V_1_3B, 480),
            real("wan2.1-t2v-14b", WAN21_T2V_14B, 480),
            real("wan2.1-i2v-14b-480p", WAN21_I2V_480P, 480, i2v=True, clip=True),
            real("wan2.1-i2v-14b-720p", WAN21_I2V_720P, 720, i2v=True, clip=True),
            real("wan2.2-t2v-a14b", WAN22_T2V_A14B, 480),
            real("wan2.2-i2v-a14b", WAN22_I2V_A14B, 480, i2v=True),
            # TI2V-5B: the Wan 2.2 VAE (16x) under 2x2 patches makes 32-px tokens; it generates 1280 x 704 at 24 fps.
            # Its image conditioning (the first frame's latent in place of the noise) needs no field of its own: the VAE
            # is causal, so it is the cached clip's first latent frame.
            real("wan2.2-ti2v-5b", WAN22_TI2V_5B, 720, vae=wan22_vae, granularity=32, frame_rate=24.0),
        )}
        tiny = dict(vae=wan21_vae, transformer=None, max_resolution=256)
        out["tiny-wan"] = Preset("tiny-wan", self.name, 64, text=text["tiny-umt5"], **tiny)
        # An image-conditioned transformer takes the image's tokens as those before the last 512 (WanAttnProcessor):
        # the I2V caption is zero-filled to the pipelines' 512 tokens, at any width.
        out["tiny-wan-i2v"] = Preset("tiny-wan-i2v", self.name, 64, text=replace(text["tiny-umt5"], max_length=MAX_TOKENS),
                                     image_to_video=True, image_encoder=ImageEncoderSpec("clip-vit-h", None, cuda_dtype="fp32"),
                                     **tiny)
        return out

    def text_encoders(self) -> dict[str, TextEncoderSpec]:
        # umT5 overflows in fp16 (fp16_safe False); the pipelines run it in bf16
        return {"umt5-xxl": TextEncoderSpec("umt5-xxl", self.name, "umt5", WAN21_T2V_1_3B, max_length=MAX_TOKENS),
                "tiny-umt5": TextEncoderSpec("tiny-umt5", self.name, "umt5", None, max_length=TINY_TOKENS)}

    # -- the video side --

    def load_vae(self, spec: VaeSpec, repo: str | None) -> torch.nn.Module:
        from diffusers import AutoencoderKLWan

        if repo:
            return AutoencoderKLWan.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision)
        if spec.kind == "wan2.2":
            raise ValueError("there is no tiny Wan 2.2 VAE: use tiny-wan, or a Wan 2.2 preset with its published weights")
        return tiny_vae()

    def latent_spec(self, vae) -> LatentSpec:
        """The posterior's mean and std, normalised per channel as the pipelines do, (z - mean) * (1 / std), with the
        VAE's own spatial and temporal factors."""
        cfg = vae.config
        return LatentSpec(int(cfg.z_dim), int(cfg.scale_factor_spatial), 1.0, 0.0, "mean_std",
                          tuple(float(v) for v in cfg.latents_mean), tuple(float(v) for v in cfg.latents_std),
                          temporal_downsample=int(cfg.scale_factor_temporal))

    def encode_videos(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        """(B, 3, F, H, W) -> (B, C, (F - 1) // 4 + 1, H / s, W / s) each (s: 8 for the Wan 2.1 VAE, 16 for 2.2's): the
        posterior's mean and std, normalised as WanPipeline normalises its latents (and denormalises them to decode)."""
        set_tiling(vae, x.shape[-2], x.shape[-1])
        dist = vae.encode(x).latent_dist
        z, std = dist.mean.float(), dist.std.float()
        mean, inverse_std = channel_stats(latent, z)
        return {"latent_mean": (z - mean) * inverse_std, "latent_std": std * inverse_std}

    def encode_images(self, vae, x: torch.Tensor, latent: LatentSpec) -> dict[str, torch.Tensor]:
        """An image is a one-frame clip: (B, 3, H, W) -> (B, C, 1, h, w) each."""
        return self.encode_videos(vae, x[:, :, None], latent)

    def vae_fingerprint(self, vae) -> dict:
        return {"tiling": {"above_pixels": TILE_ABOVE_PIXELS, "tile": [vae.tile_sample_min_height, vae.tile_sample_min_width],
                           "stride": [vae.tile_sample_stride_height, vae.tile_sample_stride_width]}}

    # -- the first frame (image to video) --

    def first_frame_fields(self, preset: Preset) -> tuple[str, ...]:
        # condition (4 + C, T, h, w): the mask and the latent of [first frame, zeros...]; image_embeds (tokens, D)
        if not preset.image_to_video:
            return ()
        return ("condition", "image_embeds") if preset.image_encoder else ("condition",)

    def load_first_frame(self, preset: Preset, vae, repo: str | None, dtype: torch.dtype) -> FirstFrameSide:
        from diffusers import WanImageToVideoPipeline

        if not preset.image_to_video:
            return super().load_first_frame(preset, vae, repo, dtype)
        spec, modules, processor = preset.image_encoder, {}, None
        if spec is not None:
            if repo:
                from transformers import CLIPImageProcessor, CLIPVisionModel

                modules[spec.subfolder] = CLIPVisionModel.from_pretrained(repo, subfolder=spec.subfolder, revision=spec.revision,
                                                                          dtype=dtype)
                processor = CLIPImageProcessor.from_pretrained(repo, subfolder=spec.processor_subfolder, revision=spec.revision)
            else:
                modules[spec.subfolder], processor = tiny_image_encoder(), tiny_image_processor()
        pipeline = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=None, image_processor=processor,
                                           image_encoder=modules.get(spec.subfolder) if spec else None, transformer=None)
        return FirstFrameSide(spec, modules, processor, pipeline)

    def encode_first_frames(self, side: FirstFrameSide, x: torch.Tensor, first: torch.Tensor,
                            latent: LatentSpec) -> dict[str, torch.Tensor]:
        """`condition` as WanImageToVideoPipeline.prepare_latents returns it (second value) for each clip's first
        frame `x[:, :, 0]` and its length, and `image_embeds` as its `encode_image` computes them from the first
        frame as an image (`first`, (B, 3, H, W) uint8), which its image processor resizes and crops."""
        from PIL import Image

        pipeline, (_, _, frames, height, width) = side.pipeline, x.shape
        set_tiling(pipeline.vae, height, width)
        shape = (1, *latent.shape(height, width, frames))
        conditions = []
        for clip in x:
            # The pipeline builds one image's condition per call (its batch repeats it); the noise it would draw is
            # given, so no random numbers are consumed.
            _, condition = pipeline.prepare_latents(clip[None, :, 0], 1, latent.channels, height, width, frames, torch.float32,
                                                    x.device, latents=torch.zeros(shape, device=x.device))
            conditions.append(condition.float())
        out = {"condition": torch.cat(conditions)}
        if side.spec is not None:
            images = [Image.fromarray(f.permute(1, 2, 0).cpu().numpy()) for f in first]
            out["image_embeds"] = pipeline.encode_image(images, x.device).float()
        return out

    def save_tiny_first_frame(self, preset: Preset, directory: str) -> None:
        if preset.image_encoder is None:
            return
        spec = preset.image_encoder
        tiny_image_encoder().save_pretrained(f"{directory}/{spec.subfolder}")
        tiny_image_processor().save_pretrained(f"{directory}/{spec.processor_subfolder}")

    # -- buckets --

    def resolution_problem(self, preset: Preset, resolution: object) -> str | None:
        """480 and 720 (the 480p and 720p tables, whatever the granularity) and any multiple of the preset's
        granularity from 4 tokens a side to its largest."""
        step, smallest = preset.granularity, 4 * preset.granularity
        if isinstance(resolution, bool) or not isinstance(resolution, int):
            return f"{resolution!r} is not a whole number of pixels"
        if resolution in AREAS:
            return None
        if resolution % step or not smallest <= resolution <= preset.max_resolution:
            return (f"{resolution} is neither 480 nor 720 (the 480p and 720p tables) nor a multiple of {step} from "
                    f"{smallest} to {preset.max_resolution} (the model's largest)")
        return None

    def bucket_table(self, preset: Preset, resolution: int) -> tuple[Bucket, ...]:
        return clip_table(resolution, preset.granularity)

    # -- the text side --

    def load_text(self, spec: TextEncoderSpec, repo: str | None, dtype: torch.dtype) -> TextSide:
        from diffusers import WanPipeline
        from transformers import UMT5EncoderModel

        if repo:
            model, tokenizer = parts.load_pretrained_text(UMT5EncoderModel, repo, spec.subfolder, spec.tokenizer_subfolder,
                                                          spec.revision, dtype)
        else:
            tokenizer = parts.tiny_t5_tokenizer()
            model = tiny_text_encoder(len(tokenizer))
        pipeline = WanPipeline(tokenizer=tokenizer, text_encoder=model, vae=None, scheduler=None)
        return TextSide(spec, {spec.subfolder: model}, {spec.tokenizer_subfolder: tokenizer}, pipeline)

    def text_spec(self, side: TextSide) -> TextSpec:
        return TextSpec("padded", parts.text_width(side.pipeline.text_encoder), side.spec.max_length)

    def text_fingerprint(self, side: TextSide) -> dict:
        # the pipeline cleans every caption first (html unescaped, whitespace collapsed, and ftfy's fix_text where
        # ftfy is installed): a cache built with ftfy may differ from one built without
        from diffusers.utils import is_ftfy_available

        return {"prompt_clean": "ftfy + html + whitespace" if is_ftfy_available() else "html + whitespace"}

    def prompt_fields(self, spec: TextEncoderSpec) -> list[str]:
        return ["text"]

    def token_counts(self, side: TextSide, captions: list[str], limit: int | None) -> list[int]:
        """Each caption's tokens (end of sequence included) as the pipeline tokenizes it, cut at `limit`."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        cut = dict(truncation=True, max_length=limit) if limit else {}
        return [len(ids) for ids in side.pipeline.tokenizer([prompt_clean(c) for c in captions], **cut).input_ids]

    def encode_text(self, side: TextSide, captions: list[str], device: torch.device,
                    instruction: bool = True) -> list[dict[str, torch.Tensor]]:
        """The pipeline's `encode_prompt` (B, max_length, D), each caption's valid tokens kept: the pipeline itself
        zeroes the rest."""
        embeds, _ = side.pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device=device,
                                                max_sequence_length=side.spec.max_length)
        embeds = embeds.float().cpu()
        return [{"text": e[:n]} for e, n in zip(embeds, self.token_counts(side, captions, side.spec.max_length))]

    def truncated(self, side: TextSide, captions: list[str]) -> list[bool]:
        return [n > side.spec.max_length for n in self.token_counts(side, captions, None)]


FAMILY = Wan()
