"""FLUX.1 Kontext in stage two (tiny-flux1-kontext): the transformer gets what FluxKontextPipeline gives it (the reference's
packed tokens after the target's, their ids' first coordinate 1) and only the target's prediction comes back, per group
of samples whose references share a shape; validation denoises as the pipeline does; the export card edits an image."""

import numpy as np
import pytest
import torch

from train.config import TrainConfig
from train.families import get_family, get_preset
from train.model import build_run_objective, train_guidance
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

C, TOKENS = 16, 32  # the tiny Flux VAE's latent channels; the tiny T5's limit


def text_batch(b: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"text": torch.randn(b, TOKENS, 32, generator=g), "pooled": torch.randn(b, 24, generator=g)}


def by_hand(transformer, xt, t, text, pooled, ref, guidance):
    """The transformer called as FluxKontextPipeline's denoising loop calls it (prepare_latents, the loop body)."""
    from diffusers import FluxKontextPipeline as K

    b, c, h, w = xt.shape
    rh, rw = ref.shape[-2:]
    latents = K._pack_latents(xt, b, c, h, w)
    image_latents = K._pack_latents(ref, b, c, rh, rw)
    image_ids = K._prepare_latent_image_ids(b, rh // 2, rw // 2, xt.device, xt.dtype)
    image_ids[..., 0] = 1
    latent_ids = torch.cat([K._prepare_latent_image_ids(b, h // 2, w // 2, xt.device, xt.dtype), image_ids], dim=0)
    noise_pred = transformer(hidden_states=torch.cat([latents, image_latents], dim=1), timestep=t / 1000,
                             guidance=torch.full([1], guidance, dtype=torch.float32).expand(b), pooled_projections=pooled,
                             encoder_hidden_states=text, txt_ids=torch.zeros(text.shape[1], 3), img_ids=latent_ids,
                             return_dict=False)[0]
    return K._unpack_latents(noise_pred[:, : latents.size(1)], h * 8, w * 8, 8)


def test_the_presets_are_flux_dev_trained_to_edit_from_one_reference():
    dev, real, tiny = get_preset("flux-dev"), get_preset("flux1-kontext-dev"), get_preset("tiny-flux1-kontext")
    assert real.repo == "black-forest-labs/FLUX.1-Kontext-dev" and real.transformer_config() == dev.transformer_config()
    assert (real.references, tiny.references) == (1, 1) and dev.references == get_preset("tiny-flux").references == 0
    assert (real.dynamic_shift, real.text_tokens, real.validation_steps, real.guidance_scale) == (True, 512, 28, 2.5)
    assert train_guidance(TrainConfig(model="flux1-kontext-dev"), real) == 1.0 == train_guidance(TrainConfig(model="tiny-flux1-kontext"), tiny)
    assert (TrainConfig(model="flux1-kontext-dev").guidance_scale, TrainConfig(model="flux1-kontext-dev").validation_steps) == (2.5, 28)
    assert tiny.transformer_config() == get_preset("tiny-flux").transformer_config() and tiny.reference_pixels == 128 * 128
    assert get_family("flux").pipeline_of(real) == "FluxKontextPipeline" and get_family("flux").pipeline_of(dev) == "FluxPipeline"


def test_forward_concatenates_each_groups_reference_after_the_target_and_predicts_the_target_only():
    """A batch of two samples whose references differ in shape (two groups: two transformer calls): each sample's
    prediction is the hand-built pipeline call on it alone, shaped like xt; a batch of one shape is one call."""
    transformer = build_transformer(get_preset("tiny-flux1-kontext"), None, 0).eval()
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(3, C, 8, 12, generator=g)  # a 64 x 96 bucket
    t = torch.tensor([900.0, 250.0, 500.0])
    refs = [torch.randn(C, 16, 16, generator=g), torch.randn(C, 10, 24, generator=g), torch.randn(C, 16, 16, generator=g)]
    batch = {**text_batch(3), "references": [[r] for r in refs]}
    calls = []
    transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["hidden_states"].shape), with_kwargs=True)
    with torch.no_grad():
        ours = model_forward(transformer, "flux", guidance=1.0)(xt, t, batch)
        assert ours.shape == xt.shape
        assert calls == [(2, 24 + 64, 64), (1, 24 + 60, 64)]  # samples 0 and 2 (16 x 16 references), then sample 1
        for i in range(3):
            alone = by_hand(transformer, xt[i : i + 1], t[i : i + 1], batch["text"][i : i + 1], batch["pooled"][i : i + 1],
                            refs[i][None], 1.0)
            torch.testing.assert_close(ours[i : i + 1], alone, rtol=1e-5, atol=1e-6)
        # one shape, one call: the pipeline's batch exactly
        two = {**text_batch(2), "references": [[refs[0]], [refs[2]]]}
        ours = model_forward(transformer, "flux", guidance=1.0)(xt[[0, 2]], t[[0, 2]], two)
        stock = by_hand(transformer, xt[[0, 2]], t[[0, 2]], two["text"], two["pooled"], torch.stack([refs[0], refs[2]]), 1.0)
        assert torch.equal(ours, stock)


def test_the_loss_sees_gradients_through_the_target_tokens_and_the_reference_conditions_them():
    transformer = build_transformer(get_preset("tiny-flux1-kontext"), None, 0)
    g = torch.Generator().manual_seed(2)
    xt = torch.randn(2, C, 8, 8, generator=g)
    ref = torch.randn(C, 8, 8, generator=g)
    batch = {**text_batch(2), "references": [[ref], [ref * 0]]}
    pred = model_forward(transformer, "flux", guidance=1.0)(xt, torch.tensor([500.0, 500.0]), batch)
    pred.square().mean().backward()
    assert all(p.grad is not None for p in transformer.parameters() if p.requires_grad)
    with torch.no_grad():
        other = model_forward(transformer, "flux", guidance=1.0)(xt, torch.tensor([500.0, 500.0]),
                                                                 {**batch, "references": [[ref * 0], [ref * 0]]})
    assert not torch.allclose(pred[0], other[0]) and torch.allclose(pred[1], other[1])


def test_more_than_one_reference_is_refused():
    transformer = build_transformer(get_preset("tiny-flux1-kontext"), None, 0)
    ref = torch.zeros(C, 8, 8)
    with pytest.raises(ValueError, match="a sample with 2 reference images: FLUX.1 Kontext takes one"):
        model_forward(transformer, "flux", guidance=1.0)(torch.zeros(1, C, 8, 8), torch.tensor([500.0]),
                                                         {**text_batch(1), "references": [[ref, ref]]})


def test_validation_edits_as_the_stock_pipeline_does():
    """`validate.generate` with a cached reference latent (FluxPipeline's sigmas and mu of the target's tokens, the
    distilled guidance, one pass per step, the reference's tokens every step) against FluxKontextPipeline.__call__ given
    the same noise, caption embeddings and the reference as latents, at a non-square bucket."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline

    from shards import TextSpec
    from train.data import TextLayout
    from train.validate import generate

    preset = get_preset("tiny-flux1-kontext")
    transformer = build_transformer(preset, None, 0).eval()
    objective = build_run_objective(TrainConfig(model=preset.name), preset, preset.transformer_config())
    height, width, steps = 64, 96, 3
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(C, 10, 16, generator=g)  # an 80 x 128 reference, of another shape than the target's
    cond, null = ({k: v[0] for k, v in text_batch(1, seed).items()} for seed in (4, 5))
    layout = TextLayout(TextSpec("flux", None, TOKENS, t5_tokens=TOKENS, pooled_width=24, t5_width=32))
    with torch.no_grad():
        ours = generate(transformer, preset, objective, cond, null, (C, height // 8, width // 8), height * width, steps=steps,
                        guidance=2.5, seed=7, precision=torch.float32, layout=layout, references=[ref])
    # FLUX.1-Kontext-dev's scheduler config as released
    stock = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                            max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxKontextPipeline(scheduler=stock, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                               tokenizer_2=None, transformer=transformer)
    noise = torch.randn(1, C, height // 8, width // 8, generator=torch.Generator().manual_seed(7))  # generate's draw
    with torch.no_grad():
        out = pipe(image=ref[None], prompt_embeds=cond["text"][None], pooled_prompt_embeds=cond["pooled"][None],
                   height=height, width=width, max_area=height * width, num_inference_steps=steps, guidance_scale=2.5,
                   latents=FluxPipeline._pack_latents(noise, 1, C, height // 8, width // 8), output_type="latent").images
    expected = FluxPipeline._unpack_latents(out, height, width, 8)[0]
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, noise[0], atol=1e-2)  # it sampled


def test_the_planner_sizes_a_reference_at_the_pipelines_preferred_resolution():
    """The preferred resolution nearest the bucket's aspect ratio (the pipeline's table; the tiny preset's a scaled copy),
    and the planned batch holds one such reference per sample."""
    family = get_family("flux")
    real, tiny = get_preset("flux1-kontext-dev"), get_preset("tiny-flux1-kontext")
    config = real.transformer_config()
    assert family.reference_size(config, real, (1024, 1024)) == (1024, 1024)
    assert family.reference_size(config, real, (768, 1344)) == (800, 1328)  # (height, width); the table's 1328 x 800
    assert family.reference_size(config, real, (1536, 640)) == (1568, 672)
    assert family.reference_size(config, tiny, (64, 64)) == (128, 128)
    batch = family.example_batch(config, real, (768, 1344), 2, 8, torch.float32)
    assert [[tuple(r.shape) for r in refs] for refs in batch["references"]] == [[(16, 100, 166)]] * 2


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_export_card_edits_an_image_through_fluxkontextpipeline(kind):
    from train.card import Base, usage

    preset = get_preset("flux1-kontext-dev")
    code = usage("flux", kind, Base("hub", preset.repo), "owner/export", preset=preset)
    assert "from diffusers import FluxKontextPipeline" in code and "from diffusers.utils import load_image" in code
    assert 'pipe = FluxKontextPipeline.from_pretrained("black-forest-labs/FLUX.1-Kontext-dev"' in code
    assert 'image = pipe(image=reference, prompt="an edit instruction", guidance_scale=2.5).images[0]' in code
    assert ('FluxTransformer2DModel.from_pretrained("owner/export", subfolder="transformer"' in code if kind == "full"
            else 'pipe.load_lora_weights("owner/export")' in code)
    compile(code, "card", "exec")
    flux = usage("flux", kind, Base("hub", "black-forest-labs/FLUX.1-dev"), "owner/export", preset=get_preset("flux-dev"))
    assert "FluxPipeline.from_pretrained" in flux and 'pipe("a prompt").images[0]' in flux and "Kontext" not in flux


# ---- end to end: stage one's cache of an edit folder, training, resume, export through the stock pipeline ----------

@pytest.fixture(scope="module")
def kontext_cache(tmp_path_factory):
    """Stage one's tiny-flux1-kontext cache (fp32) of an edit folder of 8 targets, each with `x.ref.png` beside it, and
    one validation prompt; the folder."""
    from conftest import VALIDATION_PROMPTS

    from precompute.run import main as precompute
    from precompute.sample_data import make_edit_folder

    root = tmp_path_factory.mktemp("kontext")
    data = make_edit_folder(root / "data", count=8)
    summary = precompute(str(data), "tiny-flux1-kontext", root / "cache", workers=0, progress=False, references=True,
                         storage_dtype="fp32", validation_prompt=VALIDATION_PROMPTS[:1])
    assert summary["new"] == 8
    return root / "cache", data


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """tiny-flux1-kontext's VAE, CLIP-L and T5 with their tokenizers, saved in the diffusers layout."""
    from precompute.presets import get_preset as encoders
    from precompute.presets import save_tiny

    directory = tmp_path_factory.mktemp("parts")
    save_tiny(encoders("tiny-flux1-kontext"), directory)
    return directory


def stock_kontext(transformer, parts):
    """The stock FluxKontextPipeline around `transformer`, its other components loaded with `from_pretrained`."""
    import diffusers
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                          base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                          max_image_seq_len=4096)
    return diffusers.FluxKontextPipeline(
        scheduler=scheduler, vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"),
        text_encoder=CLIPTextModel.from_pretrained(parts / "text_encoder"), tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(parts / "text_encoder_2"),
        tokenizer_2=AutoTokenizer.from_pretrained(parts / "tokenizer_2"), transformer=transformer)


def edit(pipe, data, monkeypatch, output_type="np"):
    """An edit of the folder's first reference through the stock pipeline, its preferred resolutions the tiny preset's
    (as stage one prepared the references the model trained on)."""
    from diffusers.pipelines.flux import pipeline_flux_kontext
    from PIL import Image

    from precompute.families.flux import FAMILY as FLUX
    from precompute.presets import get_preset as encoders

    table = FLUX.reference_resolutions(encoders("tiny-flux1-kontext"))
    monkeypatch.setattr(pipeline_flux_kontext, "PREFERRED_KONTEXT_RESOLUTIONS", table)
    image = Image.open(data / "00000.ref.png").convert("RGB")
    caption = (data / "00000.txt").read_text().strip()
    return pipe(image=image, prompt=caption, height=64, width=64, max_area=64 * 64, num_inference_steps=2, guidance_scale=2.5,
                max_sequence_length=TOKENS, output_type=output_type, generator=torch.Generator().manual_seed(0)).images


def run_config(cache, run, **kw):
    base = dict(model="tiny-flux1-kontext", cache=cache, run=run, steps=4, batch_size=2, workers=0, progress=False, log_every=1,
                checkpoint_every=2, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})


def test_the_cache_holds_each_reference_as_the_stock_pipeline_encodes_it(kontext_cache):
    """Every sample's cached reference latent is what FluxKontextPipeline.prepare_latents computes from its `x.ref.png`
    (resized to the tiny preset's preferred resolution, the posterior's mean shifted and scaled), bit for bit."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from precompute.families.flux import FAMILY as FLUX
    from precompute.presets import get_preset as encoders
    from shards import Cache
    from shards.references import unpack

    cache_dir, data = kontext_cache
    cache = Cache(cache_dir)
    preset = encoders("tiny-flux1-kontext")
    recorded = cache.manifest.fingerprint["references"]  # how the references were sized, with the generic entries
    assert recorded["resolutions_wh"] == [list(r) for r in FLUX.reference_resolutions(preset)] and recorded["multiple_of"] == 16
    pipe = FluxKontextPipeline(scheduler=None, vae=FLUX.load_vae(preset.vae, None), text_encoder=None, tokenizer=None,
                               text_encoder_2=None, tokenizer_2=None, transformer=None)
    for i in range(len(cache)):
        s = cache[i]
        refs = unpack(s)
        assert len(refs) == 1
        name = bytes(s["source"].tolist()).decode()
        image = Image.open(data / name.replace(".png", ".ref.png")).convert("RGB")
        pixels = FLUX.prepare_reference(preset, image, 0, 1)["pixels"]
        # the pipeline's step 3 result (the same image processor calls, checked against __call__ in stage one's tests)
        image_tensor = pipe.image_processor.preprocess(pipe.image_processor.resize(image, *pixels.shape[1:]), *pixels.shape[1:])
        with torch.no_grad():
            _, image_latents, _, image_ids = pipe.prepare_latents(image_tensor, 1, C, 64, 64, torch.float32, "cpu", None)
        h, w = refs[0].shape[1:]
        assert torch.equal(FluxKontextPipeline._pack_latents(refs[0][None].float(), 1, C, h, w), image_latents), name
        assert (h * 8, w * 8) == tuple(pixels.shape[1:]) and torch.equal(image_ids[:, 0], torch.ones(len(image_ids)))


@pytest.mark.slow
def test_tiny_kontext_trains_resumes_exactly_and_its_export_edits_through_the_stock_pipeline(kontext_cache, parts, tmp_path,
                                                                                             monkeypatch):
    from conftest import assert_same_checkpoints, losses

    from train.export import export
    from train.loop import train

    cache, data = kontext_cache
    straight = train(run_config(cache, tmp_path / "straight", validate=True, validation_bucket=["176x368"]))
    train(run_config(cache, tmp_path / "resumed", steps=2))
    resumed = train(run_config(cache, tmp_path / "resumed"))
    assert straight["step"] == resumed["step"] == 4
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")
    assert (tmp_path / "straight" / "samples-step00000004.png").exists()

    export(tmp_path / "straight", tmp_path / "export")
    from diffusers import FluxTransformer2DModel

    exported = FluxTransformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer")
    base = build_transformer(get_preset("tiny-flux1-kontext"), None, 0)
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), base.parameters()))  # it trained
    card = (tmp_path / "export" / "README.md").read_text()
    assert "FluxKontextPipeline" in card and "pipe(image=" in card
    image = edit(stock_kontext(exported, parts), data, monkeypatch)[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all() and float(image.std()) > 0


@pytest.mark.parametrize("lora_format", ["diffusers", "kohya"])
def test_tiny_kontext_lora_resumes_exactly_and_loads_through_fluxkontextpipeline(kontext_cache, parts, tmp_path, monkeypatch,
                                                                                 lora_format):
    from conftest import assert_same_checkpoints, losses

    from train.export import export
    from train.loop import train
    from train.lora import DIFFUSERS_FILE, KOHYA_FILE

    cache, data = kontext_cache
    lora = dict(lora_rank=4, lora_alpha=8, lr=1e-2)
    if lora_format == "kohya":  # diffusers' converter splits a single block's linear1 at FLUX.1's widths only: the double block
        lora["lora_targets"] = [f"transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                                        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                                                        "attn.to_add_out", "ff.net.0.proj", "ff.net.2")]
    straight = train(run_config(cache, tmp_path / "straight", **lora))
    train(run_config(cache, tmp_path / "resumed", **{**lora, "steps": 2}))
    resumed = train(run_config(cache, tmp_path / "resumed", **lora))
    assert resumed["last_loss"] == straight["last_loss"] and losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "resumed")

    written = export(tmp_path / "straight", tmp_path / "lora", lora_format=lora_format)
    assert written.name == (KOHYA_FILE if lora_format == "kohya" else DIFFUSERS_FILE)
    pipe = stock_kontext(build_transformer(get_preset("tiny-flux1-kontext"), None, 0), parts)
    before = edit(pipe, data, monkeypatch, "latent")
    pipe.load_lora_weights(tmp_path / "lora", weight_name=written.name)
    after = edit(pipe, data, monkeypatch, "latent")
    assert torch.isfinite(after).all() and not torch.allclose(before, after)
    assert 'pipe.load_lora_weights("' in (tmp_path / "lora" / "README.md").read_text()
