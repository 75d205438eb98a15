"""Stage two's model families: one registry answers for presets, a cache's family and its text layout, and every
family gives what generic code asks of it."""

import pytest
import torch

from train import families
from train.families.base import Family

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_every_family_answers_what_generic_code_asks(family: Family):
    presets = family.presets()
    assert presets and all(families.get_preset(name).family == family.name for name in presets)
    assert families.get_family(family.name) is family
    assert families.text_input(family.text.layout).layout == family.text.layout
    assert family.controlnet is not None or family.no_controlnet  # a family without one says why --controlnet is refused
    assert family.lora_targets and family.lora_formats[0] == "diffusers"
    tiny = families.get_preset(next(name for name in presets if name.startswith("tiny-")))
    config = tiny.transformer_config()
    with torch.device("meta"):
        model = tiny.transformer_class.from_config(config)
    assert families.family_of_module(model) is family
    assert family.blocks(model) and all(isinstance(b, torch.nn.Module) for b in family.blocks(model))
    bucket = (tiny.base_resolution, tiny.base_resolution)
    batch = family.example_batch(config, tiny, bucket, 2, 8, torch.float32)
    assert batch["latents"].shape[:2] == (2, family.latent_channels(config)) and batch["latents"].is_meta
    assert family.image_tokens(config, tiny, bucket) > 0


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'no-such'; choose one of"):
        families.get_preset("no-such")
    with pytest.raises(ValueError, match="unknown model family 'no-such'; stage two trains"):
        families.get_family("no-such")
    with pytest.raises(ValueError, match="text layout 'no-such' is not one stage two reads.*rebuild it"):
        families.text_input("no-such")
    with pytest.raises(ValueError, match="Linear is no transformer or ControlNet"):
        families.family_of_module(torch.nn.Linear(2, 2))


def test_released_presets_come_before_the_tiny_ones():
    names = list(families.PRESETS)
    assert names == sorted(names, key=lambda name: name.startswith("tiny-"))
