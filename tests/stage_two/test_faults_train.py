"""What `python -m train` does when its cache, its run directory or its run goes wrong: it stops before step one
or after a checkpoint, with a message saying what to do and the exit code the README lists."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import shards
from shards import Cache, CacheLock, CacheSpec, DecoderRecipe, FormatError, LatentSpec, ShardWriter, TextSpec
from train.__main__ import app
from train.cache import check_cache
from train.checkpoint import complete_checkpoints
from train.families import PRESETS, get_family, get_preset

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ROOT / "tests" / "data" / "cache-v2-3b95788"
# a cache file that is there but fails its checks (exit 3); an error of that kind where the library has none yet
DamagedCache = getattr(shards, "DamagedCache", None) or type("DamagedCache", (FormatError,), {})


@pytest.fixture
def cache(tmp_path):
    """A tiny-sana cache stage one wrote (six samples, prompts, the decoder's config), copied to change."""
    shutil.copytree(LEGACY / "tiny-sana", tmp_path / "cache")
    return tmp_path / "cache"


def train(cache, run, *args, model="tiny-sana"):
    """`python -m train` in this process: (exit code, what it printed)."""
    result = CliRunner().invoke(app, ["--model", model, "--cache", str(cache), "--run-dir", str(run), "--steps", "2",
                                      "--batch-size", "2", "--workers", "0", "--no-progress", "--no-validate",
                                      "--caption-dropout", "0", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def flip_byte(path: Path, at: float = 0.5, tensor: str | None = None) -> None:
    """Change one byte: at fraction `at` of the file, or of a safetensors file's `tensor`."""
    data = bytearray(path.read_bytes())
    start, end = 0, len(data)
    if tensor:
        header = int.from_bytes(data[:8], "little")
        begin, stop = json.loads(data[8 : 8 + header])[tensor]["data_offsets"]
        start, end = 8 + header + begin, 8 + header + stop
    data[start + int((end - start) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


# -- the cache's other files are checked before they are read ------------------------------------------------------

def test_a_damaged_prompts_file_stops_the_run_before_step_one(cache, tmp_path):
    prompts = cache / Cache(cache).manifest.files["prompts"]["path"]
    flip_byte(prompts, tensor="text")  # in an embedding: the file still reads
    code, out = train(cache, tmp_path / "run", "--caption-dropout", "0.5")
    assert code == 3, out
    assert str(prompts) in out and "python -m precompute prompts" in out and "Traceback" not in out
    assert not complete_checkpoints(tmp_path / "run")


def test_damaged_decoder_files_stop_a_validating_run_and_not_one_without_validation(cache, tmp_path):
    flip_byte(cache / "vae" / "config.json")
    code, out = train(cache, tmp_path / "run", "--validate", "--validate-every", "1")
    assert code == 3, out
    assert str(cache / "vae" / "config.json") in out and "python -m precompute DATA --model tiny-sana" in out
    assert not complete_checkpoints(tmp_path / "run")
    code, out = train(cache, tmp_path / "plain")  # no validation: the decoder is never read
    assert code == 0, out
    from train.__main__ import tools  # `train sample` decodes too: the same check, the same code

    result = CliRunner().invoke(tools, ["sample", str(tmp_path / "plain"), "--prompt-cache", str(cache),
                                        "--validation-steps", "1"], env={"COLUMNS": "200"})
    assert result.exit_code == 3 and str(cache / "vae" / "config.json") in result.output, result.output
    assert not (tmp_path / "plain" / "samples").exists()  # refused before anything was written


# -- one process owns a run directory ------------------------------------------------------------------------------

def test_a_second_process_on_a_run_directory_is_refused_with_exit_5(cache, tmp_path):
    run = tmp_path / "run"
    holder = CacheLock(run, ".lock")  # another run's lock, as a requeued job would find it
    code, out = train(cache, run)
    assert code == 5, out
    assert f"pid {os.getpid()}" in out and "--run-dir" in out and "Traceback" not in out
    assert not (run / "metrics.jsonl").exists() and not complete_checkpoints(run)
    holder.release()
    code, out = train(cache, run)
    assert code == 0, out
    CacheLock(run, ".lock").release()  # the finished run let it go


@pytest.mark.slow
def test_no_rank_waits_when_rank_0_cannot_own_the_run_directory(cache, tmp_path):
    run = tmp_path / "run"
    holder = CacheLock(run, ".lock")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
                          "--model", "tiny-sana", "--cache", str(cache), "--run-dir", str(run), "--steps", "2",
                          "--batch-size", "1", "--no-progress", "--no-validate"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    holder.release()
    assert out.returncode != 0 and out.stderr.count(f"owned by another training process (pid {os.getpid()}") == 2, out.stderr[-3000:]
    assert not complete_checkpoints(run)


def test_a_run_directory_that_cannot_be_claimed_is_a_clear_error(cache, tmp_path, monkeypatch):
    from train import state

    def refused(root, name, what):
        raise PermissionError(13, "Permission denied", str(Path(root) / name))
    monkeypatch.setattr(state, "CacheLock", refused)  # as a read-only or another user's directory refuses it
    code, out = train(cache, tmp_path / "run")
    assert code == 2 and f"cannot claim the run directory {tmp_path / 'run'}" in out and "Traceback" not in out, out


# -- a checkpoint continues over the samples it counted ------------------------------------------------------------

def copy_samples(source: Path, root: Path, pick, *, sessions: int = 1) -> Cache:
    """A cache with `source`'s fingerprint, schema and stage one's record holding its samples `pick` (re-keyed, so
    it is another dataset encoded with the same models), committed over `sessions` writer sessions."""
    src = Cache(source)
    chosen = list(pick(len(src)))
    per = -(-len(chosen) // sessions)
    for k in range(sessions):
        with ShardWriter(root, src.fingerprint, src.schema) as w:
            if k == 0:
                w.set_extra("precompute", src.manifest.extra["precompute"])
            for i in chosen[k * per:(k + 1) * per]:
                s = src[i]
                w.write(f"{root.name}-{s.key}", s.bucket, {name: s.fields[name] for name in src.schema})
    return Cache(root)


def test_resuming_against_another_dataset_with_the_same_fingerprint_is_refused(cache, tmp_path):
    run = tmp_path / "run"
    code, out = train(cache, run, "--checkpoint-every", "1")
    assert code == 0, out
    other = copy_samples(cache, tmp_path / "other", lambda n: reversed(range(n)), sessions=4)
    assert other.manifest.fingerprint_sha256 == Cache(cache).manifest.fingerprint_sha256
    assert other.generation >= Cache(cache).generation  # it has the generation the checkpoint read
    code, out = train(tmp_path / "other", run, "--steps", "4")
    assert code == 2, out
    assert "holds other shards" in out and str(cache.resolve()) in out and "--resume ''" in out
    assert [p.name for p in complete_checkpoints(run)] == ["step-00000001", "step-00000002"]


def test_a_cache_grown_by_later_commits_still_resumes(cache, tmp_path):
    run = tmp_path / "run"
    code, out = train(cache, run, "--checkpoint-every", "1")
    assert code == 0, out
    copy_samples(cache, cache, lambda n: range(2))  # an incremental run of stage one: two more samples
    code, out = train(cache, run, "--steps", "4")
    assert code == 0, out
    assert complete_checkpoints(run)[-1].name == "step-00000004"


# -- every preset against every kind of cache ----------------------------------------------------------------------

def fitting_cache(root: Path, name: str) -> Cache:
    """A one-sample cache of the kind stage one writes for preset `name`, its sizes read from the transformer's
    config (only what stage two checks before loading weights is real)."""
    preset = get_preset(name)
    config = preset.transformer_config()
    family, kind = preset.family, get_family(preset.family)
    channels = kind.latent_channels(config)
    frames = 17 if kind.temporal_downsample else 0  # a video family's cache holds clips
    latent = LatentSpec(channels, preset.latent_downsample, 0.5, 0.0, "deterministic" if family == "sana" else "mean_std",
                        temporal_downsample=kind.temporal_downsample)
    joint = config.get("joint_attention_dim")
    pooled = config.get("pooled_projection_dim")
    if family == "sd3":
        text = TextSpec("sd3_joint", joint, 256, 77, 256, True, min(joint, 768), pooled, joint)
    elif family == "flux":
        text = TextSpec("flux", joint, 512, t5_tokens=512, pooled_width=pooled, t5_width=joint)
    else:
        text = TextSpec(kind.text.layout, kind.text_width(config), preset.text_tokens if frames else 300)
    fingerprint = {"vae": {"id": f"{name}-vae", **latent.fingerprint()}, "text_encoder": {"id": f"{name}-text", **text.fingerprint()},
                   "storage_dtype": "bf16"}
    schema = {f: shards.Field(torch.bfloat16) for f in latent.fields}
    granularity = preset.latent_downsample * kind.latent_patch(config)  # a side stage one's table can hold
    size = preset.base_resolution // granularity * granularity
    with ShardWriter(root, fingerprint, schema) as w:
        w.set_extra("precompute", CacheSpec(latent, text, family, name, size, DecoderRecipe("AutoencoderKL", "x", 0.5, 0.0)).record())
        w.write("k", (size, size, frames), {f: torch.zeros(latent.shape(size, size, frames), dtype=torch.bfloat16)
                                            for f in latent.fields})
    return Cache(root)


def test_every_preset_on_every_kind_of_cache_fits_or_says_why(tmp_path):
    kinds = {name: fitting_cache(tmp_path / name, name) for name in PRESETS}
    outcomes = {}
    for cache_kind, cache in kinds.items():
        for name in PRESETS:
            preset = get_preset(name)
            try:
                check_cache(preset, cache, preset.transformer_config())
                outcomes[cache_kind, name] = None
            except Exception as e:  # noqa: BLE001 (what each pair raises is the subject)
                outcomes[cache_kind, name] = e
    crashes = {pair: repr(e) for pair, e in outcomes.items() if e is not None and type(e) is not ValueError}
    assert not crashes
    for (cache_kind, name), e in outcomes.items():
        if e is None:  # fits: the same family and sizes (e.g. SD3 medium and SD3.5 medium)
            assert kinds[cache_kind].spec.family == get_preset(name).family, (cache_kind, name)
            continue
        assert name != cache_kind, f"{name} does not fit the cache built for it: {e}"
        assert f"does not fit model {name}" in str(e) and f"--model {name}" in str(e), str(e)


def test_a_sana_model_on_an_sd3_cache_does_not_fit(tmp_path):
    shutil.copytree(LEGACY / "tiny-sd3", tmp_path / "cache")
    code, out = train(tmp_path / "cache", tmp_path / "run")
    assert code == 2, out
    assert "does not fit model tiny-sana" in out and "text layout: cache 'sd3_joint'" in out and "--model tiny-sana" in out
    assert "KeyError" not in out and "Traceback" not in out


# -- a diverged run ------------------------------------------------------------------------------------------------

def test_non_finite_steps_in_a_row_exit_6_saying_what_to_try(cache, tmp_path, monkeypatch):
    import train.model as model

    real = model.model_forward
    monkeypatch.setattr(model, "model_forward", lambda m, f, **kw: (lambda xt, t, b: real(m, f, **kw)(xt, t, b) * float("nan")))
    code, out = train(cache, tmp_path / "run", "--steps", "10", "--checkpoint-every", "1")
    assert code == 6, out
    assert "5 non-finite steps in a row" in out and "diverged after 0 step(s)" in out and "samples ['" in out
    assert "--lr" in out and "--grad-clip" in out and "--precision" in out and "Traceback" not in out
    assert not complete_checkpoints(tmp_path / "run")


def test_non_finite_weights_are_never_checkpointed(cache, tmp_path, monkeypatch):
    from train.step import TrainStep

    update = TrainStep.update

    def poisoned(self, step):  # an update that leaves a weight non-finite, its gradients finite
        done = update(self, step)
        if step == 1:
            with torch.no_grad():
                self.model.params[0].view(-1)[0] = float("inf")
        return done

    monkeypatch.setattr(TrainStep, "update", poisoned)
    code, out = train(cache, tmp_path / "run", "--steps", "3", "--checkpoint-every", "1")
    assert code == 6, out
    assert "non-finite by step 2" in out and "step-00000001" in out
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-00000001"]


# -- stops and their exit codes ------------------------------------------------------------------------------------

def test_an_empty_cache_says_it_holds_no_samples(cache, tmp_path):
    src = Cache(cache)
    empty = tmp_path / "empty"
    with ShardWriter(empty, src.fingerprint, src.schema) as w:
        w.set_extra("precompute", src.manifest.extra["precompute"])
    code, out = train(empty, tmp_path / "run")
    assert code == 2, out
    assert "holds no samples" in out and "python -m precompute DATA --model tiny-sana" in out and "--remainder" not in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_by_a_signal_exits_128_plus_its_number_after_a_checkpoint(cache, tmp_path, monkeypatch, signum):
    import train.model as model

    real = model.model_forward

    def forward(m, f, **kw):
        fn = real(m, f, **kw)

        def call(xt, t, b):
            os.kill(os.getpid(), signum)  # as a scheduler (SIGTERM) or Ctrl-C (SIGINT) would, during step one
            return fn(xt, t, b)
        return call

    monkeypatch.setattr(model, "model_forward", forward)
    code, out = train(cache, tmp_path / "run", "--steps", "10")
    assert code == 128 + signum, out
    assert f"stopped by {signal.Signals(signum).name} at step 1 of 10" in out and "resume with the same command" in out
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-00000001"]
    monkeypatch.setattr(model, "model_forward", real)
    code, out = train(cache, tmp_path / "run", "--steps", "2")  # resumed, finished: 0
    assert code == 0, out


def test_a_damaged_file_met_while_training_exits_3_after_a_checkpoint(cache, tmp_path, monkeypatch):
    from train.data import TrainingSamples

    batch = TrainingSamples.batch

    def reading(self, epoch, indices, passes=None):
        if reading.calls == 1:
            raise DamagedCache(f"{self.cache.root}/256x256/r00000-000000.safetensors: its header is damaged; restore it")
        reading.calls += 1
        return batch(self, epoch, indices, passes)

    reading.calls = 0
    monkeypatch.setattr(TrainingSamples, "batch", reading)
    code, out = train(cache, tmp_path / "run", "--steps", "4")
    assert code == 3, out
    assert "its header is damaged" in out and "Training stopped at step 1" in out and "Traceback" not in out
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-00000001"]


def test_a_damaged_record_is_not_reported_as_a_foreign_cache(cache, tmp_path, monkeypatch):
    def damaged(self):
        raise DamagedCache(f"{cache}/_log/000000000004.json does not match its checksum; restore it from a copy")

    monkeypatch.setattr(Cache, "spec", property(damaged))
    code, out = train(cache, tmp_path / "run")
    assert code == 3, out
    assert "does not match its checksum" in out and "MODEL=" not in out
