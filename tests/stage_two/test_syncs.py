"""A training step waits for the device once: the gradient norm's read, which brings the loop's flags (stop, damaged)
agreed across ranks with it; its micro-batches never wait. Counted on the CPU by `bench.sync_counter.SyncCounter`
(what `torch.cuda.set_sync_debug_mode` reports on CUDA, see its docstring), for every family's tiny preset, in the
training loop, and in two processes under torchrun; on CUDA by the sync debug mode itself."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from bench.sync_counter import SyncCounter
from bench.syncs import THE_READ, step_batch, syncs_per_step
from train.families import PRESETS, get_preset

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
TINY = [name for name in PRESETS if name.startswith("tiny-")]


# --- the counter counts what CUDA would wait for, and nothing else ------------------------------------------------

def counted(fn, *device) -> list[str]:
    counter = SyncCounter()
    counter.mark(device)
    with counter:
        fn()
    return [s.kind for s in counter.syncs]


def test_the_counter_counts_reads_of_device_tensors_and_blocking_copies_to_the_device():
    d = torch.device("cpu")  # the training device of a CPU run, named as code names it (x.device, self.device)
    x = torch.randn(4)  # marked as on the device
    assert counted(lambda: x.sum().item(), x) == ["read (item / bool / float / int)"]
    assert counted(lambda: bool((x > 0).any()), x) == ["read (item / bool / float / int)"]
    assert counted(lambda: float(x.norm()), x) == ["read (item / bool / float / int)"]
    assert counted(lambda: x.tolist(), x) == ["read (tolist)"]
    assert counted(lambda: x.cpu().numpy(), x) == ["read (cpu)"]  # one read, the copy's values are on the host
    assert counted(lambda: f"{x.sum()}", x) == ["read (__format__)"]
    assert counted(lambda: x[x > 0], x) == ["boolean mask indexing"]
    assert counted(lambda: torch.nonzero(x), x) == ["data-sized nonzero"]
    assert counted(lambda: torch.tensor([1.0, 2.0], device=d), x) == ["blocking copy host -> device (torch.tensor(..., device=))"]
    assert counted(lambda: torch.arange(3).to(d), x) == ["blocking copy host -> device (to)"]
    assert counted(lambda: x[torch.tensor([0, 2])], x) == ["host index tensor copied to the device"]
    grads = torch.randn(3, requires_grad=True)
    assert counted(lambda: (grads * 2).sum().backward() or grads.grad.sum().item(), grads) == ["read (item / bool / float / int)"]


def test_the_counter_leaves_host_values_and_device_work_alone():
    d = torch.device("cpu")
    x = torch.randn(4)
    assert counted(lambda: torch.randn(4).sum().item(), x) == []  # a host tensor: no device to wait for
    assert counted(lambda: torch.arange(3, device=d) + x[:3], x) == []  # built on the device
    assert counted(lambda: torch.full((2,), 3.5, device=d) * x.sum(), x) == []
    assert counted(lambda: torch.arange(3).to(d, non_blocking=True), x) == []  # an asynchronous copy
    assert counted(lambda: x.new_zeros(3).__setitem__(1, 2.0), x) == []  # a Python number: a fill
    assert counted(lambda: torch.nn.utils.rnn.pad_sequence([x[:2], x[:3]]), x) == []  # its output is made inside it
    assert counted(lambda: torch.zeros(2, 3).numpy() + x.shape[0], x) == []


def test_the_pipelines_own_id_builders_are_counted():
    """What the families replaced: FluxPipeline builds its ids on the host and copies them; a mask's selection."""
    from diffusers import FluxPipeline

    d, x = torch.device("cpu"), torch.randn(2, 3)
    assert counted(lambda: FluxPipeline._prepare_latent_image_ids(1, 4, 4, d, torch.float32), x) == ["blocking copy host -> device (to)"]
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert counted(lambda: [r[m] for r, m in zip(x, mask)], x, mask) == ["boolean mask indexing"] * 2


# --- a training step of every family: one read per optimizer step, none per micro-batch -----------------------------

@pytest.mark.parametrize("name", TINY)
def test_a_step_of_every_family_reads_the_device_once(name):
    """After the first step (which may copy a table to the device once: a rotary cache, the DDPM schedule), every
    optimizer step of two micro-batches waits for the device exactly once: the gradient norm's read."""
    per_step, _ = syncs_per_step(*step_batch(name))
    for syncs in per_step[1:]:
        assert len(syncs) == 1 and THE_READ in syncs[0], f"{name}: {syncs}"
    assert len(per_step[0]) <= 3, f"{name}: the first step: {per_step[0]}"


@pytest.mark.parametrize("name, options", [
    ("tiny-flux", {"lora_rank": 4}), ("tiny-sana", {"ema_decay": 0.9}), ("tiny-flux", {"precision": "bf16"}),
    ("tiny-sana", {"precision": "fp16"}), ("tiny-pixart", {"grad_checkpointing": "all"}), ("tiny-flux", {"tread": "0.5:1:-1"}),
    ("tiny-wan", {"tread": "0.5:0:-1"}),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_a_step_reads_the_device_once_with_the_options_that_change_it(name, options):
    """LoRA, the EMA on the device, autocast, fp16's loss scaler (its overflow flag rides the same read), gradient
    checkpointing, token routing."""
    per_step, _ = syncs_per_step(*step_batch(name, **options))
    for syncs in per_step[1:]:
        assert len(syncs) == 1 and THE_READ in syncs[0], f"{name} {options}: {syncs}"


def test_the_qwen_image_text_lengths_are_the_transformers_own():
    """The Qwen-Image transformer's text-length helper, without its unused per-sample lengths, answers as diffusers' own,
    which its forward is still the one caller of (a new diffusers that used them would fail here)."""
    import inspect

    from diffusers.models.transformers import transformer_qwenimage as module

    from train.families.qwen_image import sync_free_text_lengths

    sync_free_text_lengths()
    ours = module.compute_text_seq_len_from_mask
    original = ours.original
    hidden = torch.randn(2, 5, 4)
    for mask in (None, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.ones(2, 5, dtype=torch.bool)):
        mine, theirs = ours(hidden, mask), original(hidden, mask)
        assert mine[0] == theirs[0]
        assert (mine[2] is None and theirs[2] is None) or torch.equal(mine[2], theirs[2])
    with pytest.raises(ValueError, match="must match"):
        ours(hidden, torch.ones(2, 4))
    callers = inspect.getsource(module).count("compute_text_seq_len_from_mask(")
    assert callers == 2 and "text_seq_len, _, encoder_hidden_states_mask = compute_text_seq_len_from_mask(" in inspect.getsource(module)


# --- the training loop: one read per step with grad accumulation, in one process and in two -------------------------

# `python -m train` counting the syncs of each step (bench/syncs.py's), in each process torchrun starts
COUNTING = """
import sys
sys.path.insert(0, {root!r})
from bench.syncs import counted_main
counted_main()
"""
LOOP = ["--model", "tiny-sana", "--precision", "fp32", "--no-validate", "--no-progress", "--steps", "5", "--grad-accum", "2",
        "--batch-size", "2", "--log-every", "100", "--checkpoint-every", "0", "--caption-dropout", "0.2"]


def counted_run(cache: Path, run: Path, nproc: int, *args: str) -> list[list[list[str]]]:
    """`python -m train` counting syncs, in `nproc` processes: per rank, the syncs of each step after the first."""
    run.mkdir(parents=True)
    (run / "count.py").write_text(COUNTING.format(root=str(ROOT)))
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    out = subprocess.run([*runner, str(run / "count.py"), "--cache", str(cache), "--run-dir", str(run), *LOOP, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads((run / f"syncs-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
def test_the_loop_reads_the_device_once_per_step_in_one_process_and_in_two(tiny_caches, tmp_path):
    """Steps 2 to 5 of 5 (logging, checkpoints and validation off: the last step logs and saves after its update), grad
    accumulation 2: the loop's per-step work (the data's damage and the signals agreed, metrics kept on the device)
    adds no read, and under DDP neither do the flags' all-reduce nor the gradients'."""
    cache = tiny_caches["tiny-sana"]
    for nproc, args in ((1, ()), (2, ("--parallel", "ddp"))):
        for rank, steps in enumerate(counted_run(cache, tmp_path / f"run-{nproc}", nproc, *args)):
            assert len(steps) == 4, (nproc, rank, steps)
            for syncs in steps:
                assert len(syncs) == 1 and THE_READ in syncs[0], (nproc, rank, steps)


# --- on CUDA: the sync debug mode itself ------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-flux1-kontext", "tiny-qwen-image", "tiny-wan", "tiny-sana"])
def test_on_cuda_a_step_synchronises_once(name):
    from train.config import TrainConfig
    from train.data import to_device
    from train.model import build_model, build_optimizer, build_run_objective, build_schedule
    from train.step import TrainStep

    _, _, batch = step_batch(name)  # its values, on the host
    preset, device = get_preset(name), torch.device("cuda")
    cfg = TrainConfig(model=name, batch_size=2, precision="bf16", grad_accum=2)
    net = build_model(cfg, preset, "none", 1, device, resume_from=None, state={}, say=lambda *a: None)
    optimizer = build_optimizer(cfg, net.params, device)
    trainer = TrainStep(cfg, net, build_run_objective(cfg, preset, preset.transformer_config()), optimizer,
                        build_schedule(cfg, optimizer), torch.amp.GradScaler("cuda", enabled=False), None, parallel="none",
                        rank=0, world=1, device=device)
    pinned = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    for k in range(3):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(2):
                    trainer.accumulate(to_device(pinned, device), k)
                trainer.update(k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        if k:  # the first step may copy tables to the device once
            assert len(syncs) == 1, [str(w.message) for w in syncs]
