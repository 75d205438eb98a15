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
from shards import Cache
from shards.references import REFERENCE_LATENT

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


def test_a_run_counts_and_names_each_bad_reference_and_goes_on(tmp_path):
    from control_testing import failures

    from precompute.run import main as precompute

    data = make_edit_folder(tmp_path / "data", 5)
    (data / "00001.ref.png").unlink()  # missing
    (data / "00002.ref.png").write_bytes(b"not a png")  # corrupt
    (data / "00003.ref.png").rename(data / "00003.ref0.png")
    (data / "00003.ref1.png").write_bytes(png())  # two: Kontext takes one
    summary = precompute(str(data), "tiny-flux1-kontext", tmp_path / "cache", references=True, workers=0, progress=False,
                         max_shard_mb=0)
    assert summary["new"] == 2 and summary["failed"] == 3
    assert failures(tmp_path / "cache") == {"00001.png": "missing_reference", "00002.png": "corrupt_reference",
                                            "00003.png": "too_many_references"}
    # through a worker process (the references' tensors cross its pipe as arrays) the cache holds the same
    precompute(str(data), "tiny-flux1-kontext", tmp_path / "forked", references=True, workers=1, progress=False,
               max_shard_mb=0)
    one, two = Cache(tmp_path / "cache"), Cache(tmp_path / "forked")
    assert len(one) == len(two) == 2
    for i in range(2):
        assert one[i].key == two[i].key and torch.equal(one[i][REFERENCE_LATENT], two[i][REFERENCE_LATENT])
