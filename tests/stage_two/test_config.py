"""The options of a run, one dataclass per concern: `--config` files in TOML or JSON, each rule declared once and
fired alike from the trainer's config and the planner's, and the planner's command built from the same fields."""

import dataclasses
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import train.loop
import train.plan
from train.__main__ import app as train_app
from train.config import (
    DataOptions,
    EvalOptions,
    MemoryOptions,
    ModelOptions,
    ObjectiveOptions,
    OptimizerOptions,
    ParallelOptions,
    RunOptions,
    TrainConfig,
    ValidationOptions,
)
from train.families import FAMILIES
from train.plan_command import plan_command
from train.plan_config import PlanConfig

ROOT = Path(__file__).resolve().parents[2]
CONCERNS = (ModelOptions, MemoryOptions, ParallelOptions, DataOptions, OptimizerOptions, ObjectiveOptions, ValidationOptions,
            EvalOptions, RunOptions)
WIDE = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}


@pytest.fixture
def trained(monkeypatch):
    """The configs `python -m train` builds; nothing trains."""
    configs = []
    monkeypatch.setattr(train.loop, "train", configs.append)
    return configs


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_each_option_is_declared_by_one_concern():
    declared = [name for concern in CONCERNS for name in names(concern)]
    assert len(declared) == len(set(declared)) and sorted(declared) == sorted(names(TrainConfig))
    assert names(TrainConfig)[0] == "model"  # --help lists the model first


def test_the_planner_takes_the_trainers_fields_themselves():
    train_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for f in dataclasses.fields(PlanConfig):
        if f.name in train_fields and f.name not in ("optimizer", "ema_decay"):  # the planner's own help for those
            assert f.metadata == train_fields[f.name].metadata and f.default == train_fields[f.name].default, f.name
    assert {*names(ModelOptions), *names(MemoryOptions), *names(ParallelOptions)} <= set(names(PlanConfig))
    assert PlanConfig("tiny-sd3").blocks_to_swap == TrainConfig(model="tiny-sd3").blocks_to_swap


RULES = [  # options both configs take, and what each refuses them with
    (dict(lora_rank=4, base_quant="nf4", blocks_to_swap=1), "--blocks-to-swap with --base-quant nf4"),
    (dict(blocks_to_swap=1), "--blocks-to-swap applies to a frozen transformer"),
    (dict(base_quant="int8"), "--base-quant applies to a frozen transformer"),
    (dict(lora_rank=4, base_quant="int8", precision="fp32"), "--base-quant int8 computes in bf16"),
    (dict(weights_dtype="bf16", precision="fp32"), "--weights-dtype bf16 trains in bf16"),
    (dict(model="tiny-sd3", controlnet=True, lora_rank=4), "Train them in separate runs, not both"),
    (dict(model="tiny-pixart", controlnet=True), "no ControlNet"),
    (dict(controlnet_layers=3), "--controlnet-layers 3: the depth of a new ControlNet"),
    (dict(lora_rank=4, parallel="fsdp"), "LoRA trains with the frozen base replicated"),
    (dict(grad_checkpointing="sometimes"), "--grad-checkpointing 'sometimes'"),
    (dict(lora_rank=-1), "--lora-rank -1: must be at least 0"),
    (dict(model="no-such-model"), "--model 'no-such-model': choose one of"),
]


@pytest.mark.parametrize("options, message", RULES)
def test_a_rule_fires_alike_from_the_trainer_and_the_planner(options, message):
    for config in (TrainConfig, PlanConfig):
        with pytest.raises(ValueError, match=re.escape(message)):
            config(**options)


def test_each_concern_checks_once_per_config(monkeypatch):
    calls = []
    for concern in (ModelOptions, MemoryOptions, ParallelOptions):
        monkeypatch.setattr(concern, "check", lambda self, concern=concern: calls.append(concern.__name__))
    TrainConfig(model="tiny-sd3", lora_rank=4)
    PlanConfig("tiny-sd3", lora_rank=4)
    assert sorted(calls) == sorted(["ModelOptions", "MemoryOptions", "ParallelOptions"] * 2)


def test_the_plan_of_a_run_is_its_options():
    cfg = TrainConfig(model="tiny-sd3", lora_rank=8, lora_targets=["to_q"], weights_dtype="bf16", base_quant="int8",
                      blocks_to_swap=1, grad_checkpointing="every-2", ema_decay=0.99, ema_device="cpu", batch_size=3)
    pc = PlanConfig.of_run(cfg, bucket=(256, 256), world_size=2)
    for name in ("model", "lora_rank", "lora_targets", "weights_dtype", "base_quant", "blocks_to_swap", "grad_checkpointing",
                 "batch_size", "optimizer"):
        assert getattr(pc, name) == getattr(cfg, name), name
    assert (pc.ema_placement(), pc.bucket, pc.world_size) == ("cpu", (256, 256), 2)


TOML = """# a run's options, named as the flags with underscores
model = "tiny-sd3"
lora_rank = 4
lr = 1
cache = ["a", "b"]
cache_weight = [3, 1]
grad_checkpointing = "all"
validate = false
"""


@pytest.mark.parametrize("suffix, text", [(".toml", TOML), (".json", '{"model": "tiny-sd3", "lora_rank": 4, "lr": 1, "cache": '
                                                                         '["a", "b"], "cache_weight": [3, 1], "grad_checkpointing": '
                                                                         '"all", "validate": false}')])
def test_a_config_file_gives_what_the_flags_give(tmp_path, suffix, text, trained):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    result = CliRunner().invoke(train_app, ["--config", str(path), "--lora-rank", "8"], env=WIDE)
    assert result.exit_code == 0, result.output
    flags = CliRunner().invoke(train_app, ["--model", "tiny-sd3", "--lora-rank", "8", "--lr", "1", "--cache", "a", "--cache", "b",
                                           "--cache-weight", "3", "--cache-weight", "1", "--grad-checkpointing", "all",
                                           "--no-validate"], env=WIDE)
    assert flags.exit_code == 0, flags.output
    assert trained[0] == trained[1] and trained[0].lora_rank == 8  # the command line wins over the file
    assert isinstance(trained[0].lr, float) and trained[0].cache == [Path("a"), Path("b")]


@pytest.mark.parametrize("suffix, text, said", [
    (".toml", "lora_rnak = 4\n", "'lora_rnak' (did you mean 'lora_rank'?)"),
    (".json", '{"blocks_to_swp": 2}', "'blocks_to_swp' (did you mean 'blocks_to_swap'?)"),
    (".toml", "[memory]\nblocks_to_swap = 2\n", "'memory'"),
    (".toml", "lora_rank = 4\nlora_rank = 8\n", "not valid TOML"),
    (".toml", "lora_rank = \"4\"\n", "lora_rank '4': must be an integer"),
    (".toml", "caption_dropout = nan\n", "caption_dropout nan: must be a finite number in [0, 1]"),
    (".toml", "lora_rank = 4\n[", "not valid TOML"),
    (".toml", "", "is empty: write the options as TOML, e.g. steps = 100"),
])
def test_a_bad_config_file_is_refused_naming_the_file_and_key(tmp_path, suffix, text, said, trained):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    result = CliRunner().invoke(train_app, ["--config", str(path)], env=WIDE)
    assert result.exit_code == 2 and said in result.output and path.name in result.output, result.output
    assert not trained


def plan_app() -> typer.Typer:
    app = typer.Typer()
    app.command("plan")(plan_command)
    app.command("other")(lambda: None)  # two commands: typer keeps the name
    return app


def test_the_plan_command_refuses_what_the_trainer_refuses_through_the_same_rule(monkeypatch):
    monkeypatch.setattr(train.plan, "plan", lambda *a, **k: pytest.fail("planned what the trainer refuses"))
    for args, message in ((["--lora-rank", "4", "--base-quant", "nf4", "--blocks-to-swap", "2"], "--blocks-to-swap with --base-quant nf4"),
                          (["--world-size", "0"], "--world-size 0: must be at least 1"),
                          (["--ema-decay", "1.5"], "--ema-decay 1.5: must be in [0, 1)")):
        result = CliRunner().invoke(plan_app(), ["plan", "tiny-sana", *args], env=WIDE)
        assert result.exit_code == 2 and message in result.output, result.output


def test_the_plan_command_plans_with_the_trainers_defaults(monkeypatch):
    planned = []
    monkeypatch.setattr(train.plan, "plan", lambda pc, say, **_: planned.append(pc) or {"stub": True})
    monkeypatch.setattr(train.plan, "format_plan", lambda result: "formatted")
    result = CliRunner().invoke(plan_app(), ["plan", "tiny-sd3", "--lora-rank", "4", "--resolution", "256", "--gpu-memory", "16GB"],
                                env=WIDE)
    assert result.exit_code == 0 and "formatted" in result.output, result.output
    pc = planned[0]
    assert (pc.bucket, pc.gpu_memory, pc.lora_rank) == ((256, 256), 15.25 * 2**30, 4)  # the card less its CUDA reserve
    defaults = TrainConfig(model="tiny-sd3", lora_rank=4)
    assert (pc.batch_size, pc.precision, pc.optimizer, pc.grad_checkpointing, pc.ema_placement()) == (
        defaults.batch_size, defaults.precision, defaults.optimizer, defaults.grad_checkpointing, "off")


FAMILY_FREE = ["train/config.py", "train/plan.py", "train/plan_config.py", "train/plan_trace.py", "train/plan_costs.py",
               "train/plan_command.py", "train/frozen.py", "train/dryrun.py"]


@pytest.mark.parametrize("path", FAMILY_FREE)
def test_the_options_and_the_planner_name_no_family(path):
    words = {w.lower() for f in FAMILIES for w in (f.name, *f.title.replace("/", " ").split())}
    words |= {"pixart", "sana", "sd3", "sd3.5", "flux", "flux.1", "schnell", "qwen", "z-image"}
    text = (ROOT / path).read_text().lower()
    # a word, not part of a preset's name (tiny-sd3, sana-600m)
    found = sorted(w for w in words if len(w) > 2 and re.search(rf"(?<![-\w.]){re.escape(w)}(?![-\w]|\.\d)", text))
    assert not found, found
