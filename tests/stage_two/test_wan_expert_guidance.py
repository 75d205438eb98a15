"""Validation of both experts of Wan 2.2 A14B in one run (--expert both) guides each expert at its own scale, as the
pipelines' guidance_scale (the high-noise `transformer`) and guidance_scale_2 (the low-noise `transformer_2`, below the
boundary) do: the preset's released pair by default, --guidance-scale and --guidance-scale-2 to choose."""

import dataclasses

import pytest
import torch

from shards import TextSpec
from train.config import TrainConfig
from train.data import TextLayout
from train.families import PRESETS, get_preset
from train.families.wan import SCHEDULER, TEXT_TOKENS
from train.model import build_run_objective
from train.presets import build_transformer

pytestmark = pytest.mark.model  # builds tiny diffusers models

WIDTH = 32


def two_experts(monkeypatch, boundary: float = 0.875):
    """Wan 2.2 A14B's layout at CPU size: two tiny-wan transformers split at `boundary`, guided at 4.0 and 3.0."""
    tiny = get_preset("tiny-wan")
    monkeypatch.setitem(PRESETS, "tiny-wan-a14b", lambda: dataclasses.replace(
        tiny, name="tiny-wan-a14b", experts=("transformer", "transformer_2"), expert_boundary=boundary, guidance_scale=4.0,
        guidance_scale_2=3.0))
    return get_preset("tiny-wan-a14b", "both")


def captions() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1)
    return {"text": torch.randn(11, WIDTH, generator=g)}, {"text": torch.randn(1, WIDTH, generator=g)}


def padded(cond: dict) -> torch.Tensor:
    return TextLayout(TextSpec("padded", WIDTH, TEXT_TOKENS)).collate([cond])["text"]


def test_each_expert_validates_at_its_own_guidance_by_default(monkeypatch):
    two_experts(monkeypatch)
    both = TrainConfig(model="tiny-wan-a14b", expert="both")
    assert (both.guidance_scale, both.guidance_scale_2) == (4.0, 3.0)
    assert TrainConfig(model="tiny-wan-a14b", expert="both", guidance_scale=6.0, guidance_scale_2=2.0).guidance_scale_2 == 2.0
    assert TrainConfig(model="tiny-wan-a14b", expert="low").guidance_scale == 3.0
    assert TrainConfig(model="tiny-wan-a14b", expert="high").guidance_scale_2 is None
    for name, pair in (("wan2.2-t2v-a14b", (4.0, 3.0)), ("wan2.2-i2v-a14b", (3.5, 3.5))):
        cfg = TrainConfig(model=name, expert="both")
        assert (cfg.guidance_scale, cfg.guidance_scale_2) == pair, name
    for kw in (dict(model="tiny-wan-a14b", expert="high"), dict(model="tiny-wan")):
        with pytest.raises(ValueError, match="--guidance-scale-2 is the low-noise expert's guidance of a run of both experts"):
            TrainConfig(guidance_scale_2=2.0, **kw)


def test_both_experts_sample_as_the_pipeline_guides_them(monkeypatch):
    """`generate` with the pair (one module routing each timestep to its expert) against WanPipeline with transformer_2,
    boundary_ratio, guidance_scale and guidance_scale_2, from the same noise."""
    import diffusers

    from train.experts import Experts
    from train.validate import generate

    preset = two_experts(monkeypatch)
    high, low = (build_transformer(get_preset("tiny-wan"), None, seed).eval() for seed in (0, 1))
    pair = Experts(high, low, preset.expert_boundary * 1000)
    objective = build_run_objective(TrainConfig(model="tiny-wan-a14b", expert="both"), preset, preset.transformer_config())
    cond, null = captions()
    pixels, steps, seed = 64 * 64, 6, 3

    def ours(guidance_2):
        return generate(pair, preset, objective, cond, null, (16, 3, 8, 8), pixels, steps=steps, guidance=4.0, seed=seed,
                        precision=torch.float32, layout=TextLayout(TextSpec("padded", WIDTH, 64)), guidance_2=guidance_2)
    noise = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(seed))  # generate's draw
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=high, transformer_2=low,
                                 scheduler=diffusers.UniPCMultistepScheduler(**SCHEDULER, flow_shift=objective.shift_at(pixels)),
                                 boundary_ratio=preset.expert_boundary)
    with torch.no_grad():
        out = pipe(prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), latents=noise, height=64, width=64,
                   num_frames=9, num_inference_steps=steps, guidance_scale=4.0, guidance_scale_2=3.0,
                   output_type="latent").frames[0]
    assert torch.allclose(ours(3.0), out, atol=1e-6)
    assert not torch.allclose(ours(4.0), out, atol=1e-4)  # the low-noise steps at the high-noise guidance differ
    assert torch.allclose(ours(None), ours(4.0))  # no second scale: the pipeline's default, the first


def test_a_run_of_both_experts_validates_with_both_scales(tmp_path, monkeypatch):
    from video_testing import clip_cache

    from train import validate
    from train.loop import train

    two_experts(monkeypatch)
    cache = clip_cache(tmp_path / "cache", family="wan", preset="tiny-wan", decoder=True)
    seen = []
    generate = validate.generate

    def recorded(*args, **kwargs):
        seen.append((kwargs["guidance"], kwargs["guidance_2"]))
        return generate(*args, **kwargs)
    monkeypatch.setattr(validate, "generate", recorded)
    out = train(TrainConfig(model="tiny-wan-a14b", expert="both", cache=[str(cache)], run=tmp_path / "run", steps=1,
                            batch_size=2, workers=0, progress=False, precision="fp32", validation_steps=2,
                            validation_prompt=["a red square moving right"], guidance_scale_2=2.5))
    assert seen == [(4.0, 2.5)] and out["grids"]
