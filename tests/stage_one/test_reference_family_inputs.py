"""An edit preset's references are prepared in the loader by its family (`Family.prepare_reference`, bound to the preset
in the run's image policy), and a reference the family's pipeline cannot take is a named failure, not an error."""

from dataclasses import replace

import pytest
import torch
from PIL import Image
from test_reference_inputs import items, png

import precompute.config
from precompute.config import PrecomputeConfig
from precompute.sample_data import make_edit_folder

pytestmark = pytest.mark.model  # imports the family's diffusers pipeline (its image processor): seconds


def test_an_edit_preset_prepares_references_with_its_family_in_the_policy(tmp_path):
    make_edit_folder(tmp_path, 2)
    (tmp_path / "tiny.png").write_bytes(png())
    (tmp_path / "tiny.txt").write_text("make it red")
    (tmp_path / "tiny.ref.png").write_bytes(png((8, 8)))  # smaller than the model's token: its pipeline cannot take it
    config = PrecomputeConfig(str(tmp_path), model="tiny-flux1-kontext", references=True, allow_upscale=True)
    preset = config.preset()
    got = items(tmp_path, replace(config.policy(), references=config.sources()[0].takes_references))
    assert got["tiny.png"]["reason"] == "unusable_reference" and "8x8" in got["tiny.png"]["detail"]
    for name in ("00000.png", "00001.png"):
        (ref,) = got[name]["reference_pixels"]
        image = Image.open(tmp_path / name.replace(".png", ".ref.png")).convert("RGB")
        assert torch.equal(ref["pixels"], precompute.config.family(preset.family).prepare_reference(preset, image, 0, 1)["pixels"])
        assert ref["pixels"].dtype == torch.float32 and -1 <= ref["pixels"].min() and ref["pixels"].max() <= 1
    assert "tiny-flux1-kontext" in precompute.config.EDIT_PRESETS
