"""Wan 2.1 / 2.2: a video DiT over (B, C, T, h, w) latents in 1 x 2 x 2 patches, cross-attending to every umT5 token of
the caption zero-filled to 512 (no mask); image-to-video models take the cached first-frame condition (mask and latent)
on the channels and, for Wan 2.1, the CLIP embedding of the first frame. Flow matching with a fixed shift; sampled as
WanPipeline / WanImageToVideoPipeline sample: UniPC in flow sigmas, classifier-free guidance against the empty caption,
one transformer pass per caption. Wan 2.2 A14B is two experts of one shape: `transformer` (high noise) at and above the
boundary timestep and `transformer_2` (low noise) below it (`--expert`). Wan 2.2 TI2V-5B generates from text, or from an
image given as the clip's clean first latent frame (its pipelines' `expand_timesteps`: that frame's latent in place of
the noise at every step and a timestep per token, 0 on its tokens); `--i2v-probability` trains the latter. Adapters in
diffusers' layout or musubi-tuner's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shards import Bucket
from train.families.base import ATTENTION, Family, ModelPreset, TextInput, TokenRoute

# The published scheduler (scheduler/scheduler_config.json of the Wan-AI/*-Diffusers repositories): UniPC, second order
# (bh2), in flow sigmas shifted by `flow_shift` (set per preset), ending at sigma 0.
SCHEDULER = {
    "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True, "solver_order": 2,
    "solver_type": "bh2", "predict_x0": True, "lower_order_final": True, "final_sigmas_type": "zero",
    "timestep_spacing": "linspace", "steps_offset": 0,
}
# Wan's features at CPU size: 1 x 2 x 2 patches, 3-axis RoPE (a head of 12: 4 + 4 + 4), a feed-forward, cross-attention
# to the tiny umT5's width, 16 latent channels (the Wan 2.1 VAE's)
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=32,
            freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=32)
# Wan 2.1 I2V at CPU size: the condition's 4 mask and 16 latent channels on top, and the tiny CLIP vision tower's width
# for the image embedding (added keys and values in every cross-attention, of the transformer's width)
TINY_I2V = {**TINY, "in_channels": 36, "image_dim": 32, "added_kv_proj_dim": 24}
TEMPORAL = 4  # pixel frames per latent frame after the first (the Wan VAEs')
TEXT_TOKENS = 512  # umT5's tokens as the pipelines pad them; WanAttnProcessor takes the tokens before the last 512 as the image's
# The experts of Wan 2.2 A14B in the released pipeline (WanPipeline / WanImageToVideoPipeline `boundary_ratio`): the
# high-noise `transformer` takes timesteps at or above boundary x 1000, the low-noise `transformer_2` those below.
EXPERTS = ("transformer", "transformer_2")
# Parameter counts of the published encoders (diffusers 0.42.1 / transformers 5.24 modules on the meta device): umT5-XXL's
# encoder as the pipelines load it (UMT5EncoderModel), the Wan 2.1 VAE (AutoencoderKLWan's default config), the Wan 2.2
# VAE (z_dim 48, 16x spatial) and Wan 2.1 I2V's CLIP ViT-H/14 vision tower
UMT5 = {"umT5-XXL encoder (UMT5EncoderModel)": 5_680_910_336}
VAE21 = {"Wan 2.1 VAE (AutoencoderKLWan)": 126_892_531}
VAE22 = {"Wan 2.2 VAE (AutoencoderKLWan, z_dim 48)": 704_688_668}
CLIP_H = {"CLIP ViT-H/14 vision (CLIPVisionModel)": 630_766_080}


@dataclass(frozen=True)
class WanPreset(ModelPreset):
    """A Wan preset: which stock pipeline samples it (`image_to_video`: WanImageToVideoPipeline, with cached first-frame
    conditions), and whether its pipelines run with `expand_timesteps` (TI2V-5B: an image is the clip's clean first
    latent frame, at timestep 0)."""

    image_to_video: bool = False
    expand_timesteps: bool = False


def preset(name: str, repo: str, config: str, shift: float, resolution: int, encoders: dict, **kwargs) -> WanPreset:
    # validation as the pipelines' defaults: 50 steps at guidance 5.0
    return WanPreset(name, "wan", repo, config, "flow", "flow", flow_shift=shift, base_resolution=resolution,
                     released_dtype="bf16", encoder_parameters={**UMT5, **encoders}, text_tokens=TEXT_TOKENS,
                     validation_steps=50, **{"guidance_scale": 5.0, **kwargs})


class WanText(TextInput):
    """"padded": per caption `text`, umT5's valid tokens as stored, zero-filled to 512 tokens (or the cache's longer
    `max_tokens`) when collated, exactly as the pipelines' encode_prompt zero-fills them at their default
    max_sequence_length; no mask (the transformer takes none). The zeros are input: the text embedder maps them to
    tokens every caption attends to."""

    layout = "padded"
    description = "umT5's tokens zero-filled to 512, no mask"

    @staticmethod
    def tokens(spec) -> int:
        """The tokens a caption is zero-filled to: the pipelines' 512, or the cache's limit where it is longer."""
        return max(spec.max_tokens, TEXT_TOKENS)

    def collate(self, spec, conds):
        """`text` (B, 512, D), each caption's tokens first and zeros after."""
        rows = [c["text"] for c in conds]
        longest, width = max(r.shape[0] for r in rows), self.tokens(spec)
        if longest > width:
            raise ValueError(f"a caption of {longest} tokens is longer than the cache's max_tokens {spec.max_tokens}; the "
                             f"cache is damaged (stage one cuts captions there)")
        text = torch.zeros(len(rows), width, rows[0].shape[1], dtype=rows[0].dtype)
        for j, r in enumerate(rows):
            text[j, : r.shape[0]] = r
        return {"text": text}

    def problems(self, spec, config, family):
        problems = super().problems(spec, config, family)
        if config.get("added_kv_proj_dim") is not None and spec.max_tokens > TEXT_TOKENS:
            # WanAttnProcessor splits the image tokens off as everything before the last 512
            problems.append(f"text tokens: cache {spec.max_tokens}, an image-conditioned Wan transformer takes at most "
                            f"{TEXT_TOKENS} (its attention takes the tokens before the last {TEXT_TOKENS} as the image's)")
        return problems

    def example(self, config, family, batch, tokens, dtype, device="meta"):
        return {"text": torch.zeros(batch, max(tokens, TEXT_TOKENS), family.text_width(config), device=device, dtype=dtype)}


class Wan(Family):
    name = "wan"
    title = "Wan"
    transformer = "WanTransformer3DModel"
    pipeline = "WanPipeline"
    text = WanText()
    # musubi-tuner's layers (networks/lora_wan.py: every Linear of a block): self- and cross-attention q, k, v, out, the
    # image keys and values of I2V models, and the feed-forward; the set diffusers reads back from musubi's files
    lora_targets = ATTENTION + ("add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2")
    lora_formats = ("diffusers", "kohya", "lycoris")
    null_caption = "empty"  # WanPipeline's negative prompt defaults to "": its embedding, zero-filled
    no_controlnet = "--controlnet trains the ControlNets of the families that have one here; Wan has none in diffusers"
    temporal_downsample = TEMPORAL
    frame_rate = 16.0  # the clips' rate the Wan models were trained at (TI2V-5B: 24; stage one records a cache's own)

    def presets(self):
        # flow_shift at the base resolution, as diffusers' Wan schedulers sample: 3.0 at 480p, 5.0 at 720p ("5.0 for 720P,
        # 3.0 for 480P", WanPipeline's example; Wan 2.2 A14B's diffusers scheduler 3.0; TI2V-5B, a 720p model, 5.0);
        # --flow-shift sets another. A14B: two experts split at the released boundary_ratio, 0.875 (T2V) and 0.9 (I2V);
        # validation's guidance of each as the original inference configs (high noise 4.0 / low 3.0; 3.5 / 3.5)
        return {
            "wan2.1-t2v-1.3b": lambda: preset("wan2.1-t2v-1.3b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                              "wan21_t2v_1_3b_transformer.json", 3.0, 480, VAE21),
            "wan2.1-t2v-14b": lambda: preset("wan2.1-t2v-14b", "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                                             "wan21_t2v_14b_transformer.json", 3.0, 480, VAE21),
            "wan2.1-i2v-14b-480p": lambda: preset("wan2.1-i2v-14b-480p", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                                  "wan21_i2v_14b_transformer.json", 3.0, 480, {**VAE21, **CLIP_H},
                                                  image_to_video=True),
            "wan2.1-i2v-14b-720p": lambda: preset("wan2.1-i2v-14b-720p", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
                                                  "wan21_i2v_14b_transformer.json", 5.0, 720, {**VAE21, **CLIP_H},
                                                  image_to_video=True),
            "wan2.2-t2v-a14b": lambda: preset("wan2.2-t2v-a14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                                              "wan22_t2v_a14b_transformer.json", 3.0, 480, VAE21, experts=EXPERTS,
                                              expert_boundary=0.875, guidance_scale=4.0, guidance_scale_2=3.0),
            "wan2.2-i2v-a14b": lambda: preset("wan2.2-i2v-a14b", "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
                                              "wan22_i2v_a14b_transformer.json", 3.0, 480, VAE21, experts=EXPERTS,
                                              expert_boundary=0.9, guidance_scale=3.5, guidance_scale_2=3.5,
                                              image_to_video=True),
            "wan2.2-ti2v-5b": lambda: preset("wan2.2-ti2v-5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                                             "wan22_ti2v_5b_transformer.json", 5.0, 720, VAE22, latent_downsample=16,
                                             expand_timesteps=True),
            # stage one's tiny umT5 limits: 64 tokens (zero-filled to 512 as the pipelines do), 512 for the I2V preset
            "tiny-wan": lambda: WanPreset("tiny-wan", self.name, None, TINY, "flow", "flow", flow_shift=3.0,
                                          base_resolution=64, text_tokens=64, validation_steps=4, guidance_scale=5.0),
            "tiny-wan-i2v": lambda: WanPreset("tiny-wan-i2v", self.name, None, TINY_I2V, "flow", "flow", flow_shift=3.0,
                                              base_resolution=64, text_tokens=TEXT_TOKENS, validation_steps=4,
                                              guidance_scale=5.0, image_to_video=True),
        }

    def pipeline_of(self, preset):
        return "WanImageToVideoPipeline" if getattr(preset, "image_to_video", False) else self.pipeline

    def first_frame_conditioning(self, preset):
        """TI2V-5B: its pipelines' `expand_timesteps`."""
        return getattr(preset, "expand_timesteps", False)

    def first_frame_preset(self, preset):
        """TI2V-5B trained image-to-video: sampled by WanImageToVideoPipeline from an image (its repository's config sets
        `expand_timesteps`)."""
        return replace(preset, image_to_video=True) if self.first_frame_conditioning(preset) else preset

    def blocks(self, model):
        return list(model.blocks)

    def tread_route(self, model):
        """The video tokens of every block (text and a first frame's CLIP tokens are the cross-attention's keys, another
        argument); the 3D rotary embedding's rows, and a per-token timestep embedding's (Wan 2.2 TI2V), gathered for each
        sample's kept tokens."""
        return TokenRoute(self.blocks(model), per_token=wan_token_rows)

    # --- the cache it reads: latents (C, T, h, w), an I2V model's condition on top of them ---

    def latent_channels(self, config: Mapping) -> int:
        return config.get("out_channels") or config["in_channels"]  # an I2V model's in_channels count the condition's

    def condition_channels(self, config: Mapping) -> int:
        """Channels of the cached first-frame condition (mask and latent) an image-to-video model takes (0: none)."""
        return config["in_channels"] - self.latent_channels(config)

    def channels_name(self) -> str:
        return "out_channels"

    def cache_problems(self, spec, config):
        """Besides the base's: the cache must hold clips of the Wan VAE's 4 frames per latent frame, and, for an
        image-to-video transformer, the first-frame fields it takes."""
        problems = super().cache_problems(spec, config)
        if spec.latent.temporal_downsample != TEMPORAL:
            held = (f"clips of {spec.latent.temporal_downsample} frames per latent frame" if spec.latent.temporal_downsample
                    else "images (latents without a frame axis)")
            problems.append(f"latent frames: the cache holds {held}; Wan's VAE makes one latent frame of {TEMPORAL}")
        missing = [name for name in self.model_conditioning(config) if name not in self.conditioning_fields(spec)]
        if missing:
            problems.append(f"first frame: the model takes {' and '.join(missing)}, which stage one caches for image-to-video "
                            f"presets; this cache was built for {spec.preset or 'another preset'}")
        return problems

    def model_conditioning(self, config: Mapping) -> tuple[str, ...]:
        """The cached first-frame fields the transformer takes: an I2V model's `condition`, Wan 2.1's `image_embeds`."""
        return (("condition",) if self.condition_channels(config) else ()) + (
            ("image_embeds",) if config.get("image_dim") is not None else ())

    def conditioning_fields(self, spec):
        """The first-frame fields a cache holds: those of the image-to-video preset stage one built it for (a text-to-video
        transformer ignores them)."""
        from train.families import PRESETS, get_preset

        if spec.preset not in PRESETS:
            return ()
        return self.model_conditioning(get_preset(spec.preset).transformer_config())

    def latent_patch(self, config: Mapping) -> int:
        return config.get("patch_size", (1, 2, 2))[1]

    def text_width(self, config: Mapping) -> int:
        return config["text_dim"]

    # --- the transformer's call ---

    def forward(self, model, config, xt, t, batch, guidance):
        """As WanPipeline / WanImageToVideoPipeline call it: the noisy latents (B, C, T, h, w), with an I2V model's cached
        `condition` (B, 4 + C, T, h, w) concatenated on the channels, the timestep (B,) in [0, 1000], the caption's tokens
        zero-filled to 512 and, for Wan 2.1 I2V, the cached CLIP `image_embeds` (B, 257, 1280). A batch marking clips
        whose first latent frame is clean (`CLEAN_FIRST_FRAME`, TI2V image-to-video) gives a timestep per token
        (`token_timesteps`), as the pipelines with `expand_timesteps` pass it."""
        from train.objectives import CLEAN_FIRST_FRAME  # (the objective's module imports diffusers: not at start-up)

        x = xt
        clean = batch.get(CLEAN_FIRST_FRAME)
        if clean is not None:
            t = token_timesteps(config, xt, t, clean)
        if self.condition_channels(config):
            if "condition" not in batch:
                raise ValueError("this Wan transformer is image-to-video: it takes the first-frame condition stage one "
                                 "caches for an I2V preset (the batch has none); train from a cache built for it")
            x = torch.cat([xt, batch["condition"].to(xt.dtype)], dim=1)
        image = None
        if config.get("image_dim") is not None:
            if "image_embeds" not in batch:
                raise ValueError("this Wan transformer takes the first frame's CLIP embedding, which stage one caches for "
                                 "Wan 2.1 I2V presets (the batch has none); train from a cache built for it")
            image = batch["image_embeds"].to(xt.dtype)
        return model(hidden_states=x, timestep=t, encoder_hidden_states=batch["text"].to(xt.dtype),
                     encoder_hidden_states_image=image, return_dict=False)[0]

    def example_batch(self, config, preset, bucket, batch, tokens, dtype, device="meta"):
        """Zeros of a batch of clips of `bucket` (a `shards.Bucket`, or (height, width): one frame): latents
        (B, C, T, h, w) and, for I2V models, the condition and image embedding the cache holds."""
        height, width, frames = Bucket(*bucket)
        down, t = preset.latent_downsample, (max(frames, 1) - 1) // TEMPORAL + 1
        shape = (batch, self.latent_channels(config), t, height // down, width // down)
        out = {"latents": torch.zeros(shape, device=device, dtype=dtype), **self.text.example(config, self, batch, tokens, dtype, device)}
        if self.condition_channels(config):
            out["condition"] = torch.zeros(batch, self.condition_channels(config), *shape[2:], device=device, dtype=dtype)
        if config.get("image_dim") is not None:
            out["image_embeds"] = torch.zeros(batch, 257, config["image_dim"], device=device, dtype=dtype)
        return out

    def image_tokens(self, config, preset, bucket):
        """Tokens of one clip of `bucket` (a `shards.Bucket`, or (height, width): one frame): latent frames x patches."""
        height, width, frames = Bucket(*bucket)
        per_token = preset.latent_downsample * self.latent_patch(config)
        return ((max(frames, 1) - 1) // TEMPORAL + 1) * (height // per_token) * (width // per_token)

    # --- validation, as the stock pipelines sample ---

    def sampling_scheduler(self, objective, pixels):
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler(**SCHEDULER, flow_shift=objective.shift_at(pixels))

    def set_timesteps(self, scheduler, objective, steps, pixels, device):
        scheduler.set_timesteps(steps, device=device)
        scheduler.set_begin_index(0)

    def denoise(self, forward, scheduler, latents, text, *, guidance, channels, autocast, low: Callable | None = None,
                boundary: float | None = None, guidance_2: float | None = None):
        """The pipelines' loop: one pass on the caption and, when `guidance` > 1, one on the null caption, combined by
        `combine`. Two experts: `forward` (high noise) at timesteps >= `boundary` x 1000 and `low` with `guidance_2` after
        (default: `guidance`), as the pipelines switch at `boundary_ratio` (`low` None: `forward` is both, as
        `train.experts.Experts`, and only the guidance changes there). `text` holds the null caption's fields, then
        the prompt's (an I2V model's condition and image embedding too). With a clean first frame's latent
        (`FIRST_FRAME`, TI2V image-to-video) the transformer sees it in place of the first latent frame at every step,
        its tokens at timestep 0, and it replaces that frame at the end, as WanImageToVideoPipeline with
        `expand_timesteps` samples (the scheduler steps the latents beside it, as there)."""
        from train.objectives import CLEAN_FIRST_FRAME, FIRST_FRAME

        first = text.get(FIRST_FRAME)
        null, caption = (single({k: v for k, v in text.items() if k != FIRST_FRAME}, j) for j in (0, 1))
        if first is not None:
            condition = first[:1].float()  # (1, C, 1, h, w)
            keep = torch.ones(1, 1, *latents.shape[2:], device=latents.device)  # the pipeline's first_frame_mask
            keep[:, :, 0] = 0
            flags = {CLEAN_FIRST_FRAME: torch.ones(1, dtype=torch.bool, device=latents.device)}
            null, caption = {**null, **flags}, {**caption, **flags}
        switch = None if boundary is None else boundary * scheduler.config.num_train_timesteps
        for t in scheduler.timesteps:
            model, scale = forward, guidance
            if switch is not None and t < switch:  # `forward` of both experts routes by the timestep itself
                model, scale = low or forward, guidance if guidance_2 is None else guidance_2
            x = latents if first is None else (1 - keep) * condition + keep * latents
            with autocast:
                pred = model(x, t.expand(1), caption).float()
                if scale > 1:
                    pred = self.combine(model(x, t.expand(1), null).float(), pred, scale)
            latents = scheduler.step(pred, t, latents).prev_sample
        return latents if first is None else (1 - keep) * condition + keep * latents

    # --- LoRA and export ---

    def save_adapter(self, directory: Path, state, config, lora_format, fold):
        if lora_format == "kohya":
            from train.families import wan_kohya

            return wan_kohya.save(directory, state, config)
        return super().save_adapter(directory, state, config, lora_format, fold)

    def read_lora(self, tensors, header):
        from train.families import wan_kohya

        return wan_kohya.read(tensors, header)

    def lora_usage(self, location, weight_name, component="transformer", subfolder=None):
        # diffusers loads Wan adapters into `transformer` (the high-noise expert of Wan 2.2 A14B) unless told otherwise
        into = ", load_into_transformer_2=True" if component == "transformer_2" else ""
        name = f', weight_name="{weight_name}"' if weight_name else ""
        folder = f', subfolder="{subfolder}"' if subfolder else ""
        return [], [f'pipe.load_lora_weights("{location}"{name}{folder}{into})']

    def usage_generate(self, preset, extra):
        first = ', image=load_image("first_frame.png")' if getattr(preset, "image_to_video", False) else ""
        loads = ", load_image" if first else ""
        fps = 24 if self.first_frame_conditioning(preset) else 16  # TI2V-5B's clips are 24 fps, the others' 16
        return [f"from diffusers.utils import export_to_video{loads}"], [
            f'frames = pipe("a prompt"{first}, num_frames=81{extra}).frames[0]', f'export_to_video(frames, "video.mp4", fps={fps})']


def token_timesteps(config: Mapping, xt: torch.Tensor, t: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """(B, S): every token's timestep as the pipelines pass them with `expand_timesteps` (`first_frame_mask`, one value per
    1 x 2 x 2 patch, frame by frame): the sample's `t` (B,), 0 on the first latent frame's tokens of the `clean` (B,)
    ones."""
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    b, _, frames, height, width = xt.shape
    mask = torch.ones(b, frames // p_t, height // p_h, width // p_w, device=xt.device)
    mask[:, 0] = torch.where(clean.reshape(-1, 1, 1), 0.0, 1.0)
    return (mask * t.reshape(-1, 1, 1, 1)).flatten(1)


def wan_token_rows(arguments: dict, kept: torch.Tensor) -> dict:
    """The rotary embedding (cos, sin), (1, S, 1, D) each, for the kept tokens `kept` (B, K): (B, K, 1, D); a per-token
    timestep embedding (B, S, 6, D) likewise."""
    from train.tread import gather_tokens

    rows = kept.shape[0]
    out = {"rotary_emb": tuple(gather_tokens(r.expand(rows, *r.shape[1:]), kept) for r in arguments["rotary_emb"])}
    if arguments["temb"].dim() == 4:
        out["temb"] = gather_tokens(arguments["temb"], kept)
    return out

def single(text: dict, j: int) -> dict:
    """Row `j` of every field of a collated batch, as a batch of one."""
    return {k: v[j : j + 1] if isinstance(v, torch.Tensor) else v for k, v in text.items()}


FAMILY = Wan()
