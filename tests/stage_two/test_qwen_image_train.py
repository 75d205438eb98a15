"""Qwen-Image in stage two (tiny-qwen-image): the transformer gets what QwenImagePipeline gives it (packed latents,
`img_shapes`, the caption mask, the timestep as sigma), the shift is its scheduler's, validation samples as the
pipeline samples (true classifier-free guidance, norm-rescaled), training resumes exactly, full and LoRA exports load in
the stock pipeline, and the published architecture has its parameter count."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VALIDATION_PROMPTS, losses, record_calls, stage_one_cache

from shards import TextSpec
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.data import TextLayout
from train.families import get_preset
from train.families.qwen_image import ENCODERS, SCHEDULER
from train.loop import train
from train.model import build_run_objective, null_caption
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # tiny diffusers and transformers models

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 64  # tiny-qwen-image's caption limit
WIDTH = 32  # the tiny Qwen2.5-VL's hidden size


@pytest.fixture(scope="module")
def qwen_cache(tmp_path_factory):
    """A tiny-qwen-image cache of 8 sample images built by stage one, with two validation prompts."""
    return stage_one_cache(tmp_path_factory.mktemp("qwen"), "tiny-qwen-image")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """tiny-qwen-image's VAE, Qwen2.5-VL and tokenizer, saved in the diffusers layout."""
    from precompute.families.qwen_image import FAMILY
    from precompute.presets import get_preset as encoders

    directory = tmp_path_factory.mktemp("parts")
    FAMILY.save_tiny_vae(encoders("tiny-qwen-image").vae, str(directory))
    FAMILY.save_tiny_text(encoders("tiny-qwen-image").text, str(directory))
    return directory


def stock_qwen(transformer, parts: Path | None = None):
    """The stock QwenImagePipeline around `transformer` with the published scheduler; its VAE, text encoder and
    tokenizer loaded with `from_pretrained` from `parts` (None: without them, fed prompt embeddings and latents)."""
    import diffusers
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
    if parts is None:
        return diffusers.QwenImagePipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=transformer)
    return diffusers.QwenImagePipeline(
        scheduler=scheduler, vae=diffusers.AutoencoderKLQwenImage.from_pretrained(parts / "vae"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(parts / "text_encoder"),
        tokenizer=Qwen2Tokenizer.from_pretrained(parts / "tokenizer"), transformer=transformer)




def cfg(cache, run, **kw):
    base = dict(model="tiny-qwen-image", cache=cache, run=run, steps=6, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=3, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})




def generate_latents(pipe, **kwargs) -> torch.Tensor:
    return pipe(VALIDATION_PROMPTS[0], negative_prompt="", height=256, width=256, num_inference_steps=2, true_cfg_scale=4.0,
                output_type="latent", max_sequence_length=TOKENS, generator=torch.Generator().manual_seed(0), **kwargs).images


def test_the_transformer_gets_what_qwenimagepipeline_gives_it():
    """Two captions of different lengths at a non-square bucket: the packed latents, the caption tokens and mask, the
    timestep and `img_shapes` equal what QwenImagePipeline passes the transformer, and the output is its unpacking."""
    from diffusers import QwenImagePipeline

    transformer = build_transformer(get_preset("tiny-qwen-image"), None, 0).eval()
    calls = record_calls(transformer)
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(2, 9, WIDTH, generator=g)
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    embeds[1, 6:] = 0  # the pipeline's padding
    stock_qwen(transformer)(prompt_embeds=embeds, prompt_embeds_mask=mask, height=256, width=192, num_inference_steps=2,
                            true_cfg_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    stock = calls[-1]
    assert stock["hidden_states"].shape == (2, 16 * 12, 64)  # (256 / 16) x (192 / 16) packed 2 x 2 patches of 16 channels

    latents = QwenImagePipeline._unpack_latents(stock["hidden_states"], 256, 192, 8)[:, :, 0]  # (2, 16, 32, 24)
    with torch.no_grad():
        ours = model_forward(transformer, "qwen-image")(latents, stock["timestep"] * 1000, {"text": embeds, "text_mask": mask.bool()})
    mine = calls[-1]
    for name in ("hidden_states", "encoder_hidden_states"):
        assert torch.equal(mine[name], stock[name]), name
    assert torch.equal(mine["encoder_hidden_states_mask"].bool(), stock["encoder_hidden_states_mask"].bool())
    assert mine["img_shapes"] == stock["img_shapes"] == [[(1, 16, 12)]] * 2
    torch.testing.assert_close(mine["timestep"], stock["timestep"], rtol=1e-6, atol=0)
    assert ours.shape == latents.shape and torch.equal(ours, QwenImagePipeline._unpack_latents(mine["out"], 256, 192, 8)[:, :, 0])


@pytest.mark.parametrize("bucket", [(256, 256), (512, 768), (1024, 1024), (1328, 1328), (928, 1664)])
def test_the_shift_is_the_pipelines_mu_and_validation_its_sigmas(bucket):
    """Training's shift is exp(mu) of QwenImagePipeline's calculate_shift at the image's sequence length with the
    published scheduler's points; its noise levels are the scheduler's exponential time shift of the drawn ones;
    validation sets the pipeline's sigmas (stretched to its terminal 0.02)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    from train.validate import sampling_scheduler

    h, w = bucket
    seq_len = (h // 16) * (w // 16)  # the pipeline's image_seq_len: latents.shape[1] after packing
    mu = calculate_shift(seq_len, 256, 8192, 0.5, 0.9)
    preset = get_preset("qwen-image")
    objective = build_run_objective(TrainConfig(model="qwen-image"), preset, preset.transformer_config())
    assert objective.dynamic_shift and objective.mu(h * w) == mu
    assert objective.shift_at(h * w) == pytest.approx(math.exp(mu), rel=1e-12)
    stock = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER)
    u = torch.rand(256, generator=torch.Generator().manual_seed(0))
    shifted = objective.shift_at(h * w) * u / (1 + (objective.shift_at(h * w) - 1) * u)
    assert torch.allclose(shifted, stock.time_shift(mu, 1.0, u), rtol=1e-6, atol=1e-7)

    steps = 50
    retrieve_timesteps(stock, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = sampling_scheduler(preset, objective, h * w)
    from train.families import get_family

    get_family("qwen-image").set_timesteps(ours, objective, steps, h * w, torch.device("cpu"))
    assert torch.allclose(ours.sigmas, stock.sigmas) and torch.allclose(ours.timesteps, stock.timesteps)
    assert ours.sigmas[-2].item() == pytest.approx(0.02)  # the published scheduler's shift_terminal


@pytest.mark.parametrize("guidance", [4.0, 1.0], ids=["true-cfg", "no-cfg"])
def test_validation_samples_what_the_stock_pipeline_samples(guidance):
    """`validate.generate` against `QwenImagePipeline.__call__` from the same noise, captions and transformer at a
    non-square bucket: each caption in its own pass, combined by the pipeline's norm-rescaled true CFG against the
    null caption (the cached empty caption), or the caption alone at a scale of 1."""
    from diffusers import QwenImagePipeline

    from train.validate import generate

    preset = get_preset("tiny-qwen-image")
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model="tiny-qwen-image"), preset, preset.transformer_config())
    g = torch.Generator().manual_seed(1)
    cond, null = {"text": torch.randn(11, WIDTH, generator=g)}, {"text": torch.randn(5, WIDTH, generator=g)}
    height, width, steps, c = 256, 384, 3, 16
    with torch.no_grad():
        ours = generate(transformer, preset, objective, cond, null, (c, height // 8, width // 8), height * width, steps=steps,
                        guidance=guidance, seed=7, precision=torch.float32, layout=TextLayout(TextSpec("masked", WIDTH, TOKENS)))
        noise = torch.randn(1, c, height // 8, width // 8, generator=torch.Generator().manual_seed(7))  # generate's draw
        out = stock_qwen(transformer)(prompt_embeds=cond["text"][None], negative_prompt_embeds=null["text"][None],
                                      true_cfg_scale=guidance, height=height, width=width, num_inference_steps=steps,
                                      latents=QwenImagePipeline._pack_latents(noise, 1, c, height // 8, width // 8),
                                      output_type="latent").images
    stock = QwenImagePipeline._unpack_latents(out, height, width, 8)[0, :, 0]
    assert ours.shape == stock.shape and torch.allclose(ours, stock, atol=1e-5)
    assert not torch.allclose(ours, noise[0], atol=1e-2)  # it sampled


def test_the_published_architecture_has_its_parameter_count():
    preset = get_preset("qwen-image")
    assert (preset.repo, preset.transformer_config()["num_layers"]) == ("Qwen/Qwen-Image", 60)
    with torch.device("meta"):
        model = preset.transformer_class.from_config(preset.transformer_config())
    assert sum(p.numel() for p in model.parameters()) == 20_430_401_088
    assert (preset.validation_steps, preset.guidance_scale) == (50, 4.0)  # QwenImagePipeline's defaults


@pytest.mark.slow  # plans the real 20B model (the count alone is checked above, on the meta device)
def test_plan_counts_qwen_image_and_its_encoders():
    out = subprocess.run([sys.executable, "-m", "train", "plan", "qwen-image", "--batch-size", "1", "--json",
                          "--host-memory", "1024GB"], cwd=ROOT,  # a full fine-tune needs more RAM than this machine has
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["parameters"] == 20_430_401_088
    # the VAE and Qwen2.5-VL-7B resident in bf16
    assert result["peak_with_encoders_resident"] - result["predicted_peak"] == 2 * sum(ENCODERS.values())


def test_a_dropped_caption_is_the_cached_empty_caption(qwen_cache):
    from shards import Cache, prompt_key
    from train.data import TrainingSamples

    assert null_caption(cfg(qwen_cache, "r"), get_preset("tiny-qwen-image")) == "empty"
    cache = Cache(qwen_cache)
    empty = TextLayout.of(cache).caption(cache.prompts()[prompt_key("")].fields)
    cond = TrainingSamples(qwen_cache, 0, 1.0, "empty")[(0, 0)]["cond"]
    assert set(cond) == {"text"} and cond["text"].shape == (5, WIDTH)  # the template's closing tokens around nothing
    assert torch.equal(cond["text"], empty["text"])


def test_tiny_qwen_image_trains_resumes_exactly_and_its_export_generates_through_the_stock_pipeline(qwen_cache, parts, tmp_path):
    straight = train(cfg(qwen_cache, tmp_path / "straight", validate=True, validation_bucket=["256x256"]))
    train(cfg(qwen_cache, tmp_path / "resumed", steps=3))
    resumed = train(cfg(qwen_cache, tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 6 and math.isfinite(straight["last_loss"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 6
    assert (tmp_path / "straight" / "samples-step00000006.png").exists()

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "export")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    from diffusers import QwenImageTransformer2DModel

    exported = QwenImageTransformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer")
    base = build_transformer(get_preset("tiny-qwen-image"), None, 0)
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), base.parameters()))  # it trained
    image = stock_qwen(exported, parts)(VALIDATION_PROMPTS[0], negative_prompt="", height=256, width=256, num_inference_steps=2,
                                        true_cfg_scale=4.0, output_type="np", max_sequence_length=TOKENS,
                                        generator=torch.Generator().manual_seed(0)).images[0]
    assert image.shape == (256, 256, 3) and np.isfinite(image).all() and float(image.std()) > 0

    out = subprocess.run([sys.executable, "-m", "train", "sample", str(tmp_path / "straight"), "--prompt-cache", str(qwen_cache),
                          "--validation-bucket", "256x256", "--out", str(tmp_path / "samples")], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(list((tmp_path / "samples").glob("*-256x256-seed0.png"))) == len(VALIDATION_PROMPTS)


def test_tiny_qwen_image_lora_trains_adapters_alone_resumes_exactly_and_loads_into_the_pipeline(qwen_cache, parts, tmp_path):
    lora = dict(lora_rank=4, lora_alpha=8, lr=1e-2)
    straight = train(cfg(qwen_cache, tmp_path / "straight", **lora))
    train(cfg(qwen_cache, tmp_path / "resumed", **{**lora, "steps": 3}))
    resumed = train(cfg(qwen_cache, tmp_path / "resumed", **lora))
    assert resumed["last_loss"] == straight["last_loss"]
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 6

    from train.export import load_model

    trained, _, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trained.named_parameters() if ".lora_A." in n}
    # diffusers' train_dreambooth_lora_qwen_image.py's layers: the image stream's attention projections
    assert adapted == {f"transformer_blocks.{i}.attn.{m}" for i in range(2) for m in ("to_q", "to_k", "to_v", "to_out.0")}
    base = dict(build_transformer(get_preset("tiny-qwen-image"), None, 0).named_parameters())
    for name, p in trained.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace("base_layer.", "")]), name

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "lora")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    pipe = stock_qwen(build_transformer(get_preset("tiny-qwen-image"), None, 0), parts)
    before = generate_latents(pipe)
    pipe.load_lora_weights(tmp_path / "lora")
    assert 'negative_prompt=""' in (tmp_path / "lora" / "README.md").read_text()
    after = generate_latents(pipe)
    assert torch.isfinite(after).all() and not torch.allclose(before, after)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_export_card_samples_with_true_cfg_as_validation_does(kind):
    """QwenImagePipeline guides only when given a negative prompt: the card's call passes one."""
    from train.card import Base, usage

    code = usage("qwen-image", kind, Base("hub", "Qwen/Qwen-Image"), "owner/export")
    assert 'image = pipe("a prompt", negative_prompt="", true_cfg_scale=4.0).images[0]' in code


@pytest.mark.parametrize("setup", [dict(lora_rank=4), dict(lora_rank=4, grad_checkpointing="all", blocks_to_swap=1,
                                                             weights_dtype="bf16", precision="bf16")], ids=["lora", "swap"])
def test_dry_run_measures_one_qwen_image_step_next_to_the_plan(qwen_cache, tmp_path, setup):
    """The planner traces the family's inputs (packed latents, caption tokens and mask) as a step runs them, with a
    swapped block too."""
    result = train(TrainConfig(**{**dict(model="tiny-qwen-image", cache=qwen_cache, run=tmp_path, batch_size=4, precision="fp32",
                                         progress=False, dry_run=True, validation_steps=2), **setup}))
    assert result["bucket"] == "256x256"
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result
