"""The memory plan of an edit preset: each sample's sequence holds its references' tokens beside the target's
(--references, --reference-size; by default one reference at the bucket's aspect ratio and the preset's reference
area), and the dry run's measured step agrees with it."""

import json
import math

import pytest
from edit_testing import EDIT_PRESET, edit_preset, write_edit_cache
from typer.testing import CliRunner

from train.config import TrainConfig
from train.families import get_family, get_preset
from train.plan import format_plan, plan
from train.plan_config import PlanConfig

pytestmark = pytest.mark.model  # builds tiny diffusers models (left out of make test-fast)


def planned(**kw) -> dict:
    return plan(PlanConfig(EDIT_PRESET, batch_size=2, bucket=(128, 128), text_tokens=20, precision="fp32", **kw))


def test_an_edit_row_holds_more_than_the_same_bucket_without_references(monkeypatch):
    edit_preset(monkeypatch)
    none, one, two = planned(references=0), planned(), planned(references=2)
    assert one["references"] == {"count": 1, "size": "64x64", "tokens": 64}  # the preset's reference area, 64 x 64
    assert two["references"]["tokens"] == 2 * 64 and none["references"]["tokens"] == 0
    assert none["bytes"]["activations"] < one["bytes"]["activations"] < two["bytes"]["activations"]
    assert none["predicted_peak"] < one["predicted_peak"] < two["predicted_peak"]
    assert one["activation_bytes_per_sample"] > none["activation_bytes_per_sample"]
    larger = planned(reference_size="128x192")
    assert larger["references"] == {"count": 1, "size": "128x192", "tokens": 384}
    assert larger["bytes"]["activations"] > one["bytes"]["activations"]
    assert "with 1 reference image(s) of 64x64 (64 more tokens a sample" in format_plan(one)
    assert "without reference images" in format_plan(none)


def test_the_default_reference_keeps_the_buckets_aspect_at_the_presets_area():
    preset = get_preset("tiny-sana")
    family = get_family(preset.family)
    config = preset.transformer_config()
    step = preset.latent_downsample * family.latent_patch(config)
    for bucket in [(1024, 1024), (768, 1344), (1536, 640), (64, 64)]:
        h, w = family.reference_size(config, preset, bucket)
        assert h % step == 0 and w % step == 0
        assert abs(h * w / preset.reference_pixels - 1) < 0.03
        assert abs(math.log((w / h) / (bucket[1] / bucket[0]))) < 0.03


def test_reference_options_are_refused_where_they_mean_nothing(monkeypatch):
    edit_preset(monkeypatch, references=2)
    with pytest.raises(ValueError, match="--references: tiny-sana takes no reference images"):
        PlanConfig("tiny-sana", references=1)
    with pytest.raises(ValueError, match="--references 3: tiny-sana-edit takes at most 2"):
        PlanConfig(EDIT_PRESET, references=3)
    with pytest.raises(ValueError, match="--reference-size '64': give a reference image's size in pixels as HxW"):
        PlanConfig(EDIT_PRESET, reference_size="64")


def test_the_plan_command_takes_and_states_the_references(monkeypatch):
    from train.__main__ import tools

    edit_preset(monkeypatch)
    out = CliRunner().invoke(tools, ["plan", EDIT_PRESET, "--bucket", "128x128", "--references", "2", "--reference-size",
                                     "64x96", "--text-tokens", "20", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert result["references"] == {"count": 2, "size": "64x96", "tokens": 2 * 96}
    refused = CliRunner().invoke(tools, ["plan", "tiny-sana", "--references", "1"])
    assert refused.exit_code == 2 and "takes no reference images" in refused.output


def test_the_plan_of_an_edit_cache_takes_its_references(tmp_path, monkeypatch):
    from train.__main__ import tools

    edit_preset(monkeypatch)
    cache = write_edit_cache(tmp_path / "edit", [2, 1, 1, 1], buckets=((64, 64),))  # the first sample: 4x4 and 3x5 latents
    out = CliRunner().invoke(tools, ["plan", EDIT_PRESET, "--cache", str(cache), "--text-tokens", "20", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["references"] == {"count": 2, "size": "32x32", "tokens": 2 * 16}  # each at the larger's size
    given = CliRunner().invoke(tools, ["plan", EDIT_PRESET, "--cache", str(cache), "--references", "1", "--json"])
    assert json.loads(given.stdout)["references"] == {"count": 1, "size": "64x64", "tokens": 64}  # as given, default size


def test_the_dry_run_of_an_edit_run_measures_what_the_plan_predicts(tmp_path, monkeypatch, capsys):
    from train.loop import train

    edit_preset(monkeypatch)
    cache = write_edit_cache(tmp_path / "edit", [1, 2, 1, 1, 2, 1], buckets=((256, 256),), shapes=((24, 24), (16, 32)),
                             decoder=True)
    result = train(TrainConfig(model=EDIT_PRESET, cache=cache, run=tmp_path / "run", batch_size=4, precision="fp32",
                               progress=False, dry_run=True, validation_steps=2, validation_items=1))
    assert result["bucket"] == "256x256"
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result
    assert "with 1 reference image(s) of 192x192" in capsys.readouterr().out  # the cache's first sample's, as measured
