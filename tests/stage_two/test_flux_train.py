"""Flux.1 in stage two (tiny-flux): the transformer gets what FluxPipeline gives it (packed latents, ids, timestep,
guidance), the shift is FluxPipeline's, training resumes exactly, and full and LoRA exports generate through the stock
FluxPipeline."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VALIDATION_PROMPTS, losses, record_calls, stage_one_cache

from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.families import PRESETS, get_preset
from train.loop import train
from train.model import build_run_objective, null_caption
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 32  # tiny-flux's T5 limit
# FLUX.1-dev's scheduler config as released (FLUX.1-schnell's: shift 1.0, use_dynamic_shifting false)
DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                     base_image_seq_len=256, max_image_seq_len=4096)
SCHNELL_SCHEDULER = {**DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}


@pytest.fixture(scope="module")
def flux_cache(tmp_path_factory):
    """A tiny-flux cache of 8 sample images built by stage one, with two validation prompts."""
    return stage_one_cache(tmp_path_factory.mktemp("flux"), "tiny-flux")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """tiny-flux's VAE, CLIP-L and T5 with their tokenizers, saved in the diffusers layout."""
    from precompute.presets import get_preset as encoders
    from precompute.presets import save_tiny

    directory = tmp_path_factory.mktemp("parts")
    save_tiny(encoders("tiny-flux"), directory)
    return directory


def stock_flux(transformer, parts: Path, scheduler: dict = DEV_SCHEDULER):
    """The stock FluxPipeline around `transformer`, its other components loaded with `from_pretrained`."""
    import diffusers
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**scheduler), vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"),
        text_encoder=CLIPTextModel.from_pretrained(parts / "text_encoder"), tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(parts / "text_encoder_2"),
        tokenizer_2=AutoTokenizer.from_pretrained(parts / "tokenizer_2"), transformer=transformer)




def cfg(cache, run, **kw):
    base = dict(model="tiny-flux", cache=cache, run=run, steps=6, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=3, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})




@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["dev", "schnell"])
def test_the_transformer_gets_what_fluxpipeline_gives_it(parts, guidance_embeds, monkeypatch):
    """A non-square latent through our forward: the packed latents, image and text ids, timestep, guidance (none without
    the embedding) and text inputs equal what FluxPipeline passes the transformer, and the output is FluxPipeline's
    unpacking of the transformer's (packing and unpacking round-trip)."""
    from diffusers import FluxPipeline

    preset = get_preset("tiny-flux")
    monkeypatch.setitem(PRESETS, "tiny-flux", lambda: dataclasses.replace(
        preset, config={**preset.transformer_config(), "guidance_embeds": guidance_embeds}))
    transformer = build_transformer(get_preset("tiny-flux"), None, 0)
    calls = record_calls(transformer)
    pipe = stock_flux(transformer, parts)
    pipe(VALIDATION_PROMPTS[0], height=256, width=192, num_inference_steps=2, guidance_scale=3.5, output_type="latent",
         max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0))
    stock = calls[-1]
    assert stock["hidden_states"].shape == (1, 16 * 12, 64)  # (256 / 16) x (192 / 16) packed 2 x 2 patches of 16 channels

    latents = FluxPipeline._unpack_latents(stock["hidden_states"], 256, 192, 8)  # (1, 16, 32, 24)
    batch = {"text": stock["encoder_hidden_states"], "pooled": stock["pooled_projections"]}
    with torch.no_grad():
        ours = model_forward(transformer, "flux", guidance=3.5)(latents, stock["timestep"] * 1000, batch)
    mine = calls[-1]
    for name in ("hidden_states", "img_ids", "txt_ids", "timestep", "encoder_hidden_states", "pooled_projections"):
        assert mine[name].shape == stock[name].shape and torch.equal(mine[name], stock[name]), name
    assert torch.equal(mine["img_ids"][:, 0], torch.zeros(16 * 12)) and mine["img_ids"][-1].tolist() == [0, 15, 11]
    if guidance_embeds:
        assert torch.equal(mine["guidance"], stock["guidance"]) and stock["guidance"].tolist() == [3.5]
    else:
        assert mine["guidance"] is None and stock["guidance"] is None
    assert ours.shape == latents.shape and torch.equal(ours, FluxPipeline._unpack_latents(mine["out"], 256, 192, 8))
    assert torch.equal(FluxPipeline._pack_latents(ours, 1, 16, 32, 24), mine["out"])


@pytest.mark.parametrize("bucket", [(256, 256), (512, 768), (1024, 1024), (1024, 2048), (2048, 2048)])
def test_the_shift_is_fluxpipelines_mu(bucket):
    """Training's shift is exp(mu) of FluxPipeline's calculate_shift at the image's sequence length; its noise levels are
    the scheduler's exponential time shift of the drawn ones; validation samples FluxPipeline's sigmas. Schnell does not
    shift, as its scheduler does not."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    from train.validate import sampling_scheduler

    h, w = bucket
    seq_len = (h // 16) * (w // 16)  # FluxPipeline's image_seq_len: latents.shape[1] after packing
    mu = calculate_shift(seq_len, DEV_SCHEDULER["base_image_seq_len"], DEV_SCHEDULER["max_image_seq_len"],
                         DEV_SCHEDULER["base_shift"], DEV_SCHEDULER["max_shift"])
    dev = build_run_objective(TrainConfig(model="flux-dev"), get_preset("flux-dev"), get_preset("flux-dev").transformer_config())
    assert dev.dynamic_shift and dev.mu(h * w) == mu and dev.shift_at(h * w) == pytest.approx(math.exp(mu), rel=1e-12)

    reference = FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER)
    drawn = dev.sigmas(256, h * w, torch.Generator().manual_seed(0))
    u = dataclasses.replace(dev, dynamic_shift=False, shift=1.0).sigmas(256, h * w, torch.Generator().manual_seed(0))
    assert torch.allclose(drawn, reference.time_shift(mu, 1.0, u), rtol=1e-6, atol=1e-7)

    for name, config in (("flux-dev", DEV_SCHEDULER), ("flux-schnell", SCHNELL_SCHEDULER)):
        preset = get_preset(name)
        objective = build_run_objective(TrainConfig(model=name), preset, preset.transformer_config())
        steps = 4 if name == "flux-schnell" else 28
        stock = FlowMatchEulerDiscreteScheduler(**config)
        retrieve_timesteps(stock, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        ours = sampling_scheduler(preset, objective, h * w)
        ours.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=objective.mu(h * w) if objective.dynamic_shift else None)
        assert torch.allclose(ours.sigmas, stock.sigmas) and torch.allclose(ours.timesteps, stock.timesteps), name
    schnell = build_run_objective(TrainConfig(model="flux-schnell"), get_preset("flux-schnell"), {})
    assert not schnell.dynamic_shift and schnell.shift_at(h * w) == 1.0


def test_a_dropped_caption_is_the_cached_empty_caption(flux_cache):
    from shards import Cache, prompt_key
    from train.data import TextLayout, TrainingSamples

    assert null_caption(cfg(flux_cache, "r"), get_preset("tiny-flux")) == "empty"
    cache = Cache(flux_cache)
    empty = TextLayout.of(cache).caption(cache.prompts()[prompt_key("")].fields)
    cond = TrainingSamples(flux_cache, 0, 1.0, "empty")[(0, 0)]["cond"]
    assert set(cond) == {"text", "pooled"} and cond["text"].shape == (TOKENS, 32) and cond["pooled"].shape == (24,)
    assert all(torch.equal(cond[k], empty[k]) for k in cond) and cond["text"].abs().sum() > 0


def test_tiny_flux_trains_resumes_exactly_and_its_export_generates_through_the_stock_pipeline(flux_cache, parts, tmp_path):
    straight = train(cfg(flux_cache, tmp_path / "straight", validate=True, validation_bucket=["256x256"]))
    train(cfg(flux_cache, tmp_path / "resumed", steps=3))
    resumed = train(cfg(flux_cache, tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 6 and math.isfinite(straight["last_loss"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 6
    assert (tmp_path / "straight" / "samples-step00000006.png").exists()

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "export")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    from diffusers import FluxTransformer2DModel

    exported = FluxTransformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer")
    base = build_transformer(get_preset("tiny-flux"), None, 0)
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), base.parameters()))  # it trained
    pipe = stock_flux(exported, parts)
    image = pipe(VALIDATION_PROMPTS[0], height=256, width=256, num_inference_steps=2, guidance_scale=3.5, output_type="np",
                 max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.shape == (256, 256, 3) and np.isfinite(image).all() and float(image.std()) > 0

    out = subprocess.run([sys.executable, "-m", "train", "sample", str(tmp_path / "straight"), "--prompt-cache", str(flux_cache),
                          "--validation-bucket", "256x256", "--out", str(tmp_path / "samples")], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(list((tmp_path / "samples").glob("*-256x256-seed0.png"))) == len(VALIDATION_PROMPTS)


def test_tiny_flux_lora_trains_adapters_alone_resumes_exactly_and_loads_into_fluxpipeline(flux_cache, parts, tmp_path):
    lora = dict(lora_rank=4, lora_alpha=8, lr=1e-2)
    straight = train(cfg(flux_cache, tmp_path / "straight", **lora))
    train(cfg(flux_cache, tmp_path / "resumed", **{**lora, "steps": 3}))
    resumed = train(cfg(flux_cache, tmp_path / "resumed", **lora))
    assert resumed["last_loss"] == straight["last_loss"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 6

    from train.export import load_model

    trained, _, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trained.named_parameters() if ".lora_A." in n}
    # diffusers' train_dreambooth_lora_flux.py's layers: both streams' attention, the single blocks' q/k/v, the feed-forwards
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_k_proj",
            "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.ff.net.2", "transformer_blocks.0.ff_context.net.0.proj",
            "single_transformer_blocks.1.attn.to_v"} <= adapted
    assert not any(n.startswith("single_transformer_blocks") and n.endswith(("proj_mlp", "proj_out")) for n in adapted)
    base = dict(build_transformer(get_preset("tiny-flux"), None, 0).named_parameters())
    for name, p in trained.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace("base_layer.", "")]), name

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "lora")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    pipe = stock_flux(build_transformer(get_preset("tiny-flux"), None, 0), parts)

    def generate():
        return pipe(VALIDATION_PROMPTS[0], height=256, width=256, num_inference_steps=2, guidance_scale=3.5,
                    output_type="latent", max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0)).images

    before = generate()
    pipe.load_lora_weights(tmp_path / "lora")
    after = generate()
    assert torch.isfinite(after).all() and not torch.allclose(before, after)

    from train.export import export  # the adapters folded into a plain transformer generate the same

    export(tmp_path / "straight", tmp_path / "merged", merge_lora=True)
    from diffusers import FluxTransformer2DModel

    pipe.unload_lora_weights()
    pipe.transformer = FluxTransformer2DModel.from_pretrained(tmp_path / "merged", subfolder="transformer")
    assert torch.allclose(generate(), after, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_plan_counts_flux_dev_and_its_encoders():
    out = subprocess.run([sys.executable, "-m", "train", "plan", "flux-dev", "--batch-size", "1", "--json",
                          "--host-memory", "1024GB"], cwd=ROOT,  # a full fine-tune needs more RAM than this machine has
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["parameters"] == 11_901_408_320
    # the Flux VAE (SD3's architecture), CLIP-L without a projection, T5-XXL's encoder, in bf16
    assert result["peak_with_encoders_resident"] - result["predicted_peak"] == 2 * (83_819_683 + 123_060_480 + 4_762_310_656)


@pytest.mark.parametrize("lora,ckpt", [(0, "off"), (4, "off"), (0, "all"), (0, "every-2")])
@pytest.mark.slow
def test_dry_run_measures_one_flux_step_next_to_the_plan(flux_cache, tmp_path, lora, ckpt, capsys):
    """Checkpointing covers the single-stream blocks too (3 of tiny-flux's 1 + 2 blocks, every other: 1)."""
    result = train(TrainConfig(model="tiny-flux", cache=flux_cache, run=tmp_path, batch_size=4, precision="fp32", progress=False,
                               dry_run=True, validation_steps=2, lora_rank=lora, grad_checkpointing=ckpt))
    if ckpt != "off":
        assert f"gradient checkpointing: {3 if ckpt == 'all' else 1} of 3 transformer blocks" in capsys.readouterr().out
    assert result["bucket"] == "256x256"
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result


def test_a_cache_that_cannot_feed_flux_is_refused_naming_what_differs():
    """Before any weights load: another family's text layout, other widths, and a latent of odd size (Flux packs 2 x 2)."""
    from types import SimpleNamespace

    from shards import Bucket, CacheSpec, LatentSpec, TextSpec
    from train.cache import check_cache

    def cache(text, bucket=(256, 256), channels=16):
        spec = CacheSpec(LatentSpec(channels, 8, 0.3611, 0.1159, "mean_std"), text, "flux", "tiny-flux", 256)
        return SimpleNamespace(spec=spec, location="C", root="C",
                               manifest=SimpleNamespace(buckets=lambda: {Bucket(*bucket): None}))

    preset = get_preset("tiny-flux")
    config = preset.transformer_config()
    flux = TextSpec("flux", None, TOKENS, t5_tokens=TOKENS, pooled_width=24, t5_width=32)
    check_cache(preset, cache(flux), config)  # fits
    sd3 = TextSpec("sd3_joint", None, 32, 77, 32, True, 8, 24, 32)
    with pytest.raises(ValueError, match="(?s)text layout: cache .sd3_joint..*model flux takes .flux.*MODEL=tiny-flux"):
        check_cache(preset, cache(sd3), config)
    with pytest.raises(ValueError, match="pooled width: cache 8, model pooled_projection_dim 24"):
        check_cache(preset, cache(dataclasses.replace(flux, pooled_width=8)), config)
    with pytest.raises(ValueError, match="latent channels: cache 4, model in_channels / 4"):
        check_cache(preset, cache(flux, channels=4), config)
    with pytest.raises(ValueError, match="latent 31x32 is not a multiple of patch size 2"):
        check_cache(preset, cache(flux, bucket=(248, 256)), config)


@pytest.mark.slow
def test_fsdp_shards_the_single_stream_blocks_too_and_matches_one_process(flux_cache, tmp_path):
    """Two processes under FSDP (every double- and single-stream block sharded) train what one process does with the
    same global batch."""
    import os

    def launch(run, nproc, *args):
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
        out = subprocess.run([*runner, "-m", "train", "--model", "tiny-flux", "--cache", str(flux_cache), "--run-dir", str(run),
                              "--precision", "fp32", "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-3",
                              "--steps", "4", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    launch(tmp_path / "one", 1, "--batch-size", "4")
    log = launch(tmp_path / "fsdp", 2, "--batch-size", "2", "--parallel", "fsdp")
    assert "FSDP over 2 ranks: 3 FluxTransformerBlock blocks sharded" in log  # 1 double- and 2 single-stream blocks
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4) and len(losses(tmp_path / "one")) == 4


def test_validation_samples_as_each_flux_model_was_distilled_to_unless_told():
    dev, schnell, sana = (TrainConfig(model=m) for m in ("flux-dev", "flux-schnell", "tiny-sana"))
    assert (dev.validation_steps, dev.guidance_scale) == (28, 3.5)  # FluxPipeline's num_inference_steps and guidance_scale
    assert (schnell.validation_steps, schnell.guidance_scale) == (4, 0.0)
    assert (sana.validation_steps, sana.guidance_scale) == (20, 4.5)
    given = TrainConfig(model="flux-schnell", validation_steps=8, guidance_scale=2.0)
    assert (given.validation_steps, given.guidance_scale) == (8, 2.0)


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_validation_samples_what_the_stock_pipeline_samples(variant):
    """`validate.generate` against `FluxPipeline.__call__` from the same noise, caption and transformer, at a non-square
    bucket: dev with its dynamic shift and guidance embedding (no classifier-free guidance), schnell unshifted."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from shards import TextSpec
    from train.data import TextLayout
    from train.validate import generate

    dev = variant == "dev"
    preset = get_preset("tiny-flux")
    config = {**preset.transformer_config(), "guidance_embeds": dev}
    preset = dataclasses.replace(preset, config=config, dynamic_shift=dev)
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model="tiny-flux"), preset, config)
    g = torch.Generator().manual_seed(1)
    cond, null = ({"text": torch.randn(32, 32, generator=g), "pooled": torch.randn(24, generator=g)} for _ in range(2))
    layout = TextLayout(TextSpec("flux", None, 32, t5_tokens=32, pooled_width=24, t5_width=32))
    height, width, steps, c = 256, 384, 4, 16
    with torch.no_grad():
        ours = generate(transformer, preset, objective, cond, null, (c, height // 8, width // 8), height * width, steps=steps,
                        guidance=3.5, seed=7, precision=torch.float32, layout=layout)
    # the scheduler configs the released repositories ship
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0 if dev else 1.0, use_dynamic_shifting=dev,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                        transformer=transformer)
    noise = torch.randn(1, c, height // 8, width // 8, generator=torch.Generator().manual_seed(7))  # generate's draw
    with torch.no_grad():
        out = pipe(prompt_embeds=cond["text"][None], pooled_prompt_embeds=cond["pooled"][None], height=height, width=width,
                   latents=FluxPipeline._pack_latents(noise, 1, c, height // 8, width // 8), num_inference_steps=steps,
                   guidance_scale=3.5, output_type="latent").images
    stock = FluxPipeline._unpack_latents(out, height, width, 8)[0]
    assert ours.shape == stock.shape and torch.allclose(ours, stock, atol=1e-5)
    assert not torch.allclose(ours, noise[0], atol=1e-2)  # it sampled


def test_flux_dev_trains_at_guidance_one_and_validates_at_three_and_a_half():
    """FLUX.1-dev's guidance embedding gets 1.0 in training (the loss target is the unguided velocity), 3.5 in validation;
    --train-guidance overrides it; a resumed run keeps what it trained with (runs before the option's rename recorded
    it as guidance_scale_train); schnell, without the embedding, takes none."""
    from train.card import describe_training
    from train.model import train_guidance

    dev, schnell = get_preset("flux-dev"), get_preset("flux-schnell")
    assert (train_guidance(TrainConfig(model="flux-dev"), dev), TrainConfig(model="flux-dev").guidance_scale) == (1.0, 3.5)
    assert train_guidance(TrainConfig(model="flux-dev", train_guidance=3.5), dev) == 3.5
    assert train_guidance(TrainConfig(model="flux-dev"), dev, {"config": {"guidance_scale_train": 3.5}}) == 3.5
    assert train_guidance(TrainConfig(model="flux-dev"), dev, {"config": {"train_guidance": 1.0}}) == 1.0
    assert train_guidance(TrainConfig(model="flux-dev", train_guidance=2.0), dev, {"config": {"train_guidance": 1.0}}) == 2.0
    assert not schnell.transformer_config()["guidance_embeds"] and schnell.train_guidance is None
    assert train_guidance(TrainConfig(model="flux-schnell"), schnell, {"config": {"guidance_scale_train": 3.5}}) is None
    rows = describe_training({"step": 1, "config": {**dataclasses.asdict(TrainConfig(model="flux-dev", train_guidance=1.0)),
                                                    "cache": []}}, ema=False)
    assert "| guidance embedding | 1 in training (the unguided target); validation sampled at guidance_scale 3.5" in "\n".join(rows)


@pytest.mark.slow
def test_tiny_flux_feeds_its_guidance_embedding_1_in_training_and_3_5_in_validation(flux_cache, tmp_path, monkeypatch):
    from train.families import flux

    seen, forward = [], flux.Flux.forward

    def recording(self, model, config, xt, t, batch, guidance):
        seen.append((torch.is_grad_enabled(), guidance))
        return forward(self, model, config, xt, t, batch, guidance)

    monkeypatch.setattr(flux.Flux, "forward", recording)
    train(cfg(flux_cache, tmp_path / "run", steps=2, validate=True, validation_steps=1, validation_bucket=["256x256"],
              eval_fraction=0.3, eval_timesteps=1))
    training = {g for grad, g in seen if grad}
    sampled = {g for grad, g in seen if not grad}
    assert training == {1.0} and sampled == {1.0, 3.5}  # the held-out loss is the training loss: at 1.0 too
    train(cfg(flux_cache, tmp_path / "given", steps=1, train_guidance=3.5))
    assert {g for grad, g in seen[-1:]} == {3.5}
