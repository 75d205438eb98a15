"""torchrun on CPU (gloo, 2 processes): DDP and FSDP2 against one process with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.checkpoint import complete_checkpoints

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--model", "tiny-sana", "--precision", "fp32", "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-3",
          "--caption-dropout", "0.2", "--ema-decay", "0.9", "--checkpoint-every", "1000"]


def launch(cache, run, nproc: int, *args: str) -> subprocess.CompletedProcess:
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    out = subprocess.run([*runner, "-m", "train", "--cache", str(cache), "--run-dir", str(run), *COMMON, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_caches, tmp_path_factory):
    """One process at batch 4, and 2 processes at batch 2 under DDP and under FSDP: 6 steps each."""
    root = tmp_path_factory.mktemp("distributed")
    cache = tiny_caches["tiny-sana"]
    launch(cache, root / "one", 1, "--steps", "6", "--batch-size", "4")
    launch(cache, root / "ddp", 2, "--steps", "6", "--batch-size", "2", "--parallel", "ddp")
    launch(cache, root / "fsdp", 2, "--steps", "6", "--batch-size", "2", "--parallel", "fsdp")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(runs, kind):
    one, two = losses(runs / "one"), losses(runs / kind)
    assert len(one) == len(two) == 6
    assert two == pytest.approx(one, rel=1e-4)  # same samples, noise, timesteps and updates


@pytest.mark.slow
def test_fsdp_checkpoint_is_sharded_resumes_exactly_and_exports(tiny_caches, runs, tmp_path):
    ckpt = complete_checkpoints(runs / "fsdp")[-1]
    assert (ckpt / "sharded" / ".metadata").exists() and not (ckpt / "optimizer.pt").exists()
    assert not (ckpt / "transformer" / "diffusion_pytorch_model.safetensors").exists()  # never gathered on one rank
    cache = tiny_caches["tiny-sana"]
    launch(cache, tmp_path / "resumed", 2, "--steps", "3", "--batch-size", "2", "--parallel", "fsdp")
    launch(cache, tmp_path / "resumed", 2, "--steps", "6", "--batch-size", "2", "--parallel", "fsdp")
    assert losses(tmp_path / "resumed") == losses(runs / "fsdp")

    for weights in ("", "--ema"):
        args = [sys.executable, "-m", "train", "export", str(runs / "fsdp"), "--out", str(tmp_path / f"export{weights}")]
        out = subprocess.run(args + ([weights] if weights else []), cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
    exported = load_file(tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    replicated = load_file(complete_checkpoints(runs / "ddp")[-1] / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == replicated.keys()
    for k in exported:  # the same training, sharded or replicated
        torch.testing.assert_close(exported[k], replicated[k], rtol=1e-4, atol=1e-5)
    ema = load_file(tmp_path / "export--ema" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(ema[k], exported[k]) for k in ema)


def test_resuming_with_another_world_size_is_refused(tiny_caches, tmp_path):
    launch(tiny_caches["tiny-sana"], tmp_path, 1, "--steps", "1", "--batch-size", "2")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
                          "--cache", str(tiny_caches["tiny-sana"]), "--run-dir", str(tmp_path), *COMMON, "--steps", "2",
                          "--batch-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "saved with world size 1, this run has 2" in out.stderr


def test_a_block_override_that_matches_nothing_lists_the_blocks():
    from train.distributed import find_blocks
    from train.presets import build_transformer, get_preset

    model = build_transformer(get_preset("tiny-sana"), None, 0)
    assert [type(b).__name__ for b in find_blocks(model)] == ["SanaTransformerBlock"] * 2
    assert len(find_blocks(model, "SanaTransformerBlock")) == 2
    with pytest.raises(ValueError, match=r"'SanaBlock' matches no module.*SanaTransformerBlock"):
        find_blocks(model, "SanaBlock")
