"""torchrun on CPU (gloo, 2 processes): DDP and FSDP2 against one process with the same global batch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.checkpoint import complete_checkpoints

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--model", "tiny-sana", "--precision", "fp32", "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-3",
          "--caption-dropout", "0.2", "--ema-decay", "0.9", "--checkpoint-every", "3"]


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
    """One process at batch 4, and 2 processes at batch 2 under DDP and under FSDP: 6 steps each,
    checkpointed at steps 3 and 6."""
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
    from train.export import export

    ckpt = complete_checkpoints(runs / "fsdp")[-1]
    assert (ckpt / "sharded" / ".metadata").exists() and not (ckpt / "optimizer.pt").exists()
    assert not (ckpt / "transformer" / "diffusion_pytorch_model.safetensors").exists()  # never gathered on one rank
    # resume the run's step-3 checkpoint in a run directory of its own: steps 4-6 replay exactly
    half = complete_checkpoints(runs / "fsdp")[0]
    assert half.name == "step-00000003"
    shutil.copytree(half, tmp_path / "resumed" / "checkpoints" / half.name)
    launch(tiny_caches["tiny-sana"], tmp_path / "resumed", 2, "--steps", "6", "--batch-size", "2", "--parallel", "fsdp")
    assert losses(tmp_path / "resumed") == losses(runs / "fsdp")[3:]

    for ema in (False, True):  # in one process without a process group: full tensors assembled from the shards
        export(runs / "fsdp", tmp_path / f"export-ema{ema}", ema=ema)
    exported = load_file(tmp_path / "export-emaFalse" / "transformer" / "diffusion_pytorch_model.safetensors")
    replicated = load_file(complete_checkpoints(runs / "ddp")[-1] / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == replicated.keys()
    # The same training, sharded or replicated. Adam normalises every update, so where a gradient is close to
    # zero the order in which reduce-scatter and all-reduce sum it moves that weight by up to a fraction of the
    # learning rate (1e-3) per step; a wrongly assembled shard is off by the size of the weights themselves.
    for k in exported:
        torch.testing.assert_close(exported[k], replicated[k], rtol=0, atol=1e-4)
    ema = load_file(tmp_path / "export-emaTrue" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(ema[k], exported[k]) for k in ema)


def test_resuming_with_another_world_size_is_refused(tiny_caches, runs, tmp_path):
    shutil.copytree(runs / "one", tmp_path / "run")  # saved by one process
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
                          "--cache", str(tiny_caches["tiny-sana"]), "--run-dir", str(tmp_path / "run"), *COMMON, "--steps", "8",
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
