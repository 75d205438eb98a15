"""Stage one for FLUX.2 (tiny-flux2, tiny-flux2-klein): the cache holds exactly what the stock pipelines compute — each
caption's every token of the stacked hidden layers as Flux2Pipeline.encode_prompt (Mistral 3) and
Flux2KleinPipeline.encode_prompt (Qwen3) return them, the target's posterior patchified and normalised as the pipelines
normalise their latents, and each reference image prepared by Flux2Pipeline.__call__'s rules and encoded by its own
`_encode_vae_image`; the real presets name the published weights, and a dev caption costs 15 MiB."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import captioned_cache, stage_one_crop
from PIL import Image

from precompute.families.flux2 import DEV_REFERENCES, FAMILY, KLEIN, KLEIN_REFERENCES, PIPELINE_REFERENCE, TINY_REFERENCE, TINY_TOKENS
from precompute.presets import get_preset, save_tiny
from shards import Cache, TextSpec, prompt_key, verify

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "a large red circle on a blue background"
LONG = "a " + " and ".join(["large red circle on a blue background"] * 12)  # over 64 tokens: truncated
PIPELINES = {"tiny-flux2": "Flux2Pipeline", "tiny-flux2-klein": "Flux2KleinPipeline"}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def built(request, tmp_path_factory):
    """A cache of three images (one with two captions, one over the token limit) and a validation prompt, and the preset's
    VAE and text encoder saved in the diffusers layout."""
    root = tmp_path_factory.mktemp(request.param)
    out = captioned_cache(root, request.param, LONG, PROMPT, seed=5)
    save_tiny(get_preset(request.param), root / "parts")
    return {**out, "model": request.param, "parts": root / "parts"}


def tiny_transformer(text_width: int = 48):
    """A Flux2Transformer2DModel the stock pipelines can run (what it computes does not matter to stage one)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=text_width, timestep_guidance_channels=32,
                                   axes_dims_rope=(4, 4, 4, 4))


def stock(built, transformer=None):
    """The stock pipeline of the preset with the saved parts loaded back with `from_pretrained`."""
    import diffusers
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

    parts, name = built["parts"], PIPELINES[built["model"]]
    encoder = Mistral3ForConditionalGeneration if name == "Flux2Pipeline" else Qwen3ForCausalLM
    return getattr(diffusers, name)(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), transformer=transformer,
                                    vae=diffusers.AutoencoderKLFlux2.from_pretrained(parts / "vae"),
                                    text_encoder=encoder.from_pretrained(parts / "text_encoder"),
                                    tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"))


def stock_embeds(pipe, captions: list[str]) -> torch.Tensor:
    with torch.no_grad():
        return pipe.encode_prompt(captions, device="cpu", max_sequence_length=TINY_TOKENS)[0]


def test_the_cache_holds_what_encode_prompt_returns(built):
    cache, pipe = Cache(built["cache"]), stock(built)
    # three stacked layers of the 16-wide language model, all 64 tokens of every caption, padding included
    assert cache.spec.text == TextSpec("masked", 3 * 16, TINY_TOKENS)
    assert built["summary"]["new"] == 3 and built["summary"]["captions_truncated"] == 1
    seen = 0
    for i in range(len(cache)):
        s = cache[i]
        captions = built["captions"][bytes(s["source"].tolist()).decode()]
        expected = stock_embeds(pipe, list(captions))
        assert s["text_lengths"].tolist() == [TINY_TOKENS] * len(captions)
        for got, want in zip(s["text"].split(s["text_lengths"].tolist()), expected, strict=True):
            assert torch.equal(got, want)
            seen += 1
    assert seen == 4
    prompts = cache.prompts()
    assert set(prompts) == {prompt_key(""), prompt_key(PROMPT)}
    for text in ("", PROMPT):  # the empty caption is what Flux2KleinPipeline encodes as its negative prompt
        assert torch.equal(prompts[prompt_key(text)].fields["text"], stock_embeds(pipe, [text])[0])
    assert verify(built["cache"]).ok


def test_latents_are_the_pipelines_image_latents(built):
    """The cached mean is what the pipeline's `_encode_vae_image` makes of the bucket's crop (mode, 2 x 2 patches, the
    batch norm's statistics), bit for bit; the std is the posterior's, patched and divided alike."""
    pipe, cache = stock(built), Cache(built["cache"])
    spec = cache.spec.latent
    vae = pipe.vae
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps)
    assert (spec.channels, spec.downsample, spec.posterior) == (128, 16, "mean_std")
    assert spec.latents_mean == tuple(vae.bn.running_mean.tolist()) and spec.latents_std == tuple(std.tolist())
    assert vae.bn.running_mean.abs().sum() > 0  # seeded statistics: a normalisation left out would show
    for i in range(len(cache)):
        s = cache[i]
        bh, bw = s["crop"].tolist()[2:]
        img = stage_one_crop(built["data"], s)  # as stage one resized and cropped it
        x = pipe.image_processor.preprocess(img, height=bh, width=bw)  # as the pipeline hands its VAE an image
        with torch.no_grad():
            theirs = pipe._encode_vae_image(x, None)[0]
            posterior = vae.encode(x).latent_dist
        assert s["latent_mean"].shape == (128, bh // 16, bw // 16)
        assert torch.equal(s["latent_mean"], theirs)
        patched = pipe._patchify_latents(posterior.std)[0] / std.view(-1, 1, 1)
        torch.testing.assert_close(s["latent_std"], patched, rtol=1e-6, atol=1e-7)


def test_references_are_the_pipelines_image_latents(built):
    """Each reference goes through prepare_reference and encode_references as stage one runs them, and equals, bit for
    bit, what the stock pipeline's __call__ hands its transformer for the same image: cropped to multiples of 16 (a
    100 x 70 image gives 96 x 64 pixels, 6 x 4 tokens) and encoded by `_encode_vae_image`, references one after another."""
    from diffusers import Flux2Pipeline

    preset = get_preset(built["model"])
    rng = np.random.RandomState(3)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in ((70, 100), (64, 64))]
    pipe = stock(built, tiny_transformer())
    seen = {}

    def record(images, **kwargs):
        seen["latents"], seen["ids"] = Flux2Pipeline.prepare_image_latents(pipe, images, **kwargs)
        return seen["latents"], seen["ids"]

    pipe.prepare_image_latents = record
    pipe(prompt=PROMPT, image=images, num_inference_steps=1, max_sequence_length=TINY_TOKENS, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    vae, latent = pipe.vae, Cache(built["cache"]).spec.latent
    ours = []
    for index, image in enumerate(images):
        prepared = FAMILY.prepare_reference(preset, image, index, len(images))
        with torch.no_grad():
            ours.append(FAMILY.encode_references(vae, prepared["pixels"][None], latent)[0])
    assert [tuple(r.shape) for r in ours] == [(128, 4, 6), (128, 4, 4)]
    packed = torch.cat([r.flatten(1).t() for r in ours])  # (24 + 16, 128): the pipeline's packing, reference by reference
    assert torch.equal(packed, seen["latents"][0])
    # the pipeline's ids: reference i at time 10 + 10 i, its own rows and columns
    assert seen["ids"][0, 0].tolist() == [10, 0, 0, 0] and seen["ids"][0, -1].tolist() == [20, 3, 3, 0]


def test_reference_preparation_follows_the_pipelines_limits():
    """flux2-dev prepares a large reference as Flux2Pipeline.__call__ does (Lanczos to 1024 x 1024 pixels, then a centre
    crop to multiples of 16), and refuses what its image check refuses; tiny presets scale the area cap down."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    preset = get_preset("flux2-dev")
    image = Image.fromarray((np.random.RandomState(0).rand(900, 1500, 3) * 255).astype(np.uint8))
    prepared = FAMILY.prepare_reference(preset, image, 0, 1)["pixels"]
    resized = Flux2ImageProcessor._resize_to_target_area(image, 1024 * 1024)  # 1321 x 793
    w, h = resized.width // 16 * 16, resized.height // 16 * 16
    assert prepared.shape == (3, h, w) == (3, 784, 1312)
    left, top = (resized.width - w) // 2, (resized.height - h) // 2
    expected = VaeImageProcessor.pil_to_numpy(resized.crop((left, top, left + w, top + h)))
    assert torch.equal(prepared, torch.from_numpy(expected).permute(0, 3, 1, 2)[0] * 2 - 1)
    for bad in ((40, 200), (64, 600)):  # a side under 64 pixels; an aspect ratio beyond 8
        with pytest.raises(ValueError, match="flux2-dev takes no such reference image"):
            FAMILY.prepare_reference(preset, Image.new("RGB", bad), 0, 1)
    assert (PIPELINE_REFERENCE.area, PIPELINE_REFERENCE.multiple, TINY_REFERENCE.area) == (1024 * 1024, 16, 128 * 128)
    assert FAMILY.prepare_reference(get_preset("tiny-flux2"), image, 0, 1)["pixels"].shape == (3, 96, 160)
    assert FAMILY.reference_fingerprint(get_preset("tiny-flux2"))["max_area"] == 128 * 128


@pytest.mark.parametrize("name, repo, references", [("flux2-dev", "black-forest-labs/FLUX.2-dev", DEV_REFERENCES),
                                                    *[(n, r, KLEIN_REFERENCES) for n, r in KLEIN.items()]])
def test_the_real_presets_name_the_published_weights(name, repo, references):
    preset = get_preset(name)
    assert (preset.family, preset.base_resolution, preset.transformer, preset.granularity) == ("flux2", 1024, repo, 16)
    assert (preset.vae.repo, preset.vae.subfolder, preset.text.repo, preset.text.max_length) == (repo, "vae", repo, 512)
    assert (preset.references, preset.requires_references) == (references, False)  # text-to-image and edit samples
    assert preset.text.kind == ("mistral3" if name == "flux2-dev" else "qwen3")


def test_a_dev_caption_is_15_mib():
    """FLUX.2-dev's caption: 512 tokens of three stacked layers of Mistral Small 3.1 (5120 wide), the transformer's
    joint_attention_dim in the published config: 15 MiB at bf16 (what `shards inspect` and the disk check count)."""
    transformer = json.loads((ROOT / "train" / "configs" / "flux2_dev_transformer.json").read_text())
    spec = TextSpec("masked", 3 * 5120, 512)
    assert spec.width == transformer["joint_attention_dim"] == 15360
    assert FAMILY.caption_elements(spec) * 2 == 15 * 2**20
