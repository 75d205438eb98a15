"""The memory planner: exact parameter counts of the real presets, and predictions against measurement."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.config import TrainConfig
from train.families import PRESETS, get_family, get_preset
from train.families.sana import TINY as TINY_SANA
from train.model import build_model, build_optimizer, build_run_objective, build_schedule
from train.plan import measure_peak, plan
from train.plan_config import PlanConfig
from train.step import TrainStep

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]

# The counts published with the configs (../shared/model_configs/README.md, diffusers 0.42.1).
PUBLISHED = {"sana-1600m": 1_604_462_752, "sana-600m": 591_747_872, "pixart-sigma-1024": 610_856_096, "pixart-sigma-512": 610_856_096,
             "sd3-medium": 2_028_328_000, "sd35-medium": 2_243_171_520, "sd35-large": 8_056_627_520,
             "flux-dev": 11_901_408_320, "flux-schnell": 11_891_178_560}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_parameter_counts_of_the_real_presets(model):
    assert plan(PlanConfig(model, batch_size=1, bucket=(512, 512)))["parameters"] == PUBLISHED[model]


@pytest.fixture
def wide(monkeypatch):
    """A tiny Sana whose weights, not its activations, dominate: the optimizer states decide the peak."""
    config = {**TINY_SANA, "num_attention_heads": 4, "attention_head_dim": 64, "cross_attention_dim": 256,
              "num_cross_attention_heads": 4, "cross_attention_head_dim": 64, "num_layers": 3}
    monkeypatch.setitem(PRESETS, "wide-sana", lambda: dataclasses.replace(get_preset("tiny-sana"), name="wide-sana", config=config))
    return "wide-sana"


def measured(model: str, batch: int, bucket, optimizer: str, ckpt: str, tokens: int, weights_dtype: str = "fp32") -> int:
    """Peak of one training step as the trainer runs it (the step after the first, so states exist)."""
    preset = get_preset(model)
    cfg = TrainConfig(model=model, optimizer=optimizer, grad_checkpointing=ckpt, weights_dtype=weights_dtype,
                      precision="bf16" if weights_dtype == "bf16" else "fp32")
    cpu = torch.device("cpu")
    net = build_model(cfg, preset, "none", 1, cpu, resume_from=None, state={}, say=lambda *a: None)
    optimizer = build_optimizer(cfg, net.params, cpu)
    step = TrainStep(cfg, net, build_run_objective(cfg, preset, preset.transformer_config()), optimizer,
                     build_schedule(cfg, optimizer), torch.amp.GradScaler("cpu", enabled=False), None, parallel="none", rank=0,
                     world=1, device=cpu)
    down, c = preset.latent_downsample, net.module.config.in_channels
    batch = {"latents": torch.randn(batch, c, bucket[0] // down, bucket[1] // down), "bucket": bucket, "keys": ["k"] * batch,
             "text": torch.randn(batch, tokens, get_family(preset.family).text_width(net.module.config)), "text_mask": torch.ones(batch, tokens, dtype=torch.bool)}

    def one_step():
        step.accumulate(batch, 0)
        step.update(0)

    one_step()
    return measure_peak(one_step, cpu)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "came", "adafactor", "adamw-bf16"])
@pytest.mark.parametrize("ckpt", ["off", "all"])
@pytest.mark.parametrize("model,batch,bucket", [("tiny-sana", 8, (256, 256)), ("tiny-pixart", 4, (256, 256)), ("wide", 1, (64, 64))])
def test_predicted_peak_within_15_percent_of_measured(model, batch, bucket, optimizer, ckpt, wide):
    model = wide if model == "wide" else model
    weights = "bf16" if optimizer == "adamw-bf16" else "fp32"  # bf16 weights and moments, stochastic rounding
    predicted = plan(PlanConfig(model, batch_size=batch, bucket=bucket, precision="bf16" if weights == "bf16" else "fp32",
                                weights_dtype=weights, optimizer=optimizer, grad_checkpointing=ckpt, text_tokens=20))["predicted_peak"]
    actual = measured(model, batch, bucket, optimizer, ckpt, tokens=20, weights_dtype=weights)
    assert abs(predicted / actual - 1) <= 0.15, (predicted, actual)


@pytest.mark.slow
def test_lora_plan_counts_adapters_alone():
    full = plan(PlanConfig("sd35-large", batch_size=1, weights_dtype="bf16", optimizer="adamw", grad_checkpointing="all"))
    lora = plan(PlanConfig("sd35-large", batch_size=1, weights_dtype="bf16", optimizer="adamw", grad_checkpointing="all",
                           lora_rank=16))
    adapters = lora["trainable_parameters"]
    assert lora["parameters"] == full["parameters"] + adapters and 0 < adapters < full["parameters"] / 100
    assert lora["bytes"]["gradients"] == 4 * adapters and lora["bytes"]["optimizer states"] == 2 * 4 * adapters
    assert lora["predicted_peak"] < full["predicted_peak"] / 3


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-sana"])
def test_controlnet_plan_counts_the_controlnet_the_trainer_builds_as_the_only_trained_part(model):
    from train import controlnet

    preset = get_preset(model)
    transformer = preset.transformer_class.from_config(preset.transformer_config())
    built = controlnet.build_controlnet(transformer, preset.family)
    planned = plan(PlanConfig(model, batch_size=2, bucket=(256, 256), text_tokens=20, controlnet=True))
    alone = plan(PlanConfig(model, batch_size=2, bucket=(256, 256), text_tokens=20))
    trained = sum(p.numel() for p in built.parameters())
    assert planned["trainable_parameters"] == trained and planned["controlnet_layers"] == built.config.num_layers
    assert planned["parameters"] == alone["parameters"] + trained
    assert planned["bytes"]["gradients"] == 4 * trained and planned["bytes"]["optimizer states"] == 2 * 4 * trained
    # the frozen transformer still keeps activations: the ControlNet's residuals flow back through it
    assert planned["bytes"]["activations"] > alone["bytes"]["activations"] / 2


@pytest.mark.slow
def test_controlnet_plan_of_sd35_large_on_80gb():
    full = plan(PlanConfig("sd35-large", batch_size=1, weights_dtype="bf16", precision="bf16", optimizer="adamw",
                           grad_checkpointing="all"))
    cn = plan(PlanConfig("sd35-large", batch_size=1, weights_dtype="bf16", precision="bf16", optimizer="adamw",
                         grad_checkpointing="all", controlnet=True))
    assert cn["controlnet_layers"] == 12 and cn["fits"] and cn["largest_batch"] >= 1
    assert 0 < cn["trainable_parameters"] < full["parameters"] / 2
    with pytest.raises(ValueError, match="not both"):
        plan(PlanConfig("tiny-sd3", controlnet=True, lora_rank=4))
    with pytest.raises(ValueError, match="at most"):
        plan(PlanConfig("sd3-medium", controlnet=True, controlnet_layers=40))


@pytest.mark.slow
def test_plan_cli_json_and_verdict():
    out = subprocess.run([sys.executable, "-m", "train", "plan", "sana-1600m", "--batch-size", "4", "--optimizer", "came",
                          "--grad-checkpointing", "all", "--gpu-memory", "48GB", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["parameters"] == PUBLISHED["sana-1600m"]
    assert set(result["bytes"]) >= {"weights", "gradients", "optimizer states", "activations"}
    assert result["fits"] is True and result["largest_batch"] >= 4
    assert result["peak_with_encoders_resident"] - result["predicted_peak"] == 2 * (312_250_275 + 2_614_341_888)


@pytest.mark.parametrize("model,lora", [("tiny-sana", 0), ("tiny-pixart", 0), ("tiny-sd3", 0), ("tiny-sd3", 4), ("tiny-pixart", 4)])
def test_dry_run_measures_one_step_next_to_the_plan(tiny_caches, tmp_path, model, lora, capsys):
    from train.loop import train

    result = train(TrainConfig(model=model, cache=tiny_caches[model], run=tmp_path, batch_size=4, precision="fp32",
                               progress=False, dry_run=True, validation_steps=2, lora_rank=lora))
    assert result["bucket"] == "256x256"
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15
    assert "measured peak" in capsys.readouterr().out
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
