"""FLUX.2: double- then single-stream blocks over the latents as 128-channel tokens (the VAE's 32 channels patchified
2 x 2 and normalised by stage one) and every caption token of the stacked language-model layers (no mask), with 4-axis
rotary positions (time, row, column, token); flow matching whose shift follows the image's sequence length by the
pipelines' empirical mu. FLUX.2-dev is guidance-distilled (the guidance value goes into its guidance embedding); the
klein models have no guidance embedding (the undistilled bases sample with true classifier-free guidance against the
empty caption, the step-distilled ones with one pass). An edit sample's reference latents follow the target's tokens,
each at its own time offset (10, 20, ...), as Flux2Pipeline builds them; the prediction covers the target's tokens."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from train.families.base import ATTENTION, TEXT_STREAM, Family, ModelPreset, group_of, reference_groups, stacked_references

FLUX2_DEV = "black-forest-labs/FLUX.2-dev"
# The published scheduler (scheduler/scheduler_config.json of FLUX.2-dev and klein): FlowMatchEulerDiscreteScheduler
# shifted by mu (exponential time shift) where the pipelines pass one.
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
             "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "exponential"}
# Training's mu: the pipelines' compute_empirical_mu at their default step count (num_inference_steps=50), since mu
# depends on the step count as well as on the sequence length.
MU_STEPS = 50
# FLUX.2's features at CPU size: double- and single-stream blocks, 4-axis RoPE (the axes sum to the head width), the
# 128-channel patchified latent, the tiny language models' three stacked layers (3 x 16), dev's guidance embedding.
TINY = dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
# Parameter counts of the encoders stage one uses (diffusers 0.42.1 / transformers 5.24 modules counted on the meta
# device): AutoencoderKLFlux2's default config is the published one; Mistral3ForConditionalGeneration from Mistral Small
# 3.1's published config (text 5120 wide, 40 layers, 131072 tokens, its own LM head; Pixtral vision 1024 wide, 24
# layers); Qwen3-4B (tied embeddings) and Qwen3-8B as the pipelines load them (Qwen3ForCausalLM, LM head included).
VAE = {"FLUX.2 VAE (AutoencoderKLFlux2)": 84_046_115}
ENCODERS = {
    "dev": {**VAE, "Mistral Small 3.1 24B (Mistral3ForConditionalGeneration)": 24_011_361_280},
    "4b": {**VAE, "Qwen3-4B (Qwen3ForCausalLM)": 4_022_468_096},
    "9b": {**VAE, "Qwen3-8B (Qwen3ForCausalLM)": 8_190_735_360},
}
# The klein models Flux2KleinPipeline loads: step-distilled (4 steps, no guidance) and undistilled bases (50 steps, true
# classifier-free guidance 4), by preset name: (repository, size)
KLEIN = {"flux2-klein-4b": ("black-forest-labs/FLUX.2-klein-4B", "4b"),
         "flux2-klein-base-4b": ("black-forest-labs/FLUX.2-klein-base-4B", "4b"),
         "flux2-klein-9b": ("black-forest-labs/FLUX.2-klein-9B", "9b"),
         "flux2-klein-base-9b": ("black-forest-labs/FLUX.2-klein-base-9B", "9b")}
DEV_REFERENCES, KLEIN_REFERENCES = 6, 4  # BFL's documented limits (the pipelines set none)
# the single-stream blocks' output projections, by name (see `Flux2.lora_targets`), as many as dev has blocks
SINGLE_OUTPUTS = tuple(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48))
GUIDANCE_EMBEDDED = "guidance_embedded"  # validation's question to `forward` (see `Flux2.denoise`)


def preset(name: str, repo: str | None, config: dict | str, **kwargs) -> ModelPreset:
    # text to image and edits alike: its cache may hold samples without references, and it validates on prompts too
    return ModelPreset(name, "flux2", repo, config, "flow", "flow", dynamic_shift=True, latent_downsample=16,
                       requires_references=False, **kwargs)


def pipeline_class(config: Mapping) -> str:
    """The stock pipeline of a FLUX.2 transformer: dev's (guidance embedding) or klein's."""
    return "Flux2Pipeline" if config.get("guidance_embeds") else "Flux2KleinPipeline"


def position_ids(batch: int, time: int, height: int, width: int, length: int, device: torch.device) -> torch.Tensor:
    """The 4-axis ids (time, row, column, token) of a grid, (B, height * width * length, 4) int64, as the FLUX.2
    pipelines' `_prepare_latent_ids`, `_prepare_image_ids` and `_prepare_text_ids` build them (`torch.cartesian_prod`),
    but on `device`: theirs are built on the host, and copying them over waits for the device at every call."""
    axes = (torch.full((1,), time, device=device), *(torch.arange(n, device=device) for n in (height, width, length)))
    return torch.cartesian_prod(*axes).unsqueeze(0).expand(batch, -1, -1)


def rows(text: dict, picked: slice) -> dict:
    """Rows `picked` of a validation batch: its tensors and its per-sample lists (the references)."""
    return {k: v[picked] if isinstance(v, (torch.Tensor, list)) else v for k, v in text.items()}


class Flux2(Family):
    name = "flux2"
    title = "FLUX.2"
    transformer = "Flux2Transformer2DModel"
    pipeline = "Flux2Pipeline"
    # both streams' attention of the double-stream blocks, their feed-forwards (image and text), and the single-stream
    # blocks' fused q/k/v + MLP input and their output projection, named block by block: its name, `attn.to_out`, is
    # also the double blocks' output list, which a suffix cannot tell apart (as DiffSynth-Studio's FLUX.2 LoRA lists
    # them); dev has 48 single-stream blocks, klein 20 and 24
    lora_targets = ATTENTION + TEXT_STREAM + ("to_qkv_mlp_proj", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                                              "ff_context.linear_out") + SINGLE_OUTPUTS
    null_caption = "empty"  # the empty prompt, what Flux2KleinPipeline encodes as its negative prompt
    no_controlnet = "--controlnet trains the ControlNets of the families that have one here; FLUX.2 has none in diffusers"
    no_tread = ("--tread: token routing is not built for FLUX.2: its single-stream blocks take the caption's and the "
                "image's tokens as one sequence (the transformer joins the two streams after its double-stream blocks), "
                "which the router, taking the image tokens from a block argument of their own, does not split; train "
                "FLUX.2 without --tread")

    def presets(self):
        # dev: validation as Flux2Pipeline's defaults (50 steps, embedded guidance 4); trained with its guidance embedding
        # at 1.0, as FLUX.1-dev is (the loss target is the unguided velocity). klein: the distilled models sample in 4
        # steps without guidance, the bases in 50 with true classifier-free guidance 4 (Flux2KleinPipeline's default).
        out = {"flux2-dev": lambda: preset("flux2-dev", FLUX2_DEV, "flux2_dev_transformer.json", released_dtype="bf16",
                                           encoder_parameters=ENCODERS["dev"], text_tokens=512, validation_steps=50,
                                           guidance_scale=4.0, train_guidance=1.0, references=DEV_REFERENCES)}
        for name, (repo, size) in KLEIN.items():
            distilled = "-base-" not in name
            out[name] = (lambda name=name, repo=repo, size=size, distilled=distilled: preset(
                name, repo, f"flux2_klein_{size}_transformer.json", released_dtype="bf16", encoder_parameters=ENCODERS[size],
                text_tokens=512, validation_steps=4 if distilled else 50, guidance_scale=1.0 if distilled else 4.0,
                references=KLEIN_REFERENCES))
        out["tiny-flux2"] = lambda: preset("tiny-flux2", None, TINY, base_resolution=256, text_tokens=64, guidance_scale=4.0,
                                           train_guidance=1.0, references=DEV_REFERENCES, reference_pixels=128 * 128)
        out["tiny-flux2-klein"] = lambda: preset("tiny-flux2-klein", None, {**TINY, "guidance_embeds": False},
                                                 base_resolution=256, text_tokens=64, guidance_scale=4.0,
                                                 references=KLEIN_REFERENCES, reference_pixels=128 * 128)
        return out

    def pipeline_of(self, preset: ModelPreset) -> str:
        return pipeline_class(preset.transformer_config())

    def blocks(self, model):
        return list(model.transformer_blocks) + list(model.single_transformer_blocks)

    def text_width(self, config: Mapping) -> int:
        return config["joint_attention_dim"]

    def mu(self, image_tokens: int) -> float:
        """The pipelines' compute_empirical_mu of the sequence length at their default 50 steps."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_tokens, MU_STEPS)

    # --- the transformer's call ---

    def forward(self, model, config, xt, t, batch, guidance):
        """As the FLUX.2 pipelines call it: the latents as tokens (B, h * w, 128) with 4-axis ids (0, row, column, 0), each
        reference's tokens after them at time 10, 20, ... (samples whose references differ in shape run one group at a
        time), every caption token with ids (0, 0, 0, token), the timestep as sigma (t / 1000) and, for dev, the
        guidance (B,); returns the target tokens' prediction as (B, 128, h, w)."""
        if GUIDANCE_EMBEDDED in batch:
            batch[GUIDANCE_EMBEDDED] = bool(config["guidance_embeds"])
        references = batch.get("references")
        if not references or not any(references):
            return self.call(model, config, xt, t, batch, [], guidance)
        groups = reference_groups(batch)
        if len(groups) == 1:
            return self.call(model, config, xt, t, batch, stacked_references(batch), guidance)
        out = None  # the groups' predictions gathered in the dtype the transformer returns (autocast's)
        for group in groups:
            part = group_of({**batch, "xt": xt, "t": t}, group)
            pred = self.call(model, config, part["xt"], part["t"], part, stacked_references(part), guidance)
            out = pred.new_empty(xt.shape) if out is None else out
            out[torch.tensor(group, device=xt.device)] = pred
        return out

    def call(self, model, config, xt, t, batch, references: list[torch.Tensor], guidance):
        """One transformer pass over samples whose references share shapes (`references`: reference j of every sample,
        (B, 128, h_j, w_j) each)."""
        from diffusers import Flux2Pipeline

        b, c, h, w = xt.shape
        tokens = Flux2Pipeline._pack_latents(xt)  # (B, h * w, C)
        ids = position_ids(b, 0, h, w, 1, xt.device)  # (B, h * w, 4): (0, row, column, 0)
        if references:
            refs = torch.cat([Flux2Pipeline._pack_latents(r.to(xt.dtype)) for r in references], dim=1)
            # each reference's (10 + 10 j, row, column, 0), as Flux2Pipeline._prepare_image_ids
            ref_ids = torch.cat([position_ids(b, 10 + 10 * j, r.shape[-2], r.shape[-1], 1, xt.device)
                                 for j, r in enumerate(references)], dim=1)
            tokens, ids = torch.cat([tokens, refs], dim=1), torch.cat([ids, ref_ids], dim=1)
        text = batch["text"].to(xt.dtype)  # (B, L, D): every token, padding included
        g = None
        if config["guidance_embeds"]:
            if guidance is None:
                raise ValueError("this FLUX.2 transformer embeds a guidance value (FLUX.2-dev): give one (--train-guidance)")
            g = torch.full((b,), float(guidance), device=xt.device, dtype=torch.float32)
        txt_ids = position_ids(b, 0, 1, 1, text.shape[1], xt.device)  # (B, L, 4): (0, 0, 0, token)
        out = model(hidden_states=tokens, encoder_hidden_states=text, timestep=t / 1000, img_ids=ids,
                    txt_ids=txt_ids, guidance=g, return_dict=False)[0]
        return out[:, : h * w].transpose(1, 2).reshape(b, c, h, w)  # the target's tokens, back to (B, C, h, w)

    # --- validation, as the pipelines sample ---

    def sampling_scheduler(self, objective, pixels):
        from diffusers import FlowMatchEulerDiscreteScheduler

        if objective.dynamic_shift:
            return FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=objective.shift_at(pixels))

    def set_timesteps(self, scheduler, objective, steps, pixels, device):
        # the pipelines' sigmas, shifted by their empirical mu of the image's sequence length and the step count
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        mu = compute_empirical_mu(pixels // objective.pixels_per_token, steps) if objective.dynamic_shift else None
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu, device=device)
        scheduler.set_begin_index(0)

    def denoise(self, forward, scheduler, latents, text, *, guidance, channels, autocast):
        """dev (guidance embedding) and the distilled klein models (`guidance` 1): one pass on the caption per step;
        klein bases: one on the caption and one on the empty caption, combined by classifier-free guidance, as
        Flux2KleinPipeline runs them (the sample's references with both)."""
        # `forward` answers GUIDANCE_EMBEDDED in the caption's batch: whether the model takes the guidance in its
        # embedding (then it is no classifier-free guidance scale)
        null, caption = rows(text, slice(0, 1)), {**rows(text, slice(1, 2)), GUIDANCE_EMBEDDED: None}
        for t in scheduler.timesteps:
            with autocast:
                pred = forward(latents, t.expand(1), caption).float()
                if guidance > 1 and not caption[GUIDANCE_EMBEDDED]:
                    pred = self.combine(forward(latents, t.expand(1), null).float(), pred, guidance)
            latents = scheduler.step(pred, t, latents).prev_sample
        return latents

    def usage_generate(self, preset: ModelPreset | None, extra: str) -> tuple[list[str], list[str]]:
        """Text to image and an edit from reference images, at the preset's validation steps and guidance (klein's
        distilled models: 4 steps, no guidance)."""
        if preset is None:
            return super().usage_generate(preset, extra)
        args = f"num_inference_steps={preset.validation_steps}, guidance_scale={preset.guidance_scale:g}{extra}"
        return ["from diffusers.utils import load_image"], [
            f'image = pipe("a prompt", {args}).images[0]',
            f"# an edit: up to {preset.references} reference images, each prepared as the pipeline prepares its inputs",
            f'edited = pipe(image=[load_image("input.png")], prompt="an edit instruction", {args}).images[0]']


FAMILY = Flux2()
