"""FLUX.2 in stage two (tiny-flux2, tiny-flux2-klein): the transformer gets what the stock Flux2Pipeline and
Flux2KleinPipeline give it — the target's tokens, each reference's after them at its own time offset, the 4-axis ids,
every caption token, the timestep and dev's guidance — and only the target's prediction comes back, per group of samples
whose references share shapes; training's shift is the pipelines' empirical mu; validation samples as the pipelines do,
with the sample's references; the presets count the published parameters."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VALIDATION_PROMPTS, record_calls

from train.config import TrainConfig
from train.families import get_family, get_preset
from train.loop import train
from train.model import build_run_objective, train_guidance
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

C, TOKENS, WIDTH = 128, 64, 48  # the patchified latent's channels; the tiny encoders' token limit and stacked width
PIPELINES = {"tiny-flux2": "Flux2Pipeline", "tiny-flux2-klein": "Flux2KleinPipeline"}
# FLUX.2's scheduler config as released (dev and klein)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Each tiny preset's VAE, text encoder and tokenizer, saved in the diffusers layout."""
    from precompute.presets import get_preset as encoders
    from precompute.presets import save_tiny

    out = {}
    for name in PIPELINES:
        out[name] = tmp_path_factory.mktemp(name)
        save_tiny(encoders(name), out[name])
    return out


def stock(name: str, transformer, parts):
    """The stock pipeline of preset `name` around `transformer`, its other components loaded with `from_pretrained`."""
    import diffusers
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

    encoder = Mistral3ForConditionalGeneration if name == "tiny-flux2" else Qwen3ForCausalLM
    directory = parts[name]
    return getattr(diffusers, PIPELINES[name])(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER), transformer=transformer,
        vae=diffusers.AutoencoderKLFlux2.from_pretrained(directory / "vae"),
        text_encoder=encoder.from_pretrained(directory / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(directory / "tokenizer"))


def images(*sizes):
    rng = np.random.RandomState(4)
    from PIL import Image

    return [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in sizes]


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h * w, C) tokens in the pipelines' row-major order -> (B, C, h, w)."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_the_transformer_gets_what_the_stock_pipeline_gives_it(name, parts):
    """A 64 x 96 target with two references of other shapes through the stock pipeline, and the same latents, references
    and caption embeddings through our forward: every input of the transformer's call is the pipeline's, bit for bit
    (ids: the target at time 0, the references at 10 and 20; the caption's tokens at (0, 0, 0, l)), and our prediction is
    the pipeline's for the target's tokens."""
    transformer = build_transformer(get_preset(name), None, 0).eval()
    calls = record_calls(transformer)
    pipe = stock(name, transformer, parts)
    pipe(prompt="a large red circle on a blue background", image=images((64, 64), (70, 100)), height=64, width=96,
         num_inference_steps=2, guidance_scale=4.0, max_sequence_length=TOKENS, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    theirs = calls[0]  # the caption's pass (a klein base also runs the empty caption's)
    assert theirs["hidden_states"].shape == (1, 4 * 6 + 4 * 4 + 4 * 6, C)  # target 4 x 6, references 4 x 4 and 4 x 6
    hidden, ids = theirs["hidden_states"], theirs["img_ids"]
    assert ids[0, 24].tolist() == [10, 0, 0, 0] and ids[0, 40].tolist() == [20, 0, 0, 0] and ids[0, -1].tolist() == [20, 3, 5, 0]
    latents, refs = unpack(hidden[:, :24], 4, 6), [unpack(hidden[:, 24:40], 4, 4)[0], unpack(hidden[:, 40:], 4, 6)[0]]
    batch = {"text": theirs["encoder_hidden_states"], "references": [refs]}
    guidance = 4.0 if name == "tiny-flux2" else None
    with torch.no_grad():
        ours = model_forward(transformer, "flux2", guidance=guidance)(latents, theirs["timestep"] * 1000, batch)
    mine = calls[-1]
    for key in ("hidden_states", "img_ids", "txt_ids", "timestep", "encoder_hidden_states", "guidance"):
        assert (mine[key] is None and theirs[key] is None) or torch.equal(mine[key], theirs[key]), key
    assert (theirs["guidance"] is None) == (name == "tiny-flux2-klein")
    assert torch.equal(theirs["txt_ids"][0, -1], torch.tensor([0, 0, 0, TOKENS - 1]))
    assert ours.shape == latents.shape and torch.equal(ours, unpack(theirs["out"][:, :24], 4, 6))


def test_samples_whose_references_differ_run_one_group_at_a_time():
    """A batch of a text-to-image sample and two edit samples with references of different shapes: three transformer
    calls, each sample's prediction its own call's (the others' tokens never in its sequence)."""
    transformer = build_transformer(get_preset("tiny-flux2"), None, 0).eval()
    g = torch.Generator().manual_seed(1)
    xt, t = torch.randn(3, C, 4, 6, generator=g), torch.tensor([900.0, 250.0, 500.0])
    text = torch.randn(3, TOKENS, WIDTH, generator=g)
    refs = [[], [torch.randn(C, 4, 4, generator=g)], [torch.randn(C, 2, 3, generator=g), torch.randn(C, 4, 4, generator=g)]]
    calls = []
    transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["hidden_states"].shape), with_kwargs=True)
    forward = model_forward(transformer, "flux2", guidance=1.0)
    with torch.no_grad():
        ours = forward(xt, t, {"text": text, "references": refs})
        assert calls == [(1, 24, C), (1, 24 + 16, C), (1, 24 + 6 + 16, C)]
        for i in range(3):
            alone = forward(xt[i : i + 1], t[i : i + 1], {"text": text[i : i + 1], "references": [refs[i]]})
            torch.testing.assert_close(ours[i : i + 1], alone, rtol=1e-5, atol=1e-6)
        # a batch whose samples share their references' shapes is one call
        calls.clear()
        same = forward(xt[1:], t[1:], {"text": text[1:], "references": [[refs[1][0], refs[1][0]], [refs[2][1], refs[2][1]]]})
        assert calls == [(2, 24 + 32, C)] and same.shape == (2, C, 4, 6)


def test_the_reference_conditions_the_target_and_gradients_reach_every_trained_weight():
    transformer = build_transformer(get_preset("tiny-flux2-klein"), None, 0)
    g = torch.Generator().manual_seed(2)
    xt, ref = torch.randn(2, C, 4, 4, generator=g), torch.randn(C, 4, 4, generator=g)
    batch = {"text": torch.randn(2, TOKENS, WIDTH, generator=g), "references": [[ref], [ref * 0]]}
    pred = model_forward(transformer, "flux2")(xt, torch.tensor([500.0, 500.0]), batch)
    pred.square().mean().backward()
    assert all(p.grad is not None for p in transformer.parameters())
    with torch.no_grad():
        other = model_forward(transformer, "flux2")(xt, torch.tensor([500.0, 500.0]), {**batch, "references": [[ref * 0]] * 2})
    assert not torch.allclose(pred[0], other[0]) and torch.allclose(pred[1], other[1])


@pytest.mark.parametrize("bucket", [(256, 256), (512, 768), (1024, 1024), (1024, 2048), (2048, 2048)])
def test_the_shift_is_the_pipelines_empirical_mu(bucket):
    """Training shifts by exp(mu) of compute_empirical_mu at the sequence length (50 steps, the pipelines' default);
    validation's sigmas are the pipeline's for its step count."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

    from train.validate import sampling_scheduler

    h, w = bucket
    seq_len = (h // 16) * (w // 16)  # the pipelines' image_seq_len: one token per 16 x 16 pixels
    for name in ("flux2-dev", "flux2-klein-4b", "flux2-klein-base-9b"):
        preset = get_preset(name)
        objective = build_run_objective(TrainConfig(model=name), preset, preset.transformer_config())
        mu = compute_empirical_mu(seq_len, 50)
        assert objective.dynamic_shift and objective.mu(h * w) == mu
        assert objective.shift_at(h * w) == pytest.approx(math.exp(mu), rel=1e-12)
        steps = preset.validation_steps
        reference = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
        retrieve_timesteps(reference, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                           mu=compute_empirical_mu(seq_len, steps))
        ours = sampling_scheduler(preset, objective, h * w)
        get_family("flux2").set_timesteps(ours, objective, steps, h * w, "cpu")
        assert torch.allclose(ours.sigmas, reference.sigmas) and torch.allclose(ours.timesteps, reference.timesteps), name


def test_the_presets_count_the_published_parameters():
    """flux2-dev's transformer from the published config has 32,223,281,152 parameters (counted on the meta device);
    klein 4B and 9B as their configs say; dev embeds guidance (trained at 1), klein does not; references: BFL's limits."""
    counts = {}
    for name in ("flux2-dev", "flux2-klein-4b", "flux2-klein-9b"):
        preset = get_preset(name)
        with torch.device("meta"):
            model = preset.transformer_class.from_config(preset.transformer_config())
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts == {"flux2-dev": 32_223_281_152, "flux2-klein-4b": 3_875_544_576, "flux2-klein-9b": 9_078_581_248}
    dev, klein, base = get_preset("flux2-dev"), get_preset("flux2-klein-4b"), get_preset("flux2-klein-base-4b")
    assert dev.transformer_config()["joint_attention_dim"] == 3 * 5120 and klein.transformer_config()["joint_attention_dim"] == 3 * 2560
    assert get_preset("flux2-klein-9b").transformer_config()["joint_attention_dim"] == 3 * 4096
    assert train_guidance(TrainConfig(model="flux2-dev"), dev) == 1.0 and klein.train_guidance is None
    assert (dev.references, klein.references, dev.latent_downsample, dev.text_tokens) == (6, 4, 16, 512)
    assert (klein.validation_steps, klein.guidance_scale, base.validation_steps, base.guidance_scale) == (4, 1.0, 50, 4.0)
    family = get_family("flux2")
    assert family.pipeline_of(dev) == "Flux2Pipeline" and family.pipeline_of(klein) == "Flux2KleinPipeline"
    assert klein.repo == "black-forest-labs/FLUX.2-klein-4B" and base.repo == "black-forest-labs/FLUX.2-klein-base-4B"


@pytest.mark.parametrize("name, guidance", [("tiny-flux2", 4.0), ("tiny-flux2-klein", 4.0), ("tiny-flux2-klein", 1.0)])
def test_validation_samples_as_the_stock_pipeline_does(name, guidance, parts):
    """`validate.generate` from cached caption embeddings and reference latents against the stock pipeline's __call__
    given the same noise, embeddings and references as latents: dev one pass with embedded guidance; a klein base with
    classifier-free guidance against the empty caption; a distilled klein (guidance 1) one pass."""
    from diffusers import Flux2Pipeline

    from shards import TextSpec
    from train.data import TextLayout
    from train.validate import generate

    preset = dataclasses.replace(get_preset(name), guidance_scale=guidance)
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model=name), preset, preset.transformer_config())
    height, width, steps = 64, 96, 3
    g = torch.Generator().manual_seed(3)
    refs = [torch.randn(C, 4, 4, generator=g), torch.randn(C, 3, 5, generator=g)]
    cond, null = ({"text": torch.randn(TOKENS, WIDTH, generator=g)} for _ in range(2))
    with torch.no_grad():
        ours = generate(transformer, preset, objective, cond, null, (C, height // 16, width // 16), height * width, steps=steps,
                        guidance=guidance, seed=7, precision=torch.float32, layout=TextLayout(TextSpec("masked", WIDTH, TOKENS)),
                        references=refs)
    pipe = stock(name, transformer, parts)

    def given_latents(images, batch_size, **kwargs):  # the cached references in place of encoding the images
        packed = torch.cat([Flux2Pipeline._pack_latents(r[None]) for r in refs], dim=1)
        ids = Flux2Pipeline._prepare_image_ids([r[None] for r in refs])
        return packed.expand(batch_size, -1, -1), ids.expand(batch_size, -1, -1)

    pipe.prepare_image_latents = given_latents
    seen = []  # the packed latents after each step, before the pipeline denormalises them

    def keep(pipe, step, t, tensors):
        seen.append(tensors["latents"])
        return {}

    noise = torch.randn(1, C, height // 16, width // 16, generator=torch.Generator().manual_seed(7))  # generate's draw
    kwargs = {} if name == "tiny-flux2" else {"negative_prompt_embeds": null["text"][None]}
    with torch.no_grad():
        pipe(image=images((64, 64)), prompt_embeds=cond["text"][None], height=height, width=width, num_inference_steps=steps,
             guidance_scale=guidance, latents=noise, output_type="latent", callback_on_step_end=keep, **kwargs)
    assert len(seen) == steps and torch.equal(ours, unpack(seen[-1], 4, 6)[0])
    assert not torch.allclose(ours, noise[0], atol=1e-2)  # it sampled


# ---- end to end: a stage-one cache of text-to-image and two-reference samples, trained, resumed and exported ----------

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mixed_cache(tmp_path_factory):
    """tiny-flux2's cache of a dataset file's two sources: four plain images and four edits of two references each."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_edit_folder, make_folder

    root = tmp_path_factory.mktemp("flux2_mixed")
    make_folder(root / "data" / "plain", count=4)
    make_edit_folder(root / "data" / "edits", count=4, references=2)
    (root / "data" / "data.toml").write_text('[[source]]\npath = "plain"\n[[source]]\npath = "edits"\nreferences = true\n')
    summary = precompute(str(root / "data" / "data.toml"), "tiny-flux2", root / "cache", workers=0, progress=False,
                         validation_prompt=list(VALIDATION_PROMPTS))
    assert summary["new"] == 8 and summary["failed"] == 0
    return {"cache": root / "cache", "data": root / "data"}


def run_config(cache, run, **kw):
    base = dict(model="tiny-flux2", cache=cache, run=run, steps=4, batch_size=2, workers=0, progress=False, log_every=1,
                checkpoint_every=2, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})


def edit_inputs(data: Path) -> list:
    from PIL import Image

    return [Image.open(data / "edits" / f"00000.ref{k}.png").convert("RGB") for k in range(2)]


def test_one_cache_holds_text_to_image_samples_and_two_reference_edits(mixed_cache):
    from shards import Cache
    from shards.references import unpack

    cache = Cache(mixed_cache["cache"])
    counts = sorted(len(unpack(cache[i].fields)) for i in range(len(cache)))
    assert counts == [0, 0, 0, 0, 2, 2, 2, 2]
    for i in range(len(cache)):
        # each reference at its own size, within tiny-flux2's area cap of 128 x 128 pixels (64 tokens)
        assert all(r.shape[0] == C and r.shape[1] * r.shape[2] <= 64 for r in unpack(cache[i].fields))


@pytest.mark.slow
def test_tiny_flux2_trains_resumes_exactly_and_its_export_edits_through_flux2pipeline(mixed_cache, parts, tmp_path):
    import subprocess
    import sys

    from conftest import assert_same_checkpoints, losses

    straight = train(run_config(mixed_cache["cache"], tmp_path / "straight"))
    train(run_config(mixed_cache["cache"], tmp_path / "resumed", steps=2))
    resumed = train(run_config(mixed_cache["cache"], tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 4 and math.isfinite(straight["last_loss"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "export")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    from diffusers import Flux2Transformer2DModel

    exported = Flux2Transformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer")
    base = build_transformer(get_preset("tiny-flux2"), None, 0)
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), base.parameters()))  # it trained
    pipe = stock("tiny-flux2", exported, parts)
    for given in ({}, {"image": edit_inputs(mixed_cache["data"])}):  # text to image, and an edit of two references
        image = pipe(prompt=VALIDATION_PROMPTS[0], height=64, width=96, num_inference_steps=2, max_sequence_length=TOKENS,
                     output_type="np", generator=torch.Generator().manual_seed(0), **given).images[0]
        assert image.shape == (64, 96, 3) and np.isfinite(image).all() and float(image.std()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_lora_trains_alone_resumes_exactly_and_loads_into_the_stock_pipeline(name, mixed_cache, parts, tmp_path):
    """LoRA on both tiny presets (klein's on a plain cache of its own): only the adapters train, the run resumes exactly,
    and `load_lora_weights` of Flux2Pipeline / Flux2KleinPipeline takes the export and changes what it generates."""
    import subprocess
    import sys

    from conftest import assert_same_checkpoints, losses, stage_one_cache

    from train.checkpoint import complete_checkpoints
    from train.export import load_model

    cache = mixed_cache["cache"] if name == "tiny-flux2" else stage_one_cache(tmp_path / "klein", name, count=4)
    lora = dict(model=name, lora_rank=4, lora_alpha=8, lr=1e-2)
    straight = train(run_config(cache, tmp_path / "straight", **lora))
    train(run_config(cache, tmp_path / "resumed", **{**lora, "steps": 2}))
    resumed = train(run_config(cache, tmp_path / "resumed", **lora))
    assert resumed["last_loss"] == straight["last_loss"] and losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")

    trained, _, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trained.named_parameters() if ".lora_A." in n}
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_k_proj",
            "transformer_blocks.0.ff.linear_in", "transformer_blocks.0.ff_context.linear_out",
            "single_transformer_blocks.1.attn.to_qkv_mlp_proj", "single_transformer_blocks.1.attn.to_out"} <= adapted
    assert not any(n.endswith("norm_out.linear") or n.startswith(("x_embedder", "context_embedder")) for n in adapted)
    base = dict(build_transformer(get_preset(name), None, 0).named_parameters())
    for n, p in trained.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n.replace("base_layer.", "")]), n

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "lora")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    pipe = stock(name, build_transformer(get_preset(name), None, 0), parts)

    def generate():
        return pipe(prompt=VALIDATION_PROMPTS[0], height=64, width=64, num_inference_steps=2, max_sequence_length=TOKENS,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images

    before = generate()
    pipe.load_lora_weights(tmp_path / "lora")
    after = generate()
    assert torch.isfinite(after).all() and not torch.allclose(before, after)


@pytest.mark.parametrize("name, pipeline, call", [
    ("flux2-dev", "Flux2Pipeline", "num_inference_steps=50, guidance_scale=4"),
    ("flux2-klein-4b", "Flux2KleinPipeline", "num_inference_steps=4, guidance_scale=1"),
    ("flux2-klein-base-9b", "Flux2KleinPipeline", "num_inference_steps=50, guidance_scale=4")])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_export_card_generates_and_edits_through_the_models_pipeline(name, pipeline, call, kind):
    from train.card import Base, usage

    preset = get_preset(name)
    code = usage("flux2", kind, Base("hub", preset.repo), "owner/export", preset=preset)
    assert f'pipe = {pipeline}.from_pretrained("{preset.repo}"' in code
    assert f'image = pipe("a prompt", {call}).images[0]' in code
    assert f'edited = pipe(image=[load_image("input.png")], prompt="an edit instruction", {call}).images[0]' in code
    assert ('Flux2Transformer2DModel.from_pretrained("owner/export", subfolder="transformer"' in code if kind == "full"
            else 'pipe.load_lora_weights("owner/export")' in code)
    compile(code, "card", "exec")


def test_validation_decodes_the_cache_as_flux2pipeline_decodes_its_latents(mixed_cache):
    """The decoder recipe of a FLUX.2 cache undoes the batch-norm normalisation and unfolds the 2 x 2 patches, as
    Flux2Pipeline does before `vae.decode`: a cached latent decodes to the pipeline's image of it."""
    from diffusers import Flux2Pipeline

    from shards import Cache
    from train.decode import decode, decoder_recipe, load_decoder, unscale

    cache = Cache(mixed_cache["cache"])
    recipe = decoder_recipe(cache)
    assert (recipe.vae_class, recipe.patch, len(recipe.latents_mean)) == ("AutoencoderKLFlux2", 2, C)
    vae = load_decoder(recipe, torch.device("cpu"))
    s = cache[0]
    latents = s["latent_mean"].float()[None]  # (1, 128, h, w)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, -1, 1, 1)
    theirs = Flux2Pipeline._unpatchify_latents(latents * std + vae.bn.running_mean.view(1, -1, 1, 1))
    torch.testing.assert_close(unscale(recipe, latents), theirs, rtol=1e-6, atol=1e-6)
    (image,) = decode(vae, recipe, latents)
    assert (image.height, image.width) == (s.bucket.height, s.bucket.width)
