"""Learning-rate schedules: diffusers' (`get_scheduler`) by name, with warm-up, followed by the run and resumed exactly."""

import json
import math

import pytest
import torch

from train.config import TrainConfig
from train.loop import train
from train.model import build_schedule

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

STEPS, WARMUP, LR = 12, 3, 1e-3


def lrs(name: str, **options) -> list[float]:
    """The lr of each of the run's steps under schedule `name`."""
    cfg = TrainConfig(model="tiny-sana", steps=STEPS, warmup_steps=WARMUP, lr=LR, lr_schedule=name, **options)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler, seen = build_schedule(cfg, optimizer), []
    for _ in range(STEPS):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_every_schedule_warms_up_then_follows_its_shape():
    warmup = [LR * s / WARMUP for s in range(WARMUP)]  # from 0, as diffusers' schedules do
    decay = STEPS - WARMUP
    expected = {
        "constant": [LR * 1.0] * decay,
        "linear": [LR * (STEPS - s) / decay for s in range(WARMUP, STEPS)],
        "cosine": [LR * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / decay)) for s in range(WARMUP, STEPS)],
    }
    for name, after in expected.items():
        assert lrs(name) == pytest.approx(warmup + after), name
    # two hard restarts: back at the peak half-way through the decay
    restarts = lrs("cosine_with_restarts", lr_cycles=2)
    assert restarts[:WARMUP] == pytest.approx(warmup)
    half = WARMUP + decay // 2 + (decay % 2)
    assert restarts[WARMUP] == pytest.approx(LR) and restarts[half] > restarts[half - 1]
    # polynomial: from the peak towards --lr-end with the given power
    poly = lrs("polynomial", lr_power=2.0, lr_end=1e-5)
    assert poly[WARMUP] == pytest.approx(LR)
    assert poly[-1] == pytest.approx((LR - 1e-5) * (1 / decay) ** 2 + 1e-5)
    with pytest.raises(ValueError, match="--lr-end"):
        lrs("polynomial", lr_end=LR)


@pytest.mark.parametrize("name,options", [("cosine_with_restarts", {"lr_cycles": 2}), ("polynomial", {"lr_power": 2.0})])
def test_a_resumed_schedule_continues_exactly(tiny_caches, tmp_path, name, options):
    """Resumed from the checkpoint of step 5 (in another run directory): the lr of every later step, and so the losses,
    are those of the uninterrupted run."""
    common = dict(model="tiny-sana", cache=tiny_caches["tiny-sana"], batch_size=4, progress=False, log_every=1, workers=0,
                  checkpoint_every=5, lr=LR, warmup_steps=WARMUP, lr_schedule=name, validate=False, steps=STEPS, **options)
    train(TrainConfig(run=tmp_path / "straight", **common))
    train(TrainConfig(run=tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoints" / "step-00000005"), **common))

    def logged(run):
        return {r["step"]: (r["lr"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    straight, resumed = logged(tmp_path / "straight"), logged(tmp_path / "resumed")
    assert sorted(resumed) == list(range(6, STEPS + 1)) and len(straight) == STEPS
    assert resumed == {step: straight[step] for step in resumed}
