"""Stage one for FLUX.1 Kontext: the presets are FLUX.1-dev's encoders with one required reference image, and a
reference is prepared and encoded exactly as the stock FluxKontextPipeline prepares and encodes the `image` it edits
(its preferred resolution nearest the aspect ratio; the VAE posterior's mean, shifted and scaled as the target)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from precompute.families import flux
from precompute.families.flux import FAMILY as FLUX
from precompute.presets import get_preset

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

TOKENS = 32  # the tiny T5's limit
# (width, height) of reference images: square, landscape, portrait, a panorama beyond the table's widest entry
SIZES = [(64, 64), (100, 60), (40, 200), (300, 90)]


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random RGB picture (Lanczos resampling of noise alone would hide a wrong size in the noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = [np.sin(x / (5 + 7 * rng.random()) + 3 * rng.random()) * np.cos(y / (4 + 9 * rng.random())) for _ in range(3)]
    return Image.fromarray(((np.stack(rgb, -1) + 1) * 127.5).astype(np.uint8), "RGB")


@pytest.fixture(scope="module")
def stock():
    """The stock FluxKontextPipeline with tiny-flux1-kontext's VAE, CLIP-L and T5 and a tiny FLUX.1 transformer whose
    calls are recorded."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel

    preset = get_preset("tiny-flux1-kontext")
    side = FLUX.load_text(preset.text, None, torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    calls = []
    transformer.register_forward_pre_hook(lambda m, a, kw: calls.append({k: v for k, v in kw.items()}), with_kwargs=True)
    pipe = FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=FLUX.load_vae(preset.vae, None),
                               text_encoder=side.modules["text_encoder"], tokenizer=side.tokenizers["tokenizer"],
                               text_encoder_2=side.modules["text_encoder_2"], tokenizer_2=side.tokenizers["tokenizer_2"],
                               transformer=transformer)
    return pipe, calls


def test_the_presets_are_flux_dev_encoders_with_one_required_reference():
    dev, real, tiny, tiny_flux = (get_preset(n) for n in ("flux-dev", "flux1-kontext-dev", "tiny-flux1-kontext", "tiny-flux"))
    assert real.transformer == real.vae.repo == real.text.repo == "black-forest-labs/FLUX.1-Kontext-dev"
    assert (real.references, real.requires_references, tiny.references, tiny.requires_references) == (1, True, 1, True)
    assert replace(real.vae, repo=dev.vae.repo) == dev.vae and replace(real.text, repo=dev.text.repo) == dev.text
    assert real.text.max_length == 512 and (real.family, real.base_resolution, real.granularity) == ("flux", 1024, 16)
    assert replace(tiny, name="tiny-flux", references=0, requires_references=False) == tiny_flux
    assert dev.references == tiny_flux.references == 0  # the text-to-image presets are unchanged


def test_the_reference_tables_are_the_pipelines_own_and_a_scaled_copy_for_the_tiny_preset():
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    real, tiny = get_preset("flux1-kontext-dev"), get_preset("tiny-flux1-kontext")
    assert FLUX.reference_resolutions(real) == list(PREFERRED_KONTEXT_RESOLUTIONS)
    small = FLUX.reference_resolutions(tiny)
    assert [w / h for w, h in small] == [w / h for w, h in PREFERRED_KONTEXT_RESOLUTIONS]  # the same aspect ratios
    assert all(120 * 120 <= w * h <= 136 * 136 for w, h in small)  # about 128 x 128
    real_print, tiny_print = FLUX.reference_fingerprint(real), FLUX.reference_fingerprint(tiny)
    assert real_print["resolutions_wh"] == [list(r) for r in PREFERRED_KONTEXT_RESOLUTIONS]
    assert tiny_print["resolutions_wh"] == [list(r) for r in small] and tiny_print != real_print
    assert (real_print["multiple_of"], real_print["resample"]) == (16, "lanczos")
    assert FLUX.reference_fingerprint(get_preset("tiny-flux")) == {}  # a text-to-image preset's fingerprint keeps no part


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_tiny_reference_latent_is_bit_for_bit_what_the_stock_pipeline_concatenates(stock, size, monkeypatch):
    """With the pipeline's table replaced by the tiny preset's, FluxKontextPipeline.__call__ resizes, preprocesses and
    encodes the image (`prepare_latents`) into the tokens after the target's: our prepared pixels, encoded by the
    family's `encode_references` and packed, are those tokens exactly, and the reference's ids are the target's grid
    with first coordinate 1."""
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux import pipeline_flux_kontext

    pipe, calls = stock
    preset = get_preset("tiny-flux1-kontext")
    image = picture(*size)
    pixels = FLUX.prepare_reference(preset, image, 0, 1)["pixels"]  # before the table is replaced: it scales the pipeline's
    monkeypatch.setattr(pipeline_flux_kontext, "PREFERRED_KONTEXT_RESOLUTIONS", FLUX.reference_resolutions(preset))
    with torch.no_grad():
        pipe(image=image, prompt="a red circle", height=64, width=64, max_area=64 * 64, num_inference_steps=1, guidance_scale=2.5,
             max_sequence_length=TOKENS, output_type="latent", generator=torch.Generator().manual_seed(0))
    call = calls[-1]
    target = (64 // 16) ** 2  # 4 x 4 packed target tokens

    assert pixels.dtype == torch.float32 and pixels.dim() == 3 and pixels.shape[0] == 3
    assert -1 <= float(pixels.min()) and float(pixels.max()) <= 1
    vae = FLUX.load_vae(preset.vae, None)
    with torch.no_grad():  # in a batch of two, stacked as the encoder stacks a batch of references of one size
        latent = FLUX.encode_references(vae, torch.stack([pixels, pixels.flip(-1)]), FLUX.latent_spec(vae))[:1]
    _, c, h, w = latent.shape
    assert (h * 8, w * 8) == tuple(pixels.shape[1:])
    ours = FluxPipeline._pack_latents(latent, 1, c, h, w)
    assert call["hidden_states"].shape == (1, target + ours.shape[1], 64)
    assert torch.equal(call["hidden_states"][:, target:], ours)

    ids = call["img_ids"][target:]
    grid = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    assert torch.equal(ids[:, 0], torch.ones(len(ids))) and torch.equal(ids[:, 1:], grid[:, 1:])
    assert torch.equal(call["img_ids"][:target, 0], torch.zeros(target))


def test_the_real_preset_prepares_the_pixels_the_stock_pipeline_encodes(stock, monkeypatch):
    """With the pipeline's own table (about a megapixel): the pixels FluxKontextPipeline hands `prepare_latents` for
    images of several aspect ratios are the real preset's prepared pixels, exactly."""
    from diffusers import FluxKontextPipeline

    class Seen(Exception):
        pass

    seen = []

    def capture(self, image, *args, **kwargs):
        seen.append(image)
        raise Seen

    pipe, _ = stock
    monkeypatch.setattr(FluxKontextPipeline, "prepare_latents", capture)
    preset = get_preset("flux1-kontext-dev")
    for size in SIZES:
        image = picture(*size, seed=1)
        with pytest.raises(Seen), torch.no_grad():
            pipe(image=image, prompt="a red circle", height=64, width=64, max_sequence_length=TOKENS)
        ours = FLUX.prepare_reference(preset, image, 0, 1)["pixels"]
        assert seen[-1].shape == (1, *ours.shape) and torch.equal(seen[-1][0], ours), size
        assert 0.9e6 < ours.shape[1] * ours.shape[2] < 1.1e6  # about a megapixel


def test_a_reference_too_small_to_size_is_refused_naming_its_size():
    with pytest.raises(ValueError, match="reference image of 10x300 pixels: tiny-flux1-kontext takes sides of at least 16"):
        FLUX.prepare_reference(get_preset("tiny-flux1-kontext"), picture(10, 300), 0, 1)
    with pytest.raises(ValueError, match="tiny-flux is not an edit preset"):
        FLUX.prepare_reference(get_preset("tiny-flux"), picture(64, 64), 0, 1)


def test_the_tiny_table_divides_the_pipelines_exactly():
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    assert all(w % flux.TINY_REFERENCE_DIVISOR == 0 == h % flux.TINY_REFERENCE_DIVISOR for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
