"""Wan 2.2 TI2V-5B as image-to-video (--i2v-probability), on a tiny TI2V-class model built here: the real classes with
TI2V-5B's distinguishing traits (48-channel latents of a Wan 2.2-like VAE at 16x, the pipelines' `expand_timesteps`).
What the transformer gets in training and in validation is what WanImageToVideoPipeline(expand_timesteps=True) gives
it (the clean first latent frame in place of the noise, a timestep per token, 0 on that frame's tokens), the loss is over
the other frames, runs resume bit for bit, and exports load in the stock pipeline."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_same_checkpoints, losses, record_calls

from shards import Bucket, CacheSpec, DecoderRecipe, Field, LatentSpec, Prompt, ShardWriter, TextSpec, prompt_key
from train.config import TrainConfig
from train.data import TextLayout
from train.families import PRESETS, get_family, get_preset
from train.families.wan import SCHEDULER, TEXT_TOKENS, TINY, Wan
from train.model import build_run_objective
from train.objectives import CLEAN_FIRST_FRAME, FIRST_FRAME, FlowMatching
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers models

FAMILY: Wan = get_family("wan")
CHANNELS, WIDTH = 48, 32  # the Wan 2.2 VAE's latent channels; the tiny umT5's width
MEAN = tuple(0.02 * c - 0.5 for c in range(CHANNELS))
STD = tuple(0.5 + 0.02 * c for c in range(CHANNELS))
LATENT = LatentSpec(CHANNELS, 16, 1.0, 0.0, "mean_std", MEAN, STD, temporal_downsample=4)
PROMPT = "a red square moving right"
CPU = torch.device("cpu")


def tiny_ti2v(monkeypatch):
    """A TI2V-class preset at CPU size: tiny-wan's transformer on 48 channels, 16x latents, shift 5.0, expand_timesteps."""
    tiny = get_preset("tiny-wan")
    monkeypatch.setitem(PRESETS, "tiny-wan-ti2v", lambda: dataclasses.replace(
        tiny, name="tiny-wan-ti2v", config={**TINY, "in_channels": CHANNELS, "out_channels": CHANNELS}, latent_downsample=16,
        flow_shift=5.0, expand_timesteps=True))
    return get_preset("tiny-wan-ti2v")


def tiny_vae():
    """An AutoencoderKLWan shaped as the Wan 2.2 VAE (48 channels, 2x2 patchify, residual down and up blocks, 16x spatial,
    4x temporal) at CPU size, seeded."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=CHANNELS, in_channels=12, out_channels=12,
                                is_residual=True, patch_size=2, scale_factor_spatial=16, dim_mult=[1, 2, 2, 2],
                                num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
                                latents_mean=list(MEAN), latents_std=list(STD))


def stock(transformer, vae=None, flow_shift=5.0):
    """WanImageToVideoPipeline as TI2V-5B's image-to-video runs (expand_timesteps), captions given as embeddings."""
    import diffusers

    return diffusers.WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, vae=vae or tiny_vae(), image_processor=None, image_encoder=None,
        scheduler=diffusers.UniPCMultistepScheduler(**SCHEDULER, flow_shift=flow_shift), transformer=transformer,
        expand_timesteps=True)


def captions(seed: int = 1) -> tuple[dict, dict]:
    """A caption's and the null caption's valid umT5 tokens, as the cache stores them (trimmed)."""
    g = torch.Generator().manual_seed(seed)
    return {"text": torch.randn(11, WIDTH, generator=g)}, {"text": torch.randn(1, WIDTH, generator=g)}


def padded(*conds: dict) -> torch.Tensor:
    return TextLayout(TextSpec("padded", WIDTH, TEXT_TOKENS)).collate(list(conds))["text"]


def first_frame(seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def image_latent(pipe, image, frames: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's own first-frame latent (`latent_condition`) and `first_frame_mask` for `image` at 64 x 64."""
    x = pipe.video_processor.preprocess(image, height=64, width=64).to(dtype=torch.float32)
    with torch.no_grad():
        _, condition, mask = pipe.prepare_latents(x, 1, CHANNELS, 64, 64, frames, torch.float32, CPU,
                                                  generator=torch.Generator().manual_seed(0))
    return condition, mask


def test_the_option_is_for_models_that_take_a_clean_first_frame(monkeypatch):
    tiny_ti2v(monkeypatch)
    assert FAMILY.first_frame_conditioning(get_preset("wan2.2-ti2v-5b"))
    assert not any(FAMILY.first_frame_conditioning(get_preset(n)) for n in ("tiny-wan", "tiny-wan-i2v", "wan2.2-i2v-a14b"))
    assert TrainConfig(model="wan2.2-ti2v-5b", i2v_probability=0.5).i2v_probability == 0.5
    for name in ("tiny-wan", "tiny-wan-i2v", "wan2.1-t2v-14b"):
        with pytest.raises(ValueError, match=f"--i2v-probability 1: {name} does not generate a clip from an image"):
            TrainConfig(model=name, i2v_probability=1.0)
    with pytest.raises(ValueError, match=r"--i2v-probability 1.5: must be in \[0, 1\]"):
        TrainConfig(model="tiny-wan-ti2v", i2v_probability=1.5)
    objective = build_run_objective(TrainConfig(model="tiny-wan-ti2v", i2v_probability=0.25), get_preset("tiny-wan-ti2v"),
                                    get_preset("tiny-wan-ti2v").transformer_config())
    assert objective.clean_first_frame == 0.25 and objective.shift == 5.0


def test_the_transformer_gets_what_the_image_to_video_pipeline_gives_it(monkeypatch):
    """WanImageToVideoPipeline(expand_timesteps=True): the image's latent in place of the first latent frame, a timestep
    per token (0 on the first frame's); our forward on the same latents and timestep makes the same call."""
    preset = tiny_ti2v(monkeypatch)
    transformer = build_transformer(preset, None, 0).eval()
    calls = record_calls(transformer)
    cond, null = captions()
    pipe = stock(transformer)
    condition, mask = image_latent(pipe, first_frame(), frames=9)
    pipe(image=first_frame(), prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), height=64, width=64,
         num_frames=9, num_inference_steps=2, guidance_scale=5.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert len(calls) == 4
    t = pipe.scheduler.timesteps[1]
    seen = calls[2]  # the second step's pass on the caption
    assert seen["hidden_states"].shape == (1, CHANNELS, 3, 4, 4) and torch.equal(seen["hidden_states"][:, :, :1], condition)
    assert seen["timestep"].shape == (1, 3 * 2 * 2)
    assert not seen["timestep"][0, :4].any() and bool((seen["timestep"][0, 4:] == t).all())
    batch = {"text": padded(cond), CLEAN_FIRST_FRAME: torch.tensor([True])}
    with torch.no_grad():
        ours = model_forward(transformer, "wan")(seen["hidden_states"], t.expand(1), batch)
    mine = calls[-1]
    for name in ("hidden_states", "timestep", "encoder_hidden_states"):
        assert torch.equal(mine[name], seen[name]), name
    assert mine["timestep"].dtype == seen["timestep"].dtype
    assert torch.equal(ours, seen["out"])
    # the pipeline's mask, token by token, is the one our forward builds
    assert torch.equal(mine["timestep"][0], (mask[0][0][:, ::2, ::2] * t).flatten())


@pytest.mark.parametrize("guidance", [5.0, 1.0], ids=["cfg", "no-cfg"])
def test_validation_samples_image_to_video_as_the_pipeline_samples(monkeypatch, guidance):
    """`generate` with the first latent frame the validator takes from the cache (the pipeline's own image latent here):
    the family's loop against WanImageToVideoPipeline(expand_timesteps=True).__call__ from the same noise."""
    from train.validate import generate

    preset = tiny_ti2v(monkeypatch)
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model="tiny-wan-ti2v", i2v_probability=1.0), preset, preset.transformer_config())
    cond, null = captions()
    pixels, steps, seed = 64 * 64, 4, 3
    pipe = stock(transformer, flow_shift=objective.shift_at(pixels))
    condition, _ = image_latent(pipe, first_frame())
    ours = generate(transformer, preset, objective, cond, null, (CHANNELS, 5, 4, 4), pixels, steps=steps, guidance=guidance,
                    seed=seed, precision=torch.float32, layout=TextLayout(TextSpec("padded", WIDTH, 64)),
                    conditioning={FIRST_FRAME: condition[0]})
    noise = torch.randn(1, CHANNELS, 5, 4, 4, generator=torch.Generator().manual_seed(seed))  # generate's draw
    with torch.no_grad():
        out = pipe(image=first_frame(), prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), latents=noise,
                   height=64, width=64, num_frames=17, num_inference_steps=steps, guidance_scale=guidance,
                   output_type="latent").frames[0]
    assert ours.shape == out.shape and torch.allclose(ours, out, atol=1e-6)
    assert torch.equal(ours[:, :1], condition[0])  # the image's latent, kept
    assert not torch.allclose(ours[:, 1:], noise[0, :, 1:], atol=1e-2)  # the other frames were sampled
    # a text-to-video sample of the same model differs (the image conditions the clip)
    t2v = generate(transformer, preset, objective, cond, null, (CHANNELS, 5, 4, 4), pixels, steps=steps, guidance=guidance,
                   seed=seed, precision=torch.float32, layout=TextLayout(TextSpec("padded", WIDTH, 64)))
    assert not torch.allclose(t2v[:, 1:], ours[:, 1:], atol=1e-4)


def test_text_to_video_validation_samples_what_wanpipeline_with_expand_timesteps_samples(monkeypatch):
    """Without a first frame the sampler gives the transformer one timestep per sample; WanPipeline with
    expand_timesteps (the published TI2V-5B pipeline) passes the same value per token: the same samples up to float
    rounding of the per-token embedding (the per-token one would cost a (tokens, 6, width) modulation per block)."""
    import diffusers

    from train.validate import generate

    preset = tiny_ti2v(monkeypatch)
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model="tiny-wan-ti2v"), preset, preset.transformer_config())
    cond, null = captions()
    ours = generate(transformer, preset, objective, cond, null, (CHANNELS, 5, 4, 4), 64 * 64, steps=4, guidance=5.0, seed=3,
                    precision=torch.float32, layout=TextLayout(TextSpec("padded", WIDTH, 64)))
    noise = torch.randn(1, CHANNELS, 5, 4, 4, generator=torch.Generator().manual_seed(3))
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=tiny_vae(), transformer=transformer,
                                 scheduler=diffusers.UniPCMultistepScheduler(**SCHEDULER, flow_shift=objective.shift_at(64 * 64)),
                                 expand_timesteps=True)
    with torch.no_grad():
        out = pipe(prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), latents=noise, height=64, width=64,
                   num_frames=17, num_inference_steps=4, guidance_scale=5.0, output_type="latent").frames[0]
    assert torch.allclose(ours, out, atol=1e-5) and not torch.allclose(ours, noise[0], atol=1e-2)


def test_training_keeps_the_first_frame_clean_and_takes_the_loss_over_the_other_frames(monkeypatch):
    """The objective's inputs at a noise level and noise: the first latent frame of an image-to-video clip is its clean
    latent (the pipeline's condition), the others (1 - s) x0 + s n, the transformer gets the pipeline's per-token timestep,
    and the loss is the mean over the other frames of the velocity error (DiffSynth-Studio's TI2V loss)."""
    preset = tiny_ti2v(monkeypatch)
    transformer = build_transformer(preset, None, 0).eval()
    calls = record_calls(transformer)
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, CHANNELS, 5, 4, 4, generator=g), torch.randn(2, CHANNELS, 5, 4, 4, generator=g)
    batch = {"latents": x0, "text": padded(*captions()), "bucket": (64, 64, 17)}
    s, clean = torch.tensor([0.7, 0.3]), torch.tensor([True, False])
    seen = []

    def model_fn(xt, t, b):
        seen.append((xt, t, b))
        return model_forward(transformer, "wan")(xt, t, b)
    with torch.no_grad():
        loss = FlowMatching(shift=5.0, clean_first_frame=0.5).loss_at(model_fn, batch, s, noise, clean=clean)
    xt, t, given = seen[0]
    expected = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise
    assert torch.equal(xt[0, :, 0], x0[0, :, 0]) and torch.equal(xt[0, :, 1:], expected[0, :, 1:])
    assert torch.equal(xt[1], expected[1])  # a text-to-video clip of the same batch: all noised
    assert torch.equal(given[CLEAN_FIRST_FRAME], clean) and torch.equal(t, s * 1000)
    timestep = calls[0]["timestep"]
    _, mask = image_latent(stock(transformer), first_frame())
    assert torch.equal(timestep[0], (mask[0][0][:, ::2, ::2] * t[0]).flatten())  # as the pipeline at this timestep
    assert bool((timestep[1] == t[1]).all())
    pred = calls[0]["out"]
    velocity = noise - x0
    assert torch.allclose(loss[0], (pred[0, :, 1:] - velocity[0, :, 1:]).square().mean(), rtol=1e-6)
    assert torch.allclose(loss[1], (pred[1] - velocity[1]).square().mean(), rtol=1e-6)
    # the held-out loss (no draws): every clip image-to-video
    seen.clear()
    with torch.no_grad():
        FlowMatching(shift=5.0, clean_first_frame=0.5).loss_at(model_fn, batch, s, noise)
    assert bool(seen[0][2][CLEAN_FIRST_FRAME].all())


def test_the_share_is_drawn_after_the_noise_and_images_train_text_to_image():
    """A run with the option draws the same noise and timesteps as one without, then its share of image-to-video clips;
    one-frame clips (images of a video source) never are."""
    seen = {}

    def model_fn(key):
        def fn(xt, t, b):
            seen[key] = (xt, t, b.get(CLEAN_FIRST_FRAME))
            return torch.zeros_like(xt)
        return fn
    clips = {"latents": torch.randn(4000, 4, 2, 1, 1), "bucket": (64, 64, 5)}
    for p in (0.0, 0.3, 1.0):
        FlowMatching(clean_first_frame=p)(model_fn(p), clips, torch.Generator().manual_seed(0))
    assert seen[0.0][2] is None and torch.equal(seen[0.0][1], seen[0.3][1])
    noised = ~seen[0.3][2]
    assert torch.equal(seen[0.0][0][noised], seen[0.3][0][noised])  # the same noise where the first frame is noised too
    assert abs(float(seen[0.3][2].float().mean()) - 0.3) < 0.03 and bool(seen[1.0][2].all())
    images = {"latents": torch.randn(8, 4, 1, 1, 1), "bucket": (64, 64, 1)}
    FlowMatching(clean_first_frame=1.0)(model_fn("images"), images, torch.Generator().manual_seed(0))
    assert seen["images"][2] is None


# --- training from a cache of TI2V clips ---


def store_decoder(w: ShardWriter) -> DecoderRecipe:
    """The tiny Wan 2.2-like VAE stored in the cache as its decoder (as stage one stores a tiny preset's)."""
    from safetensors.torch import save

    vae = tiny_vae()
    w.add_file("decoder:config.json", "vae/config.json", vae.to_json_string().encode())
    w.add_file("decoder:diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
               save({n: t.contiguous() for n, t in vae.state_dict().items()}))
    return DecoderRecipe("AutoencoderKLWan", "vae", 1.0, 0.0, in_cache=True, latents_mean=MEAN, latents_std=STD, frame_axis=True)


def ti2v_cache(root: Path) -> Path:
    """A tiny-wan-ti2v cache as stage one writes a TI2V-5B one: 48-channel latents of 17-frame clips (and two one-frame
    clips), no first-frame field (a clip's first latent frame is the image's latent), captions, prompts, the decoder."""
    g = torch.Generator().manual_seed(5)
    schema = {"latent_mean": Field(torch.bfloat16), "latent_std": Field(torch.bfloat16), "text": Field(torch.bfloat16, ragged=True),
              "text_lengths": Field(torch.int32, ragged=True), "source": Field(torch.uint8, ragged=True)}
    text = TextSpec("padded", WIDTH, TEXT_TOKENS)
    fingerprint = {"vae": {"id": "tiny-wan22-vae", **LATENT.fingerprint()}, "text_encoder": {"id": "tiny-umt5", **text.fingerprint()},
                   "buckets": {"clips": {"frame_buckets": [1, 17], "frame_rate": 24.0}}}
    with ShardWriter(root, fingerprint, schema) as w:
        for k, bucket in enumerate([Bucket(64, 64, 17)] * 4 + [Bucket(64, 64, 1)] * 2):
            shape = LATENT.shape(*bucket)
            w.write(f"clip{k}", bucket, {
                "latent_mean": torch.randn(shape, generator=g).bfloat16(), "latent_std": torch.full(shape, 0.05).bfloat16(),
                "text": torch.randn(5, WIDTH, generator=g).bfloat16(), "text_lengths": torch.tensor([5], dtype=torch.int32),
                "source": torch.tensor(list(f"videos/clip{k}.mp4".encode()), dtype=torch.uint8)})
        w.add_prompts({prompt_key(t): Prompt(t, {"text": torch.randn(len(t) // 4, WIDTH, generator=g).bfloat16()})
                       for t in ("", PROMPT)}, {"text": schema["text"]})
        w.set_extra("precompute", CacheSpec(LATENT, text, "wan", "tiny-wan-ti2v", 64, store_decoder(w)).record())
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return ti2v_cache(tmp_path_factory.mktemp("ti2v"))


def run_cfg(cache, run, **kw):
    base = dict(model="tiny-wan-ti2v", cache=[str(cache)], run=run, steps=4, batch_size=2, workers=0, progress=False,
                log_every=1, checkpoint_every=2, lr=1e-3, precision="fp32", validate=False, i2v_probability=1.0)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("adapters", [pytest.param({}, marks=pytest.mark.slow), {"lora_rank": 4, "lora_alpha": 8}],
                         ids=["full", "lora"])
def test_ti2v_trains_image_to_video_resumes_exactly_and_exports_what_the_stock_pipeline_loads(cache, tmp_path, monkeypatch,
                                                                                               adapters):
    """A run at --i2v-probability 1: every clip's transformer call has its first frame clean at timestep 0 (images
    train text-to-image), the validation videos start from a cached clip's first latent frame, a resumed run's
    checkpoints are the uninterrupted one's bit for bit, and the export loads in WanImageToVideoPipeline(expand_timesteps)
    and predicts what the checkpoint does."""
    from train.checkpoint import complete_checkpoints
    from train.export import export, load_model
    from train.loop import train

    preset = tiny_ti2v(monkeypatch)
    seen = []
    forward = FAMILY.forward

    def recorded(model, config, xt, t, batch, guidance):
        if not xt.is_meta:  # the planner traces on the meta device
            seen.append((xt.detach().clone(), batch.get(CLEAN_FIRST_FRAME), batch.get("latents")))
        return forward(model, config, xt, t, batch, guidance)
    monkeypatch.setattr(FAMILY, "forward", recorded)
    straight = train(run_cfg(cache, tmp_path / "straight", validate=not adapters, validation_steps=2, **adapters))
    steps = [(xt, clean, x0) for xt, clean, x0 in seen if x0 is not None]  # training's calls (validation's have no data)
    clips = [(xt, clean, x0) for xt, clean, x0 in steps if xt.shape[2] > 1]
    assert len(steps) == 4 and clips and all(bool(clean.all()) and torch.equal(xt[:, :, 0], x0[:, :, 0]) for xt, clean, x0 in clips)
    assert all(clean is None for xt, clean, _ in steps if xt.shape[2] == 1)  # images: text to image
    if not adapters:  # validation: image-to-video, the first frame's tokens at timestep 0
        assert straight["grids"] and list((tmp_path / "straight" / "samples").rglob("*-17x64x64.mp4"))
        sampled = [(xt, clean) for xt, clean, x0 in seen if x0 is None]
        assert len(sampled) == 4 and all(bool(clean.all()) for _, clean in sampled)
    train(run_cfg(cache, tmp_path / "resumed", steps=2, **adapters))
    train(run_cfg(cache, tmp_path / "resumed", **adapters))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")
    assert math.isfinite(straight["last_loss"])

    trained, _, _ = load_model(complete_checkpoints(tmp_path / "straight")[-1], ema=False)
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(1, CHANNELS, 5, 4, 4, generator=g), torch.tensor([700.0])
    batch = {"text": padded(captions()[0]), CLEAN_FIRST_FRAME: torch.tensor([True])}
    with torch.no_grad():
        expected = model_forward(trained.eval(), "wan")(x, t, batch)
    out = export(tmp_path / "straight", tmp_path / "export")
    card = (tmp_path / "export" / "README.md").read_text()  # its code samples from an image, at the clips' 24 fps
    assert "WanImageToVideoPipeline.from_pretrained" in card and 'image=load_image("first_frame.png")' in card
    assert 'export_to_video(frames, "video.mp4", fps=24)' in card
    if adapters:
        pipe = stock(build_transformer(preset, None, 0).eval())
        pipe.load_lora_weights(out.parent, weight_name=out.name)
    else:
        from diffusers import WanTransformer3DModel

        pipe = stock(WanTransformer3DModel.from_pretrained(out.parent, subfolder="transformer").eval())
    with torch.no_grad():
        assert torch.allclose(model_forward(pipe.transformer, "wan")(x, t, batch), expected, atol=1e-5)
        cond, null = captions()
        frames = pipe(image=first_frame(), prompt_embeds=padded(cond), negative_prompt_embeds=padded(null), height=64,
                      width=64, num_frames=9, num_inference_steps=2, output_type="np",
                      generator=torch.Generator().manual_seed(0)).frames[0]
    assert frames.shape == (9, 64, 64, 3) and np.isfinite(frames).all()
    if not adapters:  # `python -m train sample` of the run samples as it validated: image-to-video
        from train.export import sample

        seen.clear()
        written = sample(tmp_path / "straight", out=tmp_path / "sampled", steps=2)
        assert any(p.suffix == ".mp4" for p in written) and seen and all(bool(clean.all()) for _, clean, _ in seen)


def test_a_text_to_video_run_goes_on_as_image_to_video(cache, tmp_path, monkeypatch, capsys):
    """The share may change on resume (a text-to-video LoRA continued as image-to-video): the start-up log says so."""
    from train.loop import train

    tiny_ti2v(monkeypatch)
    train(run_cfg(cache, tmp_path / "run", steps=2, i2v_probability=0.0, lora_rank=4))
    capsys.readouterr()
    train(run_cfg(cache, tmp_path / "run", steps=4, i2v_probability=1.0, lora_rank=4))
    assert "applied on resume: i2v-probability 0.0 -> 1.0 from step 2" in capsys.readouterr().out


def test_a_mixed_run_trains_both_and_resumes_exactly(cache, tmp_path, monkeypatch):
    """--i2v-probability 0.5 with LoRA: batches mix image-to-video and text-to-video clips (per-token timesteps for the
    batch, the text-to-video clips' all at their timestep), and the run resumes bit for bit."""
    from train.loop import train

    tiny_ti2v(monkeypatch)
    flags = []
    forward = FAMILY.forward

    def recorded(model, config, xt, t, batch, guidance):
        if not xt.is_meta and xt.shape[2] > 1:
            flags.append(batch[CLEAN_FIRST_FRAME].clone())
        return forward(model, config, xt, t, batch, guidance)
    monkeypatch.setattr(FAMILY, "forward", recorded)
    options = {"i2v_probability": 0.5, "lora_rank": 4, "steps": 8, "checkpoint_every": 4}
    train(run_cfg(cache, tmp_path / "straight", **options))
    drawn = torch.cat(flags)
    assert bool(drawn.any()) and not bool(drawn.all())
    train(run_cfg(cache, tmp_path / "resumed", **{**options, "steps": 4}))
    train(run_cfg(cache, tmp_path / "resumed", **options))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_export_card_samples_as_the_run_trained(kind):
    """A TI2V-5B run's card: WanPipeline from a caption; trained image-to-video, WanImageToVideoPipeline from an image."""
    from train.card import Base, usage

    base, preset = Base("hub", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"), get_preset("wan2.2-ti2v-5b")
    t2v = usage("wan", kind, base, "owner/export", preset=preset)
    i2v = usage("wan", kind, base, "owner/export", preset=FAMILY.first_frame_preset(preset))
    assert "WanPipeline.from_pretrained" in t2v and "load_image" not in t2v
    assert "WanImageToVideoPipeline.from_pretrained" in i2v and 'image=load_image("first_frame.png")' in i2v
    assert all('fps=24' in code for code in (t2v, i2v))
    assert FAMILY.first_frame_preset(get_preset("tiny-wan")) == get_preset("tiny-wan")
    compile(t2v, "card", "exec"), compile(i2v, "card", "exec")


def test_the_planner_plans_the_per_token_timesteps(monkeypatch):
    """`train plan --i2v-probability P` traces image-to-video batches: a timestep per token makes the blocks' modulation
    per token, more activations than a text-to-video batch's; a model without a clean first frame refuses it."""
    from train.plan import plan
    from train.plan_config import PlanConfig

    tiny_ti2v(monkeypatch)
    t2v = plan(PlanConfig(model="tiny-wan-ti2v", bucket=(64, 64, 17), batch_size=2))
    i2v = plan(PlanConfig(model="tiny-wan-ti2v", bucket=(64, 64, 17), batch_size=2, i2v_probability=0.5))
    assert i2v["parameters"] == t2v["parameters"] == sum(p.numel() for p in build_transformer(get_preset("tiny-wan-ti2v"), None,
                                                                                                      0).parameters())
    assert i2v["bytes"]["activations"] > t2v["bytes"]["activations"] > 0
    with pytest.raises(ValueError, match="--i2v-probability 0.5: tiny-wan does not generate a clip from an image"):
        PlanConfig(model="tiny-wan", bucket=(64, 64, 17), i2v_probability=0.5)


def test_a_dry_run_measures_what_the_plan_predicts(cache, tmp_path, monkeypatch):
    """--dry-run of an image-to-video run (a step and an image-to-video validation sample): the measured peak is the
    predicted one, which is above a text-to-video run's."""
    from train.loop import train

    tiny_ti2v(monkeypatch)
    runs = {p: train(run_cfg(cache, tmp_path / str(p), dry_run=True, validate=True, validation_steps=2, i2v_probability=p))
            for p in (0.0, 1.0)}
    for result in runs.values():
        assert result["bucket"] == "17x64x64" and abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result
    assert runs[1.0]["predicted_peak"] > runs[0.0]["predicted_peak"]


def test_token_routing_takes_the_per_token_timesteps_along(cache, tmp_path, monkeypatch):
    """--tread with image-to-video clips: the routed blocks get the kept tokens' rows of the per-token timestep
    embedding (`wan_token_rows`), and the run trains."""
    from train.families import wan
    from train.loop import train

    tiny_ti2v(monkeypatch)
    rows = wan.wan_token_rows
    seen = []

    def recorded(arguments, kept):
        out = rows(arguments, kept)
        seen.append((tuple(arguments["temb"].shape), tuple(out.get("temb", arguments["temb"]).shape), tuple(kept.shape)))
        return out
    monkeypatch.setattr(wan, "wan_token_rows", recorded)
    result = train(run_cfg(cache, tmp_path / "run", tread="0.5:1:1", lora_rank=4, steps=2))
    assert math.isfinite(result["last_loss"])
    clips = [s for s in seen if len(s[0]) == 4]  # (B, S, 6, D): a clip batch's per-token embedding
    assert clips and all(after[:2] == kept and kept[1] < before[1] for before, after, kept in clips)
