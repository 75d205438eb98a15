"""Stage one and stage two name the same presets: their two registries (which cannot import each other) agree."""

from pathlib import Path

import pytest

from precompute import presets as encoders
from shards import Cache
from train import families as transformers

LEGACY = Path(__file__).resolve().parent / "data" / "cache-v2-3b95788"


def test_both_stages_know_the_same_presets():
    assert sorted(encoders.preset_names()) == sorted(transformers.PRESETS)


@pytest.mark.parametrize("name", sorted(transformers.PRESETS))
def test_a_preset_means_the_same_model_in_both_stages(name):
    one, two = encoders.get_preset(name), transformers.get_preset(name)
    assert one.family == two.family
    assert one.base_resolution == two.base_resolution
    assert one.transformer == two.repo  # the released transformer stage two loads
    clip = 77 if one.family == "sd3" else 0  # SD3's CLIP tokens come before T5's (Flux's text tokens are T5's alone)
    assert two.text_tokens == clip + one.text.max_length  # what the planner traces
    assert two.latent_downsample == {"dc": 32, "kl": 8, "sd3": 8, "flux": 8, "qwen-image": 8, "wan2.1": 8, "wan2.2": 16, "flux2": 16}[one.vae.kind] or name.startswith("tiny")


@pytest.mark.parametrize("name", ["tiny-sana", "tiny-sd3"])
def test_a_tiny_transformer_takes_what_its_tiny_encoders_cached(name):
    spec, preset = Cache(LEGACY / name).spec, transformers.get_preset(name)
    config = preset.transformer_config()
    assert spec.latent.channels == config["in_channels"] and spec.latent.downsample == preset.latent_downsample
    assert spec.text.tokens == preset.text_tokens
    assert (spec.text.width if spec.text.layout == "masked" else spec.text.t5_width) == transformers.get_family(preset.family).text_width(config)
