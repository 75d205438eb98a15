"""Class (regularisation) sources: DreamBooth's prior preservation, their batches' loss weighted by prior_loss_weight,
and output preservation, whose target is the base model's own prediction with the LoRA adapters off."""

import json
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from precompute.run import main as precompute
from precompute.sample_data import make_folder
from precompute.sources import read_dataset_file
from train.config import TrainConfig
from train.families import get_family, get_preset
from train.frozen import load_meta, quiet_diffusers
from train.model import build_model, build_optimizer, build_run_objective, build_schedule
from train.order import seeded_generator
from train.plan import format_plan, measure_peak, plan
from train.plan_config import PlanConfig
from train.presets import build_transformer, model_forward, resolve_weights
from train.step import TrainStep

pytestmark = pytest.mark.model  # builds tiny diffusers models

CPU = torch.device("cpu")
TOKENS = 20


def write_toml(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


# ---- stage one: the dataset file marks a class source -------------------------------------------------------------

def test_a_class_source_is_recorded_with_its_prior_loss_weight(tmp_path):
    file = write_toml(tmp_path / "data.toml", """
[[source]]
name = "dog"
path = "dog"

[[source]]
name = "dogs"
path = "class"
is_reg = true
prior_loss_weight = 0.5

[[source]]
path = "more-class"
is_reg = true
""")
    dog, dogs, more = read_dataset_file(file)
    assert dog.record() == {"path": str(tmp_path / "dog"), "repeats": 1}  # as before: nothing written for it
    assert dogs.record() == {"path": str(tmp_path / "class"), "repeats": 1, "is_reg": True, "prior_loss_weight": 0.5}
    assert more.record()["prior_loss_weight"] == 1.0
    assert dog.salt() == dogs.salt() == 0  # the role changes no sample: nothing is encoded again


@pytest.mark.parametrize("body, line, message", [
    ('[[source]]\npath = "a"\nprior_loss_weight = 2.0\n', 3, "add is_reg = true"),
    ('[[source]]\npath = "a"\nis_reg = "yes"\n', 3, "must be true or false"),
    ('[[source]]\npath = "a"\nis_reg = true\nprior_loss_weight = 0\n', 4, "above 0"),
    ('[[source]]\npath = "a"\nis_reg = true\nprior_loss_weight = "1"\n', 4, "above 0"),
    ('[[source]]\npath = "a"\nis_rge = true\n', 3, "did you mean 'is_reg'"),
    ('[[source]]\npath = "a"\nis_reg = true\neval = true\n', 3, "an eval source is held out of training"),
])
def test_a_wrong_class_key_is_refused_naming_the_line(tmp_path, body, line, message):
    file = write_toml(tmp_path / "data.toml", body)
    with pytest.raises(ValueError, match=message) as e:
        read_dataset_file(file)
    assert f"{file}:{line}" in str(e.value)


def test_marking_a_cached_source_as_class_encodes_nothing_again(tmp_path):
    from typer.testing import CliRunner

    from shards import load
    from shards.cli import app as shards_app

    dog, dogs = make_folder(tmp_path / "dog", count=2, seed=1), make_folder(tmp_path / "dogs", count=2, seed=2)
    file = write_toml(tmp_path / "data.toml", f'[[source]]\npath = "{dog}"\n[[source]]\npath = "{dogs}"\n')
    run = dict(workers=0, progress=False, batch_size=4, max_shard_mb=0)
    precompute(str(file), "tiny-sana", tmp_path / "cache", **run)
    write_toml(file, file.read_text() + "is_reg = true\nprior_loss_weight = 0.25\n")
    summary = precompute(str(file), "tiny-sana", tmp_path / "cache", **run)
    assert [s["unchanged"] for s in summary["sources"].values()] == [2, 2]
    records = load(tmp_path / "cache").extra["sources"]
    assert records["dogs"] == {"path": str(dogs), "repeats": 1, "is_reg": True, "prior_loss_weight": 0.25}
    assert records["dog"] == {"path": str(dog), "repeats": 1}
    shown = CliRunner().invoke(shards_app, ["inspect", str(tmp_path / "cache")]).output
    assert "repeats 1, class (is_reg), prior_loss_weight 0.25" in shown


# ---- stage two: one step -------------------------------------------------------------------------------------------

def built(model: str = "tiny-sana", **options):
    """The run's model and step as the trainer builds them (LoRA rank 4, fp32: exact comparisons)."""
    preset = get_preset(model)
    cfg = TrainConfig(model=model, lora_rank=4, precision="fp32", **options)
    net = build_model(cfg, preset, "none", 1, CPU, resume_from=None, state={}, say=lambda *a: None)
    optimizer = build_optimizer(cfg, net.params, CPU)
    objective = build_run_objective(cfg, preset, preset.transformer_config())
    step = TrainStep(cfg, net, objective, optimizer, build_schedule(cfg, optimizer), torch.amp.GradScaler("cpu", enabled=False),
                     None, parallel="none", rank=0, world=1, device=CPU)
    return cfg, preset, net, step


def batch_of(preset, net, n: int = 3, seed: int = 0, bucket=(128, 128)) -> dict:
    g = torch.Generator().manual_seed(seed)
    down, c = preset.latent_downsample, net.module.config.in_channels
    width = get_family(preset.family).text_width(net.module.config)
    return {"latents": torch.randn(n, c, bucket[0] // down, bucket[1] // down, generator=g), "bucket": bucket,
            "keys": [f"k{i}" for i in range(n)], "text": torch.randn(n, TOKENS, width, generator=g),
            "text_mask": torch.ones(n, TOKENS, dtype=torch.bool)}


def noise_of(cfg, step: int = 0, micro: int = 0) -> torch.Generator:
    """The generator `TrainStep.accumulate` draws micro-batch `micro` of step `step`'s noise and timesteps from."""
    return seeded_generator(cfg.seed, 1_000_003, step, micro, device=CPU)


def grads(net) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.params]


def test_class_batches_loss_and_gradients_are_weighted_exactly():
    cfg, preset, net, step = built()
    batch = batch_of(preset, net)
    per_sample, _ = step.objective(net.forward, batch, noise_of(cfg))  # the data's loss, by hand
    per_sample.mean().backward()
    unweighted = grads(net)
    step.optimizer.zero_grad(set_to_none=True)

    step.accumulate({**batch, "prior_loss_weight": 0.5}, 0)  # a class source's batch, weight 0.5 (exact in binary)
    micro = step.micros[0]
    assert torch.equal(micro.loss, per_sample.detach().mean() * 0.5)
    assert torch.equal(micro.class_loss, per_sample.detach().mean())  # reported unweighted
    assert all(torch.equal(g, 0.5 * u) for g, u in zip(grads(net), unweighted))
    step.rewind()

    step.accumulate(batch, 0)  # an instance batch: as before
    assert torch.equal(step.micros[0].loss, per_sample.detach().mean()) and step.micros[0].class_loss is None
    assert all(torch.equal(g, u) for g, u in zip(grads(net), unweighted))
    step.rewind()

    step.cfg = TrainConfig(model="tiny-sana", lora_rank=4, precision="fp32", prior_loss_weight=2.0)  # the stage-two override
    step.accumulate({**batch, "prior_loss_weight": 0.5}, 0)
    assert torch.equal(step.micros[0].loss, per_sample.detach().mean() * 2.0)
    assert all(torch.equal(g, 2.0 * u) for g, u in zip(grads(net), unweighted))


def plain_transformer(cfg, preset) -> torch.nn.Module:
    """The transformer the run's frozen base loads, built apart and without adapters (independent of disabling them)."""
    weights = resolve_weights(preset, cfg.pretrained, cfg.revision, cfg.from_scratch, cfg.seed)
    return build_transformer(preset, weights, cfg.seed, torch.float32)


@pytest.mark.parametrize("model, options", [
    ("tiny-sana", {}),  # flow matching
    ("tiny-pixart", {}),  # DDPM, epsilon
    ("tiny-sana", {"blocks_to_swap": 2, "grad_checkpointing": "all"}),  # the swapped blocks' weights brought for it too
    ("tiny-sana", {"adapter": "dora"}), ("tiny-sana", {"adapter": "lokr"}), ("tiny-sana", {"adapter": "loha"}),
])
def test_output_preservation_targets_the_base_models_prediction(model, options):
    cfg, preset, net, step = built(model, preservation="output", **options)
    batch = {**batch_of(preset, net), "prior_loss_weight": 1.0}
    data_loss, _ = step.objective(net.forward, batch, noise_of(cfg))

    # step 0: the adapters start as no change (lora_B, or a factor, at zero), so the trained model is the base model and
    # the loss is exactly 0
    step.accumulate(batch, 0)
    assert torch.equal(step.micros[0].loss, torch.zeros(())) and data_loss.mean() > 0
    assert all(not g.any() for g in grads(net))
    step.rewind()

    # adapters that changed something: the loss is the MSE to a model without adapters, on the same noisy input
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    plain = plain_transformer(cfg, preset)
    forward = model_forward(plain, preset.family, guidance=preset.train_guidance)
    with torch.no_grad():
        expected, _ = step.objective(net.forward, batch, noise_of(cfg), target_fn=forward)
    step.accumulate(batch, 0)
    assert torch.equal(step.micros[0].loss, expected.mean()) and expected.mean() > 0
    assert all(p.requires_grad for p in net.params) and any(g.any() for g in grads(net))  # the adapters train again
    with torch.no_grad():
        t = torch.full((3,), 500.0)
        assert not torch.equal(net.forward(batch["latents"], t, batch), forward(batch["latents"], t, batch))

    step.rewind()
    step.accumulate({k: v for k, v in batch.items() if k != "prior_loss_weight"}, 0)  # an instance batch: the data's
    assert torch.equal(step.micros[0].loss, step.objective(net.forward, batch, noise_of(cfg))[0].mean())


@pytest.mark.parametrize("options", [{"base_quant": "int8"}, {"base_quant": "int8", "blocks_to_swap": 1, "grad_checkpointing": "all"}])
def test_output_preservation_on_a_quantized_base_starts_at_zero(options):
    pytest.importorskip("torchao")
    preset = get_preset("tiny-sana")
    cfg = TrainConfig(model="tiny-sana", lora_rank=4, precision="bf16", preservation="output", **options)
    net = build_model(cfg, preset, "none", 1, CPU, resume_from=None, state={}, say=lambda *a: None)
    optimizer = build_optimizer(cfg, net.params, CPU)
    step = TrainStep(cfg, net, build_run_objective(cfg, preset, preset.transformer_config()), optimizer,
                     build_schedule(cfg, optimizer), torch.amp.GradScaler("cpu", enabled=False), None, parallel="none", rank=0,
                     world=1, device=CPU)
    batch = {**batch_of(preset, net), "prior_loss_weight": 1.0}
    step.accumulate(batch, 0)  # the quantized base with its adapters off is the target: exactly the trained model at step 0
    assert torch.equal(step.micros[0].loss, torch.zeros(()))
    step.rewind()
    with torch.no_grad():
        for name, p in net.module.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    step.accumulate(batch, 0)
    assert step.micros[0].loss > 0 and any(p.grad.any() for p in net.params)


def test_output_preservation_needs_adapters():
    for config in (TrainConfig, PlanConfig):
        with pytest.raises(ValueError, match="second, frozen copy of every weight"):
            config(model="tiny-sana", preservation="output")
        with pytest.raises(ValueError, match="a ControlNet run has no adapters"):
            config(model="tiny-sd3", controlnet=True, preservation="output")
        config(model="tiny-sana", lora_rank=4, preservation="output")
    with pytest.raises(ValueError, match="--prior-loss-weight -1: must be above 0"):
        TrainConfig(model="tiny-sana", prior_loss_weight=-1)


# ---- a run ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def class_cache(tmp_path_factory):
    """A cache of two sources: 4 instance images and 4 class images (is_reg, prior_loss_weight 0.5)."""
    root = tmp_path_factory.mktemp("classes")
    dog, dogs = make_folder(root / "dog", count=4, seed=1), make_folder(root / "dogs", count=4, seed=2)
    file = write_toml(root / "data.toml", f'[[source]]\npath = "{dog}"\n\n'
                                          f'[[source]]\npath = "{dogs}"\nis_reg = true\nprior_loss_weight = 0.5\n')
    precompute(str(file), "tiny-sana", root / "cache", workers=0, progress=False, batch_size=4, max_shard_mb=0)
    return root / "cache"


def run_config(cache, run, steps, **kw):
    return TrainConfig(model="tiny-sana", cache=[str(cache)], run=run, steps=steps, batch_size=2, lora_rank=4, progress=False,
                       log_every=1, checkpoint_every=1000, validate=False, lr=1e-2, **kw)


def close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6, abs=1e-9)
    return a == b


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_a_class_source_logs_both_losses_and_resumes_exactly(class_cache, tmp_path, capsys):
    from train.loop import train

    train(run_config(class_cache, tmp_path / "straight", 6, preservation="output"))
    assert "source dogs: 4 samples, 4 drawn per epoch, class (is_reg): loss weight 0.5, target the base model" in capsys.readouterr().out
    train(run_config(class_cache, tmp_path / "resumed", 3, preservation="output"))
    train(run_config(class_cache, tmp_path / "resumed", 6, preservation="output"))
    straight, resumed = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert len(straight) == len(resumed) == 6
    for r, s in zip(resumed, straight):  # every figure but the timings; the smoothed loss resumes through a float
        assert set(r) == set(s)
        for key in set(r) - {"samples_per_s", "data_wait", "peak_memory"}:
            assert close(r[key], s[key]), (r["step"], key, r[key], s[key])
    assert sum(straight[-1]["samples_by_source"].values()) == 12 and set(straight[-1]["samples_by_source"]) == {"dog", "dogs"}
    kinds = [(r["class_loss"] is None, r["instance_loss"] is None) for r in straight]
    assert set(kinds) == {(True, False), (False, True)}  # one batch per step, of one kind or the other
    for r in straight:
        weighted = 0.5 * r["class_loss"] if r["class_loss"] is not None else r["instance_loss"]
        assert r["loss"] == pytest.approx(weighted, rel=1e-6, abs=1e-12)
    first_class = next(r for r in straight if r["class_loss"] is not None)
    assert (first_class["step"] == 1) == (first_class["class_loss"] == 0.0)  # untrained adapters: the base model itself


def test_a_class_source_is_drawn_by_its_share_and_named_to_the_step(class_cache):
    from shards import Cache
    from train.order import BatchPlan

    plan = BatchPlan.of(Cache(class_cache), 2)
    assert plan.classes == {"dogs": 0.5} and plan.draws_by_source() == {"dog": 4, "dogs": 4}
    assert BatchPlan.of([Cache(class_cache), Cache(class_cache)], 2).classes == {"0-cache/dogs": 0.5, "1-cache/dogs": 0.5}


def test_preservation_options_without_a_class_source_are_refused():
    from types import SimpleNamespace

    from train.loop import check_class_sources

    def cache(records):
        return SimpleNamespace(location="/caches/c", manifest=SimpleNamespace(extra={"sources": records}))

    plain, classes = cache({"dog": {"repeats": 1}}), cache({"dog": {"repeats": 1}, "dogs": {"repeats": 1, "is_reg": True}})
    for options in ({"preservation": "output"}, {"prior_loss_weight": 0.5}):
        cfg = TrainConfig(model="tiny-sana", lora_rank=4, **options)
        with pytest.raises(ValueError, match="/caches/c holds none: mark the class images' source is_reg = true"):
            check_class_sources(cfg, [plain])
        check_class_sources(cfg, [plain, classes])
    check_class_sources(TrainConfig(model="tiny-sana"), [plain])


# ---- the planner --------------------------------------------------------------------------------------------------

def forward_flops(model: str, batch: int, bucket) -> int:
    """FLOPs of one forward of the plain transformer (no adapters) on the meta device."""
    preset = get_preset(model)
    family = get_family(preset.family)
    with quiet_diffusers():
        transformer = load_meta(preset, torch.float32, None)
    inputs = family.example_batch(transformer.config, preset, bucket, batch, TOKENS, torch.float32)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        family.forward(transformer, transformer.config, inputs["latents"], torch.full((batch,), 500.0, device="meta"), inputs, preset.train_guidance)
    return counter.get_total_flops()


@pytest.mark.parametrize("model, batch", [("tiny-sana", 8), ("tiny-pixart", 4)])
def test_the_planner_counts_output_preservations_forward(model, batch):
    bucket = (256, 256)
    setup = dict(lora_rank=4, precision="fp32", batch_size=batch, bucket=bucket, text_tokens=TOKENS)
    prior, output = plan(PlanConfig(model, **setup)), plan(PlanConfig(model, preservation="output", **setup))
    assert "preservation_forward" not in prior
    extra = output["preservation_forward"]
    # its compute: one forward of the base model, adapters off, next to the step's forward and backward
    assert extra["flops"] == forward_flops(model, batch, bucket)
    assert 0.25 < extra["added_compute"] < 0.6 and extra["step_flops"] > 2 * extra["flops"]
    # its peak: the tensors alive during a no-grad forward, as measured on the CPU (weights and inputs apart)
    cfg, preset, net, step = built(model, preservation="output", batch_size=batch)
    inputs = batch_of(preset, net, batch, bucket=bucket)
    t = torch.full((batch,), 500.0)
    step.base_forward(inputs["latents"], t, inputs)  # once before: nothing lazily built is measured
    held = sum(p.nbytes for p in net.module.parameters()) + sum(v.nbytes for v in (t, *inputs.values()) if isinstance(v, torch.Tensor))
    measured = measure_peak(lambda: step.base_forward(inputs["latents"], t, inputs).float(), CPU) - held
    assert abs(extra["peak"] / measured - 1) <= 0.1, (extra["peak"], measured)
    assert extra["peak_per_sample"] > 0
    # the step peaks at the largest of the activations, the gradients and that forward
    static = sum(v for k, v in output["bytes"].items() if k not in ("activations", "gradients"))
    assert output["predicted_peak"] == static + max(output["bytes"]["activations"], output["bytes"]["gradients"], extra["peak"])
    assert output["bytes"] == prior["bytes"]
    assert "preservation forward" in format_plan(output) and "output preservation adds" in format_plan(output)
    assert "preservation" not in format_plan(prior)


def test_the_plan_command_takes_preservation(capsys):
    from train.plan_command import plan_command

    plan_command("tiny-sana", resolution=128, lora_rank=4, preservation="output", batch_size=2)
    assert "output preservation adds" in capsys.readouterr().out
    import typer

    with pytest.raises(typer.Exit):
        plan_command("tiny-sana", resolution=128, preservation="output")
    assert "--preservation output needs" in capsys.readouterr().err


def test_a_dry_run_measures_a_class_batchs_step_and_the_start_up_says_its_cost(class_cache, tmp_path, capsys):
    from train.loop import train

    summary = train(run_config(class_cache, tmp_path / "dry", 1, preservation="output", dry_run=True))
    out = capsys.readouterr().out
    assert summary["dry_run"] and summary["measured_peak"] > 0
    assert re.search(r"output preservation: class batches are \d+% of an epoch's, each \d+% more compute: about \+\d+% for "
                     r"the epoch", out), out


@pytest.mark.slow
def test_two_ddp_processes_preserve_output_as_one_process_does(class_cache, tmp_path):
    """The base model's forward without gradients goes through the DDP wrapper on every rank; the class and instance
    losses of 2 processes at batch 2 are those of one process at batch 4."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def launch(run, nproc: int, batch: int):
        runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
        out = subprocess.run([*runner, "-m", "train", "--model", "tiny-sana", "--cache", str(class_cache), "--run-dir", str(run),
                              "--lora-rank", "4", "--preservation", "output", "--precision", "fp32", "--steps", "4",
                              "--batch-size", str(batch), "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-2"],
                             cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return rows(run)

    one, two = launch(tmp_path / "one", 1, 4), launch(tmp_path / "ddp", 2, 2)
    assert [r["class_loss"] is None for r in one] == [r["class_loss"] is None for r in two]
    assert any(r["class_loss"] for r in one)
    for a, b in zip(one, two):
        for key in ("loss", "class_loss", "instance_loss"):
            assert (a[key] is None and b[key] is None) or a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["step"], key)
