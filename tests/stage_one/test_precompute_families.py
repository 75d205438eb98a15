"""The families' registry: each family names its presets and text encoders as its own, names are unique across
families, and a family added to the registry is built, encoded with and refused through generic code alone."""

from dataclasses import replace

import pytest
import torch

import precompute.families
from precompute.config import PrecomputeConfig
from precompute.encode import Encoders
from precompute.families import FAMILIES, family
from precompute.families.base import Preset
from precompute.families.pixart import PixArt
from precompute.presets import get_preset, get_text_encoder, preset_names, text_encoder_names

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


def test_every_family_names_its_own_presets_and_text_encoders():
    for f in FAMILIES:
        assert f is family(f.name)
        for name, preset in f.presets().items():
            assert (preset.name, preset.family) == (name, f.name)
            assert family(preset.text.family).text_encoders()[preset.text.name].kind == preset.text.kind
        for name, spec in f.text_encoders().items():
            assert (spec.name, spec.family) == (name, f.name)
    assert len(preset_names()) == len(set(preset_names())) == sum(len(f.presets()) for f in FAMILIES)
    assert len(text_encoder_names()) == len(set(text_encoder_names()))


def test_unknown_names_are_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of .*tiny-pixart"):
        get_preset("huge")
    with pytest.raises(ValueError, match="unknown text encoder 'huge'; choose one of .*tiny-t5"):
        get_text_encoder("huge")
    with pytest.raises(ValueError, match="unknown model family 'huge'; stage one knows pixart"):
        family("huge")


class Other(PixArt):
    """A family that is PixArt's encoders under another name, with a preset of its own."""

    name = "other"
    own_text_encoder = "its T5 (tiny-other-t5)"

    def presets(self) -> dict[str, Preset]:
        tiny = PixArt().presets()["tiny-pixart"]
        return {"tiny-other": replace(tiny, name="tiny-other", family=self.name, text=self.text_encoders()["tiny-other-t5"])}

    def text_encoders(self):
        return {"tiny-other-t5": replace(PixArt().text_encoders()["tiny-t5"], name="tiny-other-t5", family=self.name)}


def test_a_family_added_to_the_registry_needs_no_other_change(monkeypatch):
    monkeypatch.setattr(precompute.families, "FAMILIES", (*FAMILIES, Other()))
    assert "tiny-other" in preset_names() and "tiny-other-t5" in text_encoder_names()
    preset = PrecomputeConfig("data", "tiny-other").preset()
    enc = Encoders(preset, torch.device("cpu"))
    reference = Encoders(get_preset("tiny-pixart"), torch.device("cpu"))
    pixels = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    assert torch.equal(enc.encode_images(pixels)["latent_mean"], reference.encode_images(pixels)["latent_mean"])
    assert torch.equal(enc.encode_text(["a red circle"]).fields[0]["text"], reference.encode_text(["a red circle"]).fields[0]["text"])
    assert enc.text_fingerprint()["name"] == "tiny-other-t5"
    with pytest.raises(ValueError, match="--text-encoder tiny-t5: the other family needs its T5"):
        PrecomputeConfig("data", "tiny-other", text_encoder="tiny-t5")
    with pytest.raises(ValueError, match="--text-encoder tiny-other-t5: the pixart family needs a single text encoder"):
        PrecomputeConfig("data", "tiny-pixart", text_encoder="tiny-other-t5")
