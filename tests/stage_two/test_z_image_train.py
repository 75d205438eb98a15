"""Z-Image in stage two (tiny-z-image): the transformer gets what ZImagePipeline gives it (per-sample latents and
unpadded captions, the timestep as 1 - sigma, its output negated), the shift is its scheduler's, validation samples as
the pipeline samples, and the published architecture has its parameter count."""

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VALIDATION_PROMPTS, losses, stage_one_cache

from train.families.base import TextInput
from train.families.z_image import FAMILY, TINY, pipeline_default
from train.objectives import FlowMatching

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]

# the scheduler configs the released repositories ship (scheduler/scheduler_config.json)
SCHEDULERS = {"z-image": dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False),
              "z-image-turbo": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)}


def tiny_transformer(seed: int = 0):
    from diffusers import ZImageTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ZImageTransformer2DModel.from_config(TINY).eval()


def stock_z_image(transformer, scheduler: dict = SCHEDULERS["z-image"]):
    """ZImagePipeline around `transformer`, fed prompt embeddings (no text encoder or VAE needed for latents)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**scheduler), vae=None, text_encoder=None, tokenizer=None,
                          transformer=transformer)


def record_calls(model) -> list[dict]:
    """Every call's positional arguments to `model` (cloned) and what it returned."""
    calls = []

    def pre(module, args, kwargs):
        calls.append({"x": [x.clone() for x in args[0]], "t": args[1].clone(), "cap_feats": [c.clone() for c in args[2]]})

    def post(module, args, kwargs, out):
        calls[-1]["out"] = [o.clone() for o in out[0]]

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    return calls


def captions(*lengths: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, TINY["cap_feat_dim"], generator=g) for n in lengths]


def test_the_transformer_gets_what_zimagepipeline_gives_it():
    """A batch of two captions of different lengths, padded and masked as collated, at a non-square bucket: the
    latents, timestep and unpadded captions reach the transformer as the pipeline's guided step passes them, and the
    prediction is the negated output."""
    transformer = tiny_transformer()
    calls = record_calls(transformer)
    prompt, negative = captions(11, 5)
    stock_z_image(transformer)(prompt_embeds=[prompt], negative_prompt_embeds=[negative], height=256, width=192,
                               num_inference_steps=2, guidance_scale=5.0, output_type="latent",
                               generator=torch.Generator().manual_seed(0))
    stock = calls[-1]  # the last step: two samples (the prompt's, then the negative's) at t = 1 - sigma
    assert [x.shape for x in stock["x"]] == [(16, 1, 32, 24)] * 2 and 0 < float(stock["t"][0]) < 1

    collated = TextInput().collate(None, [{"text": prompt}, {"text": negative}])
    assert collated["text"].shape == (2, 11, TINY["cap_feat_dim"])
    xt = torch.stack(stock["x"]).squeeze(2)
    with torch.no_grad():
        ours = FAMILY.forward(transformer, transformer.config, xt, (1 - stock["t"]) * 1000, collated, None)
    mine = calls[-1]
    assert all(torch.equal(a, b) for a, b in zip(mine["x"], stock["x"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(mine["cap_feats"], stock["cap_feats"], strict=True))
    assert [len(c) for c in mine["cap_feats"]] == [11, 5]
    torch.testing.assert_close(mine["t"], stock["t"], rtol=0, atol=1e-7)
    assert torch.equal(ours, -torch.stack(mine["out"]).squeeze(2))


def test_the_shift_is_the_released_schedulers():
    """Z-Image's scheduler shifts by 6 and Z-Image-Turbo's by 3, whatever the resolution (use_dynamic_shifting is off,
    so the mu ZImagePipeline computes is ignored): training draws its noise levels with that shift, and validation
    samples the pipeline's sigmas."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas, retrieve_timesteps

    presets = FAMILY.presets()
    for name, config in SCHEDULERS.items():
        preset = presets[name]()
        assert (preset.flow_shift, preset.dynamic_shift) == (config["shift"], False)
        objective = FlowMatching(shift=preset.flow_shift)
        for bucket, steps in (((1024, 1024), preset.validation_steps), ((512, 768), 4)):
            pixels = bucket[0] * bucket[1]
            assert objective.shift_at(pixels) == config["shift"]
            stock = FlowMatchEulerDiscreteScheduler(**config)
            retrieve_timesteps(stock, steps, "cpu", sigmas=get_default_z_image_sigmas(steps),
                               mu=calculate_shift((bucket[0] // 16) * (bucket[1] // 16)))
            ours = FAMILY.sampling_scheduler(objective, pixels)
            FAMILY.set_timesteps(ours, objective, steps, pixels, torch.device("cpu"))
            assert torch.equal(ours.sigmas, stock.sigmas) and torch.equal(ours.timesteps, stock.timesteps), name
    assert presets["tiny-z-image"]().flow_shift == 6.0


def test_validation_defaults_are_the_pipelines_and_the_turbo_model_cards():
    presets = FAMILY.presets()
    base, turbo = presets["z-image"](), presets["z-image-turbo"]()
    assert (base.validation_steps, base.guidance_scale) == (50, 5.0) == (pipeline_default("num_inference_steps"),
                                                                         pipeline_default("guidance_scale"))
    assert (turbo.validation_steps, turbo.guidance_scale) == (8, 0.0)  # 8 function evaluations, no guidance
    assert (base.repo, turbo.repo) == ("Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Turbo")
    assert base.config == turbo.config == "z_image_transformer.json" and base.released_dtype == turbo.released_dtype == "bf16"


@pytest.mark.parametrize("guidance, normalization, truncation", [(5.0, False, 1.0), (0.0, False, 1.0), (4.0, 1.0, 0.1)],
                         ids=["guided", "turbo", "renormalised-truncated"])
def test_the_sampler_samples_what_zimagepipeline_samples(guidance, normalization, truncation, monkeypatch):
    """The family's sampler against `ZImagePipeline.__call__` from the same noise, captions and transformer at a
    non-square bucket: its guidance (the prompt pushed away from the negative), none at scale 0, and its options
    `cfg_normalization` and `cfg_truncation` where they are set."""
    import train.families.z_image as z_image

    defaults = {"cfg_normalization": normalization, "cfg_truncation": truncation}
    if (normalization, truncation) != (False, 1.0):
        monkeypatch.setattr(z_image, "pipeline_default", lambda name: defaults.get(name, pipeline_default(name)))
    transformer = tiny_transformer()
    prompt, negative = captions(9, 14)
    height, width, steps = 256, 192, 4
    objective = FlowMatching(shift=6.0)
    scheduler = FAMILY.sampling_scheduler(objective, height * width)
    FAMILY.set_timesteps(scheduler, objective, steps, height * width, torch.device("cpu"))
    noise = torch.randn(1, 16, height // 8, width // 8, generator=torch.Generator().manual_seed(7))
    text = TextInput().collate(None, [{"text": negative}, {"text": prompt}])  # the null caption first, as validation builds it

    def forward(xt, t, batch):
        return FAMILY.forward(transformer, transformer.config, xt, t, batch, None)

    with torch.no_grad():
        ours = FAMILY.denoise(forward, scheduler, noise.clone(), text, guidance=guidance, channels=16,
                              autocast=contextlib.nullcontext())
        stock = stock_z_image(transformer)(prompt_embeds=[prompt], negative_prompt_embeds=[negative], height=height, width=width,
                                           latents=noise.clone(), num_inference_steps=steps, guidance_scale=guidance,
                                           cfg_normalization=normalization, cfg_truncation=truncation, output_type="latent").images
    assert ours.shape == stock.shape == noise.shape and torch.allclose(ours, stock, atol=1e-6)
    assert not torch.allclose(ours, noise, atol=1e-2)  # it sampled


def test_the_published_transformer_has_six_billion_parameters():
    """train/configs/z_image_transformer.json on the meta device: 6,154,908,736 parameters (the "6B" of the model
    card), its RoPE tables as the Hub's config sizes them."""
    from diffusers import ZImageTransformer2DModel

    preset = FAMILY.presets()["z-image"]()
    config = preset.transformer_config()
    assert config["axes_lens"] == [1536, 512, 512] and config["cap_feat_dim"] == 2560
    with torch.device("meta"):
        model = ZImageTransformer2DModel.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 6_154_908_736
    assert len(FAMILY.blocks(model)) == 2 + 2 + 30  # noise and context refiners, then the main layers


# --- end to end: stage one's tiny cache, training, resume, export into the stock pipeline ---

@pytest.fixture(scope="module")
def z_cache(tmp_path_factory):
    """A tiny-z-image cache of 8 sample images built by stage one, with two validation prompts."""
    return stage_one_cache(tmp_path_factory.mktemp("z_image"), "tiny-z-image")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """tiny-z-image's VAE, Qwen3 and tokenizer, saved in the diffusers layout."""
    from precompute.presets import get_preset as encoders
    from precompute.presets import save_tiny

    directory = tmp_path_factory.mktemp("parts")
    save_tiny(encoders("tiny-z-image"), directory)
    return directory


def stock_pipeline(transformer, parts):
    """The stock ZImagePipeline around `transformer`, its other components loaded with `from_pretrained`."""
    import diffusers
    from transformers import AutoTokenizer, Qwen3Model

    return diffusers.ZImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULERS["z-image"]),
        vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"), text_encoder=Qwen3Model.from_pretrained(parts / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"), transformer=transformer)


def generate(pipe, output_type="latent"):
    return pipe(VALIDATION_PROMPTS[0], height=256, width=256, num_inference_steps=2, output_type=output_type,
                max_sequence_length=64, generator=torch.Generator().manual_seed(0)).images


def cfg(cache, run, **kw):
    from train.config import TrainConfig

    base = dict(model="tiny-z-image", cache=cache, run=run, steps=6, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=3, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})




def test_tiny_z_image_trains_resumes_exactly_and_its_export_generates_through_the_stock_pipeline(z_cache, parts, tmp_path):
    from diffusers import ZImageTransformer2DModel

    from train.export import export
    from train.loop import train

    straight = train(cfg(z_cache, tmp_path / "straight", validate=True, validation_bucket=["256x256"]))
    train(cfg(z_cache, tmp_path / "resumed", steps=3))
    resumed = train(cfg(z_cache, tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 6 and math.isfinite(straight["last_loss"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 6
    assert (tmp_path / "straight" / "samples-step00000006.png").exists()

    export(tmp_path / "straight", tmp_path / "export")
    exported = ZImageTransformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer")
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), tiny_transformer().parameters()))  # it trained
    image = generate(stock_pipeline(exported, parts), "np")[0]
    assert image.shape == (256, 256, 3) and np.isfinite(image).all() and float(image.std()) > 0


def test_tiny_z_image_lora_trains_adapters_alone_resumes_exactly_and_loads_into_zimagepipeline(z_cache, parts, tmp_path):
    from diffusers import ZImageTransformer2DModel

    from train.checkpoint import complete_checkpoints
    from train.export import export, load_model
    from train.loop import train

    lora = dict(lora_rank=4, lora_alpha=8, lr=1e-2)
    straight = train(cfg(z_cache, tmp_path / "straight", **lora))
    train(cfg(z_cache, tmp_path / "resumed", **{**lora, "steps": 3}))
    resumed = train(cfg(z_cache, tmp_path / "resumed", **lora))
    assert resumed["last_loss"] == straight["last_loss"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 6

    trained, _, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trained.named_parameters() if ".lora_A." in n}
    # attention q, k, v, out and the feed-forward of every block: the main layers' and the refiners'
    for block in ("layers.1", "noise_refiner.0", "context_refiner.0"):
        assert {f"{block}.attention.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0")} | {
            f"{block}.feed_forward.w{i}" for i in (1, 2, 3)} <= adapted
    assert not any("adaLN" in n or "embedder" in n or "final_layer" in n for n in adapted)
    base = dict(tiny_transformer().named_parameters())
    for name, p in trained.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace("base_layer.", "")]), name

    export(tmp_path / "straight", tmp_path / "lora")
    pipe = stock_pipeline(tiny_transformer(), parts)
    before = generate(pipe)
    pipe.load_lora_weights(tmp_path / "lora")  # ZImagePipeline's own LoRA loader (ZImageLoraLoaderMixin)
    after = generate(pipe)
    assert torch.isfinite(after).all() and not torch.allclose(before, after)

    export(tmp_path / "straight", tmp_path / "merged", merge_lora=True)  # the adapters folded into a plain transformer
    pipe.unload_lora_weights()
    pipe.transformer = ZImageTransformer2DModel.from_pretrained(tmp_path / "merged", subfolder="transformer")
    assert torch.allclose(generate(pipe), after, rtol=1e-4, atol=1e-4)


def test_plan_counts_z_image_and_its_encoders():
    out = subprocess.run([sys.executable, "-m", "train", "plan", "z-image", "--batch-size", "1", "--json",
                          "--host-memory", "1024GB"], cwd=ROOT,  # a full fine-tune needs more RAM than this machine has
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["parameters"] == 6_154_908_736
    # the Flux VAE and Qwen3-4B (without its LM head), in bf16
    assert result["peak_with_encoders_resident"] - result["predicted_peak"] == 2 * (83_819_683 + 4_022_468_096)


@pytest.fixture(scope="module")
def long_cache(tmp_path_factory):
    """A tiny-z-image cache whose captions all reach the token limit (what the planner assumes of every caption)."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("z_image_long")
    data = make_folder(root / "data", count=4)
    long = "a " + " and ".join(["large red circle on a blue background"] * 12)
    for caption in data.glob("*.txt"):
        caption.write_text(long)
    summary = precompute(str(data), "tiny-z-image", root / "cache", workers=0, progress=False, validation_prompt=[long])
    assert summary["captions_truncated"] == 4
    return root / "cache"


@pytest.mark.parametrize("setup", [dict(lora_rank=4), dict(lora_rank=4, grad_checkpointing="all")], ids=["lora", "checkpointed"])
def test_dry_run_measures_one_z_image_step_next_to_the_plan(long_cache, tmp_path, setup):
    """The planner traces the single stream the transformer builds (image patches and the caption's tokens, each padded
    to a multiple of 32) at the cache's token limit; a step on captions that reach it measures what was planned."""
    from train.config import TrainConfig
    from train.loop import train

    result = train(TrainConfig(**{**dict(model="tiny-z-image", cache=long_cache, run=tmp_path, batch_size=8, precision="fp32",
                                         progress=False, dry_run=True, validation_steps=2), **setup}))
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result

@pytest.mark.slow
def test_fsdp_shards_the_refiners_and_the_layers_and_matches_one_process(z_cache, tmp_path):
    """Two processes under FSDP (each refiner and main block sharded) train what one process does with the same
    global batch."""
    import os

    def launch(run, nproc, *args):
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
        out = subprocess.run([*runner, "-m", "train", "--model", "tiny-z-image", "--cache", str(z_cache), "--run-dir", str(run),
                              "--precision", "fp32", "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-3",
                              "--steps", "4", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    launch(tmp_path / "one", 1, "--batch-size", "4")
    log = launch(tmp_path / "fsdp", 2, "--batch-size", "2", "--parallel", "fsdp")
    assert "FSDP over 2 ranks: 4 ZImageTransformerBlock blocks sharded" in log  # a noise and a context refiner, 2 layers
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4) and len(losses(tmp_path / "one")) == 4
