"""Stage two's options: checked when a config is built, refused by the command line with the valid values, read from a
config file beside flags; no model is built."""

import json
from pathlib import Path

import pytest
import torch

from train.config import TrainConfig


def test_options_are_checked():
    with pytest.raises(ValueError, match="adamw-bf16"):
        TrainConfig(optimizer="adamw-bf16")
    with pytest.raises(ValueError, match="--precision fp16"):
        TrainConfig(weights_dtype="bf16", precision="fp16")
    with pytest.raises(ValueError, match="every-K"):
        TrainConfig(grad_checkpointing="sometimes")
    # bf16 weights updated with round-to-nearest lose updates below half a bf16 step: refused, pointing at adamw-bf16
    for optimizer in ("adamw", "came", "adafactor", "adamw-8bit"):
        with pytest.raises(ValueError, match="vanish.*--optimizer adamw-bf16"):
            TrainConfig(weights_dtype="bf16", optimizer=optimizer)
    TrainConfig(weights_dtype="bf16", optimizer="adamw", lora_rank=4)  # LoRA: a frozen bf16 base, fp32 adapters
    # every option with a fixed set of values refuses anything else, listing the valid ones
    for name, value in [("weighting_scheme", "logitnormal"), ("ema_device", "gpu"), ("parallel", "zero3"), ("precision", "bf32"),
                        ("lr_schedule", "linear-ish"), ("remainder", "pad"), ("decode_device", "tpu"), ("optimizer", "sgd")]:
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} '{value}': choose one of"):
            TrainConfig(**{name: value})
    with pytest.raises(ValueError, match="LoRA adapts released weights"):
        TrainConfig(lora_rank=4, from_scratch=True)


def test_the_cli_refuses_unknown_choices_listing_the_valid_ones():
    from typer.testing import CliRunner

    from train.__main__ import app

    result = CliRunner().invoke(app, ["--weighting-scheme", "logitnormal"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 2 and "'logitnormal' is not one of 'logit_normal', 'mode', 'sigma_sqrt', 'cosmap', 'none'" in result.output
    from train.__main__ import tools

    wide = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
    for args, listed in ((["plan", "tiny-sana", "--ema-device", "gpu"], "'device', 'cpu'"),
                         (["plan", "tiny-sana", "--parallel", "zero3"], "'auto', 'ddp', 'fsdp'"),
                         (["plan", "tiny-sana", "--precision", "bf32"], "'fp32', 'bf16', 'fp16'"),
                         (["plan", "tiny-sana", "--weights-dtype", "fp8"], "'fp32', 'bf16'"),
                         (["export", "RUN", "--out", "OUT", "--dtype", "int4"], "'fp32', 'bf16', 'fp16'"),
                         (["sample", "RUN", "--prompt-cache", "C", "--precision", "fp64"], "'fp32', 'bf16', 'fp16'"),
                         (["sample", "RUN", "--prompt-cache", "C", "--decode-device", "tpu"], "'cpu', 'device'")):
        result = CliRunner().invoke(tools, args, env=wide)
        assert result.exit_code == 2 and f"is not one of {listed}" in result.output, (args, result.output)


def test_adamw_8bit_without_bitsandbytes_says_how_to_install(monkeypatch):
    import builtins

    from train.model import build_optimizer

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "bitsandbytes" else real(name, *a, **k))
    with pytest.raises(ValueError, match=r"pip install -e '\.\[8bit\]'"):
        build_optimizer(TrainConfig(optimizer="adamw-8bit"), [torch.nn.Parameter(torch.zeros(2))], torch.device("cuda"))


def test_a_config_file_gives_defaults_and_flags_win(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import train.loop as loop
    from train.__main__ import app

    seen = []
    monkeypatch.setattr(loop, "train", seen.append)
    (tmp_path / "run.json").write_text(json.dumps({"steps": 7, "lr": 0.5, "model": "tiny-sd3"}))
    result = CliRunner().invoke(app, ["--config", str(tmp_path / "run.json"), "--lr", "0.25"])
    assert result.exit_code == 0, result.output
    assert (seen[0].steps, seen[0].lr, seen[0].model, seen[0].cache) == (7, 0.25, "tiny-sd3", [Path("cache/tiny-sd3")])
    (tmp_path / "bad.json").write_text(json.dumps({"steps": 7, "stepz": 8}))
    result = CliRunner().invoke(app, ["--config", str(tmp_path / "bad.json")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "unknown options 'stepz'" in result.output
