"""Qwen-Image: a 60-block double-stream MMDiT over the latents packed into 2 x 2 patches and Qwen2.5-VL's caption tokens
with a mask; flow matching whose shift follows the image's sequence length (its scheduler's base and max shift), and
sampled as QwenImagePipeline samples: its scheduler and sigmas, true classifier-free guidance against the empty caption
with its norm-rescaled combination, one transformer pass per caption.

Qwen-Image-Edit and Qwen-Image-Edit-2509 are the same transformer taking the reference images' packed latents after the
target's (QwenImageEditPipeline, QwenImageEditPlusPipeline): `img_shapes` lists the target's and each reference's
patch grid, and only the target's tokens are the prediction."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from train.families.base import Family, ModelPreset, TokenRoute, group_of, reference_groups, stacked_references

# The published scheduler's config (scheduler/scheduler_config.json of Qwen/Qwen-Image): mu from the image's sequence
# length between these points, the exponential time shift, and sampling stretched to end at sigma 0.02.
SCHEDULER = {
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9, "num_train_timesteps": 1000,
    "shift": 1.0, "shift_terminal": 0.02, "use_dynamic_shifting": True, "time_shift_type": "exponential",
    "invert_sigmas": False, "stochastic_sampling": False, "use_beta_sigmas": False, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# Qwen-Image's features at CPU size: double-stream blocks, 3-axis RoPE (the axes sum to the head width), 16 latent
# channels packed 2 x 2 (in_channels 64), the tiny Qwen2.5-VL's width.
TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
# Parameter counts of the published encoders (diffusers 0.42.1 / transformers 5.24 modules, counted on the meta device):
# the VAE's default config is the published one; Qwen2.5-VL-7B-Instruct whole, as the pipeline loads it (vision tower
# and LM head included).
ENCODERS = {"Qwen-Image VAE (AutoencoderKLQwenImage)": 126_892_531,
            "Qwen2.5-VL-7B (Qwen2_5_VLForConditionalGeneration)": 8_292_166_656}
# The edit presets' pipelines; their transformer is Qwen-Image's architecture (the published config is the same).
EDIT_PIPELINES = {"qwen-image-edit": "QwenImageEditPipeline", "qwen-image-edit-2509": "QwenImageEditPlusPipeline",
                  "tiny-qwen-image-edit": "QwenImageEditPipeline", "tiny-qwen-image-edit-2509": "QwenImageEditPlusPipeline"}
# What stage one caches per edit text: the caption (up to 512 tokens, as a planning figure; the edit pipelines cut nothing)
# and Qwen2.5-VL's vision tokens of the references: about 37 x 37 for Edit's 1024 x 1024 image, 14 x 14 and the
# "Picture n: " words for each of 2509's three 384 x 384 ones.
EDIT_TOKENS = 512 + 37 * 37
EDIT_2509_TOKENS = 512 + 3 * (14 * 14 + 7)


class QwenImage(Family):
    name = "qwen-image"
    title = "Qwen-Image"
    transformer = "QwenImageTransformer2DModel"
    pipeline = "QwenImagePipeline"
    # lora_targets: the attention projections, as diffusers' train_dreambooth_lora_qwen_image.py (the base default)
    null_caption = "empty"  # what the pipeline encodes for an empty negative prompt
    no_controlnet = ("--controlnet trains the ControlNets of the families that have one here; Qwen-Image ControlNet training "
                     "is not built yet")

    def presets(self):
        # validation as QwenImagePipeline's defaults: 50 steps, true_cfg_scale 4; captions cut at 512 tokens as it cuts them
        real = dict(dynamic_shift=True, released_dtype="bf16", encoder_parameters=ENCODERS, validation_steps=50, guidance_scale=4.0)
        tiny = dict(dynamic_shift=True, base_resolution=256, text_tokens=64, guidance_scale=4.0)
        # the edit pipelines prepare each reference at about a megapixel (tiny: 64 x 64) and take one (Edit) or up to
        # three (2509, as its model card documents) references
        return {
            "qwen-image": lambda: ModelPreset("qwen-image", self.name, "Qwen/Qwen-Image", "qwen_image_transformer.json", "flow",
                                              "flow", text_tokens=512, **real),
            "qwen-image-edit": lambda: ModelPreset("qwen-image-edit", self.name, "Qwen/Qwen-Image-Edit", "qwen_image_transformer.json",
                                                   "flow", "flow", text_tokens=EDIT_TOKENS, references=1,
                                                   reference_pixels=1024 * 1024, **real),
            "qwen-image-edit-2509": lambda: ModelPreset("qwen-image-edit-2509", self.name, "Qwen/Qwen-Image-Edit-2509",
                                                        "qwen_image_transformer.json", "flow", "flow", text_tokens=EDIT_2509_TOKENS,
                                                        references=3, reference_pixels=1024 * 1024, **real),
            "tiny-qwen-image": lambda: ModelPreset("tiny-qwen-image", self.name, None, TINY, "flow", "flow", **tiny),
            "tiny-qwen-image-edit": lambda: ModelPreset("tiny-qwen-image-edit", self.name, None, TINY, "flow", "flow", references=1,
                                                        reference_pixels=64 * 64, **tiny),
            "tiny-qwen-image-edit-2509": lambda: ModelPreset("tiny-qwen-image-edit-2509", self.name, None, TINY, "flow", "flow",
                                                             references=3, reference_pixels=64 * 64, **tiny),
        }

    def pipeline_of(self, preset: ModelPreset) -> str:
        return EDIT_PIPELINES.get(preset.name, self.pipeline)

    def reference_size(self, config: Mapping, preset: ModelPreset, bucket: tuple[int, ...]) -> tuple[int, int]:
        """As the edit pipelines size an input image: `calculate_dimensions` at the preset's area (the bucket's aspect
        ratio, sides multiples of 32)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        height, width = bucket[0], bucket[1]
        w, h = calculate_dimensions(preset.reference_pixels, width / height)
        return h, w

    def usage_generate(self, preset: ModelPreset | None, extra: str) -> tuple[list[str], list[str]]:
        """An edit model's card edits an image (2509: a list of up to three)."""
        pipeline = EDIT_PIPELINES.get(preset.name) if preset is not None else None
        if pipeline is None:
            return super().usage_generate(preset, extra)
        images = ('[load_image("input1.png"), load_image("input2.png")]' if pipeline == "QwenImageEditPlusPipeline"
                  else 'load_image("input.png")')
        return (["from diffusers.utils import load_image"],
                [f'image = pipe(image={images}, prompt="an edit instruction"{extra}).images[0]'])

    def usage_call_args(self) -> str:
        # QwenImagePipeline guides (true CFG) only when given a negative prompt, as validation samples
        return 'negative_prompt="", true_cfg_scale=4.0'

    def tread_route(self, model):
        """The image stream of the dual-stream blocks (returned second, after the text stream, never routed); the image
        rotary table's rows (and a per-token modulation index, where the model has one) gathered for the kept tokens.
        One selection per call: the table has no batch dimension. The joint attention mask is built in the blocks from
        the sequence they get."""
        return TokenRoute(self.blocks(model), output=1, shared=True, per_token=qwen_token_rows)

    def tread_tokens(self, config, xt):
        """The target's packed tokens; the references' follow them and are never routed (the images being edited,
        which every block sees at inference; their outputs are dropped)."""
        return (xt.shape[-2] // 2) * (xt.shape[-1] // 2)

    def latent_channels(self, config: Mapping) -> int:
        return config["in_channels"] // 4  # in_channels count the 2 x 2 packed patch

    def channels_name(self) -> str:
        return "in_channels / 4 (2 x 2 packed)"

    def output_channels(self, config: Mapping) -> int:
        return config.get("out_channels") or self.latent_channels(config)  # unpacked back to the latent's

    def latent_patch(self, config: Mapping) -> int:
        return config.get("patch_size", 2)

    def text_width(self, config: Mapping) -> int:
        return config["joint_attention_dim"]

    def mu(self, image_tokens: int) -> float:
        """The pipeline's calculate_shift with its scheduler's points (256 tokens -> 0.5, 8192 -> 0.9)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        s = SCHEDULER
        return calculate_shift(image_tokens, s["base_image_seq_len"], s["max_image_seq_len"], s["base_shift"], s["max_shift"])

    def forward(self, model, config, xt, t, batch, guidance):
        """As QwenImagePipeline calls it: the latents packed into 2 x 2 patches (B, h/2 * w/2, 4C) with their
        `img_shapes`, the caption tokens with the batch's mask (validation's single captions have none, as the
        pipeline's `encode_prompt` returns none for them), the timestep as sigma (t / 1000); the prediction unpacked
        to (B, C, h, w). An edit batch (`batch["references"]`) runs as the edit pipelines call it, once per group of
        samples whose references share their shapes (`reference_groups`): each reference's packed latent after the
        target's, their patch grids after the target's in `img_shapes`, the target's tokens alone kept."""
        if config.get("guidance_embeds"):
            raise ValueError("this Qwen-Image transformer has guidance_embeds set, which QwenImageTransformer2DModel cannot "
                             "run; train the published architecture (guidance_embeds false)")
        if not batch.get("references"):
            return self.call(model, xt, t, batch, [])
        groups = reference_groups(batch)
        if len(groups) == 1:
            return self.call(model, xt, t, batch, stacked_references(batch) if batch["references"][0] else [])
        out: list[torch.Tensor | None] = [None] * xt.shape[0]
        for rows in groups:
            group = group_of(batch, rows)
            refs = stacked_references(group) if group["references"][0] else []
            index = torch.tensor(rows, device=xt.device)
            for i, pred in zip(rows, self.call(model, xt[index], t[index], group, refs)):
                out[i] = pred
        return torch.stack(out)

    def call(self, model, xt: torch.Tensor, t: torch.Tensor, batch: dict, references: list[torch.Tensor]) -> torch.Tensor:
        """One transformer pass: target (B, C, h, w) and references (B, C, h_j, w_j) each -> the target's prediction."""
        from diffusers import QwenImagePipeline

        sync_free_text_lengths()
        b, c, h, w = xt.shape
        packed = [QwenImagePipeline._pack_latents(x, b, c, x.shape[2], x.shape[3]) for x in (xt, *references)]
        shapes = [(1, x.shape[2] // 2, x.shape[3] // 2) for x in (xt, *references)]
        mask = batch.get("text_mask")
        out = model(hidden_states=torch.cat(packed, dim=1), encoder_hidden_states=batch["text"].to(xt.dtype),
                    encoder_hidden_states_mask=mask, timestep=t / 1000, img_shapes=[shapes] * b, return_dict=False)[0]
        # the target's tokens come first; sizes given in latent pixels: a scale factor of 1; the VAE's frame axis dropped
        return QwenImagePipeline._unpack_latents(out[:, : packed[0].shape[1]], h, w, 1)[:, :, 0]

    # --- validation, as QwenImagePipeline samples ---

    def sampling_scheduler(self, objective, pixels):
        from diffusers import FlowMatchEulerDiscreteScheduler

        if objective.dynamic_shift:  # the published scheduler (a run with a fixed shift samples with that shift)
            return FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
        return super().sampling_scheduler(objective, pixels)

    def set_timesteps(self, scheduler, objective, steps, pixels, device):
        # the pipeline's sigmas, shifted by mu of the image's sequence length when dynamic; its first step index
        mu = objective.mu(pixels) if objective.dynamic_shift else None
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu, device=device)
        scheduler.set_begin_index(0)

    def denoise(self, forward, scheduler, latents, text, *, guidance, channels, autocast):
        """One pass on the caption and, when `guidance` > 1, one on the null caption (each alone, its valid tokens
        without a mask, as the pipeline encodes a single prompt), combined by `combine`."""
        null, caption = (single(text, j) for j in (0, 1))
        for t in scheduler.timesteps:
            with autocast:
                pred = forward(latents, t.expand(1), caption).float()
                if guidance > 1:
                    pred = self.combine(forward(latents, t.expand(1), null).float(), pred, guidance)
            latents = scheduler.step(pred, t, latents).prev_sample
        return latents

    def combine(self, uncond, cond, guidance):
        """True classifier-free guidance rescaled to the conditional prediction's norm per image token, the norms taken
        over the packed patch's channels as the pipeline takes them."""
        from diffusers import QwenImagePipeline

        b, c, h, w = cond.shape
        cond_p, uncond_p = (QwenImagePipeline._pack_latents(x, b, c, h, w) for x in (cond, uncond))
        combined = uncond_p + guidance * (cond_p - uncond_p)
        combined = combined * (torch.norm(cond_p, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return QwenImagePipeline._unpack_latents(combined, h, w, 1)[:, :, 0]


def sync_free_text_lengths() -> None:
    """QwenImageTransformer2DModel's forward asks `compute_text_seq_len_from_mask` for the text's length (for its rotary
    positions) and the mask as booleans, and drops the per-sample lengths it also computes, for which that function makes
    `torch.as_tensor(length, device=...)`: a blocking copy from the host at every call. Its module's name is pointed at
    the same function without that unused part (the length and the mask it returns are the function's own)."""
    from diffusers.models.transformers import transformer_qwenimage as module

    original = module.compute_text_seq_len_from_mask
    if getattr(original, "unused_lengths_dropped", False):
        return

    def text_lengths(encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None):
        length, _, _ = original(encoder_hidden_states, None)  # the sequence's length, from its shape
        if encoder_hidden_states_mask is None or encoder_hidden_states_mask.shape[:2] != encoder_hidden_states.shape[:2]:
            return original(encoder_hidden_states, encoder_hidden_states_mask)  # its answer, or its error
        return length, None, encoder_hidden_states_mask.to(torch.bool)

    text_lengths.unused_lengths_dropped = True
    text_lengths.original = original
    module.compute_text_seq_len_from_mask = text_lengths


def single(text: dict, j: int) -> dict:
    """Caption `j` of a collated batch alone: its valid tokens (1, L_j, D) and no mask; an edit's references with it,
    passed every step as the edit pipelines pass them."""
    tokens = text["text"][j]
    if "text_mask" in text:
        tokens = tokens[text["text_mask"][j].to(torch.bool)]
    out = {"text": tokens[None]}
    if text.get("references"):
        out["references"] = [text["references"][j if len(text["references"]) > 1 else 0]]
    return out


def qwen_token_rows(arguments: dict, kept: torch.Tensor) -> dict:
    """The image rotary table (image tokens, D / 2) complex, with the text's beside it, for the kept image tokens `kept`
    (1, K); a modulation index (B, image tokens) likewise."""
    image, text = arguments["image_rotary_emb"]
    out = {"image_rotary_emb": (image[kept[0].to(image.device)], text)}
    index = arguments.get("modulate_index")
    if index is not None:
        out["modulate_index"] = index.gather(1, kept.to(index.device).expand(index.shape[0], -1))
    return out

FAMILY = QwenImage()
