"""Wan in stage two: the transformer gets what WanPipeline / WanImageToVideoPipeline give it (latents, the condition on
the channels, timestep, zero-filled umT5 tokens, the CLIP image embedding), validation samples what they sample (UniPC,
guidance, two experts switching at the boundary), the released architectures have their parameter counts, each expert
of a two-expert model draws only its own timesteps, and adapters load through the pipelines' load_lora_weights in
diffusers' and musubi-tuner's layouts."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import record_calls

from shards import TextSpec
from train import lora
from train.config import TrainConfig
from train.data import TextLayout
from train.families import PRESETS, get_family, get_preset
from train.families.wan import SCHEDULER, TEXT_TOKENS, Wan
from train.model import build_run_objective
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

WIDTH = 32  # tiny-wan's text width (the tiny umT5's)
FAMILY: Wan = get_family("wan")
# the released transformers' parameter counts (the published configs on the meta device); the A14B presets count one expert
COUNTS = {"wan2.1-t2v-1.3b": 1_418_996_800, "wan2.1-t2v-14b": 14_288_491_584, "wan2.1-i2v-14b-480p": 16_394_878_784,
          "wan2.1-i2v-14b-720p": 16_394_878_784, "wan2.2-t2v-a14b": 14_288_491_584, "wan2.2-i2v-a14b": 14_288_901_184,
          "wan2.2-ti2v-5b": 4_999_787_712}


def tiny_vae():
    """A tiny AutoencoderKLWan (the Wan 2.1 VAE's 16 channels, 8x spatial and 4x temporal), seeded."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])


def stock(transformer, *, vae=None, transformer_2=None, boundary=None, flow_shift=3.0, image_to_video=False):
    """The stock pipeline around `transformer` (captions given as embeddings: no text encoder), with its scheduler as
    published; I2V with a tiny CLIP vision tower when the transformer takes image embeddings."""
    import diffusers

    scheduler = diffusers.UniPCMultistepScheduler(**SCHEDULER, flow_shift=flow_shift)
    if not image_to_video:
        return diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer,
                                     transformer_2=transformer_2, boundary_ratio=boundary)
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = processor = None
    if transformer.config.image_dim is not None:
        torch.manual_seed(0)
        encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=transformer.config.image_dim, projection_dim=32, num_hidden_layers=2,
                                                   num_attention_heads=4, image_size=32, intermediate_size=37, patch_size=4))
        processor = CLIPImageProcessor(crop_size=32, size=32)
    return diffusers.WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler,
                                             image_processor=processor, image_encoder=encoder, transformer=transformer,
                                             transformer_2=transformer_2, boundary_ratio=boundary)


def captions(seed: int = 1) -> tuple[dict, dict]:
    """A caption's and the null caption's valid umT5 tokens, as the cache stores them (trimmed)."""
    g = torch.Generator().manual_seed(seed)
    return {"text": torch.randn(11, WIDTH, generator=g)}, {"text": torch.randn(1, WIDTH, generator=g)}


def padded(*conds: dict) -> torch.Tensor:
    """What the pipelines' encode_prompt returns for these captions: their tokens zero-filled to 512."""
    return TextLayout(TextSpec("padded", WIDTH, TEXT_TOKENS)).collate(list(conds))["text"]


def first_frame() -> "PIL.Image.Image":  # noqa: F821
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def test_the_padded_layout_zero_fills_to_512_as_encode_prompt_does():
    """Captions cached at any limit (the tiny umT5's 64) are zero-filled to the pipelines' default 512 tokens."""
    cond, null = captions()
    text = TextLayout(TextSpec("padded", WIDTH, 64)).collate([null, cond])["text"]
    assert text.shape == (2, TEXT_TOKENS, WIDTH)
    assert torch.equal(text[1, :11], cond["text"]) and not text[1, 11:].any() and not text[0, 1:].any()
    assert TextLayout(TextSpec("padded", WIDTH, 600)).collate([cond])["text"].shape == (1, 600, WIDTH)
    assert FAMILY.text.problems(TextSpec("padded", WIDTH, 600), get_preset("tiny-wan-i2v").transformer_config(), FAMILY) == [
        "text tokens: cache 600, an image-conditioned Wan transformer takes at most 512 (its attention takes the tokens "
        "before the last 512 as the image's)"]
    assert FAMILY.text.problems(TextSpec("padded", WIDTH, 64), get_preset("tiny-wan-i2v").transformer_config(), FAMILY) == []
    assert FAMILY.text.problems(TextSpec("padded", WIDTH, 600), get_preset("tiny-wan").transformer_config(), FAMILY) == []


def test_the_transformer_gets_what_wanpipeline_gives_it():
    """Our forward on the pipeline's latents, timestep and the cached captions zero-filled: the same call and output."""
    transformer = build_transformer(get_preset("tiny-wan"), None, 0).eval()
    calls = record_calls(transformer)
    cond, null = captions()
    latents = torch.randn(1, 16, 3, 8, 12, generator=torch.Generator().manual_seed(2))  # 9 frames at 64 x 96
    stock(transformer)(prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), latents=latents, height=64, width=96,
                       num_frames=9, num_inference_steps=2, guidance_scale=5.0, output_type="latent")
    assert len(calls) == 4  # two steps, each a pass on the caption and one on the negative (empty) caption
    for j, c in ((0, cond), (1, null)):
        seen = calls[j]
        with torch.no_grad():
            ours = model_forward(transformer, "wan")(seen["hidden_states"], seen["timestep"], {"text": padded(c)})
        mine = calls[-1]
        for name in ("hidden_states", "timestep", "encoder_hidden_states"):
            assert torch.equal(mine[name], seen[name]), name
        assert mine["encoder_hidden_states_image"] is None and seen.get("encoder_hidden_states_image") is None
        assert torch.equal(ours, seen["out"])


def test_the_i2v_transformer_gets_the_condition_and_image_embedding_as_the_pipeline_gives_them():
    """Wan 2.1 I2V: the noisy latents with the condition (mask, first-frame latent) on the channels, and the CLIP
    embedding of the first frame; our forward takes both from the batch as stage one caches them."""
    transformer = build_transformer(get_preset("tiny-wan-i2v"), None, 0).eval()
    calls = record_calls(transformer)
    cond, null = captions()
    stock(transformer, vae=tiny_vae(), image_to_video=True)(
        image=first_frame(), prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), height=64, width=64,
        num_frames=9, num_inference_steps=2, guidance_scale=5.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    seen = calls[0]
    assert seen["hidden_states"].shape == (1, 36, 3, 8, 8) and seen["encoder_hidden_states_image"].shape == (1, 65, 32)
    batch = {"text": padded(cond), "condition": seen["hidden_states"][:, 16:], "image_embeds": seen["encoder_hidden_states_image"]}
    with torch.no_grad():
        ours = model_forward(transformer, "wan")(seen["hidden_states"][:, :16], seen["timestep"], batch)
    for name in ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"):
        assert torch.equal(calls[-1][name], seen[name]), name
    assert torch.equal(ours, seen["out"])
    # the condition's mask: 1 on the first frame's four pixel frames, 0 after
    mask = seen["hidden_states"][0, 16:20]
    assert bool((mask[:, 0] == 1).all()) and not mask[:, 1:].any()
    with pytest.raises(ValueError, match="image-to-video: it takes the first-frame condition"):
        model_forward(transformer, "wan")(seen["hidden_states"][:, :16], seen["timestep"], {"text": padded(cond)})


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["cfg", "no-cfg"])
def test_validation_samples_what_wanpipeline_samples(guidance):
    """The family's scheduler, timesteps and loop against WanPipeline.__call__ from the same noise and captions."""
    preset = get_preset("tiny-wan")
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model="tiny-wan"), preset, preset.transformer_config())
    cond, null = captions()
    noise = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    pixels, steps = 64 * 64, 4
    with torch.no_grad():
        scheduler = FAMILY.sampling_scheduler(objective, pixels)
        FAMILY.set_timesteps(scheduler, objective, steps, pixels, torch.device("cpu"))
        text = TextLayout(TextSpec("padded", WIDTH, TEXT_TOKENS)).collate([null, cond])
        ours = FAMILY.denoise(model_forward(transformer, "wan"), scheduler, noise.clone(), text, guidance=guidance, channels=16,
                              autocast=torch.autocast("cpu", enabled=False))
        out = stock(transformer, flow_shift=objective.shift_at(pixels))(
            prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), latents=noise.clone(), height=64, width=64,
            num_frames=9, num_inference_steps=steps, guidance_scale=guidance, output_type="latent").frames
    assert ours.shape == out.shape and torch.allclose(ours, out, atol=1e-6)
    assert not torch.allclose(ours, noise, atol=1e-2)  # it sampled


def two_experts(monkeypatch, boundary: float = 0.875):
    """A tiny two-expert preset (Wan 2.2 A14B's layout at CPU size: two tiny-wan transformers split at `boundary`)."""
    tiny = get_preset("tiny-wan")
    monkeypatch.setitem(PRESETS, "tiny-wan-a14b", lambda: dataclasses.replace(
        tiny, name="tiny-wan-a14b", experts=("transformer", "transformer_2"), expert_boundary=boundary, guidance_scale=4.0,
        guidance_scale_2=3.0))
    return get_preset("tiny-wan-a14b")


def test_two_experts_sample_as_the_pipeline_switches_them(monkeypatch):
    """The high-noise expert with its guidance at timesteps >= boundary x 1000, the low-noise one with its own after,
    as WanPipeline with transformer_2 and boundary_ratio samples."""
    preset = two_experts(monkeypatch)
    high, low = (build_transformer(preset, None, seed).eval() for seed in (0, 1))
    objective = build_run_objective(TrainConfig(model="tiny-wan-a14b", expert="high"), preset, preset.transformer_config())
    cond, null = captions()
    noise = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    used = record_calls(low)
    with torch.no_grad():
        scheduler = FAMILY.sampling_scheduler(objective, 64 * 64)
        FAMILY.set_timesteps(scheduler, objective, 6, 64 * 64, torch.device("cpu"))
        text = TextLayout(TextSpec("padded", WIDTH, TEXT_TOKENS)).collate([null, cond])
        ours = FAMILY.denoise(model_forward(high, "wan"), scheduler, noise.clone(), text, guidance=4.0, channels=16,
                              autocast=torch.autocast("cpu", enabled=False), low=model_forward(low, "wan"),
                              boundary=preset.expert_boundary, guidance_2=3.0)
        switched = len(used)
        out = stock(high, transformer_2=low, boundary=0.875, flow_shift=3.0)(
            prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), latents=noise.clone(), height=64, width=64,
            num_frames=9, num_inference_steps=6, guidance_scale=4.0, guidance_scale_2=3.0, output_type="latent").frames
    assert 0 < switched < 12  # both experts denoised
    assert torch.allclose(ours, out, atol=1e-6)


@pytest.mark.parametrize("expert", ["high", "low"])
@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "none"])
def test_each_expert_draws_only_its_own_timesteps(monkeypatch, expert, scheme):
    """--expert high draws timesteps in [boundary x 1000, 1000], low in [0, boundary x 1000), from the run's density cut to
    the range (the same shape: its quantiles are the whole density's, restricted), for the objective's draws and the
    held-out loss's fixed timesteps alike."""
    preset = two_experts(monkeypatch)
    objective = build_run_objective(TrainConfig(model="tiny-wan-a14b", expert=expert, weighting_scheme=scheme),
                                    get_preset("tiny-wan-a14b", expert), preset.transformer_config())
    pixels = 64 * 64
    t = objective.sigmas(20_000, pixels, torch.Generator().manual_seed(0)) * 1000
    inside = (t >= 875) & (t <= 1000) if expert == "high" else (t >= 0) & (t < 875)
    assert bool(inside.all()), (float(t.min()), float(t.max()))
    # the same density: draws of the whole model's, kept where they fall in the range, have the same quantiles
    whole = dataclasses.replace(objective, timestep_range=(0.0, 1.0)).sigmas(200_000, pixels, torch.Generator().manual_seed(1)) * 1000
    kept = whole[(whole >= 875) == (expert == "high")]
    for q in (0.1, 0.5, 0.9):
        assert abs(float(t.quantile(q)) - float(kept.quantile(q))) < 12, q
    fixed = objective.fixed_times(8, pixels) * 1000
    assert bool(((fixed >= 875) if expert == "high" else (fixed < 875)).all()) and bool((fixed.diff() > 0).all())

    # a training step's timesteps (the loss's draw) stay in range too
    seen = []

    def model_fn(xt, s, batch):
        seen.append(s)
        return torch.zeros_like(xt)
    batch = {"latents": torch.zeros(64, 16, 1, 2), "bucket": (64, 64)}
    for step in range(5):
        objective(model_fn, batch, torch.Generator().manual_seed(step))
    s = torch.cat(seen)
    assert bool(((s >= 875) if expert == "high" else (s < 875)).all())


def test_the_expert_option_loads_its_transformer_and_is_required_for_two_experts(monkeypatch):
    assert get_preset("wan2.2-t2v-a14b", "high").subfolder == "transformer"
    assert get_preset("wan2.2-i2v-a14b", "low").subfolder == "transformer_2"
    assert (get_preset("wan2.2-t2v-a14b").expert_boundary, get_preset("wan2.2-i2v-a14b").expert_boundary) == (0.875, 0.9)
    with pytest.raises(ValueError, match="wan2.2-t2v-a14b is two experts.*--expert high, --expert low or --expert both"):
        TrainConfig(model="wan2.2-t2v-a14b")
    with pytest.raises(ValueError, match="--expert low: tiny-wan is one transformer"):
        TrainConfig(model="tiny-wan", expert="low")
    assert get_preset("wan2.2-t2v-a14b").expert_range("low") == (0.0, 0.875)
    # each validates at its own guidance, as the pipeline guides it (guidance_scale, guidance_scale_2)
    assert TrainConfig(model="wan2.2-t2v-a14b", expert="high").guidance_scale == 4.0
    assert TrainConfig(model="wan2.2-t2v-a14b", expert="low").guidance_scale == 3.0


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_the_published_architectures_have_their_parameter_counts(name):
    preset = get_preset(name)
    with torch.device("meta"):
        model = preset.transformer_class.from_config(preset.transformer_config())
    assert sum(p.numel() for p in model.parameters()) == COUNTS[name]
    assert len(FAMILY.blocks(model)) == preset.transformer_config()["num_layers"]
    assert preset.family == "wan" and preset.text_tokens == TEXT_TOKENS and preset.repo.startswith("Wan-AI/")


def test_the_published_flow_shifts_and_boundaries():
    shifts = {name: get_preset(name).flow_shift for name in COUNTS}
    assert shifts == {"wan2.1-t2v-1.3b": 3.0, "wan2.1-t2v-14b": 3.0, "wan2.1-i2v-14b-480p": 3.0, "wan2.1-i2v-14b-720p": 5.0,
                      "wan2.2-t2v-a14b": 3.0, "wan2.2-i2v-a14b": 3.0, "wan2.2-ti2v-5b": 5.0}
    assert FAMILY.pipeline_of(get_preset("wan2.2-i2v-a14b")) == "WanImageToVideoPipeline"
    assert FAMILY.pipeline_of(get_preset("wan2.2-t2v-a14b")) == "WanPipeline"


def adapted(preset_name: str, seed: int = 0):
    """A tiny Wan transformer with the family's default LoRA layers, their B factors random (a trained adapter)."""
    preset = get_preset(preset_name)
    model = build_transformer(preset, None, 0).eval()
    config = lora.lora_config("wan", 4, 8.0)
    lora.add_lora(model, config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model, config


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-wan-i2v"])
def test_adapters_load_through_load_lora_weights_in_both_layouts(name, tmp_path):
    """The adapters written in diffusers' layout and in musubi-tuner's (lora_unet_blocks_0_self_attn_q.lora_down.weight
    with alpha) load into the stock pipeline's transformer with load_lora_weights and predict what the trained one does."""
    from safetensors.torch import load_file

    model, config = adapted(name)
    state = lora.adapter_state(model)
    assert {"blocks.0.attn1.to_q.lora_A.weight", "blocks.1.attn2.to_out.0.lora_B.weight", "blocks.0.ffn.net.0.proj.lora_A.weight",
            "blocks.1.ffn.net.2.lora_B.weight"} <= set(state)
    assert ("blocks.0.attn2.add_k_proj.lora_A.weight" in state) == (name == "tiny-wan-i2v")
    preset = get_preset(name)
    cfg = preset.transformer_config()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 2, 4, 4, generator=g)
    batch = {"text": padded(captions()[0])}
    if FAMILY.condition_channels(cfg):
        batch |= {"condition": torch.randn(1, 20, 2, 4, 4, generator=g), "image_embeds": torch.randn(1, 5, 32, generator=g)}
    t = torch.tensor([500.0])
    with torch.no_grad():
        expected = model_forward(model, "wan")(x, t, batch)
    for fmt in ("diffusers", "kohya"):
        written = lora.save_adapter(tmp_path / fmt, "wan", state, config, lora_format=fmt)
        if fmt == "kohya":
            keys = load_file(written)
            assert keys["lora_unet_blocks_0_self_attn_q.alpha"] == 8.0
            assert {"lora_unet_blocks_1_cross_attn_o.lora_up.weight", "lora_unet_blocks_0_ffn_2.lora_down.weight"} <= set(keys)
            assert ("lora_unet_blocks_0_cross_attn_k_img.lora_down.weight" in keys) == (name == "tiny-wan-i2v")
        pipe = stock(build_transformer(preset, None, 0).eval(), image_to_video=name == "tiny-wan-i2v")
        pipe.load_lora_weights(tmp_path / fmt, weight_name=written.name)
        with torch.no_grad():
            loaded = model_forward(pipe.transformer, "wan")(x, t, batch)
        assert torch.allclose(loaded, expected, atol=1e-5), fmt
        with torch.no_grad():
            base = model_forward(build_transformer(preset, None, 0), "wan")(x, t, batch)
        assert not torch.allclose(base, expected, atol=1e-3)  # the adapters change the prediction


def test_the_low_noise_experts_adapters_load_into_transformer_2(monkeypatch, tmp_path):
    """A low-noise expert's LoRA loads into the pipeline's transformer_2 (load_into_transformer_2=True), as diffusers
    loads Wan 2.2's second denoiser's adapters."""
    two_experts(monkeypatch)
    model, config = adapted("tiny-wan")
    written = lora.save_adapter(tmp_path, "wan", lora.adapter_state(model), config)
    preset = get_preset("tiny-wan")
    pipe = stock(build_transformer(preset, None, 0), transformer_2=build_transformer(preset, None, 0), boundary=0.875)
    pipe.load_lora_weights(tmp_path, weight_name=written.name, load_into_transformer_2=True)
    x, batch, t = torch.randn(1, 16, 1, 4, 4), {"text": padded(captions()[0])}, torch.tensor([100.0])
    with torch.no_grad():
        assert torch.allclose(model_forward(pipe.transformer_2, "wan")(x, t, batch), model_forward(model, "wan")(x, t, batch), atol=1e-5)
        assert not torch.allclose(model_forward(pipe.transformer, "wan")(x, t, batch), model_forward(model, "wan")(x, t, batch), atol=1e-3)


def test_a_kohya_export_of_layers_outside_the_blocks_is_refused(tmp_path):
    model = build_transformer(get_preset("tiny-wan"), None, 0)
    config = lora.lora_config("wan", 4, targets=["proj_out"])
    lora.add_lora(model, config)
    with pytest.raises(ValueError, match="proj_out: musubi-tuner's Wan layout names the Linear layers of the transformer's blocks"):
        lora.save_adapter(tmp_path, "wan", lora.adapter_state(model), config, lora_format="kohya")


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-wan-i2v"])
def test_an_exported_transformer_generates_a_video_through_the_stock_pipeline(name, tmp_path):
    """A full fine-tune's export (the transformer in diffusers' layout, OUT/transformer) loads in WanPipeline (an I2V
    preset's in WanImageToVideoPipeline, from a first frame) beside the VAE and generates frames."""
    from diffusers import WanTransformer3DModel

    build_transformer(get_preset(name), None, 0).save_pretrained(tmp_path / "transformer", safe_serialization=True)
    transformer = WanTransformer3DModel.from_pretrained(tmp_path, subfolder="transformer")
    cond, null = captions()
    i2v = FAMILY.pipeline_of(get_preset(name)) == "WanImageToVideoPipeline"
    pipe = stock(transformer, vae=tiny_vae(), image_to_video=i2v)
    frames = pipe(prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), height=64, width=64, num_frames=9,
                  num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0),
                  **({"image": first_frame()} if i2v else {})).frames[0]
    assert frames.shape == (9, 64, 64, 3) and np.isfinite(frames).all() and float(frames.std()) > 0


def test_the_planner_traces_clips_with_their_condition():
    preset = get_preset("tiny-wan-i2v")
    config = preset.transformer_config()
    from shards import Bucket

    batch = FAMILY.example_batch(config, preset, Bucket(64, 96, 17), 2, 64, torch.float32)
    assert batch["latents"].shape == (2, 16, 5, 8, 12) and batch["condition"].shape == (2, 20, 5, 8, 12)
    assert batch["image_embeds"].shape == (2, 257, 32) and batch["text"].shape == (2, 512, WIDTH)
    assert FAMILY.example_batch(config, preset, (64, 96), 1, 64, torch.float32)["latents"].shape == (1, 16, 1, 8, 12)
    assert FAMILY.image_tokens(config, preset, Bucket(64, 96, 17)) == 5 * 4 * 6
    assert FAMILY.image_tokens(get_preset("wan2.1-t2v-14b").transformer_config(), get_preset("wan2.1-t2v-14b"),
                               Bucket.parse("81x480x832")) == 21 * 30 * 52


def lora_grads(options: dict, tmp_path) -> tuple[float, dict]:
    """The loss and adapter gradients of one tiny-wan-i2v LoRA step built as a run builds it (`build_model`)."""
    from train.model import build_model

    cfg = TrainConfig(model="tiny-wan-i2v", run=tmp_path, lora_rank=4, **{"precision": "fp32", **options})
    model = build_model(cfg, get_preset("tiny-wan-i2v"), "none", 1, torch.device("cpu"), resume_from=None, state={},
                        say=lambda *a: None)
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 16, 2, 4, 4, generator=g), "text": padded(*captions()),
             "condition": torch.randn(2, 20, 2, 4, 4, generator=g), "image_embeds": torch.randn(2, 5, 32, generator=g)}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        pred = model.forward(batch["latents"], torch.tensor([900.0, 100.0]), batch).float()
    loss = pred.square().mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.module.named_parameters() if p.requires_grad}


def test_block_swap_and_a_quantized_base_train_the_blocks_adapters(tmp_path):
    """The frozen blocks (`Family.blocks`: model.blocks) swapped and recomputed give the loss and gradients of a run
    without it; an int8 base (torchao) trains the same adapters, its loss near the bf16 base's."""
    plain_loss, plain = lora_grads({}, tmp_path / "plain")
    swapped_loss, swapped = lora_grads({"blocks_to_swap": 1, "grad_checkpointing": "all"}, tmp_path / "swapped")
    assert swapped_loss == plain_loss and all(torch.equal(swapped[n], plain[n]) for n in plain)
    assert any("blocks.1.attn2.add_k_proj" in n for n in plain)
    bf16_loss, _ = lora_grads({"precision": "bf16", "weights_dtype": "bf16"}, tmp_path / "bf16")
    int8_loss, int8 = lora_grads({"precision": "bf16", "base_quant": "int8"}, tmp_path / "int8")
    assert set(int8) == set(plain) and all(torch.isfinite(g).all() for g in int8.values())
    assert abs(int8_loss - bf16_loss) < 0.05 * bf16_loss


def test_a_cache_of_images_or_of_another_text_layout_is_refused():
    from shards import CacheSpec, LatentSpec

    config = get_preset("tiny-wan").transformer_config()
    clips = LatentSpec(16, 8, 1.0, 0.0, "mean_std", temporal_downsample=4)
    assert FAMILY.cache_problems(CacheSpec(latent=clips, text=TextSpec("padded", WIDTH, 64), family="wan"), config) == []
    images = CacheSpec(latent=LatentSpec(16, 8, 1.0, 0.0, "mean_std"), text=TextSpec("masked", WIDTH, 64), family="wan")
    problems = FAMILY.cache_problems(images, config)
    assert any(p.startswith("text layout: cache 'masked'") for p in problems)
    assert "latent frames: the cache holds images (latents without a frame axis); Wan's VAE makes one latent frame of 4" in problems


def test_an_image_to_video_model_takes_the_first_frame_fields_of_an_image_to_video_cache():
    from shards import CacheSpec, LatentSpec

    clips = LatentSpec(16, 8, 1.0, 0.0, "mean_std", temporal_downsample=4)
    i2v = CacheSpec(latent=clips, text=TextSpec("padded", WIDTH, 512), family="wan", preset="tiny-wan-i2v")
    t2v = dataclasses.replace(i2v, preset="tiny-wan")
    assert FAMILY.conditioning_fields(i2v) == ("condition", "image_embeds") and FAMILY.conditioning_fields(t2v) == ()
    assert FAMILY.conditioning_fields(dataclasses.replace(i2v, preset="wan2.2-i2v-a14b")) == ("condition",)
    model = get_preset("tiny-wan-i2v").transformer_config()
    assert FAMILY.cache_problems(i2v, model) == [] and FAMILY.cache_problems(i2v, get_preset("tiny-wan").transformer_config()) == []
    assert FAMILY.cache_problems(t2v, model) == [
        "first frame: the model takes condition and image_embeds, which stage one caches for image-to-video presets; this "
        "cache was built for tiny-wan"]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_export_card_loads_each_expert_where_the_pipeline_takes_it(kind):
    """The card's code puts a low-noise expert's export in `transformer_2` (its LoRA with load_into_transformer_2), an I2V
    preset's in WanImageToVideoPipeline with its first frame, and writes the frames as a video."""
    from train.card import Base, usage

    low = usage("wan", kind, Base("hub", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"), "owner/export", preset=get_preset("wan2.2-i2v-a14b", "low"))
    assert "WanImageToVideoPipeline.from_pretrained" in low and 'image=load_image("first_frame.png")' in low
    assert ("transformer_2=transformer_2" in low) if kind == "full" else ("load_into_transformer_2=True" in low)
    assert '.frames[0]' in low and 'export_to_video(frames, "video.mp4", fps=16)' in low
    high = usage("wan", kind, Base("hub", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"), "owner/export", preset=get_preset("wan2.2-t2v-a14b", "high"))
    assert "WanPipeline.from_pretrained" in high and "transformer_2" not in high and "load_image" not in high
    compile(low, "card", "exec"), compile(high, "card", "exec")


# --- training from a cache of clips (stage one's layout, written as stage one writes it: tests/stage_two/video_testing.py) ---


def i2v_cache(root: Path) -> Path:
    """A tiny-wan-i2v cache of 17-frame clips with the first-frame fields stage one caches: `condition` (4 + 16, T, h, w)
    and the tiny CLIP's `image_embeds` (17, 32); its decoder the tiny video VAE."""
    from video_testing import LATENT, TEXT, TEXT_WIDTH, store_decoder

    from shards import Bucket, CacheSpec, Field, Prompt, ShardWriter, prompt_key

    g = torch.Generator().manual_seed(5)
    schema = {"latent_mean": Field(torch.bfloat16), "latent_std": Field(torch.bfloat16), "condition": Field(torch.bfloat16),
              "image_embeds": Field(torch.bfloat16), "text": Field(torch.bfloat16, ragged=True),
              "text_lengths": Field(torch.int32, ragged=True), "source": Field(torch.uint8, ragged=True)}
    fingerprint = {"vae": {"id": "tiny-video-vae", **LATENT.fingerprint()}, "text_encoder": {"id": "tiny-umt5", **TEXT.fingerprint()}}
    shape = LATENT.shape(64, 64, 17)
    with ShardWriter(root, fingerprint, schema) as w:
        for k in range(4):
            w.write(f"clip{k}", Bucket(64, 64, 17), {
                "latent_mean": torch.randn(shape, generator=g).bfloat16(), "latent_std": torch.full(shape, 0.1).bfloat16(),
                "condition": torch.randn(20, *shape[1:], generator=g).bfloat16(),
                "image_embeds": torch.randn(17, 32, generator=g).bfloat16(),
                "text": torch.randn(5, TEXT_WIDTH, generator=g).bfloat16(), "text_lengths": torch.tensor([5], dtype=torch.int32),
                "source": torch.tensor(list(f"videos/clip{k}.mp4".encode()), dtype=torch.uint8)})
        w.add_prompts({prompt_key(t): Prompt(t, {"text": torch.randn(len(t) // 4, TEXT_WIDTH, generator=g).bfloat16()})
                       for t in ("", "a red square moving right")}, {"text": schema["text"]})
        recipe = store_decoder(w)
        w.set_extra("precompute", CacheSpec(LATENT, TEXT, "wan", "tiny-wan-i2v", 64, recipe,
                                            extra={"frame_rate": 16.0, "image_to_video": True}).record())
    return root


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """tiny-wan's cache of clips (17 frames in two shapes, one-frame clips) and tiny-wan-i2v's (first-frame fields)."""
    from video_testing import clip_cache

    root = tmp_path_factory.mktemp("wan")
    return {"tiny-wan": clip_cache(root / "t2v", family="wan", preset="tiny-wan", decoder=True),
            "tiny-wan-i2v": i2v_cache(root / "i2v")}


def run_cfg(caches, run, model="tiny-wan", **kw):
    base = dict(model=model, cache=[str(caches[model if model in caches else "tiny-wan"])], run=run, steps=4, batch_size=2,
                workers=0, progress=False, log_every=1, checkpoint_every=2, lr=1e-3, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-wan-i2v"])
# the full fine-tunes' runs take over ten seconds: in the slow suite (CI runs it)
@pytest.mark.parametrize("adapters", [pytest.param({}, marks=pytest.mark.slow), {"lora_rank": 4, "lora_alpha": 8}],
                         ids=["full", "lora"])
def test_tiny_wan_trains_from_clips_resumes_exactly_and_exports_what_the_stock_pipeline_loads(caches, tmp_path, model, adapters):
    """Full and LoRA training of T2V and I2V from a cache of clips: a resumed run's losses are the uninterrupted one's,
    and the export (the transformer, or the adapters in diffusers' and musubi-tuner's layouts) loads into the stock
    pipeline's transformer and predicts what the trained checkpoint does."""
    from conftest import losses

    from train.checkpoint import complete_checkpoints
    from train.export import export, load_model
    from train.loop import train

    # the full fine-tunes validate too: a video per prompt sampled by the family's loop (I2V: from a cached first frame)
    straight = train(run_cfg(caches, tmp_path / "straight", model, validate=not adapters, validation_steps=2, **adapters))
    if not adapters:
        assert straight["grids"] and list((tmp_path / "straight" / "samples").rglob("*-17x64x64.mp4"))
    train(run_cfg(caches, tmp_path / "resumed", model, steps=2, **adapters))
    train(run_cfg(caches, tmp_path / "resumed", model, **adapters))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    trained, preset, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    cfg = preset.transformer_config()
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(1, 16, 5, 8, 8, generator=g), torch.tensor([700.0])
    batch = {"text": padded(captions()[0])}
    if FAMILY.condition_channels(cfg):
        batch |= {"condition": torch.randn(1, 20, 5, 8, 8, generator=g), "image_embeds": torch.randn(1, 17, 32, generator=g)}
    with torch.no_grad():
        expected = model_forward(trained.eval(), "wan")(x, t, batch)
    i2v = model == "tiny-wan-i2v"
    for fmt in ("diffusers", "kohya") if adapters else ("diffusers",):
        out = export(tmp_path / "straight", tmp_path / f"export-{fmt}", lora_format=fmt)
        if adapters:
            pipe = stock(build_transformer(preset, None, 0).eval(), image_to_video=i2v)
            pipe.load_lora_weights(out.parent, weight_name=out.name)
            loaded = pipe.transformer
        else:
            from diffusers import WanTransformer3DModel

            loaded = WanTransformer3DModel.from_pretrained(out.parent, subfolder="transformer").eval()
            assert "training.json" in {p.name for p in out.iterdir()}
        with torch.no_grad():
            assert torch.allclose(model_forward(loaded, "wan")(x, t, batch), expected, atol=1e-5), fmt
    assert math.isfinite(straight["last_loss"])
    if not adapters:  # the export generates a video through the stock pipeline
        cond, null = captions()
        pipe = stock(loaded, vae=tiny_vae(), image_to_video=i2v)
        frames = pipe(prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), height=64, width=64, num_frames=9,
                      num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0),
                      **({"image": first_frame()} if i2v else {})).frames[0]
        assert frames.shape == (9, 64, 64, 3) and np.isfinite(frames).all()


@pytest.mark.parametrize("expert", ["high", "low"])
def test_each_expert_trains_on_its_own_timesteps(caches, tmp_path, monkeypatch, expert):
    """A run of one expert of a two-expert model feeds its transformer only timesteps of its range, step after step, and
    records the expert in its checkpoint; the export says where the pipeline takes it."""
    from train.loop import train

    preset = two_experts(monkeypatch)
    seen = []
    forward = FAMILY.forward

    def recorded(model, config, xt, t, batch, guidance):
        if not t.is_meta:  # the planner traces on the meta device
            seen.append(t.detach().clone())
        return forward(model, config, xt, t, batch, guidance)
    monkeypatch.setattr(FAMILY, "forward", recorded)
    train(run_cfg(caches, tmp_path / "run", "tiny-wan-a14b", expert=expert, steps=6))
    t = torch.cat(seen)
    assert len(t) == 12
    boundary = preset.expert_boundary * 1000
    assert bool(((t >= boundary) & (t <= 1000)).all()) if expert == "high" else bool(((t >= 0) & (t < boundary)).all())
    other = "low" if expert == "high" else "both"
    with pytest.raises(ValueError, match=f"was trained with --expert {expert}, this run has {other}: the checkpoint holds the expert"):
        train(run_cfg(caches, tmp_path / "run", "tiny-wan-a14b", expert=other, steps=8))
    from train.export import export

    out = export(tmp_path / "run", tmp_path / "export")
    assert json.loads((out / "training.json").read_text())["expert"] == expert
    assert ("transformer_2=transformer_2" in (out.parent / "README.md").read_text()) == (expert == "low")


# --- both experts in one run (--expert both) ---


def test_two_experts_called_as_one_give_each_sample_its_experts_prediction(monkeypatch):
    """`Experts`: a batch of mixed timesteps is split, each sample predicted by the expert of its timestep, with its
    own rows of every batch-sized input."""
    from train.experts import Experts

    preset = two_experts(monkeypatch)
    high, low = (build_transformer(get_preset("tiny-wan"), None, seed).eval() for seed in (0, 1))
    pair = Experts(high, low, preset.expert_boundary * 1000)
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(3, 16, 1, 4, 4, generator=g), padded(*captions(), captions(2)[0])
    t = torch.tensor([900.0, 100.0, 875.0])
    with torch.no_grad():
        mixed = model_forward(pair, "wan")(x, t, {"text": text})
        for j, expert in enumerate((high, low, high)):
            alone = model_forward(expert, "wan")(x[j : j + 1], t[j : j + 1], {"text": text[j : j + 1]})
            assert torch.allclose(mixed[j : j + 1], alone, atol=1e-6), j


@pytest.mark.parametrize("adapters", [{}, {"lora_rank": 4, "lora_alpha": 8}], ids=["full", "lora"])
def test_both_experts_train_in_one_run_each_on_its_own_timesteps(caches, tmp_path, monkeypatch, adapters):
    """--expert both: each transformer sees only the timesteps of its side of the boundary, the run resumes exactly,
    and the export holds both where the pipeline takes them (transformer/ and transformer_2/; a LoRA export's second
    expert's adapters in transformer_2/, loaded with load_into_transformer_2), predicting what the checkpoint does."""
    from conftest import losses

    from train import experts
    from train.checkpoint import complete_checkpoints
    from train.export import export, load_model
    from train.loop import train

    preset = two_experts(monkeypatch)
    seen = {"transformer": [], "transformer_2": []}
    made = experts.Experts.__init__

    def recording(self, transformer, transformer_2, boundary, names=("transformer", "transformer_2")):
        made(self, transformer, transformer_2, boundary, names)
        for name, expert in zip(names, (transformer, transformer_2)):
            expert.register_forward_pre_hook(
                lambda module, args, kwargs, name=name: None if kwargs["timestep"].is_meta else seen[name].append(kwargs["timestep"]),
                with_kwargs=True)
    monkeypatch.setattr(experts.Experts, "__init__", recording)
    train(run_cfg(caches, tmp_path / "straight", "tiny-wan-a14b", expert="both", **adapters))
    high, low = torch.cat(seen["transformer"]), torch.cat(seen["transformer_2"])
    assert len(high) + len(low) == 8 and len(high) and len(low)  # 4 steps of 2 clips, each by its expert
    assert bool((high >= 875).all()) and bool((low < 875).all())
    train(run_cfg(caches, tmp_path / "resumed", "tiny-wan-a14b", expert="both", steps=2, **adapters))
    train(run_cfg(caches, tmp_path / "resumed", "tiny-wan-a14b", expert="both", **adapters))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")

    trained, _, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    out = export(tmp_path / "straight", tmp_path / "export")
    pipe = stock(build_transformer(preset.expert("high"), None, 0), transformer_2=build_transformer(preset.expert("high"), None, 1),
                 boundary=preset.expert_boundary)
    if adapters:
        assert out.parent.name == "transformer"  # each expert's adapters in its folder
        pipe.load_lora_weights(out.parent.parent, subfolder="transformer")
        pipe.load_lora_weights(out.parent.parent, subfolder="transformer_2", load_into_transformer_2=True)
    else:
        from diffusers import WanTransformer3DModel

        pipe.transformer, pipe.transformer_2 = (WanTransformer3DModel.from_pretrained(out.parent, subfolder=f)
                                                for f in ("transformer", "transformer_2"))
    x, batch, t = torch.randn(1, 16, 2, 4, 4), {"text": padded(captions()[0])}, torch.tensor([500.0])
    with torch.no_grad():
        for loaded, expert in ((pipe.transformer, trained.transformer), (pipe.transformer_2, trained.transformer_2)):
            assert torch.allclose(model_forward(loaded, "wan")(x, t, batch), model_forward(expert.eval(), "wan")(x, t, batch),
                                  atol=1e-5)
        assert not torch.allclose(model_forward(pipe.transformer, "wan")(x, t, batch),
                                  model_forward(pipe.transformer_2, "wan")(x, t, batch), atol=1e-4)
    # validation samples with the pair as the pipeline does: the high-noise expert, then the low-noise one
    from train.validate import generate

    seen["transformer"].clear(), seen["transformer_2"].clear()
    objective = build_run_objective(TrainConfig(model="tiny-wan-a14b", expert="both"), preset, preset.transformer_config())
    cond, null = captions()
    generate(trained, preset, objective, cond, null, (16, 2, 8, 8), 64 * 64, steps=4, guidance=4.0, seed=0,
             precision=torch.float32, layout=TextLayout(TextSpec("padded", WIDTH, 64)))
    assert len(seen["transformer"]) and len(seen["transformer_2"]) and len(seen["transformer"]) + len(seen["transformer_2"]) == 8
    card = (tmp_path / "export" / "README.md").read_text()
    assert ('subfolder="transformer_2", load_into_transformer_2=True' in card) if adapters else ("transformer_2=transformer_2" in card)


def test_the_plan_of_both_experts_counts_both(monkeypatch):
    """`train plan MODEL --expert both` plans the two experts on the device; --parallel fsdp is refused for them."""
    from train.plan import plan
    from train.plan_config import PlanConfig

    two_experts(monkeypatch)
    one = plan(PlanConfig(model="tiny-wan-a14b", expert="high", bucket=(64, 64, 17)))
    both = plan(PlanConfig(model="tiny-wan-a14b", expert="both", bucket=(64, 64, 17)))
    assert both["parameters"] == 2 * one["parameters"] == 2 * 22_952
    assert both["bytes"]["weights"] > one["bytes"]["weights"]
    with pytest.raises(ValueError, match="--expert both keeps two transformers in one module, which FSDP does not shard"):
        TrainConfig(model="tiny-wan-a14b", expert="both", parallel="fsdp")


def test_both_experts_swap_and_quantize_as_one_transformer_does(monkeypatch, tmp_path):
    """--expert both with a quantized base and swapped blocks: the swap takes the pair's blocks (the first expert's,
    then the second's), and a batch of both sides' timesteps trains both experts' adapters."""
    from train.model import build_model

    two_experts(monkeypatch)
    cfg = TrainConfig(model="tiny-wan-a14b", expert="both", run=tmp_path, lora_rank=4, precision="bf16", base_quant="int8",
                      blocks_to_swap=3, grad_checkpointing="all")
    model = build_model(cfg, get_preset("tiny-wan-a14b", "both"), "none", 1, torch.device("cpu"), resume_from=None, state={},
                        say=lambda *a: None)
    assert len(FAMILY.blocks(model.module.transformer)) + len(FAMILY.blocks(model.module.transformer_2)) == 4
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 16, 2, 4, 4, generator=g), "text": padded(*captions())}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.forward(batch["latents"], torch.tensor([950.0, 300.0]), batch).float().square().mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.module.named_parameters() if p.requires_grad}
    for expert in ("transformer.", "transformer_2."):
        assert any(n.startswith(expert) and g is not None and bool(g.abs().sum() > 0) for n, g in grads.items()), expert


@pytest.mark.slow  # a process of its own: the planner's start-up
def test_plan_prints_the_parameter_count():
    """`python -m train plan` builds the released 1.3B on the meta device and prints its count (every real preset's count
    is checked above)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "train", "plan", "wan2.1-t2v-1.3b", "--bucket", "17x480x832", "--batch-size",
                          "1", "--json"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["parameters"] == COUNTS["wan2.1-t2v-1.3b"]


def test_both_experts_with_the_second_swapped_train_as_without(monkeypatch, tmp_path):
    """--expert both --blocks-to-swap N (N = one expert's blocks) keeps the low-noise expert's frozen weights in CPU
    memory: batches of either side, or both, give the losses and adapter gradients of a run without it."""
    from train.model import build_model

    two_experts(monkeypatch)

    def run(swap: int):
        cfg = TrainConfig(model="tiny-wan-a14b", expert="both", run=tmp_path / str(swap), lora_rank=4, precision="fp32",
                          blocks_to_swap=swap, grad_checkpointing="all" if swap else "off")
        model = build_model(cfg, get_preset("tiny-wan-a14b", "both"), "none", 1, torch.device("cpu"), resume_from=None,
                            state={}, say=lambda *a: None)
        losses = []
        for t in ([950.0, 900.0], [100.0, 200.0], [950.0, 100.0], [880.0, 990.0]):
            batch = {"latents": torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0)), "text": padded(*captions())}
            loss = model.forward(batch["latents"], torch.tensor(t), batch).square().mean()
            loss.backward()
            losses.append(float(loss.detach()))
        return losses, {n: p.grad for n, p in model.module.named_parameters() if p.requires_grad}

    plain, swapped = run(0), run(2)
    assert plain[0] == swapped[0] and all(torch.equal(plain[1][n], swapped[1][n]) for n in plain[1])
