"""One name for a step's sample folder: `train sample RUN` writes into RUN/samples/NNNNNNNN, the folder a run's
validation videos of that step go to, in a folder of its own there (`sample`, `sample-ema` with --ema), so that neither
overwrites the other."""

from pathlib import Path

import pytest
from conftest import stage_one_cache
from typer.testing import CliRunner
from video_testing import clip_cache

from train.__main__ import tools
from train.config import TrainConfig
from train.export import sample
from train.loop import train
from train.video import SHEET

pytestmark = pytest.mark.model  # builds tiny diffusers models


def test_a_sample_of_a_clip_run_goes_into_the_steps_validation_folder_without_touching_it(tmp_path):
    run = tmp_path / "run"
    cache = clip_cache(tmp_path / "cache", family="wan", preset="tiny-wan", decoder=True)
    train(TrainConfig(model="tiny-wan", cache=cache, run=run, steps=1, batch_size=2, workers=0, progress=False,
                      precision="fp32", validate=True, validate_every=1, validation_steps=1, validation_frames=5,
                      validation_bucket=["48x80"]))
    folder = run / "samples" / "00000001"  # the run's validation of step 1
    validated = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert SHEET in validated and any(name.endswith(".mp4") for name in validated)

    written = sample(run, None, None, buckets=["48x80"], frames=5, steps=1)
    assert written and all(p.parent == folder / "sample" for p in written) and written[-1].name == SHEET
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == validated  # untouched
    assert sorted(p.name for p in run.glob("samples/*")) == ["00000001"]  # one folder for the step


def test_a_sample_of_an_image_run_is_named_as_validation_names_the_step_and_the_ema_weights_have_their_own(tmp_path):
    cache = stage_one_cache(tmp_path / "data", "tiny-sana", count=4)
    train(TrainConfig(model="tiny-sana", cache=cache, run=tmp_path / "run", steps=2, batch_size=2, workers=0, progress=False,
                      validate=False, ema_decay=0.5))
    args = ["sample", str(tmp_path / "run"), "--validation-steps", "1", "--validation-bucket", "256x256"]
    plain, ema = CliRunner().invoke(tools, args), CliRunner().invoke(tools, [*args, "--ema"])
    assert plain.exit_code == 0 and ema.exit_code == 0, plain.output + ema.output
    step = tmp_path / "run" / "samples" / "00000002"
    assert {Path(line).parent for line in plain.stdout.splitlines()} == {step / "sample"}
    assert {Path(line).parent for line in ema.stdout.splitlines()} == {step / "sample-ema"}
    assert len(list((step / "sample").glob("*.png"))) == len(list((step / "sample-ema").glob("*.png"))) == 2


def test_the_help_says_where_a_sample_goes():
    help_text = " ".join(CliRunner().invoke(tools, ["sample", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "RUN/samples/STEP/sample, with --ema RUN/samples/STEP/sample-ema" in help_text
    assert "in a folder of its own that no validation writes to" in help_text
