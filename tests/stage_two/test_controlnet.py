"""ControlNet training (SD3, Sana) from caches with control latents built by stage one: only the ControlNet trains,
resumes exactly, exports to what the stock ControlNet pipelines load, and computes what they compute."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VALIDATION_PROMPTS, pipeline_kwargs, stock_pipeline, train_processes
from controlnet_testing import MODELS, build_caches, cfg, perturbed
from PIL import Image, ImageDraw

from shards import Cache, LatentSpec
from train import controlnet
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.families import get_preset
from train.loop import train
from train.presets import build_transformer, model_forward

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    return build_caches(tmp_path_factory.mktemp("control"), plain=True)


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(caches, tmp_path_factory):
    """Per model, an uninterrupted run of 8 steps (the trained Model captured) and one stopped at step 4 and resumed."""
    import train.loop as loop

    root = tmp_path_factory.mktemp("controlnet-runs")
    out = {}
    for model in MODELS:
        built = []
        real = loop.build_model
        loop.build_model = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
        try:
            train(cfg(caches[model], root / model / "straight", model))
        finally:
            loop.build_model = real
        train(cfg(caches[model], root / model / "resumed", model, steps=4))
        train(cfg(caches[model], root / model / "resumed", model))
        out[model] = (root / model, built[0])
    return out


@pytest.mark.parametrize("model", MODELS)
def test_a_new_controlnet_copies_the_transformer_and_starts_at_zero(model):
    preset = get_preset(model)
    transformer = build_transformer(preset, None, 0)
    config = dict(transformer.config)
    net = controlnet.build_controlnet(transformer, preset.family, seed=0)
    assert dict(transformer.config) == config  # diffusers' from_transformer writes into the config it is given
    assert net.config.num_layers == 1  # the default, within what the 2-block transformer takes
    theirs = transformer.state_dict()
    projections = 0
    for name, p in net.state_dict().items():
        if name.startswith(("controlnet_blocks.", "input_block.", "pos_embed_input.")):
            assert not p.any(), name
            projections += 1
        elif name.startswith("transformer_blocks.0.") and name in theirs:
            assert torch.equal(p, theirs[name]), name
    assert projections >= 4
    g = torch.Generator().manual_seed(1)
    xt, batch = inputs(model, g)
    t = torch.tensor([120.0, 810.0])
    with torch.no_grad():  # zero residuals: exactly the transformer alone
        assert torch.equal(controlnet.controlled_forward(transformer, net, preset.family)(xt, t, batch),
                           model_forward(transformer, preset.family)(xt, t, batch))


def inputs(model: str, g: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Noisy latents and a batch of the trainer's form (cache text fields, control latent) for a tiny preset."""
    channels = get_preset(model).transformer_config()["in_channels"]
    batch = {"control": torch.randn(2, channels, 8, 8, generator=g)}
    if model == "tiny-sd3":
        batch.update(clip=torch.randn(2, 77, 24, generator=g), pooled=torch.randn(2, 24, generator=g),
                     text=torch.randn(2, 6, 32, generator=g))
    else:
        batch.update(text=torch.randn(2, 6, 32, generator=g), text_mask=torch.tensor([[True] * 6, [True] * 4 + [False] * 2]))
    return torch.randn(2, channels, 8, 8, generator=g), batch


def test_depth_and_structure_are_checked():
    for name, layers in (("sd35-large", 12), ("sana-1600m", 7)):  # the defaults, built on the meta device as a planner would
        preset = get_preset(name)
        with torch.device("meta"):
            net = controlnet.build_controlnet(preset.transformer_class.from_config(preset.transformer_config()), preset.family)
        assert net.config.num_layers == layers and next(net.parameters()).device.type == "meta"
    sana, sd3 = get_preset("tiny-sana"), get_preset("tiny-sd3")
    transformer = build_transformer(sana, None, 0)
    with pytest.raises(ValueError, match="has 2 blocks and takes the residuals of at most 1"):
        controlnet.build_controlnet(transformer, "sana", layers=2)
    qk = type(sana)(**{**sana.__dict__, "config": {**sana.transformer_config(), "qk_norm": "rms_norm_across_heads"}})
    with pytest.raises(ValueError, match="cannot mirror this transformer.*qk_norm"):
        controlnet.build_controlnet(build_transformer(qk, None, 0), "sana")
    wide = type(sd3)(**{**sd3.__dict__, "config": {**sd3.transformer_config(), "num_layers": 4}})
    net = controlnet.build_controlnet(build_transformer(wide, None, 0), "sd3", layers=2)
    with pytest.raises(ValueError, match="2 blocks: the transformer's 2 blocks take the residuals of at most 1"):
        controlnet.check_fits(net, build_transformer(sd3, None, 0), "sd3")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_the_controlled_forward_is_what_the_stock_pipeline_computes(tmp_path, model):
    """The stock ControlNet pipeline's transformer output at one denoising step equals `controlled_forward` on the
    inputs it fed the ControlNet and the transformer, the control latent taken back to the cache's form; also for
    an SD3 ControlNet trained without the VAE's shift and with zeroed pooled prompts (InstantX's)."""
    import diffusers

    preset = get_preset(model)
    transformer = build_transformer(preset, None, 0)
    net = perturbed(controlnet.build_controlnet(transformer, preset.family, seed=0))
    base = stock_pipeline(model, transformer, tmp_path / "parts")
    cls = diffusers.StableDiffusion3ControlNetPipeline if model == "tiny-sd3" else diffusers.SanaControlNetPipeline
    pipe = cls(**{k: v for k, v in base.components.items() if v is not None}, controlnet=net)
    seen = {}
    hooks = [pipe.controlnet.register_forward_pre_hook(lambda m, a, k: seen.update(cn=(a, k)), with_kwargs=True),
             pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.update(tr=(a, k)), with_kwargs=True),
             pipe.transformer.register_forward_hook(lambda m, a, out: seen.update(out=out[0]))]
    control_image = Image.new("RGB", (256, 256), "black")
    ImageDraw.Draw(control_image).ellipse((60, 60, 200, 200), outline="white", width=6)
    vae = pipe.vae.config
    latent = LatentSpec(16, 8, vae.scaling_factor, vae.get("shift_factor") or 0.0, "mean_std")
    for zeros in ([False, True] if model == "tiny-sd3" else [None]):
        if zeros is not None:
            net.register_to_config(force_zeros_for_pooled_projection=zeros)
        pipe(VALIDATION_PROMPTS[0], control_image=control_image, height=256, width=256, num_inference_steps=1, guidance_scale=4.5,
             output_type="latent", generator=torch.Generator().manual_seed(0), **pipeline_kwargs(model))
        (_cn_args, cn_kwargs), (tr_args, tr_kwargs), expected = seen["cn"], seen["tr"], seen["out"]
        xt = tr_kwargs.get("hidden_states", tr_args[0] if tr_args else None)
        cond = cn_kwargs["controlnet_cond"]
        if model == "tiny-sd3":
            text = tr_kwargs["encoder_hidden_states"]
            batch = {"clip": text[:, :77], "text": text[:, 77:], "pooled": tr_kwargs["pooled_projections"],
                     # the cache stores (z - shift) * scaling; this ControlNet's pipeline fed it z * scaling
                     "control": cond - latent.shift_factor * latent.scaling_factor if zeros else cond}
            if zeros:
                assert not cn_kwargs["pooled_projections"].any()
        else:
            batch = {"text": tr_kwargs["encoder_hidden_states"], "text_mask": tr_kwargs["encoder_attention_mask"], "control": cond}
        with torch.no_grad():
            ours = controlnet.controlled_forward(transformer, net, preset.family, latent=latent)(xt, tr_kwargs["timestep"], batch)
            alone = model_forward(transformer, preset.family)(xt, tr_kwargs["timestep"], batch)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ours, alone)  # the residuals count
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("model", MODELS)
def test_training_changes_only_the_controlnet(runs, model):
    root, built = runs[model]
    preset = get_preset(model)
    assert built.controlnet is not None and built.module is not built.controlnet
    fresh = build_transformer(preset, None, 0)
    after = built.module.state_dict()
    assert after.keys() == fresh.state_dict().keys()
    assert all(torch.equal(after[k], v) for k, v in fresh.state_dict().items())  # the frozen transformer, bit for bit
    assert not any(p.requires_grad for p in built.module.parameters())

    ckpt = complete_checkpoints(root / "straight")[-1]
    assert sorted(p.name for p in (ckpt / "transformer").iterdir()) == ["config.json"]  # the base is not saved again
    state = json.loads((ckpt / "state.json").read_text())
    assert state["weights"]["kind"] == "fresh" and state["config"]["controlnet"]
    saved = controlnet.load_checkpoint(ckpt, preset.family)
    initial = controlnet.build_controlnet(fresh, preset.family, seed=0)
    n = sum(1 for _ in saved.parameters())
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert sum(len(g["params"]) for g in optimizer["param_groups"]) == n  # the ControlNet's parameters alone
    assert len(torch.load(ckpt / "ema.pt", weights_only=True)["shadow_params"]) == n
    moved = {name for name, p in saved.named_parameters() if not torch.equal(p, dict(initial.named_parameters())[name])}
    assert "controlnet_blocks.0.weight" in moved and len(moved) > n // 2
    assert saved.controlnet_blocks[0].weight.abs().sum() > 0  # the zero-initialised output projection trained


@pytest.mark.parametrize("model", MODELS)
def test_a_resumed_run_equals_an_uninterrupted_one(runs, caches, model):
    root, _ = runs[model]
    straight, resumed = losses(root / "straight"), losses(root / "resumed")
    assert len(straight) == 8 and resumed == straight
    a = torch.load(complete_checkpoints(root / "straight")[-1] / "ema.pt", weights_only=True)["shadow_params"]
    b = torch.load(complete_checkpoints(root / "resumed")[-1] / "ema.pt", weights_only=True)["shadow_params"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="--controlnet True, this run has False: a ControlNet run's checkpoints"):
        train(cfg(caches[model], root / "resumed", model, steps=10, controlnet=False, ema_decay=0.9))


@pytest.mark.parametrize("model", MODELS)
def test_the_export_loads_into_the_stock_pipeline_and_follows_the_control_image(runs, tmp_path, model):
    import diffusers

    root, _ = runs[model]
    out = subprocess.run([sys.executable, "-m", "train", "export", str(root / "straight"), "--out", str(tmp_path / "export"), "--ema"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    preset = get_preset(model)
    cls = {"tiny-sd3": diffusers.SD3ControlNetModel, "tiny-sana": diffusers.SanaControlNetModel}[model]
    net = cls.from_pretrained(tmp_path / "export", subfolder="controlnet")
    ckpt = complete_checkpoints(root / "straight")[-1]
    shadow = torch.load(ckpt / "ema.pt", weights_only=True)["shadow_params"]
    assert all(torch.equal(p, s) for p, s in zip(net.parameters(), shadow))  # --ema: the EMA weights
    provenance = json.loads((tmp_path / "export" / "controlnet" / "training.json").read_text())
    assert provenance["weights"] == "ema" and provenance["step"] == 8 and "base" in provenance
    # --pretrained-controlnet continues from an export (its controlnet/ subfolder)
    again = controlnet.build_controlnet(build_transformer(preset, None, 0), preset.family, pretrained=str(tmp_path / "export"))
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), net.parameters()))

    base = stock_pipeline(model, build_transformer(preset, None, 0), tmp_path / "parts")
    pipeline = diffusers.StableDiffusion3ControlNetPipeline if model == "tiny-sd3" else diffusers.SanaControlNetPipeline
    pipe = pipeline(**{k: v for k, v in base.components.items() if v is not None}, controlnet=net)

    def generate(control: Image.Image) -> torch.Tensor:
        torch.manual_seed(0)  # SD3's pipeline samples the control image's latent from the VAE's posterior
        return pipe(VALIDATION_PROMPTS[0], control_image=control, height=256, width=256, num_inference_steps=2, guidance_scale=4.5,
                    output_type="latent", generator=torch.Generator().manual_seed(0), **pipeline_kwargs(model)).images

    circle, square = (Image.new("RGB", (256, 256), "black") for _ in range(2))
    ImageDraw.Draw(circle).ellipse((60, 60, 200, 200), outline="white", width=6)
    ImageDraw.Draw(square).rectangle((30, 100, 120, 230), outline="white", width=6)
    first, again, other = generate(circle), generate(circle), generate(square)
    assert torch.isfinite(first).all() and torch.equal(first, again)
    assert not torch.allclose(first, other)  # the control image steers the output


@pytest.mark.parametrize("model", MODELS)
def test_batches_carry_the_control_latent_drawn_after_the_latent(caches, model):
    from train.data import TrainingSamples
    from train.order import seeded_generator

    cache = Cache(caches[model])
    with_control = TrainingSamples(cache, 3, 0.0, control=True)
    without = TrainingSamples(cache, 3, 0.0)
    item = with_control[(2, 5)]
    assert torch.equal(item["latent"], without[(2, 5)]["latent"])  # the latent's draw comes first, as before
    sample, g = cache[5], seeded_generator(3, 2, 5)
    if model == "tiny-sd3":  # the posterior, drawn with the sample's own generator right after the latent
        mean, std = (sample[f"control_latent_{k}"].float() for k in ("mean", "std"))
        torch.randn(mean.shape, generator=g)
        expected = mean + std * torch.randn(mean.shape, generator=g)
    else:
        expected = sample["control_latent"].float()
    assert torch.equal(item["control"], expected)
    assert torch.equal(with_control[(2, 5)]["control"], item["control"])  # deterministic
    pair = next(list(r) for ranges in cache.ranges_by_bucket().values() for r in ranges if len(r) >= 2)[:2]  # one bucket
    batch = with_control.batch(2, pair)
    assert batch["control"].shape == batch["latents"].shape == (2, *item["control"].shape[:1], *batch["latents"].shape[2:])
    assert torch.equal(batch["control"][1], with_control[(2, pair[1])]["control"])


def test_refusals_say_why(caches, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="PixArt-Sigma has no ControlNet in diffusers"):
        TrainConfig(model="tiny-pixart", controlnet=True)
    with pytest.raises(ValueError, match="--controlnet with --lora-rank: a ControlNet run trains the ControlNet alone"):
        TrainConfig(model="tiny-sd3", controlnet=True, lora_rank=4)
    with pytest.raises(ValueError, match="--controlnet-layers 3: the depth"):
        TrainConfig(model="tiny-sd3", controlnet_layers=3)
    assert TrainConfig(model="tiny-sd3", pretrained_controlnet="some/controlnet").controlnet
    with pytest.raises(ValueError, match="validates on cached dataset items .* not on --validation-prompt"):
        TrainConfig(model="tiny-sd3", controlnet=True, validation_prompt=["a red circle"])
    with pytest.raises(ValueError, match="--validation-items -1: must be at least 0"):
        TrainConfig(model="tiny-sd3", controlnet=True, validation_items=-1)
    from train.loop import parallelism

    with pytest.raises(ValueError, match="--controlnet trains with the frozen transformer and the ControlNet replicated"):
        parallelism(TrainConfig(model="tiny-sana", controlnet=True, parallel="fsdp"), 2, torch.device("cpu"))

    from train import model as building

    monkeypatch.setattr(building, "build_transformer", lambda *a, **k: pytest.fail("weights loaded before the cache was checked"))
    with pytest.raises(ValueError, match=r"holds none\. Build a cache with them with stage one's --control.*"
                                         r"--model tiny-sana --cache CACHE --control"):
        train(cfg(caches["plain"], tmp_path, "tiny-sana"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("model", MODELS)
def test_gradient_checkpointing_covers_both_and_keeps_the_gradients(model):
    from train.model import checkpoint_blocks

    preset = get_preset(model)

    def grads(every: int) -> list[torch.Tensor]:
        transformer = build_transformer(preset, None, 0).requires_grad_(False)
        net = perturbed(controlnet.build_controlnet(transformer, preset.family, seed=0))
        if every:
            assert (checkpoint_blocks(net, every), checkpoint_blocks(transformer, every)) == {1: (1, 2), 2: (0, 1)}[every]
        xt, batch = inputs(model, torch.Generator().manual_seed(2))
        out = controlnet.controlled_forward(transformer, net, preset.family)(xt, torch.tensor([100.0, 600.0]), batch)
        out.square().mean().backward()
        assert all(p.grad is None for p in transformer.parameters())
        return [p.grad.clone() if p.grad is not None else None for p in net.parameters()]

    plain = grads(0)
    assert sum(g is not None and bool(g.any()) for g in plain) > len(plain) // 2
    for every in (1, 2):
        for a, b in zip(plain, grads(every)):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-5, atol=1e-7))


@pytest.mark.slow
def test_two_processes_train_the_controlnet_as_one(caches, tmp_path):
    """DDP wraps the ControlNet alone (SD3's has parameters without gradients): 2 ranks at batch 1 train what one
    process at batch 2 does."""
    args = ["--model", "tiny-sd3", "--cache", str(caches["tiny-sd3"]), "--controlnet", "--precision", "fp32", "--no-validate",
            "--no-progress", "--log-every", "1", "--steps", "3", "--lr", "5e-3", "--checkpoint-every", "3"]
    for nproc, batch in ((1, 2), (2, 1)):
        train_processes(nproc, tmp_path / str(nproc), *args, "--batch-size", str(batch))
    assert losses(tmp_path / "2") == pytest.approx(losses(tmp_path / "1"), rel=1e-4)
    assert (complete_checkpoints(tmp_path / "2")[-1] / "controlnet" / "diffusion_pytorch_model.safetensors").exists()


# ---- validation and the memory plan ------------------------------------------------------------------------------


