"""Stage one for Flux.1 (tiny-flux): the cache holds exactly what the stock FluxPipeline computes — every T5 token of a
caption with its padding, CLIP-L's pooled vector, the VAE posterior shifted and scaled once — and the real presets
name the published weights."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import captioned_cache, stage_one_crop
from typer.testing import CliRunner

from precompute.__main__ import prompts_app
from precompute.config import PrecomputeConfig
from precompute.families.flux import FAMILY as FLUX
from precompute.families.flux import TINY_POOLED_WIDTH as TINY_FLUX_POOLED_WIDTH
from precompute.families.parts import TINY_T5_WIDTH
from precompute.presets import get_preset, save_tiny
from precompute.run import main as precompute
from shards import Cache, TextSpec, prompt_key, verify

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

CONFIGS = Path(__file__).resolve().parents[2] / "precompute" / "configs"
RUN = dict(workers=0, progress=False, batch_size=2, storage_dtype="fp32")
TOKENS = 32  # tiny-flux's T5 limit
PROMPT, NEW = "a large red circle on a blue background", "a small green triangle on a white background"
LONG = "a " + " and ".join(["large red circle on a blue background"] * 5)  # over 32 T5 tokens: truncated


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny-flux cache of three images (one with two captions, one with a caption over the token limit) and one
    validation prompt; the images and each one's captions."""
    return captioned_cache(tmp_path_factory.mktemp("flux"), "tiny-flux", LONG, PROMPT, seed=3)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """The stock FluxPipeline with tiny-flux's VAE, CLIP-L and T5, saved in the diffusers layout and loaded back."""
    import diffusers
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    parts = tmp_path_factory.mktemp("parts")
    save_tiny(get_preset("tiny-flux"), parts)
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"),
        text_encoder=CLIPTextModel.from_pretrained(parts / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(parts / "tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(parts / "text_encoder_2"),
        tokenizer_2=AutoTokenizer.from_pretrained(parts / "tokenizer_2"), transformer=None,
    )


def flux_inputs(spec: TextSpec, fields: dict, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per caption, FluxPipeline's (prompt_embeds (1, T5 tokens, D), pooled_prompt_embeds (1, D_pooled), text_ids
    (T5 tokens, 3)) rebuilt from cached fields as the contract's "flux" layout defines them."""
    out = []
    for i, t5 in enumerate(fields["text"].split(lengths)):
        assert t5.shape == (spec.t5_tokens, spec.t5_width)
        out.append((t5[None], fields["pooled"][i : i + 1], torch.zeros(spec.t5_tokens, 3)))
    return out


def assert_stock(stock, caption: str, rebuilt) -> None:
    with torch.no_grad():
        expected = stock.encode_prompt(caption, None, device="cpu", max_sequence_length=TOKENS)
    for name, a, b in zip(("prompt_embeds", "pooled_prompt_embeds", "text_ids"), rebuilt, expected):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (caption, name)


def test_the_cache_rebuilds_what_the_stock_pipeline_encodes(built, stock):
    cache = Cache(built["cache"])
    spec = cache.spec.text
    assert spec == TextSpec("flux", TINY_T5_WIDTH, TOKENS, t5_tokens=TOKENS, pooled_width=TINY_FLUX_POOLED_WIDTH,
                            t5_width=TINY_T5_WIDTH)
    assert built["summary"]["new"] == 3 and built["summary"]["captions_truncated"] == 1
    seen = 0
    for i in range(len(cache)):
        s = cache[i]
        captions = built["captions"][bytes(s["source"].tolist()).decode()]
        lengths = s["text_lengths"].tolist()
        assert lengths == [TOKENS] * len(captions)  # every token kept, padding included
        for caption, rebuilt in zip(captions, flux_inputs(spec, s, lengths), strict=True):
            assert_stock(stock, caption, rebuilt)
            seen += 1
    assert seen == 4
    prompts = cache.prompts()
    assert set(prompts) == {prompt_key(""), prompt_key(PROMPT)}  # the empty caption (guidance) is cached too
    for text in ("", PROMPT):
        assert_stock(stock, text, flux_inputs(spec, prompts[prompt_key(text)].fields, [TOKENS])[0])
    assert verify(built["cache"]).ok


def test_latents_are_the_vae_posterior_shifted_and_scaled(built, stock):
    cache = Cache(built["cache"])
    vae = stock.vae
    shift, scaling = vae.config.shift_factor, vae.config.scaling_factor
    assert (shift, scaling, vae.config.latent_channels) == (0.1159, 0.3611, 16)
    assert (cache.spec.latent.shift_factor, cache.spec.latent.scaling_factor, cache.spec.latent.channels) == (shift, scaling, 16)
    for i in range(len(cache)):
        s = cache[i]
        bh, bw = s["crop"].tolist()[2:]
        img = stage_one_crop(built["data"], s)  # as stage one resized and cropped it
        # (1, 3, H, W) in [-1, 1] as x / 127.5 - 1: the random tiny VAE turns the last bit of another rounding of the
        # same pixels (the image processor's x / 255 * 2 - 1) into differences of 1e-3
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            dist = vae.encode(x).latent_dist
        assert s["latent_mean"].shape == (16, bh // 8, bw // 8)
        torch.testing.assert_close(s["latent_mean"], ((dist.mean - shift) * scaling)[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s["latent_std"], (dist.std * scaling)[0], rtol=1e-6, atol=1e-6)


def test_the_stored_decoder_decodes_as_the_pipeline_does(built, stock):
    """Stage two decodes a cached latent with the recipe as FluxPipeline decodes its output, `z / scaling + shift`."""
    from diffusers import AutoencoderKL

    cache = Cache(built["cache"])
    recipe = cache.spec.decoder.located(built["cache"])
    assert recipe.in_cache and (recipe.vae_class, recipe.scaling_factor, recipe.shift_factor) == ("AutoencoderKL", 0.3611, 0.1159)
    decoder = AutoencoderKL.from_pretrained(recipe.source).eval()
    z = cache[0]["latent_mean"][None]
    with torch.no_grad():
        ours = decoder.decode(z / recipe.scaling_factor + recipe.shift_factor).sample
        theirs = stock.vae.decode(z / stock.vae.config.scaling_factor + stock.vae.config.shift_factor).sample
    assert torch.equal(ours, theirs)


def test_the_fingerprint_carries_the_flux_layout(built):
    fp = Cache(built["cache"]).fingerprint
    text, vae = fp["text_encoder"], fp["vae"]
    assert text["layout"] == {"kind": "flux", "t5_tokens": TOKENS, "pooled_width": TINY_FLUX_POOLED_WIDTH,
                              "t5_width": TINY_T5_WIDTH}
    assert text["encode_prompt"] == "FluxPipeline.encode_prompt" and text["padding"] == "all tokens kept"
    assert (text["name"], text["max_length"], text["hidden_size"]) == ("tiny-clip-l-t5", TOKENS, TINY_T5_WIDTH)
    assert {name: m["class"] for name, m in text["modules"].items()} == {"text_encoder": "CLIPTextModel",
                                                                         "text_encoder_2": "T5EncoderModel"}
    assert (vae["shift_factor"], vae["scaling_factor"], vae["latent_channels"]) == (0.1159, 0.3611, 16)
    assert vae["posterior"] == "mean_std"
    record = Cache(built["cache"]).manifest.extra["precompute"]
    assert (record["preset"], record["family"], record["base_resolution"]) == ("tiny-flux", "flux", 256)


def test_prompts_command_adds_a_prompt_to_a_flux_cache(built, stock, tmp_path):
    cache = shutil.copytree(built["cache"], tmp_path / "cache")
    out = CliRunner().invoke(prompts_app, [str(cache), "--prompt", NEW, "--prompt", PROMPT])
    assert out.exit_code == 0, out.output
    assert "1 prompt(s) added, 1 already cached" in out.output
    prompts = Cache(cache).prompts()
    assert set(prompts) == {prompt_key(""), prompt_key(PROMPT), prompt_key(NEW)}
    assert_stock(stock, NEW, flux_inputs(Cache(cache).spec.text, prompts[prompt_key(NEW)].fields, [TOKENS])[0])


@pytest.mark.parametrize("name, repo, tokens", [("flux-dev", "black-forest-labs/FLUX.1-dev", 512),
                                                ("flux-schnell", "black-forest-labs/FLUX.1-schnell", 256)])
def test_the_real_presets_name_the_published_weights(name, repo, tokens):
    preset = get_preset(name)
    assert (preset.family, preset.base_resolution, preset.transformer) == ("flux", 1024, repo)
    assert (preset.vae.kind, preset.vae.repo, preset.vae.subfolder, preset.vae.cuda_dtype) == ("flux", repo, "vae", "fp32")
    assert (preset.text.kind, preset.text.repo, preset.text.max_length) == ("flux", repo, tokens)
    assert FLUX.text_subfolders(preset.text) == [("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")]
    assert PrecomputeConfig("data", name).preset() == preset
    # Flux packs 2x2 patches of the f8 latent: every bucket of the table is a multiple of 16 pixels each way
    assert all(b.height % 16 == 0 and b.width % 16 == 0 for b in PrecomputeConfig("data", name).policy().buckets)
    with pytest.raises(ValueError, match="--text-dtype fp16: the text encoder overflows"):
        PrecomputeConfig("data", name, text_dtype="fp16")  # T5


@pytest.mark.parametrize("model, options, message", [
    ("tiny-flux", {"text_encoder": "tiny-clip-l-g-t5"}, "the flux family needs CLIP-L + T5 (clip-l-t5)"),
    ("tiny-flux", {"text_encoder": "tiny-t5"}, "the flux family needs CLIP-L + T5 (clip-l-t5)"),
    ("tiny-sd3", {"text_encoder": "tiny-clip-l-t5"}, "the sd3 family needs CLIP-L + CLIP-G + T5"),
    ("tiny-sana", {"text_encoder": "tiny-clip-l-t5"}, "the sana family needs a single text encoder"),
    ("tiny-flux", {"drop_t5": True}, "--drop-t5 applies to SD3 presets"),
])
def test_another_familys_text_encoder_is_refused(model, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PrecomputeConfig("data", model, **options)


def test_the_published_vae_config_is_sd3s_architecture_with_fluxs_factors():
    from diffusers import AutoencoderKL

    flux, sd3 = (json.loads((CONFIGS / f"{name}_vae.json").read_text()) for name in ("flux", "sd3"))
    with torch.device("meta"):
        counts = [sum(p.numel() for p in AutoencoderKL.from_config(cfg).parameters()) for cfg in (flux, sd3)]
    assert counts == [83_819_683] * 2
    differing = {k for k in flux.keys() | sd3.keys() if flux.get(k) != sd3.get(k)}
    assert differing == {"scaling_factor", "shift_factor", "mid_block_add_attention"}  # SD3's file leaves the default out
    assert AutoencoderKL.from_config(sd3).config.mid_block_add_attention is True
    assert (flux["shift_factor"], flux["scaling_factor"], flux["latent_channels"]) == (0.1159, 0.3611, 16)


def test_the_tiny_transformer_takes_what_tiny_flux_caches(built):
    from train import families as transformers

    spec, preset = Cache(built["cache"]).spec, transformers.get_preset("tiny-flux")
    config = preset.transformer_config()
    assert config["joint_attention_dim"] == spec.text.t5_width and config["pooled_projection_dim"] == spec.text.pooled_width
    assert preset.text_tokens == spec.text.t5_tokens
    assert config["in_channels"] == 4 * spec.latent.channels  # 2x2 patches of the 16-channel latent, packed


def test_the_encoders_load_from_the_diffusers_layout_as_the_real_presets_do(built, tmp_path):
    """`--pretrained DIR` loads what a Flux repository holds (vae/, text_encoder/ as a CLIPTextModel, text_encoder_2/,
    tokenizer/, tokenizer_2/) with from_pretrained, the path of flux-dev and flux-schnell: the same cache."""
    save_tiny(get_preset("tiny-flux"), tmp_path / "weights")
    precompute(str(built["data"]), "tiny-flux", tmp_path / "cache", pretrained=str(tmp_path / "weights"), **RUN)
    a, b = Cache(built["cache"]), Cache(tmp_path / "cache")
    assert b.fingerprint["text_encoder"]["source"] == str(tmp_path / "weights")
    assert a.fingerprint["text_encoder"]["modules"] == b.fingerprint["text_encoder"]["modules"]
    assert a.fingerprint["vae"]["weights"] == b.fingerprint["vae"]["weights"]
    for i in range(len(a)):
        assert all(torch.equal(a[i][name], b[i][name]) for name in ("latent_mean", "latent_std", "text", "pooled"))
