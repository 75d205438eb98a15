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

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--model", "tiny-sana", "--precision", "fp32", "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-3",
          "--caption-dropout", "0.2", "--ema-decay", "0.9", "--checkpoint-every", "3"]


# Runs `python -m train` recording what the transformer and its first block receive as `timestep`, per rank,
# after FSDP's forward hooks have had their say (the hooks run before the patched `forward`).
RECORDER = """
import inspect, os, sys
import torch
sys.path.insert(0, {root!r})
from diffusers.models.transformers.sana_transformer import SanaTransformer2DModel, SanaTransformerBlock
seen = {{"model": [], "block": []}}

def recording(cls, key):
    real, signature = cls.forward, inspect.signature(cls.forward)
    def forward(self, *args, **kwargs):
        t = signature.bind(self, *args, **kwargs).arguments.get("timestep")
        if t.device.type != "meta" and torch.is_grad_enabled() and len(seen[key]) < len(seen["model"]) + (key == "model"):  # once per step
            seen[key].append((str(t.dtype), t.detach().float().cpu().clone()))
        return real(self, *args, **kwargs)
    cls.forward = forward

recording(SanaTransformer2DModel, "model")
recording(SanaTransformerBlock, "block")
from train.__main__ import main
try:
    main()
finally:
    torch.save(seen, os.path.join(sys.argv[sys.argv.index("--run-dir") + 1], f"inputs-rank{{os.environ.get('RANK', '0')}}.pt"))
"""


def launch(cache, run, nproc: int, *args: str, record: bool = False) -> subprocess.CompletedProcess:
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    entry = ["-m", "train"]
    if record:
        Path(run).mkdir(parents=True, exist_ok=True)
        (Path(run) / "record.py").write_text(RECORDER.format(root=str(ROOT)))
        entry = [str(Path(run) / "record.py")]
    out = subprocess.run([*runner, *entry, "--cache", str(cache), "--run-dir", str(run), *COMMON, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def two_source_cache(root: Path) -> Path:
    """A tiny-sana cache of two sources of 4 images each, the first drawn three times an epoch."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    a, b = make_folder(root / "a", count=4, seed=1), make_folder(root / "b", count=4, seed=2)
    (root / "data.toml").write_text(f'[[source]]\npath = "{a}"\nrepeats = 3\n\n[[source]]\npath = "{b}"\n')
    precompute(str(root / "data.toml"), "tiny-sana", root / "cache", workers=0, progress=False)
    return root / "cache"


@pytest.fixture(scope="module")
def runs(tiny_caches, tmp_path_factory):
    """One process at batch 4, and 2 processes at batch 2 under DDP and under FSDP: 6 steps each,
    checkpointed at steps 3 and 6, from a cache of two sources."""
    root = tmp_path_factory.mktemp("distributed")
    cache = two_source_cache(root / "sources")
    launch(cache, root / "one", 1, "--steps", "6", "--batch-size", "4")
    launch(cache, root / "ddp", 2, "--steps", "6", "--batch-size", "2", "--parallel", "ddp")
    launch(cache, root / "fsdp", 2, "--steps", "6", "--batch-size", "2", "--parallel", "fsdp")
    # bf16 compute: autocast in one process, FSDP's bf16 parameters in two
    cache = tiny_caches["tiny-sana"]
    bf16 = ["--steps", "3", "--precision", "bf16"]
    launch(cache, root / "one-bf16", 1, *bf16, "--batch-size", "4", record=True)
    launch(cache, root / "fsdp-bf16", 2, *bf16, "--batch-size", "2", "--parallel", "fsdp", record=True)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(runs, kind):
    one, two = losses(runs / "one"), losses(runs / kind)
    assert len(one) == len(two) == 6
    assert two == pytest.approx(one, rel=1e-4)  # same samples, noise, timesteps and updates


@pytest.mark.slow
def test_sources_are_drawn_alike_by_one_process_and_two(runs):
    """samples_by_source in metrics.jsonl: what the data order plans for the run's 24 samples, on 1 and 2 ranks."""
    from shards import Cache
    from train.order import BatchPlan

    plan = BatchPlan.of(Cache(runs / "sources" / "cache"), 4, seed=0)
    expected = {}
    for planned in list(plan.global_batches(0))[:6]:
        expected[planned.source] = expected.get(planned.source, 0) + 4
    drawn = {kind: json.loads((runs / kind / "metrics.jsonl").read_text().splitlines()[-1])["samples_by_source"]
             for kind in ("one", "ddp", "fsdp")}
    assert drawn["one"] == drawn["ddp"] == drawn["fsdp"] == expected
    assert set(expected) == {"a", "b"} and plan.draws_by_source() == {"a": 12, "b": 4}


@pytest.mark.slow
def test_fsdp_in_bf16_feeds_the_model_what_one_process_does(runs):
    """FSDP's bf16 parameters must not round the fp32 flow timesteps (sigma * 1000) the model receives; its
    blocks see their inputs in the dtypes of one process under autocast; the losses agree to bf16's precision."""
    one = torch.load(runs / "one-bf16" / "inputs-rank0.pt")
    ranks = [torch.load(runs / "fsdp-bf16" / f"inputs-rank{r}.pt") for r in range(2)]
    assert len(one["model"]) == 3 and all(len(r["model"]) == 3 for r in ranks)
    for step in range(3):
        dtype, whole = one["model"][step]
        assert dtype == "torch.float32"
        for r, seen in enumerate(ranks):
            assert seen["model"][step][0] == "torch.float32"
            assert torch.equal(seen["model"][step][1], whole[2 * r : 2 * r + 2])  # this rank's half of the global batch, unrounded
            assert seen["block"][step][0] == one["block"][step][0]
            torch.testing.assert_close(seen["block"][step][1], one["block"][step][1][2 * r : 2 * r + 2], rtol=2e-2, atol=2e-2)
    assert losses(runs / "fsdp-bf16") == pytest.approx(losses(runs / "one-bf16"), rel=2e-2)


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
    launch(runs / "sources" / "cache", tmp_path / "resumed", 2, "--steps", "6", "--batch-size", "2", "--parallel", "fsdp")
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


@pytest.mark.slow
def test_resuming_with_another_world_size_is_refused(tiny_caches, runs, tmp_path):
    shutil.copytree(runs / "one", tmp_path / "run")  # saved by one process
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
                          "--cache", str(runs / "sources" / "cache"), "--run-dir", str(tmp_path / "run"), *COMMON, "--steps", "8",
                          "--batch-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "saved with world size 1, this run has 2" in out.stderr


def test_a_block_override_that_matches_nothing_lists_the_blocks():
    from train.distributed import find_blocks
    from train.families import get_preset
    from train.presets import build_transformer

    model = build_transformer(get_preset("tiny-sana"), None, 0)
    assert [type(b).__name__ for b in find_blocks(model)] == ["SanaTransformerBlock"] * 2
    assert len(find_blocks(model, "SanaTransformerBlock")) == 2
    with pytest.raises(ValueError, match=r"'SanaBlock' matches no module.*SanaTransformerBlock"):
        find_blocks(model, "SanaBlock")


@pytest.mark.slow
def test_a_damaged_sample_stops_every_rank_at_the_same_step_after_a_checkpoint(tiny_caches, tmp_path):
    import struct

    from shards import Cache

    cache = tmp_path / "cache"
    shutil.copytree(tiny_caches["tiny-sana"], cache)
    shard = cache / Cache(cache).shards[0].path
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, _ = json.loads(raw[8 : 8 + n])["latent"]["data_offsets"]
    raw[8 + n + begin + 1] ^= 0x01  # one byte of the first sample's latent
    shard.write_bytes(bytes(raw))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
                          "--cache", str(cache), "--run-dir", str(tmp_path / "run"), *COMMON, "--steps", "6", "--batch-size", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    assert str(shard) in out.stderr and "--repair" in out.stderr
    assert out.stderr.count("Training stopped at step") == 2  # both ranks, at the same step, no hang
    state = json.loads((complete_checkpoints(tmp_path / "run")[-1] / "state.json").read_text())
    assert state["step"] < 6
