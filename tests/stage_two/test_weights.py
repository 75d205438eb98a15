"""Which weights a run starts from: released ones by default, random ones only when asked, and a clear
error (never a hang) when they cannot be had."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.families import PRESETS, get_preset
from train.loop import train
from train.presets import build_transformer, resolve_weights

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def released(tmp_path, monkeypatch):
    """A preset of the tiny Sana architecture whose "released weights" live in a local directory, as a
    downloaded snapshot would (seed 7, unlike the seeded initialisation's 0)."""
    weights = build_transformer(get_preset("tiny-sana"), None, seed=7)
    weights.save_pretrained(tmp_path / "released" / "transformer")
    preset = dataclasses.replace(get_preset("tiny-sana"), name="released-sana", repo=str(tmp_path / "released"))
    monkeypatch.setitem(PRESETS, "released-sana", lambda: preset)
    return preset, weights.state_dict()


def cfg(cache, run, **kw):
    return TrainConfig(**{**dict(model="released-sana", cache=cache, run=run, steps=1, batch_size=2, lr=1e-30, progress=False,
                                 validate=False, caption_dropout=0.0), **kw})


def test_a_real_preset_starts_from_its_released_weights(tiny_caches, tmp_path, released, capsys):
    preset, published = released
    model = build_transformer(preset, resolve_weights(preset), seed=0)
    assert all(torch.equal(v, published[k]) for k, v in model.state_dict().items())
    train(cfg(tiny_caches["tiny-sana"], tmp_path / "run"))
    assert f"transformer weights: local directory {tmp_path / 'released'}" in capsys.readouterr().out
    state = json.loads((complete_checkpoints(tmp_path / "run")[-1] / "state.json").read_text())
    assert state["weights"] == {"kind": "local", "source": str(tmp_path / "released"), "revision": None, "commit": None}

    # --from-scratch: the architecture with fresh seeded weights, said so
    train(cfg(tiny_caches["tiny-sana"], tmp_path / "scratch", from_scratch=True))
    assert "transformer weights: fresh weights from the published config (seed 0)" in capsys.readouterr().out
    fresh = build_transformer(preset, None, seed=0).state_dict()
    trained = type(model).from_pretrained(complete_checkpoints(tmp_path / "scratch")[-1] / "transformer").state_dict()
    assert all(torch.equal(v, fresh[k]) for k, v in trained.items())  # updates below half an fp32 step: unchanged


def test_lora_on_a_random_base_is_refused(tiny_caches, tmp_path, released):
    with pytest.raises(ValueError, match="LoRA adapts released weights"):
        cfg(tiny_caches["tiny-sana"], tmp_path, lora_rank=4, from_scratch=True)


def test_tiny_presets_keep_their_seeded_initialisation():
    weights = resolve_weights(get_preset("tiny-sana"), seed=3)
    assert weights.kind == "fresh"
    a, b = build_transformer(get_preset("tiny-sana"), weights, seed=3), build_transformer(get_preset("tiny-sana"), None, seed=3)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_offline_without_a_local_copy_names_the_repository_and_the_way_out():
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # conftest
    with pytest.raises(ValueError) as e:
        resolve_weights(get_preset("sana-1600m"))
    message = str(e.value)
    assert "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers" in message
    assert "--pretrained DIR" in message and "--from-scratch" in message
    with pytest.raises(ValueError, match="no such directory"):
        resolve_weights(get_preset("sana-1600m"), "./not/here")


def test_an_unreachable_hub_fails_at_once_instead_of_hanging():
    """No HF_HUB_OFFLINE and no network (or, where there is one, no such repository): the loader answers with
    the message; the timeout only guards the test against a hang."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from train.families import get_preset\nfrom train.presets import resolve_weights\n"
            "try:\n    resolve_weights(get_preset('tiny-sana'), 'cachedit-tests/no-such-model')\nexcept ValueError as e:\n    print('ERROR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_HOME"] = "/nonexistent-hf-home"  # no cached snapshot to fall back on
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ERROR" in out.stdout and "cachedit-tests/no-such-model" in out.stdout, out.stdout + out.stderr[-2000:]
