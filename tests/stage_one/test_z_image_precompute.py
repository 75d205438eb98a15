"""Stage one for Z-Image (tiny-z-image): the cache holds exactly what the stock ZImagePipeline computes — each caption's
valid tokens of Qwen3's second-to-last layer, in the chat template — and the Flux VAE's posterior, shifted and scaled as
ZImageImg2ImgPipeline encodes an image; the real presets name the published weights."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import captioned_cache, stage_one_crop

from precompute.config import PrecomputeConfig
from precompute.families.z_image import FAMILY, TINY_WIDTH
from precompute.presets import get_preset
from shards import Cache, TextSpec, prompt_key, verify

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

CONFIGS = Path(__file__).resolve().parents[2] / "precompute" / "configs"
TOKENS = 64  # tiny-qwen3's limit, of the templated caption
PROMPT = "a large red circle on a blue background"
LONG = "a " + " and ".join(["large red circle on a blue background"] * 12)  # over 64 tokens: truncated


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny-z-image cache of three images (one with two captions, one over the token limit) and a validation prompt."""
    return captioned_cache(tmp_path_factory.mktemp("z_image"), "tiny-z-image", LONG, PROMPT, seed=5)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """tiny-z-image's VAE, Qwen3 and tokenizer saved in the diffusers layout."""
    directory = tmp_path_factory.mktemp("parts")
    preset = get_preset("tiny-z-image")
    FAMILY.save_tiny_vae(preset.vae, directory)
    FAMILY.save_tiny_text(preset.text, directory)
    return directory


def stock(parts: Path, pipeline: str = "ZImagePipeline", scheduler=None):
    """The stock pipeline with the saved parts, loaded back with `from_pretrained` (no transformer)."""
    import diffusers
    from transformers import AutoTokenizer, Qwen3Model

    return getattr(diffusers, pipeline)(
        scheduler=scheduler, vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"),
        text_encoder=Qwen3Model.from_pretrained(parts / "text_encoder"), tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
        transformer=None)


def stock_embeds(pipe, captions: list[str]) -> list[torch.Tensor]:
    with torch.no_grad():
        return pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False, max_sequence_length=TOKENS)[0]


def test_the_cache_holds_what_encode_prompt_returns(built, parts):
    cache, pipe = Cache(built["cache"]), stock(parts)
    assert cache.spec.text == TextSpec("masked", TINY_WIDTH, TOKENS)
    assert built["summary"]["new"] == 3 and built["summary"]["captions_truncated"] == 1
    seen = 0
    for i in range(len(cache)):
        s = cache[i]
        captions = built["captions"][bytes(s["source"].tolist()).decode()]
        expected = stock_embeds(pipe, list(captions))
        assert s["text_lengths"].tolist() == [len(e) for e in expected]  # each caption's valid tokens, no padding
        for got, want in zip(s["text"].split(s["text_lengths"].tolist()), expected, strict=True):
            assert torch.equal(got, want)
            seen += 1
    assert seen == 4
    assert s["text_lengths"].tolist() == [TOKENS]  # the long caption, truncated to the limit as the pipeline does
    prompts = cache.prompts()
    assert set(prompts) == {prompt_key(""), prompt_key(PROMPT)}
    for text in ("", PROMPT):  # the empty caption is what ZImagePipeline encodes as the negative prompt
        assert torch.equal(prompts[prompt_key(text)].fields["text"], stock_embeds(pipe, [text])[0])
    assert verify(built["cache"]).ok


def test_captions_are_encoded_in_qwen3s_chat_template(parts):
    """The template ZImagePipeline applies (`enable_thinking=True`: no thinking block) reaches Qwen3 as one user turn
    and the assistant's prompt; the pipeline takes the second-to-last hidden layer's valid tokens."""
    pipe = stock(parts)
    templated = pipe.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                   add_generation_prompt=True, enable_thinking=True)
    assert templated == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    ids = pipe.tokenizer(templated, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = pipe.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == 4 and torch.equal(stock_embeds(pipe, [PROMPT])[0], hidden[-2][0])


def test_latents_are_the_posterior_as_the_img2img_pipeline_encodes(built, parts):
    """ZImageImg2ImgPipeline samples the posterior and applies (z - shift) * scaling; the cache's mean and std give the
    same latent for the same noise (its scheduler is told to add none)."""
    import diffusers

    class NoNoise(diffusers.FlowMatchEulerDiscreteScheduler):
        def scale_noise(self, sample, timestep, noise=None):
            return sample

    pipe = stock(parts, "ZImageImg2ImgPipeline", NoNoise())
    cache = Cache(built["cache"])
    assert (cache.spec.latent.shift_factor, cache.spec.latent.scaling_factor, cache.spec.latent.channels) == (0.1159, 0.3611, 16)
    for i in range(len(cache)):
        s = cache[i]
        bh, bw = s["crop"].tolist()[2:]
        img = stage_one_crop(built["data"], s)  # as stage one resized and cropped it
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            theirs = pipe.prepare_latents(x, None, 1, 16, bh, bw, torch.float32, "cpu", torch.Generator().manual_seed(i))
        eps = torch.randn(16, bh // 8, bw // 8, generator=torch.Generator().manual_seed(i))
        assert s["latent_mean"].shape == (16, bh // 8, bw // 8)
        torch.testing.assert_close(s["latent_mean"] + s["latent_std"] * eps, theirs[0], rtol=1e-5, atol=1e-5)


def test_the_fingerprint_names_the_pipeline_and_the_encoders(built):
    fp = Cache(built["cache"]).fingerprint
    text, vae = fp["text_encoder"], fp["vae"]
    assert text["encode_prompt"] == "ZImagePipeline.encode_prompt" and text["padding"] == "trimmed"
    assert (text["name"], text["max_length"], text["class"], text["tokenizer"]) == ("tiny-qwen3", TOKENS, "Qwen3Model",
                                                                                   "Qwen2Tokenizer")
    assert (vae["class"], vae["shift_factor"], vae["scaling_factor"], vae["posterior"]) == ("AutoencoderKL", 0.1159, 0.3611,
                                                                                          "mean_std")
    record = Cache(built["cache"]).manifest.extra["precompute"]
    assert (record["preset"], record["family"], record["base_resolution"]) == ("tiny-z-image", "z-image", 256)


@pytest.mark.parametrize("name, repo", [("z-image", "Tongyi-MAI/Z-Image"), ("z-image-turbo", "Tongyi-MAI/Z-Image-Turbo")])
def test_the_real_presets_name_the_published_weights(name, repo):
    preset = get_preset(name)
    assert (preset.family, preset.base_resolution, preset.transformer) == ("z-image", 1024, repo)
    assert (preset.vae.repo, preset.vae.subfolder, preset.vae.cuda_dtype) == (repo, "vae", "fp32")
    assert (preset.text.name, preset.text.repo, preset.text.max_length, preset.text.cuda_dtype) == ("qwen3-4b", repo, 512, "bf16")
    assert PrecomputeConfig("data", name).preset() == preset
    # the transformer takes 2 x 2 patches of the f8 latent: every bucket is a multiple of 16 pixels each way
    assert all(b.height % 16 == 0 and b.width % 16 == 0 for b in PrecomputeConfig("data", name).policy().buckets)


def test_the_published_text_encoder_config_is_qwen3_4b():
    """Qwen3-4B as Z-Image's text_encoder/config.json describes it: a Qwen3Model 2560 wide (the transformer's
    cap_feat_dim), 36 layers, grouped-query attention; 4.02B parameters without the LM head."""
    from transformers import Qwen3Config, Qwen3Model

    cfg = json.loads((CONFIGS / "qwen3_4b_text.json").read_text())
    with torch.device("meta"):
        model = Qwen3Model(Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    assert sum(p.numel() for p in model.parameters()) == 4_022_468_096
    transformer = json.loads((Path(__file__).resolve().parents[2] / "train" / "configs" / "z_image_transformer.json").read_text())
    assert cfg["hidden_size"] == transformer["cap_feat_dim"] == 2560
