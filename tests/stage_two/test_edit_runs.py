"""Edit runs end to end with a real edit family (tiny-flux1-kontext) on stage one's edit cache: exact resume, two
processes against one, the held-out loss and validation with references in the batch, and the planner's longer
sequence against the dry run's measurement."""

import json

import pytest
from edit_testing import stage_one_edit_cache

from train.config import TrainConfig
from train.plan import plan
from train.plan_config import PlanConfig

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

MODEL = "tiny-flux1-kontext"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return stage_one_edit_cache(tmp_path_factory.mktemp("kontext"), MODEL)


def cfg(cache, run, **kw) -> TrainConfig:
    base = dict(model=MODEL, cache=cache, run=run, steps=6, batch_size=2, progress=False, log_every=1, checkpoint_every=1000,
                caption_dropout=0.0, lr=1e-3, validate=False, precision="fp32")
    return TrainConfig(**{**base, **kw})


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run) -> list[float]:
    return [row["loss"] for row in metrics(run) if "loss" in row]


@pytest.mark.slow
def test_an_edit_run_resumes_exactly_and_two_processes_train_what_one_does(cache, tmp_path):
    from conftest import train_processes

    from train.loop import train

    train(cfg(cache, tmp_path / "straight", caption_dropout=0.2))
    train(cfg(cache, tmp_path / "resumed", steps=3, caption_dropout=0.2))
    train(cfg(cache, tmp_path / "resumed", caption_dropout=0.2))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    common = ["--model", MODEL, "--cache", str(cache), "--steps", "4", "--precision", "fp32", "--log-every", "1", "--no-validate",
              "--no-progress", "--lr", "1e-3", "--caption-dropout", "0"]
    train_processes(1, tmp_path / "one", *common, "--batch-size", "2")
    train_processes(2, tmp_path / "two", *common, "--batch-size", "1", "--parallel", "ddp")
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)


@pytest.mark.slow  # the background decoder starts in a process of its own
def test_an_edit_run_validates_on_its_items_and_holds_out_edits(cache, tmp_path):
    from train.loop import train

    summary = train(cfg(cache, tmp_path / "run", steps=2, validate=True, validation_items=2, validation_steps=2,
                        eval_fraction=0.34, eval_timesteps=2))
    assert summary["grids"] == [str(tmp_path / "run" / "samples-step00000002.png")]
    held = [row for row in metrics(tmp_path / "run") if "eval_loss" in row]
    assert held and all(row["eval_loss"] == row["eval_loss"] > 0 for row in held)


def test_the_dry_run_of_an_edit_run_measures_what_the_plan_predicts(cache, tmp_path):
    from train.loop import train

    result = train(cfg(cache, tmp_path / "run", batch_size=2, dry_run=True, validate=True, validation_items=1,
                       validation_steps=2))
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result


@pytest.mark.slow
def test_the_dry_run_of_a_flux2_edit_run_measures_what_the_plan_predicts(tmp_path):
    from train.loop import train

    model = "tiny-flux2"  # its references at their time offsets, after the target's tokens
    cache = stage_one_edit_cache(tmp_path / "cache", model, count=4)
    result = train(cfg(cache, tmp_path / "run", model=model, batch_size=2, dry_run=True, validate=True, validation_items=1,
                       validation_steps=2))
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15, result


def test_an_edit_row_holds_more_than_the_same_bucket_without_references():
    setup = dict(batch_size=2, bucket=(256, 256), text_tokens=32, precision="fp32")
    edit, plain = plan(PlanConfig(MODEL, **setup)), plan(PlanConfig("tiny-flux", **setup))  # one architecture
    assert edit["parameters"] == plain["parameters"] and edit["references"]["count"] == 1
    assert edit["bytes"]["activations"] > plain["bytes"]["activations"]
    assert edit["predicted_peak"] > plain["predicted_peak"] and edit["largest_batch"] <= plain["largest_batch"]
    # the sequence is the target's and the reference's tokens: activations per sample grow about as the tokens do
    grown = edit["activation_bytes_per_sample"] / plain["activation_bytes_per_sample"]
    tokens = (edit["tokens_per_sample"] + edit["references"]["tokens"]) / edit["tokens_per_sample"]
    assert 0.6 * tokens < grown < 1.4 * tokens, (grown, tokens)
