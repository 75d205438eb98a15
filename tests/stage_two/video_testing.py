"""What the video tests share: a cache of clips written with `shards.ShardWriter` as stage one writes one (latents
(C, T, h, w) normalised per channel, umT5-like text stored trimmed in the "padded" layout, an optional first-frame
`condition`, prompts and the decoder recipe of a tiny video VAE stored in the cache), and a stand-in video family
that reads it, for the generic stage-two code tested without a family's transformer."""

from __future__ import annotations

from pathlib import Path

import torch

from shards import Bucket, CacheSpec, DecoderRecipe, Field, LatentSpec, Prompt, ShardWriter, TextSpec, prompt_key
from train.families.base import Family, TextInput

CHANNELS, TEXT_WIDTH, MAX_TOKENS = 16, 32, 512
MEAN = tuple(0.1 * c - 0.8 for c in range(CHANNELS))
STD = tuple(1.0 + 0.1 * c for c in range(CHANNELS))
LATENT = LatentSpec(CHANNELS, 8, 1.0, 0.0, "mean_std", MEAN, STD, temporal_downsample=4)
TEXT = TextSpec("padded", TEXT_WIDTH, MAX_TOKENS)
PROMPTS = ("a red square moving right", "a blue circle bouncing")
# (bucket, samples): 17-frame clips in two shapes and one-frame clips (an image in a video source)
BUCKETS = ((Bucket(64, 64, 17), 4), (Bucket(48, 80, 17), 2), (Bucket(64, 64, 1), 2))


class PaddedText(TextInput):
    """The "padded" layout: each caption's tokens zero-filled to the cache's max_tokens, no mask."""

    layout = "padded"
    description = "tokens zero-filled to max_tokens, no mask"

    def collate(self, spec, conds):
        text = torch.zeros(len(conds), spec.max_tokens, conds[0]["text"].shape[1], dtype=conds[0]["text"].dtype)
        for j, c in enumerate(conds):
            text[j, : len(c["text"])] = c["text"]
        return {"text": text}

    def example(self, config, family, batch, tokens, dtype, device="meta"):
        return {"text": torch.zeros(batch, tokens, family.text_width(config), device=device, dtype=dtype)}


class StandIn(Family):
    """A video family as generic code sees one: clips with a frame axis, 4 pixel frames per latent frame, 16 fps, and
    the first-frame `condition` as a conditioning field where the cache holds it."""

    name = "stand-in-video"
    title = "stand-in video"
    transformer = "WanTransformer3DModel"
    pipeline = "WanPipeline"
    text = PaddedText()
    temporal_downsample = 4
    frame_rate = 16.0

    def presets(self):
        return {}

    def conditioning_fields(self, spec):
        return ("condition",) if spec.extra.get("image_to_video") else ()

    def latent_channels(self, config):
        return config["out_channels"]

    def latent_patch(self, config):
        return config["patch_size"][1]

    def text_width(self, config):
        return config["text_dim"]


STAND_IN = StandIn()


def register(monkeypatch) -> StandIn:
    """Make the stand-in family known to stage two for one test."""
    import train.families

    monkeypatch.setattr(train.families, "FAMILIES", [*train.families.FAMILIES, STAND_IN])
    return STAND_IN


def tiny_video_vae():
    """A video VAE at CPU size: 16 channels, 8x spatial and 4x temporal downsampling, seeded."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKLWan(base_dim=8, z_dim=CHANNELS, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                                temperal_downsample=[False, True, True], latents_mean=list(MEAN), latents_std=list(STD))


def clip_cache(root: Path, *, family: str = "stand-in-video", preset: str = "stand-in", condition: bool = False,
               image_embeds: bool = False, decoder: bool = False, buckets=BUCKETS, prompts=PROMPTS, seed: int = 0,
               frame_rate: float | None = 16.0) -> Path:
    """A cache of random clips at `buckets` ((bucket, samples) pairs), each with one or two captions, the empty caption
    and `prompts` as prompts; with `condition`, a first-frame condition (4 + C, T, h, w) per sample (recorded as an
    image-to-video cache), with `image_embeds` a first-frame image embedding (257, 32); with `decoder`, the tiny video
    VAE's weights stored in the cache as its decoder. The clips' `frame_rate` is in the fingerprint's buckets part, as
    stage one records it (None: not recorded)."""
    g = torch.Generator().manual_seed(seed)
    schema = {"latent_mean": Field(torch.bfloat16), "latent_std": Field(torch.bfloat16),
              "text": Field(torch.bfloat16, ragged=True), "text_lengths": Field(torch.int32, ragged=True),
              "source": Field(torch.uint8, ragged=True)}
    if condition:
        schema["condition"] = Field(torch.bfloat16)
    if image_embeds:
        schema["image_embeds"] = Field(torch.bfloat16)
    fingerprint = {"vae": {"id": "tiny-video-vae", **LATENT.fingerprint()}, "text_encoder": {"id": "tiny-umt5", **TEXT.fingerprint()},
                   "buckets": {"clips": {"frame_buckets": sorted({b.frames for b, _ in buckets}),
                                         **({"frame_rate": frame_rate} if frame_rate else {})}}}
    root = Path(root)
    with ShardWriter(root, fingerprint, schema) as w:
        k = 0
        for bucket, count in buckets:
            shape = LATENT.shape(*bucket)
            for _ in range(count):
                lengths = [3 + k % 5] + ([2] if k % 3 == 0 else [])
                fields = {"latent_mean": torch.randn(shape, generator=g).bfloat16(),
                          "latent_std": (0.05 + 0.1 * torch.rand(shape, generator=g)).bfloat16(),
                          "text": torch.randn(sum(lengths), TEXT_WIDTH, generator=g).bfloat16(),
                          "text_lengths": torch.tensor(lengths, dtype=torch.int32),
                          "source": torch.tensor(list(f"videos/clip{k:04d}.mp4".encode()), dtype=torch.uint8)}
                if condition:
                    fields["condition"] = torch.randn(4 + CHANNELS, *shape[1:], generator=g).bfloat16()
                if image_embeds:
                    fields["image_embeds"] = torch.randn(257, TEXT_WIDTH, generator=g).bfloat16()
                w.write(f"clip{k:04d}", bucket, fields)
                k += 1
        text_schema = {"text": schema["text"]}
        w.add_prompts({prompt_key(t): Prompt(t, {"text": torch.randn(0 if not t else 4 + i, TEXT_WIDTH, generator=g).bfloat16()})
                       for i, t in enumerate(("", *prompts))}, text_schema)
        recipe = store_decoder(w) if decoder else None
        extra = {"image_to_video": True} if condition else {}
        w.set_extra("precompute", CacheSpec(LATENT, TEXT, family, preset, 64, recipe, extra=extra).record())
    return root


def store_decoder(w: ShardWriter) -> DecoderRecipe:
    """Store the tiny video VAE in the cache (as stage one stores a tiny preset's) and return its decoder recipe."""
    from safetensors.torch import save

    vae = tiny_video_vae()
    w.add_file("decoder:config.json", "vae/config.json", vae.to_json_string().encode())
    w.add_file("decoder:diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
               save({n: t.contiguous() for n, t in vae.state_dict().items()}))
    return DecoderRecipe("AutoencoderKLWan", "vae", 1.0, 0.0, in_cache=True, latents_mean=MEAN, latents_std=STD,
                         frame_axis=True)
