"""A quantized frozen base (--base-quant) and block swapping (--blocks-to-swap) through the trainer: the losses they
give, resume, DDP, ControlNets, exports and dry runs against the plan (the plans themselves: test_plan_one_card.py)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import VALIDATION_PROMPTS, train_processes
from PIL import Image, ImageFilter, ImageOps

from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.families import get_preset
from train.loop import train
from train.presets import build_transformer

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Stage one's caches of 8 sample images with edge maps as control images: tiny-sd3 and tiny-sana (with control
    latents), tiny-flux."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("quant")
    data = make_folder(root / "data", count=8)
    for image in sorted(data.glob("?????.png")):
        ImageOps.grayscale(Image.open(image)).filter(ImageFilter.FIND_EDGES).convert("RGB").save(image.with_suffix(".control.png"))
    for model in ("tiny-sd3", "tiny-sana", "tiny-flux"):
        precompute(str(data), model, root / model, workers=0, progress=False, control=model != "tiny-flux",
                   validation_prompt=VALIDATION_PROMPTS)
    return root


def cfg(caches, run, model="tiny-flux", **kw):
    base = dict(model=model, cache=caches / model, run=run, steps=6, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=3, lr=1e-3, precision="bf16", validate=False, lora_rank=4)
    return TrainConfig(**{**base, **kw})


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


# ---- a quantized frozen base -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-sana"])
@pytest.mark.slow
def test_a_quantized_base_trains_as_the_bf16_base_does(caches, tmp_path, model, kind, capsys):
    """The same run on the bf16 base and on its int8 / fp8 weights: every step's loss within 1 % (the quantization error
    of the frozen weights is all that differs; measured 0.1-0.3 % on these presets), and the adapters learn what they
    learn on the bf16 base: what lora_B learned within 20 % of the bf16 run's (measured: int8 ~5 %, fp8, with 3 mantissa
    bits, ~13 %; adapters that learned nothing would be 100 % off)."""
    from train import lora
    from train.checkpoint import ADAPTER_DIR

    train(cfg(caches, tmp_path / "bf16", model, weights_dtype="bf16", grad_checkpointing="all"))
    train(cfg(caches, tmp_path / kind, model, base_quant=kind, grad_checkpointing="all"))
    out = capsys.readouterr().out
    assert f"Linear layers in {kind}, the rest in bf16" in out
    bf16, quantized = losses(tmp_path / "bf16"), losses(tmp_path / kind)
    assert len(quantized) == 6 and quantized != bf16
    assert quantized == pytest.approx(bf16, rel=0.01)
    # lora_B starts at zero: what it holds after 6 steps is what was learned
    learned = {run: {k: v for k, v in lora.read_adapter(complete_checkpoints(tmp_path / run)[-1] / ADAPTER_DIR).items()
                     if "lora_B" in k} for run in ("bf16", kind)}
    delta = torch.cat([(learned[kind][k] - learned["bf16"][k]).flatten() for k in learned["bf16"]])
    reference = torch.cat([v.flatten() for v in learned["bf16"].values()])
    assert reference.norm() > 0 and delta.norm() < 0.2 * reference.norm()


def test_the_base_is_quantized_as_it_loads_from_a_directory(tmp_path):
    """A saved transformer loaded with --base-quant int8: every Linear weight is torchao's int8 tensor, the rest bf16;
    its output is the bf16 model's within int8's error; under autocast the quantized layers compute in bf16 (as autocast
    runs an unquantized Linear), not in the fp32 a LayerNorm hands them."""
    from torchao.quantization import Int8Tensor

    from train import quant
    from train.presets import Weights

    preset = get_preset("tiny-sd3")
    build_transformer(preset, None, 0).save_pretrained(tmp_path / "transformer")
    weights = Weights("local", str(tmp_path), path=str(tmp_path))
    reference = build_transformer(preset, weights, 0, torch.bfloat16)
    model = build_transformer(preset, weights, 0, quant="int8")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m.weight, Int8Tensor) for m in linears)
    assert quant.quantized_linears(model) == len(linears)
    assert {p.dtype for p in model.parameters() if not isinstance(p, Int8Tensor)} == {torch.bfloat16}
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 16, 16, 16, generator=g), encoder_hidden_states=torch.randn(2, 20, 32, generator=g),
                  pooled_projections=torch.randn(2, 24, generator=g), timestep=torch.tensor([100.0, 700.0]), return_dict=False)
    outputs = []
    linears[len(linears) // 2].register_forward_hook(lambda m, a, o: outputs.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(**inputs)[0].float(), reference(**inputs)[0].float()
    assert outputs == [torch.bfloat16]
    assert (got - want).abs().mean() < 0.02 * want.abs().mean()


def test_kinds_and_combinations_that_cannot_run_are_refused_with_the_reason(caches, tmp_path):
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        train(cfg(caches, tmp_path / "nf4", base_quant="nf4"))
    with pytest.raises(ValueError, match="frozen transformer"):
        cfg(caches, tmp_path, lora_rank=0, base_quant="int8")
    with pytest.raises(ValueError, match="frozen transformer"):
        cfg(caches, tmp_path, lora_rank=0, blocks_to_swap=1)
    with pytest.raises(ValueError, match="--precision bf16"):
        cfg(caches, tmp_path, base_quant="int8", precision="fp32")
    with pytest.raises(ValueError, match="nf4"):
        cfg(caches, tmp_path, base_quant="nf4", blocks_to_swap=1)
    with pytest.raises(ValueError, match="has 3 blocks"):
        train(cfg(caches, tmp_path / "too-many", blocks_to_swap=4))


def test_a_new_controlnet_copies_the_unquantized_transformer(caches, tmp_path):
    """With --base-quant a new ControlNet still starts from the transformer's released weights (built before the base is
    quantized): its weights equal those of the ControlNet built beside the bf16 base."""
    from train.model import build_model

    built = {}
    for kind in ("none", "int8"):
        c = cfg(caches, tmp_path / kind, "tiny-sd3", lora_rank=0, controlnet=True, weights_dtype="bf16", base_quant=kind)
        built[kind] = build_model(c, get_preset("tiny-sd3"), "none", 1, torch.device("cpu"), resume_from=None, state={},
                                  say=lambda *_: None)
    plain, quantized = (built[k].controlnet.state_dict() for k in ("none", "int8"))
    assert plain.keys() == quantized.keys() and all(torch.equal(plain[k], quantized[k]) for k in plain)
    from train import quant

    assert quant.quantized_linears(built["int8"].module) > 0 and quant.quantized_linears(built["none"].module) == 0


def test_a_quantized_run_exports_adapters_that_merge_onto_the_unquantized_base(caches, tmp_path):
    from train import lora
    from train.export import export

    train(cfg(caches, tmp_path / "run", base_quant="int8", grad_checkpointing="all", steps=3))
    export(tmp_path / "run", tmp_path / "adapters")
    adapters = lora.read_adapter(tmp_path / "adapters")
    assert adapters and all(v.dtype == torch.float32 for v in adapters.values())
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(export(tmp_path / "run", tmp_path / "merged", merge_lora=True))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


# ---- block swapping ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setup", [
    dict(model="tiny-flux", weights_dtype="bf16", grad_checkpointing="all", blocks_to_swap=2),
    dict(model="tiny-flux", weights_dtype="bf16", blocks_to_swap=3),  # every block swapped, none checkpointed otherwise
    dict(model="tiny-flux", base_quant="int8", grad_checkpointing="all", blocks_to_swap=1),
    dict(model="tiny-sd3", lora_rank=0, controlnet=True, weights_dtype="bf16", blocks_to_swap=1),
], ids=["flux-lora", "flux-all-blocks", "flux-int8", "sd3-controlnet"])
def test_block_swapping_gives_the_losses_of_a_run_without_it(caches, tmp_path, setup, capsys):
    model = setup.pop("model")
    train(cfg(caches, tmp_path / "swapped", model, **setup))
    assert "block swapping:" in capsys.readouterr().out
    train(cfg(caches, tmp_path / "resident", model, **{**setup, "blocks_to_swap": 0}))
    assert losses(tmp_path / "swapped") == losses(tmp_path / "resident")


def test_a_resumed_quantized_swapped_run_equals_an_uninterrupted_one(caches, tmp_path):
    """Stopped after 3 steps and resumed with the swap changed (applied on resume, logged): the losses of 6 steps in one go."""
    setup = dict(base_quant="int8", grad_checkpointing="all")
    train(cfg(caches, tmp_path / "straight", **setup, blocks_to_swap=2))
    train(cfg(caches, tmp_path / "resumed", **setup, blocks_to_swap=2, steps=3))
    train(cfg(caches, tmp_path / "resumed", **setup, blocks_to_swap=1))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")


@pytest.mark.slow
def test_two_processes_train_a_quantized_swapped_base_as_one(caches, tmp_path):
    """DDP leaves the frozen (int8, partly swapped) base alone and reduces the adapters: 2 ranks at batch 2 train what one
    process at batch 4 does."""
    args = ["--model", "tiny-flux", "--cache", str(caches / "tiny-flux"), "--lora-rank", "4", "--base-quant", "int8",
            "--blocks-to-swap", "2", "--grad-checkpointing", "all", "--no-validate", "--no-progress", "--log-every", "1",
            "--steps", "3", "--lr", "1e-3", "--checkpoint-every", "3"]
    for nproc, batch in ((1, 4), (2, 2)):
        train_processes(nproc, tmp_path / str(nproc), *args, "--batch-size", str(batch))
    assert losses(tmp_path / "2") == pytest.approx(losses(tmp_path / "1"), rel=2e-3)  # bf16 compute, batches split
    assert complete_checkpoints(tmp_path / "2")


# ---- dry runs against the plan ------------------------------------------------------------------------------

@pytest.mark.parametrize("model,options", [
    ("tiny-sd3", dict(lora_rank=4, base_quant="int8")),
    ("tiny-sana", dict(lora_rank=4, base_quant="int8", grad_checkpointing="all")),
    ("tiny-flux", dict(lora_rank=4, weights_dtype="bf16", blocks_to_swap=2)),
    ("tiny-sana", dict(lora_rank=0, controlnet=True, base_quant="int8", grad_checkpointing="all", blocks_to_swap=1)),
], ids=["sd3-int8", "sana-int8-checkpointed", "flux-swap", "sana-controlnet-int8-swap"])
@pytest.mark.slow
def test_dry_runs_meet_their_plans(caches, tmp_path, model, options):
    result = train(TrainConfig(model=model, cache=caches / model, run=tmp_path, batch_size=8, precision="bf16", progress=False,
                               dry_run=True, validation_steps=2, workers=0, **options))
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.15
