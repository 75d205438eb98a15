"""--masked-loss: the per-element loss weighted by the cached loss mask, for flow and DDPM objectives and through the
packing of families whose latents become tokens; an all-white mask trains exactly as no mask does."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from precompute.encode import Encoders
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from train.config import TrainConfig
from train.families import get_family
from train.loop import train
from train.objectives import DDPM, FlowMatching

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

RUN = dict(workers=0, progress=False, max_shard_mb=0)


def latents_batch(n=2, c=4, h=8, w=8, mask=None):
    g = torch.Generator().manual_seed(0)
    out = {"latents": torch.randn(n, c, h, w, generator=g), "bucket": (64, 64), "keys": ["k"] * n}
    if mask is not None:
        out["mask"] = mask
    return out


class Prediction(torch.nn.Module):
    """A model stand-in whose prediction is a trained tensor: its gradient says which elements the loss reached."""

    def __init__(self, shape):
        super().__init__()
        self.out = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1)))

    def forward(self, xt, t, batch):
        return self.out


OBJECTIVES = {
    "flow": lambda masked: FlowMatching(weighting_scheme="none", masked_loss=masked),
    "flow_x0": lambda masked: FlowMatching(weighting_scheme="sigma_sqrt", precondition_outputs=True, masked_loss=masked),
    "ddpm": lambda masked: DDPM("epsilon", masked_loss=masked),
    "ddpm_v": lambda masked: DDPM("v_prediction", masked_loss=masked),
    "ddpm_learned_variance": lambda masked: DDPM("epsilon", learned_variance=True, masked_loss=masked),
}


@pytest.mark.parametrize("kind", OBJECTIVES)
def test_a_white_mask_gives_the_unmasked_loss_exactly_and_a_half_mask_stops_the_masked_half(kind):
    channels = 8 if kind == "ddpm_learned_variance" else 4
    white = torch.full((2, 1, 8, 8), 255, dtype=torch.uint8)
    plain, _ = OBJECTIVES[kind](False)(Prediction((2, channels, 8, 8)), latents_batch(), torch.Generator().manual_seed(3))
    masked, _ = OBJECTIVES[kind](True)(Prediction((2, channels, 8, 8)), latents_batch(mask=white), torch.Generator().manual_seed(3))
    assert torch.equal(plain, masked)

    half = white.clone()
    half[:, :, :, :4] = 0  # the left half of every latent is not trained
    model = Prediction((2, channels, 8, 8))
    loss, _ = OBJECTIVES[kind](True)(model, latents_batch(mask=half), torch.Generator().manual_seed(3))
    assert not torch.allclose(loss, plain)
    loss.sum().backward()
    grad = model.out.grad.abs().sum(dim=(0, 1))  # (h, w)
    assert torch.all(grad[:, :4] == 0) and torch.all(grad[:, 4:] > 0)


def test_the_mask_weights_each_element_and_the_mean_runs_over_every_element():
    """kohya's and SimpleTuner's normalisation: mean(loss * mask) over every element, not sum(loss * mask) / sum(mask)."""
    mask = torch.zeros((2, 1, 8, 8), dtype=torch.uint8)
    mask[:, :, :2] = 255
    mask[:, :, 2:4] = 51  # latent cells of which a fifth of the pixels are kept
    seen = {}
    pred = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))

    def model(xt, t, b):
        seen.update(xt=xt, s=t / 1000)
        return pred

    b = latents_batch(mask=mask)
    loss, _ = FlowMatching(weighting_scheme="none", masked_loss=True)(model, b, torch.Generator().manual_seed(3))
    x0, s4 = b["latents"], seen["s"][:, None, None, None]
    noise = (seen["xt"] - (1 - s4) * x0) / s4  # what the objective drew
    err = (pred - (noise - x0)) ** 2
    torch.testing.assert_close(loss, (err * mask.float() / 255).mean(dim=(1, 2, 3)), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(loss, (err * mask).sum(dim=(1, 2, 3)) / mask.float().sum(dim=(1, 2, 3)))


def test_a_masked_loss_without_masks_in_the_batch_is_refused():
    with pytest.raises(ValueError, match="--masks"):
        FlowMatching(masked_loss=True)(Prediction((2, 4, 8, 8)), latents_batch(), torch.Generator().manual_seed(3))


def fake_model(shapes: list, kind: str):
    """A transformer stand-in for `Family.forward`: returns a trained tensor of the packed (or per-sample) shape the
    family gives it, so the gradient shows which of its tokens the masked loss reaches."""
    out = {}

    def model(*args, **kwargs):
        if kind == "list":  # Z-Image: a list of per-sample latents (C, 1, h, w)
            out["p"] = [torch.nn.Parameter(torch.randn(x.shape)) for x in args[0]]
            return (out["p"],)
        out["p"] = torch.nn.Parameter(torch.randn(kwargs["hidden_states"].shape))
        return (out["p"],)

    model.out = out
    return model


@pytest.mark.parametrize("name,kind", [("flux", "packed"), ("qwen-image", "packed"), ("z-image", "list")])
def test_packed_families_take_the_mask_through_their_unpacking(name, kind):
    """The prediction a family returns is unpacked to (B, C, h, w) as its pipeline unpacks it: a mask over the left
    half of the latent reaches no token whose 2 x 2 patch lies there, and every token of the right half."""
    family = get_family(name)
    b, c, h, w = 2, 16, 8, 8
    model = fake_model([], kind)
    config = {"guidance_embeds": False}
    batch = {"latents": torch.randn(b, c, h, w), "bucket": (64, 64), "keys": ["k"] * b, "text": torch.zeros(b, 3, 8),
             "text_mask": torch.ones(b, 3, dtype=torch.bool), "pooled": torch.zeros(b, 8)}
    mask = torch.full((b, 1, h, w), 255, dtype=torch.uint8)
    mask[..., : w // 2] = 0
    batch["mask"] = mask

    def forward(xt, t, batch):
        return family.forward(model, config, xt, t, batch, None)

    loss, _ = FlowMatching(weighting_scheme="none", masked_loss=True)(forward, batch, torch.Generator().manual_seed(0))
    loss.sum().backward()
    if kind == "list":
        grads = torch.stack([p.grad for p in model.out["p"]]).squeeze(2)  # (B, C, h, w)
        per_cell = grads.abs().sum(dim=(0, 1))
        assert torch.all(per_cell[:, : w // 2] == 0) and torch.all(per_cell[:, w // 2 :] > 0)
        return
    grad = model.out["p"].grad.abs().sum(dim=(0, 2)).reshape(h // 2, w // 2)  # per token, in the 2 x 2 patch grid
    assert torch.all(grad[:, : w // 4] == 0) and torch.all(grad[:, w // 4 :] > 0)


# ---- end to end: stage one's masks, stage two's loss --------------------------------------------------------------

def write_masks(data: Path, half: bool) -> None:
    for image in sorted(data.glob("*.png")):
        if image.name.endswith(".mask.png"):
            continue
        with Image.open(image) as img:
            mask = Image.new("L", img.size, 255)
        if half:
            mask.paste(0, (0, 0, img.width // 2, img.height))
        mask.save(image.with_name(image.stem + ".mask.png"))


def losses(run: Path, name: str = "loss") -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[name] for r in rows if r.get(name) is not None]


def trained(cache: Path, run: Path, model: str, metric: str = "loss", **kw) -> list[float]:
    options = dict(steps=3, batch_size=4, progress=False, log_every=1, checkpoint_every=1000, caption_dropout=0.0, lr=1e-3,
                   validate=False)
    train(TrainConfig(model=model, cache=[str(cache)], run=run, **{**options, **kw}))
    return losses(run, metric)


@pytest.mark.parametrize("model", ["tiny-sana", "tiny-flux"])
def test_masked_loss_with_white_masks_equals_unmasked_exactly_and_differs_with_half_masks(tmp_path, model, monkeypatch):
    data = make_folder(tmp_path / "data", count=8)
    write_masks(data, half=False)
    precompute(str(data), model, tmp_path / "plain", **RUN)  # the mask files are no training images
    precompute(str(data), model, tmp_path / "masked", masks=True, **RUN)
    unmasked = trained(tmp_path / "plain", tmp_path / "unmasked", model)
    white = trained(tmp_path / "masked", tmp_path / "white", model, masked_loss=True)
    assert len(unmasked) == 3 and white == unmasked  # bit for bit

    write_masks(data, half=True)
    calls = []
    encode = Encoders.encode_images
    monkeypatch.setattr(Encoders, "encode_images", lambda self, px: calls.append(len(px)) or encode(self, px))
    summary = precompute(str(data), model, tmp_path / "masked", masks=True, **RUN)
    assert summary["changed"] == 8 and summary["latents_reused"] == 8 and calls == []  # new masks, no VAE
    half = trained(tmp_path / "masked", tmp_path / "half", model, masked_loss=True)
    assert all(a != b for a, b in zip(half, unmasked))
    # the same cache without --masked-loss trains as if it had no masks
    assert trained(tmp_path / "masked", tmp_path / "ignored", model) == unmasked

    # the held-out loss is the training loss: masked the same way
    held = dict(metric="eval_loss", eval_fraction=0.25, eval_every=1, eval_timesteps=2, batch_size=2)
    masked_eval = trained(tmp_path / "masked", tmp_path / "eval-masked", model, masked_loss=True, **held)
    plain_eval = trained(tmp_path / "masked", tmp_path / "eval-plain", model, **held)
    assert len(masked_eval) == len(plain_eval) > 1 and all(a < b for a, b in zip(masked_eval, plain_eval))


def test_a_masked_loss_run_on_a_cache_without_masks_is_refused(tiny_caches, tmp_path):
    with pytest.raises(ValueError, match=r"--masked-loss: .* holds no loss masks.*--masks"):
        trained(tiny_caches["tiny-sana"], tmp_path / "run", "tiny-sana", masked_loss=True)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_masked_loss_is_an_option_with_help():
    from train.config import ObjectiveOptions

    help_text = {f.name: f.metadata["help"] for f in ObjectiveOptions.__dataclass_fields__.values()}["masked_loss"]
    assert "kohya" in help_text and "mean" in help_text
    assert TrainConfig(model="tiny-sana", masked_loss=True).masked_loss


def test_the_planner_counts_the_mask_in_the_objective_bytes():
    from train.plan_costs import measure_objective_bytes

    plain = measure_objective_bytes(FlowMatching(weighting_scheme="none"), 4, 4)
    masked = measure_objective_bytes(FlowMatching(weighting_scheme="none", masked_loss=True), 4, 4)
    assert masked[1] > plain[1]  # the mask and its product with the loss, at the peak
