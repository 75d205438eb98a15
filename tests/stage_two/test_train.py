"""Stage two on CPU with tiny presets and caches built by stage one in the test."""

import ast
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Bucket
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.loop import train
from train.order import BatchPlan

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def caches(tiny_caches):
    return tiny_caches


def cfg(cache, run, **kw):
    base = dict(model="tiny-sana", cache=cache, run=run, steps=20, batch_size=4, progress=False,
                log_every=1, checkpoint_every=1000, caption_dropout=0.0, lr=1e-3, validate=False)
    return TrainConfig(**{**base, **kw})


def metrics(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-sana", "tiny-pixart"])
def test_tiny_model_overfits_eight_samples(caches, tmp_path, model):
    train(cfg(caches[model], tmp_path, model=model, steps=150, lr=2e-3, log_every=10, remainder="repeat"))
    rows = metrics(tmp_path)
    first, last = rows[0]["smoothed_loss"], rows[-1]["smoothed_loss"]
    assert last < 0.6 * first, (first, last)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert set(rows[-1]) >= {"loss", "smoothed_loss", "lr", "grad_norm", "samples_per_s", "data_wait", "peak_memory", "loss_by_timestep"}


def test_resume_equals_an_uninterrupted_run(caches, tmp_path):
    train(cfg(caches["tiny-sana"], tmp_path / "straight", steps=12, caption_dropout=0.2))
    train(cfg(caches["tiny-sana"], tmp_path / "resumed", steps=6, caption_dropout=0.2))
    train(cfg(caches["tiny-sana"], tmp_path / "resumed", steps=12, caption_dropout=0.2))
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 13))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-7) and x["lr"] == y["lr"]
        assert x["samples_by_source"] == y["samples_by_source"]  # carried over the resume
    assert b[-1]["samples_by_source"] == {"data": 12 * 4}
    wa = torch.load(complete_checkpoints(tmp_path / "straight")[-1] / "optimizer.pt", weights_only=True)
    wb = torch.load(complete_checkpoints(tmp_path / "resumed")[-1] / "optimizer.pt", weights_only=True)
    for k in wa["state"]:
        assert torch.allclose(wa["state"][k]["exp_avg"], wb["state"][k]["exp_avg"], atol=1e-7)


def test_fp16_run_restarts_in_bf16(caches, tmp_path, caplog):
    cache = caches["tiny-sana"]
    def cached():  # the cache's files, without the registrations of the runs reading it
        return {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file() and p.parent.name != "_readers"}

    before = cached()
    train(cfg(cache, tmp_path, steps=4, precision="fp16"))
    ckpt = complete_checkpoints(tmp_path)[-1]
    assert (ckpt / "scaler.pt").exists()
    with caplog.at_level("WARNING"):
        train(cfg(cache, tmp_path, steps=8, precision="bf16"))
    assert "GradScaler state is dropped" in caplog.text
    ckpt = complete_checkpoints(tmp_path)[-1]
    moments = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert {int(m["step"]) for m in moments.values()} == {8}  # the fp16 run's moments carried on, not restarted
    state = json.loads((ckpt / "state.json").read_text())
    assert state["precision_history"] == [{"step": 0, "precision": "fp16", "weights_dtype": "fp32"},
                                          {"step": 4, "precision": "bf16", "weights_dtype": "fp32"}]
    assert not (ckpt / "scaler.pt").exists()
    rows = metrics(tmp_path)
    assert [r["precision"] for r in rows] == ["fp16"] * 4 + ["bf16"] * 4
    assert before == cached()  # nothing re-encoded


def test_resuming_a_finished_run_changes_nothing(caches, tmp_path, capsys):
    train(cfg(caches["tiny-sana"], tmp_path, steps=3, validate=True, validation_steps=2))
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    summary = train(cfg(caches["tiny-sana"], tmp_path, steps=3, validate=True, validation_steps=2))
    assert summary["finished"] and summary["step"] == 3
    assert "already finished" in capsys.readouterr().out
    assert files == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}  # no checkpoint, grid or metric


def test_resume_applies_a_new_schedule_and_refuses_a_new_seed(caches, tmp_path, capsys):
    train(cfg(caches["tiny-sana"], tmp_path, steps=2, lr=1e-3, weight_decay=0.0, ema_decay=0.9))
    train(cfg(caches["tiny-sana"], tmp_path, steps=4, lr=5e-4, weight_decay=0.01, ema_decay=0.5, warmup_steps=10))
    out = capsys.readouterr().out
    for line in ("lr 0.001 -> 0.0005 from step 2", "weight-decay 0.0 -> 0.01 from step 2", "ema-decay 0.9 -> 0.5 from step 2",
                 "warmup-steps 0 -> 10 from step 2"):
        assert line in out
    rows = metrics(tmp_path)
    # the warm-up of the new peak, as at steps 3 and 4 of a run started with it (the logged lr is the next step's; the
    # warm-up starts from 0 at step 0, as diffusers' schedules do)
    assert [r["lr"] for r in rows[2:]] == pytest.approx([5e-4 * 3 / 10, 5e-4 * 4 / 10])
    ckpt = complete_checkpoints(tmp_path)[-1]
    groups = torch.load(ckpt / "optimizer.pt", weights_only=True)["param_groups"]
    assert {g["weight_decay"] for g in groups} == {0.01}
    assert torch.load(ckpt / "ema.pt", weights_only=True)["decay"] == 0.5
    with pytest.raises(ValueError, match="--seed 0, this run has 1: the data order"):
        train(cfg(caches["tiny-sana"], tmp_path, steps=6, seed=1))
    with pytest.raises(ValueError, match="--optimizer adamw, this run has came"):
        train(cfg(caches["tiny-sana"], tmp_path, steps=6, optimizer="came"))
    train(cfg(caches["tiny-sana"], tmp_path, steps=5, lr=5e-4, weight_decay=0.01, ema_decay=0.5, warmup_steps=10,
              lr_schedule="cosine"))
    assert "lr-schedule constant -> cosine from step 4" in capsys.readouterr().out
    for other, flag in ((dict(batch_size=2), "--batch-size 4"), (dict(remainder="drop"), "--remainder repeat"),
                        (dict(pretrained=str(tmp_path)), "continues its own weights.*--pretrained"),
                        (dict(revision="v2"), "continues its own weights.*--revision v2")):
        with pytest.raises(ValueError, match=flag):
            train(cfg(caches["tiny-sana"], tmp_path, steps=6, **other))


@pytest.mark.slow
def test_bf16_weights_with_stochastic_rounding_train_and_resume_exactly(caches, tmp_path):
    common = dict(weights_dtype="bf16", optimizer="adamw-bf16", precision="bf16", ema_decay=0.9, lr=2e-3)
    train(cfg(caches["tiny-sana"], tmp_path / "straight", steps=30, **common))
    train(cfg(caches["tiny-sana"], tmp_path / "resumed", steps=15, **common))
    train(cfg(caches["tiny-sana"], tmp_path / "resumed", steps=30, **common))
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [x["loss"] for x in a] == [y["loss"] for y in b]  # stochastic rounding replays exactly
    assert [x["smoothed_loss"] for x in a] == [y["smoothed_loss"] for y in b]
    assert b[-1]["smoothed_loss"] < 0.8 * b[0]["smoothed_loss"]
    ckpt = complete_checkpoints(tmp_path / "resumed")[-1]
    moments = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert {v.dtype for m in moments.values() for k, v in m.items() if k != "step"} == {torch.bfloat16}
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(ckpt / "transformer" / "diffusion_pytorch_model.safetensors").values()} == {torch.bfloat16}
    ema = torch.load(ckpt / "ema.pt", weights_only=True)
    assert {t.dtype for t in ema["shadow_params"]} == {torch.float32}


@pytest.mark.parametrize("every", [1, 2])
def test_gradient_checkpointing_every_kth_block_keeps_gradients(every):
    from train.families import get_preset
    from train.model import checkpoint_blocks
    from train.presets import build_transformer

    preset = get_preset("tiny-sana")
    config = {**preset.transformer_config(), "num_layers": 4}
    preset = type(preset)(**{**preset.__dict__, "config": config})

    def grads(every_k):
        model = build_transformer(preset, None, seed=0)
        if every_k:
            assert checkpoint_blocks(model, every_k) == 4 // every_k
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 8, 8, 8, generator=g)
        text = torch.randn(2, 5, 32, generator=g)
        out = model(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([10, 500]), return_dict=False)[0]
        out.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, recomputed in zip(grads(0), grads(every)):
        torch.testing.assert_close(plain, recomputed)


def test_sampler_properties_three_ranks_skewed_buckets():
    ranges = {Bucket(64, 64): [range(0, 50)], Bucket(48, 80): [range(50, 53)], Bucket(80, 48): [range(53, 54), range(54, 61)]}
    samplers = [BatchPlan(ranges, 4, seed=1, rank=r, world_size=3) for r in range(3)]
    per_rank = [s(epoch=0) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches: no rank waits forever
    bucket_of = {i: b for b, rs in ranges.items() for r in rs for i in r}
    used = Counter()
    for batches in per_rank:
        for batch in batches:
            assert len(batch) == 4 and len({bucket_of[i] for i in batch}) == 1  # one shape per batch
            used.update(batch)
    assert set(used) == set(range(61))  # every sample every epoch
    assert per_rank == [s(epoch=0) for s in samplers]  # deterministic
    assert per_rank[0] != samplers[0](epoch=1)
    assert samplers[1](epoch=0, start=2) == per_rank[1][2:]  # resume jumps without replaying
    dropped = [BatchPlan(ranges, 4, seed=1, rank=r, world_size=3, remainder="drop")(0) for r in range(3)]
    assert len({len(b) for b in dropped}) == 1 and all(len(b) == 4 for bs in dropped for b in bs)


def test_training_never_imports_an_encoder():
    """No VAE encoder or text encoder class is named anywhere in train/ (validation decodes elsewhere)."""
    banned = {"AutoencoderKL", "AutoencoderDC", "T5EncoderModel", "Gemma2Model", "CLIPTextModel", "CLIPTextModelWithProjection",
              "AutoTokenizer", "T5Tokenizer", "GemmaTokenizer", "precompute"}
    found = []
    for path in (ROOT / "train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module.split(".")[0])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[-1] in banned]
    assert found == []


def test_training_process_holds_no_encoder_even_while_validating(caches, tmp_path):
    code = f"""
import sys, gc, torch
from collections import Counter
sys.path.insert(0, {str(ROOT)!r})
import train.validate as validate
from train.config import TrainConfig
from train.loop import train
kinds = []
real = validate.Validator.run
def run(self, *args, **kwargs):
    path = real(self, *args, **kwargs)
    kinds.append(Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.nn.Module)))
    return path
validate.Validator.run = run
train(TrainConfig(model="tiny-sana", cache={str(caches["tiny-sana"])!r}, run={str(tmp_path)!r}, steps=2, batch_size=4,
                  progress=False, validate_every=1, validation_steps=2))
bad = set().union(*kinds) & {{"AutoencoderDC", "AutoencoderKL", "Gemma2Model", "T5EncoderModel", "Decoder"}}
print("VALIDATIONS", len(kinds), "MODULES", sorted(bad), "TRANSFORMERS", max(k["SanaTransformer2DModel"] for k in kinds))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "VALIDATIONS 2 MODULES [] TRANSFORMERS 1" in out.stdout  # no encoder, no second transformer
    assert sorted(p.name for p in tmp_path.glob("samples-*.png")) == ["samples-step00000001.png", "samples-step00000002.png"]


def test_mismatched_cache_fails_fast_naming_fields(caches, tmp_path):
    with pytest.raises(ValueError) as e:
        train(cfg(caches["tiny-pixart"], tmp_path, model="tiny-sana"))
    msg = str(e.value)
    assert "family: cache 'pixart', model 'sana'" in msg and "latent channels: cache 4, model in_channels 8" in msg
    assert "make precompute DATA=... MODEL=tiny-sana" in msg
    assert not (tmp_path / "checkpoints").exists()


KILL_IN_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import train.checkpoint as ck
real = ck.atomic_write_json
def dying(path, obj):
    if obj.get("step") == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, obj)
ck.atomic_write_json = dying
from train.config import TrainConfig
from train.loop import train
train(TrainConfig(model="tiny-sana", cache={cache!r}, run={run!r}, steps=6, batch_size=4, progress=False, checkpoint_every=2, validate=False))
"""


def test_sigkill_during_checkpoint_save_keeps_the_previous(caches, tmp_path):
    code = KILL_IN_SAVE.format(root=str(ROOT), cache=str(caches["tiny-sana"]), run=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == -signal.SIGKILL
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000002"]
    summary = train(cfg(caches["tiny-sana"], tmp_path, steps=6, checkpoint_every=2))
    assert summary["step"] == 6 and complete_checkpoints(tmp_path)[-1].name == "step-00000006"


def test_non_finite_loss_skips_then_aborts(caches, tmp_path, caplog, monkeypatch):
    import train.model as model

    real = model.model_forward
    monkeypatch.setattr(model, "model_forward", lambda m, f, **kw: (lambda xt, t, b: real(m, f, **kw)(xt, t, b) * float("nan")))
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="5 non-finite steps in a row.*non-finite loss"):
        train(cfg(caches["tiny-sana"], tmp_path, steps=10))
    assert "non-finite loss, skipped; samples ['" in caplog.text


def test_non_finite_gradients_skip_naming_the_samples(caches, tmp_path, caplog, monkeypatch):
    import train.step as step

    monkeypatch.setattr(step.torch.nn.utils, "clip_grad_norm_", lambda params, clip: torch.tensor(float("nan")))
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="5 non-finite steps in a row.*non-finite gradients"):
        train(cfg(caches["tiny-sana"], tmp_path, steps=10, grad_accum=2))
    assert "non-finite gradients, skipped; samples ['" in caplog.text
    assert caplog.text.count("', '") >= 7  # both micro-batches' four samples each


def test_a_signal_during_the_last_checkpoint_is_only_recorded(caches, tmp_path, monkeypatch):
    from train.state import TrainState

    handlers, save = [], TrainState.save

    def saving(self, *args):  # what SIGTERM or a second Ctrl-C would meet while the last checkpoint is written
        handlers.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)))
        return save(self, *args)

    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1))
    monkeypatch.setattr(TrainState, "save", saving)
    train(cfg(caches["tiny-sana"], tmp_path, steps=2))
    assert handlers and all(h != b for h, b in zip(handlers[-1], before))  # the run's own handlers
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)) == before


def test_new_shards_join_at_the_next_epoch(tmp_path, monkeypatch):
    data = make_folder(tmp_path / "data", count=8)
    for p in sorted(data.glob("0000[4-7].*")):
        p.rename(tmp_path / p.name)
    cache = tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, workers=0, progress=False)
    from shards import Cache

    epoch0 = BatchPlan.of(Cache(cache), 2).batches_per_epoch()
    train(cfg(cache, tmp_path / "run", steps=epoch0, batch_size=2))  # all of epoch 0 (4 samples)
    for p in sorted(tmp_path.glob("0000[4-7].*")):
        p.rename(data / p.name)
    precompute(str(data), "tiny-sana", cache, workers=0, progress=False)  # incremental: 4 more
    seen = []
    import train.data as train_data

    real = train_data.TrainingSamples.collate
    def spy(self, samples):
        seen.append([s["key"] for s in samples])
        return real(self, samples)
    monkeypatch.setattr(train_data.TrainingSamples, "collate", spy)
    epoch1 = BatchPlan.of(Cache(cache), 2).batches_per_epoch()
    train(cfg(cache, tmp_path / "run", steps=epoch0 + epoch1, batch_size=2, workers=0))  # batches built when taken
    # the first batch built is the start-up plan's (one batch of the largest bucket, read before the weights load);
    # then epoch 1, which covers all eight
    assert len(seen) == epoch1 + 1 and len({k for batch in seen[1:] for k in batch}) == 8


def test_memory_report_on_demand(caches, tmp_path, monkeypatch):
    import train.model as model

    real = model.model_forward
    def forward(m, f, **kw):
        fn = real(m, f, **kw)
        def call(xt, t, b):
            os.kill(os.getpid(), signal.SIGUSR1)  # as a user would with `kill -USR1 PID`
            return fn(xt, t, b)
        return call
    monkeypatch.setattr(model, "model_forward", forward)
    train(cfg(caches["tiny-sana"], tmp_path, steps=2))
    assert "rss" in (tmp_path / "memory.txt").read_text()


