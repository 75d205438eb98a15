"""Every numeric option of both stages is checked against what it means, where it is declared: a value outside its
range (or NaN, or infinite) is refused before anything runs, naming the option as typed, and --help shows the range."""

import dataclasses
import re
import typing

import pytest
import typer
from typer.testing import CliRunner

import precompute.run
import train.loop
from precompute.__main__ import app as precompute_app
from precompute.config import PrecomputeConfig
from shards.options import flag
from train.__main__ import app as train_app
from train.config import TrainConfig

NAN, INF = float("nan"), float("inf")
WIDE = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}

# option: (values it refuses, values it takes), from what the option means
TRAIN = {
    "cache_weight": ([[1.0, 0.0], [1.0, -2.0], [1.0, NAN]], [[3.0, 1.0]]),
    "steps": ([0, -1], [1]),
    "batch_size": ([0], [1]),
    "grad_accum": ([0], [1]),
    "lr": ([0.0, -1e-4, NAN, INF], [1e-6, 1.0]),
    "warmup_steps": ([-1], [0, 10]),
    "lr_cycles": ([0], [1]),
    "lr_power": ([0.0, -1.0, INF], [0.5, 2.0]),
    "lr_end": ([-1e-7, NAN], [0.0]),
    "weight_decay": ([-0.01, INF], [0.0, 0.1]),
    "grad_clip": ([-1.0, NAN], [0.0, 1.0]),
    "seed": ([-1, 2**64], [0, 2**64 - 1]),
    "caption_dropout": ([1.5, -0.1, NAN], [0.0, 1.0]),
    "logit_mean": ([NAN, INF, -INF], [-1.0, 0.0]),
    "logit_std": ([0.0, -1.0], [0.5]),
    "mode_scale": ([-1.5, 2.0, NAN], [-1.0, 0.0, 1.29, 1.75]),  # the density is monotonic for [-1, 2 / (pi - 2)]
    "flow_shift": ([-3.0, 0.0, INF], [0.5, 3.0]),
    "ema_decay": ([1.0, 1.5, -0.1, NAN], [0.0, 0.999]),
    "ema_every": ([0], [1]),
    "workers": ([-1], [0]),
    "prefetch": ([0], [1]),
    "readahead": ([-1], [0]),
    "shuffle_shards": ([0], [1]),
    "local_cache_gb": ([0.0, -1.0, INF], [0.5]),
    "checkpoint_every": ([-1], [0, 1]),  # 0: only at the end (documented)
    "keep_checkpoints": ([-1], [0, 1]),
    "log_every": ([0, -1], [1]),
    "max_bad_steps": ([0], [1]),
    "validate_every": ([-1], [0]),  # 0: only at the end (documented)
    "validation_steps": ([0], [1]),
    "validation_frames": ([0], [1]),
    "guidance_scale": ([-1.0, NAN], [0.0, 4.5]),
    "train_guidance": ([-1.0, INF], [0.0, 1.0]),
    "eval_fraction": ([1.0, -0.1, NAN], [0.0, 0.05]),
    "eval_every": ([-1], [0, 10]),  # 0: only at the end (documented)
    "eval_batches": ([-1], [0, 4]),  # 0: all (documented)
    "eval_timesteps": ([0], [1, 8]),
    "prior_loss_weight": ([0.0, -1.0, INF, NAN], [0.5, 2.0]),
    "validation_seed": ([-1, 2**64], [0]),
    "validation_items": ([-1], [0]),  # 0: no grids (documented)
    "lora_rank": ([-1], [0, 4]),
    "lora_alpha": ([0.0, -8.0, NAN], [8.0]),
    "lora_dropout": ([1.5, 1.0, -0.1, NAN], [0.0, 0.5]),
    "lokr_factor": ([-2], [-1, 4]),  # -1: near square (LyCORIS' default); 0 is refused by its check
    "controlnet_layers": ([0, -1], [1]),
    "blocks_to_swap": ([-1], [0]),
    "controlnet_conditioning_scale": ([-1.0, NAN], [0.0, 1.0]),
    "i2v_probability": ([1.5, -0.1, NAN], [0.0, 0.5, 1.0]),  # a share of the clips
    "guidance_scale_2": ([-1.0, NAN], [0.0, 3.0]),
}
# what an accepted value needs beside it
TRAIN_CONTEXT = {"cache_weight": dict(cache=["a", "b"]), "controlnet_layers": dict(model="tiny-sd3", controlnet=True),
                 "lora_alpha": dict(lora_rank=4), "lora_dropout": dict(lora_rank=4),
                 "lokr_factor": dict(lora_rank=4, adapter="lokr"), "i2v_probability": dict(model="wan2.2-ti2v-5b"),
                 "guidance_scale_2": dict(model="wan2.2-t2v-a14b", expert="both")}
PRECOMPUTE = {
    "max_length": ([0, -1], [1, 77]),
    "batch_size": ([0], [1]),
    "text_batch_size": ([0], [1]),
    "workers": ([-1], [0]),
    "max_upscale": ([0.5, 0.0, -1.0, NAN, INF], [1.0, 2.5]),  # 1: never upscale; below 1 would skip downscaled images
    "max_pixels": ([0], [1]),
    "max_removal_fraction": ([1.5, -0.1, NAN], [0.0, 1.0]),
    "max_failure_fraction": ([1.01, -0.5, INF], [0.0, 1.0]),
    "max_shard_mb": ([-1], [0, 1]),  # 0: a shard per sample
    "caption_variants": ([0, -1, 65], [2, 64]),  # 1 (the default): the caption as written
    "keep_tokens": ([-1], [0, 3]),
    "tag_dropout": ([-0.1, 1.0, NAN], [0.5, 0.99]),  # 1 would drop every tag that is not kept
    "log_seconds": ([-1.0, NAN, INF], [0.0, 60.0]),  # 0: a line per input
    "frames": ([0, -1], [17, 81]),  # a video model's longest clip (4k+1 frames, checked against the family)
    "clips": ([0, -1], [1, 3]),
    "clip_stride": ([0, -1], [1, 8]),  # frames between a sliding clip's starts
    "decode_timeout": ([0.0, -1.0, NAN, INF], [0.5, 60.0]),
}
# what an accepted value needs beside it
PRECOMPUTE_CONTEXT = {"caption_variants": dict(shuffle_tags=True), "keep_tokens": dict(shuffle_tags=True, caption_variants=2),
                      "tag_dropout": dict(caption_variants=2), "frames": dict(model="tiny-wan"),
                      "clips": dict(model="tiny-wan", clip_extraction="uniform"),
                      "clip_stride": dict(model="tiny-wan", clip_extraction="slide")}


def numeric_fields(cls) -> set[str]:
    def numeric(annotation) -> bool:
        args = typing.get_args(annotation)
        return annotation in (int, float) or any(numeric(a) for a in args if a is not type(None))

    hints = typing.get_type_hints(cls)
    return {f.name for f in dataclasses.fields(cls) if numeric(hints[f.name])}


def one_value(value):
    return value[-1] if isinstance(value, list) else value


def cases(table):
    return [(name, v) for name, (bad, _) in table.items() for v in bad]


def accepted(table):
    return [(name, v) for name, (_, good) in table.items() for v in good]


def test_every_numeric_option_has_a_meaning_here():
    """A new numeric option gets its range here too, so this file keeps covering all of them."""
    assert numeric_fields(TrainConfig) == set(TRAIN)
    assert numeric_fields(PrecomputeConfig) == set(PRECOMPUTE)


@pytest.mark.parametrize("name, value", cases(TRAIN))
def test_a_training_option_outside_its_range_is_refused_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"^{re.escape(flag(name))} .*: must be "):
        TrainConfig(**{**TRAIN_CONTEXT.get(name, {}), name: value})


@pytest.mark.parametrize("name, value", accepted(TRAIN))
def test_a_training_option_within_its_range_is_taken(name, value):
    assert getattr(TrainConfig(**{**TRAIN_CONTEXT.get(name, {}), name: value}), name) == value


@pytest.mark.parametrize("name, value", cases(PRECOMPUTE))
def test_a_precompute_option_outside_its_range_is_refused_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"^{re.escape(flag(name))} .*: must be "):
        PrecomputeConfig("data", **{name: value})


@pytest.mark.parametrize("name, value", accepted(PRECOMPUTE))
def test_a_precompute_option_within_its_range_is_taken(name, value):
    assert getattr(PrecomputeConfig("data", **{**PRECOMPUTE_CONTEXT.get(name, {}), name: value}), name) == value


@pytest.fixture
def trained(monkeypatch):
    """The configs `python -m train` builds; nothing trains."""
    configs = []
    monkeypatch.setattr(train.loop, "train", configs.append)
    return configs


@pytest.mark.parametrize("args, message", [
    (["--caption-dropout", "1.5"], "--caption-dropout 1.5: must be in [0, 1]"),
    (["--flow-shift", "-3"], "--flow-shift -3.0: must be above 0"),
    (["--log-every", "0"], "--log-every 0: must be at least 1"),
    (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout 1.5: must be in [0, 1)"),
    (["--lr", "nan"], "--lr nan: must be a finite number above 0"),
    (["--lr", "inf"], "--lr inf: must be a finite number above 0"),
    (["--ema-decay", "1"], "--ema-decay 1.0: must be in [0, 1)"),
    (["--seed", "-1"], "--seed -1: must be in [0, "),
])
def test_the_training_command_refuses_an_out_of_range_value_before_training(args, message, trained):
    result = CliRunner().invoke(train_app, args, env=WIDE)
    assert result.exit_code == 2 and f"error: {message}" in result.output and not trained, result.output
    assert "--lora-targets" not in result.output  # a bad dropout is the dropout's fault, not the targets'


def test_the_precompute_command_refuses_an_out_of_range_value_before_encoding(monkeypatch):
    runs = []
    monkeypatch.setattr(precompute.run, "run", runs.append)
    for args, message in ((["--max-upscale", "0.5"], "--max-upscale 0.5: must be at least 1"),
                          (["--max-failure-fraction", "nan"], "--max-failure-fraction nan: must be a finite number in [0, 1]"),
                          (["--text-batch-size", "0"], "--text-batch-size 0: must be at least 1")):
        result = CliRunner().invoke(precompute_app, ["data", *args], env=WIDE)
        assert result.exit_code == 2 and f"error: {message}" in result.output and not runs, result.output


@pytest.mark.parametrize("app, table, name, shown", [(train_app, TRAIN, "log_every", "Must be at least 1."),
                                                     (train_app, TRAIN, "lora_dropout", "Must be in [0, 1)."),
                                                     (precompute_app, PRECOMPUTE, "max_upscale", "Must be at least 1.")])
def test_help_shows_every_range(app, table, name, shown):
    params = {p.name: p for p in typer.main.get_command(app).params}
    bounded = [option for option, (bad, _) in table.items() if any(v == v and abs(v) != INF for v in map(one_value, bad))]
    for option in bounded:
        assert re.search(r" Must be (in [\[(]|at least |above |at most |below )", params[option].help), params[option].help
    assert params[name].help.endswith(shown)
    out = CliRunner().invoke(app, ["--help"], env=WIDE).output
    assert re.search(r"\s+".join(map(re.escape, shown.split())), out), out


def test_cross_field_checks_still_hold():
    with pytest.raises(ValueError, match="--lr-end 0.0001 must be below --lr 0.0001"):
        TrainConfig(lr_schedule="polynomial", lr=1e-4, lr_end=1e-4)
    with pytest.raises(ValueError, match="--controlnet-layers 3: the depth"):
        TrainConfig(model="tiny-sd3", controlnet_layers=3)
    with pytest.raises(ValueError, match="2 weights for 1 caches"):
        TrainConfig(cache=["a"], cache_weight=[1.0, 2.0])
    with pytest.raises(ValueError, match="--blocks-to-swap applies to a frozen transformer"):
        TrainConfig(blocks_to_swap=1)


def test_a_command_that_takes_an_option_without_its_config_checks_the_same_range():
    import shards.options

    range_check = getattr(shards.options, "range_check", None)
    assert range_check is not None, "shards.options offers no range check for such commands"
    tool = typer.Typer()

    @tool.command()
    def plan(ema_decay: float = typer.Option(0.0, callback=range_check(TrainConfig, "ema_decay")),
             validation_steps: int | None = typer.Option(None, callback=range_check(TrainConfig, "validation_steps"))):
        print("planned")

    assert CliRunner().invoke(tool, ["--validation-steps", "3"]).output == "planned\n"
    for args, message in ((["--ema-decay", "1.5"], "1.5: must be in [0, 1)"), (["--ema-decay", "nan"], "nan: must be a finite"),
                          (["--validation-steps", "0"], "0: must be at least 1")):
        result = CliRunner().invoke(tool, args, env=WIDE)
        assert result.exit_code == 2 and message in result.output and "planned" not in result.output, result.output


def test_an_adapter_error_is_blamed_on_the_targets_only_when_none_matched():
    import torch

    from train.lora import add_lora, lora_config

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="--lora-targets to_q: .*not found"):
        add_lora(model, lora_config("sana", 2, targets=["to_q"]))
    with pytest.raises(ValueError) as e:  # an error of its own (here peft's dropout check) keeps its words
        add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), lora_config("sana", 2, targets=["0"], dropout=1.5))
    assert "--lora-targets" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["plan", "tiny-sana", "--ema-decay", "1.5"], "must be in [0, 1)"),
    (["plan", "tiny-sana", "--batch-size", "0"], "must be at least 1"),
    (["plan", "tiny-sana", "--world-size", "0"], "--world-size 0: must be at least 1"),
    (["sample", "run", "--prompt-cache", "cache", "--guidance-scale", "nan"], "finite"),
])
def test_plan_and_sample_refuse_what_the_trainer_refuses(args, message, monkeypatch):
    import train.plan
    from train.__main__ import tools

    monkeypatch.setattr(train.plan, "plan", lambda *a, **k: pytest.fail("planned with a value out of range"))
    result = CliRunner().invoke(tools, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output, result.output
