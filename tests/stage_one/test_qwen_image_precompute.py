"""Stage one for Qwen-Image (tiny-qwen-image): the cache holds what the stock QwenImagePipeline computes — each
caption's valid tokens after the template's dropped prefix, from which stage two rebuilds the pipeline's padded
embeddings and mask; the VAE posterior as one frame, normalised per channel as the pipelines normalise it — decodes as
the pipeline decodes, and the real preset loads the published layout with `from_pretrained`."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import captioned_cache, stage_one_crop

from precompute.encode import Encoders
from precompute.families.qwen_image import FAMILY, LATENTS_MEAN, LATENTS_STD, check_template, tiny_tokenizer
from precompute.presets import get_preset
from shards import Cache, LatentSpec, prompt_key, verify
from train.families.base import TextInput

pytestmark = pytest.mark.model  # tiny diffusers and transformers models

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 64  # tiny-qwen-image's caption limit
PROMPT = "a large red circle on a blue background"
LONG = "a " + " and ".join(["large red circle on a blue background"] * 12)  # over 64 tokens: cut as the pipeline cuts


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny-qwen-image cache of three images (one with two captions, one with a caption over the token limit) and one
    validation prompt; the images and each one's captions."""
    return captioned_cache(tmp_path_factory.mktemp("qwen"), "tiny-qwen-image", LONG, PROMPT, seed=3)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """tiny-qwen-image's VAE, Qwen2.5-VL and tokenizer saved in the diffusers layout."""
    directory = tmp_path_factory.mktemp("parts")
    preset = get_preset("tiny-qwen-image")
    FAMILY.save_tiny_vae(preset.vae, str(directory))
    FAMILY.save_tiny_text(preset.text, str(directory))
    return directory


@pytest.fixture(scope="module")
def stock(parts):
    """The stock QwenImagePipeline with those components loaded back with `from_pretrained` (no transformer)."""
    import diffusers
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    return diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=diffusers.AutoencoderKLQwenImage.from_pretrained(parts / "vae"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(parts / "text_encoder").eval(),
        tokenizer=Qwen2Tokenizer.from_pretrained(parts / "tokenizer"), transformer=None)


def stock_prompt(stock, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's (prompt_embeds (B, L, D), mask (B, L)) for a batch, its mask as ones where it returns none."""
    with torch.no_grad():
        embeds, mask = stock.encode_prompt(captions, device="cpu", max_sequence_length=TOKENS)
    return embeds, torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask


def rebuilt(fields: dict, lengths: list[int]) -> dict:
    """Stage two's collated text input of cached captions: padded embeddings and mask."""
    text = TextInput()
    fields = {"text": fields["text"], "text_lengths": torch.tensor(lengths)}
    return text.collate(None, [text.caption(None, fields, j) for j in range(len(lengths))])


def test_the_tiny_tokenizer_splits_the_template_prefix_into_the_tokens_the_pipeline_drops():
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=tiny_tokenizer(), transformer=None)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    prefix = pipe.tokenizer(template.split("{}")[0]).input_ids
    full = pipe.tokenizer(template.format(PROMPT)).input_ids
    assert drop == 34 and len(prefix) == drop and full[:drop] == prefix  # the caption starts right after the prefix
    assert pipe.tokenizer.decode(full[drop:]).startswith(PROMPT)
    # the same vocabulary in another process (the fingerprint records its digest)
    code = ("import hashlib, json; from precompute.families.qwen_image import tiny_tokenizer; "
            "print(hashlib.sha256(json.dumps(sorted(tiny_tokenizer().get_vocab().items())).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == hashlib.sha256(json.dumps(sorted(pipe.tokenizer.get_vocab().items())).encode()).hexdigest()


def test_a_tokenizer_that_splits_the_template_otherwise_is_refused():
    from precompute.families.qwen_tokenizer import tiny_qwen_tokenizer

    with pytest.raises(ValueError, match="into [0-9]+ tokens, but the pipeline drops 34"):
        check_template(tiny_qwen_tokenizer(["a red circle"]))  # never saw the template: its words split into pieces


def test_encoding_a_batch_rebuilds_the_pipelines_padded_embeddings_and_mask(stock):
    """The family's encoding of a batch of captions of different lengths (one cut at the limit, the empty one), stored
    trimmed and collated back as stage two collates them, is exactly the pipeline's `encode_prompt` of that batch."""
    side = FAMILY.load_text(get_preset("tiny-qwen-image").text, None, torch.float32)
    captions = [PROMPT, "a tiny pink star", "", LONG]
    with torch.inference_mode():
        fields = FAMILY.encode_text(side, captions, torch.device("cpu"))
    assert [f["text"].shape[0] for f in fields] == [13, 9, 5, TOKENS]  # caption + the template's 5 closing tokens
    batch = TextInput().collate(None, fields)
    embeds, mask = stock_prompt(stock, captions)
    assert torch.equal(batch["text"], embeds) and torch.equal(batch["text_mask"], mask.bool())
    assert FAMILY.truncated(side, captions) == [False, False, False, True]


def test_the_cache_holds_what_the_stock_pipeline_encodes(built, stock):
    """Every cached caption and prompt, rebuilt, is the pipeline's encoding of it (encoded alone: stage one's batches
    pad differently, which moves the last bits), with the pipeline's mask."""
    cache = Cache(built["cache"])
    assert cache.spec.text.layout == "masked" and (cache.spec.text.width, cache.spec.text.max_tokens) == (32, TOKENS)
    assert built["summary"]["new"] == 3 and built["summary"]["captions_truncated"] == 1
    seen = 0
    for i in range(len(cache)):
        s = cache[i]
        captions = built["captions"][bytes(s["source"].tolist()).decode()]
        lengths = s["text_lengths"].tolist()
        for j, caption in enumerate(captions):
            embeds, _ = stock_prompt(stock, [caption])
            ours = rebuilt(s, lengths)
            assert lengths[j] == embeds.shape[1]
            torch.testing.assert_close(ours["text"][j, : lengths[j]], embeds[0], rtol=1e-5, atol=1e-6)
            seen += 1
        embeds, mask = stock_prompt(stock, captions)  # the sample's captions as one batch: the same padding and mask
        assert torch.equal(rebuilt(s, lengths)["text_mask"], mask.bool())
    assert seen == 4
    prompts = cache.prompts()
    assert set(prompts) == {prompt_key(""), prompt_key(PROMPT)}  # the empty caption: true CFG's negative prompt
    for text in ("", PROMPT):
        embeds, _ = stock_prompt(stock, [text])
        torch.testing.assert_close(prompts[prompt_key(text)].fields["text"], embeds[0], rtol=1e-5, atol=1e-6)
    assert verify(built["cache"]).ok


def test_latents_are_the_posterior_of_one_frame_normalised_per_channel_as_the_pipelines_do(built, stock):
    """A cached posterior's draw is the stock img2img pipeline's `_encode_vae_image` of the same pixels with the same
    noise: (z - latents_mean) * (1 / latents_std) of the one-frame posterior."""
    from diffusers import QwenImageImg2ImgPipeline
    from diffusers.utils.torch_utils import randn_tensor

    cache = Cache(built["cache"])
    spec = cache.spec.latent
    assert spec == LatentSpec(16, 8, 1.0, 0.0, "mean_std", LATENTS_MEAN, LATENTS_STD)
    img2img = QwenImageImg2ImgPipeline(scheduler=stock.scheduler, vae=stock.vae, text_encoder=None, tokenizer=None, transformer=None)
    for i in range(len(cache)):
        s = cache[i]
        bh, bw = s["crop"].tolist()[2:]
        img = stage_one_crop(built["data"], s)  # as stage one resized and cropped it
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            theirs = img2img._encode_vae_image(x[:, :, None], torch.Generator().manual_seed(i))  # (1, 16, 1, h, w)
        noise = randn_tensor((1, 16, 1, bh // 8, bw // 8), generator=torch.Generator().manual_seed(i))
        assert s["latent_mean"].shape == (16, bh // 8, bw // 8)
        ours = s["latent_mean"] + s["latent_std"] * noise[0, :, 0]
        torch.testing.assert_close(ours, theirs[0, :, 0], rtol=1e-5, atol=1e-5)


def test_the_stored_decoder_decodes_as_the_pipeline_does(built, stock):
    """Stage two's decoder (the recipe stage one recorded, the normalisation undone per channel, one frame) gives the
    pixels QwenImagePipeline's decoding gives."""
    from train.decode import decode, decoder_recipe, load_decoder

    cache = Cache(built["cache"])
    recipe = decoder_recipe(cache)
    assert recipe.in_cache and recipe.frame_axis and (recipe.latents_mean, recipe.latents_std) == (LATENTS_MEAN, LATENTS_STD)
    z = cache[0]["latent_mean"][None]  # (1, 16, h, w)
    ours = np.asarray(decode(load_decoder(recipe, torch.device("cpu")), recipe, z)[0], dtype=np.int16)
    vae = stock.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():  # the pipeline's own lines after its denoising loop
        image = vae.decode(z[:, :, None] / inverse_std + mean, return_dict=False)[0][:, :, 0]
    theirs = np.asarray(stock.image_processor.postprocess(image, output_type="pil")[0], dtype=np.int16)
    assert ours.shape == theirs.shape == (z.shape[2] * 8, z.shape[3] * 8, 3)
    assert np.abs(ours - theirs).max() <= 1 and ours.std() > 0  # two roundings of the same values to 8 bits


def test_the_fingerprint_records_the_normalisation_and_the_template(built):
    fp = Cache(built["cache"]).fingerprint
    text, vae = fp["text_encoder"], fp["vae"]
    assert vae["class"] == "AutoencoderKLQwenImage" and vae["posterior"] == "mean_std"
    assert (vae["latents_mean"], vae["latents_std"]) == (list(LATENTS_MEAN), list(LATENTS_STD))
    assert vae["stored"] == "(z - latents_mean[c]) * (1 / latents_std[c])"
    assert text["encode_prompt"] == "QwenImagePipeline.encode_prompt" and text["padding"] == "trimmed"
    assert (text["class"], text["tokenizer"]) == ("Qwen2_5_VLForConditionalGeneration", "Qwen2Tokenizer")
    assert text["complex_human_instruction_sha256"]  # the prompt template and its dropped prefix
    record = Cache(built["cache"]).manifest.extra["precompute"]
    assert (record["preset"], record["family"], record["base_resolution"]) == ("tiny-qwen-image", "qwen-image", 256)


def test_the_real_preset_loads_the_published_layout_with_from_pretrained(parts, stock):
    """qwen-image names Qwen/Qwen-Image; pointed at a directory in its layout (the tiny components saved there), it
    loads them with `from_pretrained` and encodes what the tiny preset encodes."""
    preset = get_preset("qwen-image")
    assert (preset.vae.repo, preset.text.repo, preset.transformer) == ("Qwen/Qwen-Image",) * 3
    assert (preset.text.max_length, preset.base_resolution, preset.family) == (512, 1024, "qwen-image")
    real = Encoders(preset, torch.device("cpu"), pretrained=str(parts))
    tiny = Encoders(get_preset("tiny-qwen-image"), torch.device("cpu"))
    assert type(real.pipeline.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert real.fingerprint()["vae"]["weights"] == tiny.fingerprint()["vae"]["weights"]
    captions = [PROMPT, ""]
    for a, b in zip(real.encode_text(captions).fields, tiny.encode_text(captions).fields):
        assert torch.equal(a["text"], b["text"])
    x = torch.randint(0, 256, (1, 3, 64, 96), dtype=torch.uint8)
    assert all(torch.equal(real.encode_images(x)[k], tiny.encode_images(x)[k]) for k in ("latent_mean", "latent_std"))


def test_the_per_channel_normalisation_is_recorded_only_where_it_is_used():
    """A spec or recipe without per-channel statistics writes exactly the JSON it always wrote (existing caches keep
    their fingerprints and manifests); with them, both round-trip; one value per channel or the spec is refused."""
    from shards import DecoderRecipe, FormatError

    kl = LatentSpec(16, 8, 0.3611, 0.1159, "mean_std")
    assert kl.fingerprint() == {"scaling_factor": 0.3611, "shift_factor": 0.1159, "latent_channels": 16, "downsample": 8,
                                "posterior": "mean_std", "stored": "(z - shift_factor) * scaling_factor"}
    plain = DecoderRecipe("AutoencoderKL", "vae", 0.3611, 0.1159, in_cache=True)
    assert plain.to_json() == {"class": "AutoencoderKL", "scaling_factor": 0.3611, "shift_factor": 0.1159, "source": "vae",
                               "subfolder": None, "revision": None, "in_cache": True}
    assert DecoderRecipe.from_json(json.loads(json.dumps(plain.to_json()))) == plain

    spec = LatentSpec(16, 8, 1.0, 0.0, "mean_std", LATENTS_MEAN, LATENTS_STD)
    assert LatentSpec.from_fingerprint(json.loads(json.dumps(spec.fingerprint()))) == spec
    recipe = DecoderRecipe("AutoencoderKLQwenImage", "vae", 1.0, 0.0, in_cache=True, latents_mean=LATENTS_MEAN,
                           latents_std=LATENTS_STD, frame_axis=True)
    assert DecoderRecipe.from_json(json.loads(json.dumps(recipe.to_json()))) == recipe
    with pytest.raises(FormatError, match="one value per latent channel"):
        LatentSpec(16, 8, 1.0, 0.0, "mean_std", LATENTS_MEAN[:4], LATENTS_STD[:4])
    with pytest.raises(FormatError, match="latents_std finite and above 0"):
        LatentSpec(16, 8, 1.0, 0.0, "mean_std", LATENTS_MEAN, (0.0,) * 16)
