"""Flux.1: double- then single-stream blocks over every T5 token (no mask) and the latents packed into 2 x 2 patches,
pooled CLIP-L; flow matching whose shift follows the image's sequence length (FLUX.1-dev, guidance-distilled: the
guidance value goes into its guidance embedding) or none (FLUX.1-schnell, timestep-distilled). Sampled as FluxPipeline
samples: its sigmas and mu, one pass per step, no classifier-free guidance. Adapters in diffusers' or kohya's layout.

FLUX.1 Kontext is FLUX.1-dev trained to edit: the same transformer, called with the packed tokens of one reference image
after the target's (their position ids' first coordinate 1), as FluxKontextPipeline calls it; only the target's tokens
are predicted."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from shards import Bucket
from train.families.base import ATTENTION, TEXT_STREAM, Family, ModelPreset, TextInput, TokenRoute, group_of, indices, reference_groups

# Flux.1-dev's features at CPU size: double- and single-stream blocks, 3-axis RoPE (the axes sum to the head width),
# the guidance embedding; the text and pooled widths of tiny-sd3's encoders.
TINY = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
# Parameter counts of the published encoder configs. Its VAE is SD3's architecture (16 channels, no quant convs; its
# own weights, shift and scaling); CLIP-L without the projection (CLIPTextModel)
ENCODERS = {"Flux VAE (AutoencoderKL)": 83_819_683, "CLIP-L": 123_060_480, "T5-v1.1-XXL encoder": 4_762_310_656}


class FluxText(TextInput):
    """"flux": per caption `text`, every T5 token padding included (Flux attends to the padding without a mask, so it
    is part of the input), and `pooled`, CLIP-L's pooled output."""

    layout = "flux"
    description = "every T5 token and CLIP-L's pooled vector"

    def caption(self, spec, fields, pick=0):
        return {**super().caption(spec, fields, pick), "pooled": fields["pooled"][pick]}

    def collate(self, spec, conds):
        """`text` (B, L, D) (every caption holds every T5 token: nothing is padded) and `pooled` (B, D_pooled)."""
        return {**super().collate(spec, conds), "pooled": torch.stack([c["pooled"] for c in conds])}

    def problems(self, spec, config, family):
        problems = []
        if spec.t5_width != config.get("joint_attention_dim"):
            problems.append(f"T5 width: cache {spec.t5_width}, model joint_attention_dim {config.get('joint_attention_dim')}")
        if spec.pooled_width != config.get("pooled_projection_dim"):
            problems.append(f"pooled width: cache {spec.pooled_width}, model pooled_projection_dim {config.get('pooled_projection_dim')}")
        return problems

    def example(self, config, family, batch, tokens, dtype, device="meta"):
        return {"text": torch.zeros(batch, tokens, family.text_width(config), device=device, dtype=dtype),
                "pooled": torch.zeros(batch, config["pooled_projection_dim"], device=device, dtype=dtype)}


def preset(name: str, family: str, repo: str, config: str, **kwargs) -> ModelPreset:
    return ModelPreset(name, family, repo, config, "flow", "flow", encoder_parameters=ENCODERS, released_dtype="bf16", **kwargs)


class Flux(Family):
    name = "flux"
    title = "Flux"
    transformer = "FluxTransformer2DModel"
    pipeline = "FluxPipeline"
    text = FluxText()
    # diffusers' train_dreambooth_lora_flux.py: both streams' attention (q, k, v of the single-stream blocks too, which
    # have no output projection) and the double-stream blocks' feed-forwards, image and text
    lora_targets = ATTENTION + TEXT_STREAM + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    lora_formats = ("diffusers", "kohya", "lycoris")
    # the empty caption, what FluxPipeline encodes for an empty prompt and true-CFG's negative prompt: zeroed T5 tokens
    # and pooled vector are no input its pipeline ever builds
    null_caption = "empty"
    no_controlnet = ("--controlnet trains the ControlNets of the families that have one here; Flux ControlNet training "
                     "(FluxControlNetModel beside the packed latents) is not built yet")

    def presets(self):
        # dev shifts by the image's sequence length; schnell samples unshifted (its scheduler: shift 1, no dynamic
        # shifting); validation as FluxPipeline's defaults (dev: 28 steps at distilled guidance 3.5; schnell: the 4
        # steps it was distilled for, no guidance). dev trains with its guidance embedding at 1.0, as kohya's
        # sd-scripts, SimpleTuner and ai-toolkit train it: the loss target is the data's velocity, the unguided
        # prediction, which the distilled embedding gives at guidance 1; training at 3.5 would teach it that 3.5 means
        # no guidance, and sampling at 3.5 would then be unguided (washed out)
        return {
            "flux-dev": lambda: preset("flux-dev", self.name, "black-forest-labs/FLUX.1-dev", "flux_dev_transformer.json",
                                       dynamic_shift=True, text_tokens=512, validation_steps=28, guidance_scale=3.5,
                                       train_guidance=1.0),
            "flux-schnell": lambda: preset("flux-schnell", self.name, "black-forest-labs/FLUX.1-schnell",
                                           "flux_schnell_transformer.json", text_tokens=256, validation_steps=4,
                                           guidance_scale=0.0),
            "tiny-flux": lambda: ModelPreset("tiny-flux", self.name, None, TINY, "flow", "flow", dynamic_shift=True,
                                             base_resolution=256, text_tokens=32, guidance_scale=3.5,
                                             train_guidance=1.0),
            # FLUX.1 Kontext [dev]: FLUX.1-dev's architecture and shift, one reference image; validation edits as its
            # pipeline's documented example does (28 steps, guidance 2.5), training feeds the guidance embedding 1.0 as
            # for FLUX.1-dev. A reference is prepared at about one megapixel (the pipeline's preferred resolutions);
            # the tiny preset's at about 128 x 128 (stage one's scaled-down table)
            "flux1-kontext-dev": lambda: preset("flux1-kontext-dev", self.name, "black-forest-labs/FLUX.1-Kontext-dev",
                                                "flux1_kontext_dev_transformer.json", dynamic_shift=True, text_tokens=512,
                                                validation_steps=28, guidance_scale=2.5, train_guidance=1.0, references=1),
            "tiny-flux1-kontext": lambda: ModelPreset("tiny-flux1-kontext", self.name, None, TINY, "flow", "flow",
                                                      dynamic_shift=True, base_resolution=256, text_tokens=32,
                                                      guidance_scale=2.5, train_guidance=1.0, references=1,
                                                      reference_pixels=128 * 128),
        }

    def blocks(self, model):
        return list(model.transformer_blocks) + list(model.single_transformer_blocks)

    def tread_route(self, model):
        """The image stream of the double-stream blocks and the image part of the single-stream ones, one range over
        both (each takes the image tokens apart from the text's and returns them second); the rotary table's text rows
        stay and its image rows are gathered for the kept tokens. One selection per call: the table has no batch
        dimension (FluxPipeline's ids are one per call)."""
        return TokenRoute(self.blocks(model), output=1, shared=True, per_token=flux_rotary_rows)

    def tread_tokens(self, config, xt):
        """The target's packed tokens; a Kontext reference's follow them and are never routed: they are the image being
        edited, which every block sees at inference, and their outputs are dropped, so routing them would only hide
        the input from the blocks between."""
        return (xt.shape[-2] // 2) * (xt.shape[-1] // 2)

    def latent_channels(self, config: Mapping) -> int:
        return config["in_channels"] // 4  # in_channels count the 2 x 2 packed patch

    def channels_name(self) -> str:
        return "in_channels / 4 (2 x 2 packed)"

    def output_channels(self, config: Mapping) -> int:
        return self.latent_channels(config)  # unpacked back to the latent's

    def latent_patch(self, config: Mapping) -> int:
        return 2

    def text_width(self, config: Mapping) -> int:
        return config["joint_attention_dim"]

    def mu(self, image_tokens: int) -> float:
        """calculate_shift with diffusers' defaults (FLUX.1's scheduler config: 256 -> 0.5, 4096 -> 1.15)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        return calculate_shift(image_tokens)

    def forward(self, model, config, xt, t, batch, guidance):
        """As FluxPipeline calls it: the latents packed into 2 x 2 patches (B, h/2 * w/2, 4C) with their position ids,
        every T5 token with zero ids, the pooled CLIP-L vector, the timestep as sigma (t / 1000) and, for guidance-
        distilled models, the guidance (B,); the prediction unpacked to (B, C, h, w). An edit batch (Kontext: its
        `references`) runs one call per group of samples whose references share a shape (`reference_groups`), each
        as FluxKontextPipeline calls it (`edit_call`)."""
        if "references" not in batch:
            return self.edit_call(model, config, xt, t, batch, guidance, [])
        groups = reference_groups(batch)
        if len(groups) == 1:
            return self.edit_call(model, config, xt, t, batch, guidance, batch["references"])
        preds, order = [], []
        for rows in groups:
            index = indices(rows, xt.device)
            group = group_of(batch, rows)
            preds.append(self.edit_call(model, config, xt[index], t[index], group, guidance, group["references"]))
            order += rows
        inverse = torch.empty(len(order), dtype=torch.long, device=xt.device)
        inverse[indices(order, xt.device)] = torch.arange(len(order), device=xt.device)
        return torch.cat(preds)[inverse]

    def edit_call(self, model, config, xt, t, batch, guidance, references: list[list[torch.Tensor]]) -> torch.Tensor:
        """One transformer call on samples whose references (per sample a list of (C, h', w'), the same shapes for
        every sample; none for text-to-image) share a shape: as FluxKontextPipeline's denoising loop, the packed
        reference tokens after the target's (B, N + M, 4C) and their ids after the target's, their first coordinate 1
        instead of 0 (`prepare_latents`); of the prediction the first N tokens, the target's."""
        from diffusers import FluxPipeline

        b, c, h, w = xt.shape
        packed = FluxPipeline._pack_latents(xt, b, c, h, w)
        img_ids = image_ids(h // 2, w // 2, xt.device, xt.dtype)  # (h/2 * w/2, 3)
        count = len(references[0]) if references else 0
        if count > 1:
            raise ValueError(f"a sample with {count} reference images: FLUX.1 Kontext takes one (its pipeline's `image`)")
        if count:
            ref = torch.stack([sample[0] for sample in references]).to(xt.dtype)  # (B, C, h', w')
            rh, rw = ref.shape[-2:]
            ref_ids = image_ids(rh // 2, rw // 2, xt.device, xt.dtype, first=1)
            packed = torch.cat([packed, FluxPipeline._pack_latents(ref, b, c, rh, rw)], dim=1)
            img_ids = torch.cat([img_ids, ref_ids])
        text = batch["text"].to(xt.dtype)  # (B, L, D): every token, padding included
        txt_ids = torch.zeros(text.shape[1], 3, device=xt.device, dtype=xt.dtype)
        g = None
        if config["guidance_embeds"]:
            if guidance is None:
                raise ValueError("this Flux transformer embeds a guidance value (FLUX.1-dev): give one (--train-guidance)")
            g = torch.full((b,), float(guidance), device=xt.device, dtype=torch.float32)
        out = model(hidden_states=packed, encoder_hidden_states=text, pooled_projections=batch["pooled"].to(xt.dtype),
                    timestep=t / 1000, img_ids=img_ids, txt_ids=txt_ids, guidance=g, return_dict=False)[0]
        out = out[:, : (h // 2) * (w // 2)]  # the target's tokens
        return FluxPipeline._unpack_latents(out, h, w, 1)  # sizes given in latent pixels: a scale factor of 1

    def reference_size(self, config, preset, bucket):
        """FluxKontextPipeline's size for a reference of the bucket's aspect ratio: its preferred resolution nearest
        that ratio, floored to whole tokens; scaled to the preset's `reference_pixels` where that is not the table's
        megapixel (the tiny preset's table is the pipeline's divided by 8)."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        bucket = Bucket(*bucket)
        step = preset.latent_downsample * self.latent_patch(config)
        scale = (preset.reference_pixels / (1024 * 1024)) ** 0.5
        _, width, height = min((abs(bucket.width / bucket.height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        return (max(step, round(height * scale) // step * step), max(step, round(width * scale) // step * step))

    def sampling_scheduler(self, objective, pixels):
        from diffusers import FlowMatchEulerDiscreteScheduler

        # FLUX.1's scheduler: the dynamic (exponential) shift from mu, or a fixed shift (schnell's is 1)
        if objective.dynamic_shift:
            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True,
                                                   time_shift_type="exponential")
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=objective.shift_at(pixels))

    def set_timesteps(self, scheduler, objective, steps, pixels, device):
        # FluxPipeline's sigmas, shifted by mu of the image's sequence length when dynamic
        mu = objective.mu(pixels) if objective.dynamic_shift else None
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu, device=device)

    def denoise(self, forward, scheduler, latents, text, *, guidance, channels, autocast):
        # guidance-distilled or timestep-distilled: one pass on the caption, no null half (of an edit, the caption's
        # row of the references too: the pipeline passes its image's tokens at every step)
        text = {k: v[-1:] if isinstance(v, (torch.Tensor, list)) else v for k, v in text.items()}
        for t in scheduler.timesteps:
            with autocast:
                pred = forward(latents, t.expand(1), text).float()
            latents = scheduler.step(pred, t, latents).prev_sample
        return latents

    def pipeline_of(self, preset: ModelPreset) -> str:
        return "FluxKontextPipeline" if preset.references else self.pipeline

    def usage_generate(self, preset: ModelPreset | None, extra: str) -> tuple[list[str], list[str]]:
        if preset is not None and preset.references:  # an edit, at the guidance Kontext's examples use (the pipeline's default is 3.5)
            extra = f", guidance_scale={preset.guidance_scale:g}{extra}"
        return super().usage_generate(preset, extra)

    def save_adapter(self, directory: Path, state, config, lora_format, fold):
        if lora_format == "kohya":
            from train.families import flux_kohya

            return flux_kohya.save(directory, state, config)
        return super().save_adapter(directory, state, config, lora_format, fold)

    def read_lora(self, tensors, header):
        from train.families import flux_kohya

        return flux_kohya.read(tensors, header)


def flux_rotary_rows(arguments: dict, kept: torch.Tensor) -> dict:
    """The rotary table (cos, sin), (text + image tokens, D) each, for the text tokens and the kept image tokens
    (`kept` (1, K) among the image tokens)."""
    text = arguments["encoder_hidden_states"].shape[1]
    cos, sin = arguments["image_rotary_emb"]
    rows = torch.cat([torch.arange(text, device=cos.device), text + kept[0].to(cos.device)])
    return {"image_rotary_emb": (cos[rows], sin[rows])}


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype, first: float = 0.0) -> torch.Tensor:
    """FluxPipeline's `_prepare_latent_image_ids` (first coordinate 0, then row and column, as float32 converted to
    `dtype`), (height * width, 3), built on `device`: the pipeline builds them on the host and copies them over, which
    waits for the device at every call. Kontext's reference ids have their first coordinate 1 (`first`)."""
    ids = torch.zeros(height, width, 3, device=device)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(height * width, 3).to(dtype)


FAMILY = Flux()
