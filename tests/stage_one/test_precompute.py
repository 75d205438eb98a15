"""Stage one end to end on CPU with the tiny presets and a dataset generated here."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import precompute_processes

from precompute.run import main as precompute
from precompute.sample_data import make_folder, make_tars
from shards import Cache, FingerprintMismatch, prompt_key, verify

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


def run(data, cache, model="tiny-sana", **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return precompute(str(data), model, Path(cache), **kw)


def digests(cache) -> dict[str, bytes]:
    c = Cache(cache)
    return {k: c.shard(c.locate(i)[0]).digest(c.locate(i)[1]) for k, i in c.keys()}


def files(cache) -> dict[str, bytes]:
    return {p.relative_to(cache).as_posix(): p.read_bytes() for p in sorted(Path(cache).rglob("*")) if p.is_file() and not p.name.startswith(".lock")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("data") / "folder", count=24)


@pytest.fixture(scope="module")
def clean_cache(folder, tmp_path_factory):
    """The folder encoded in one uninterrupted run, one shard per batch of four."""
    cache = tmp_path_factory.mktemp("clean") / "cache"
    run(folder, cache, max_shard_mb=0, batch_size=4)
    return cache


@pytest.mark.parametrize("model", ["tiny-sana", "tiny-pixart"])
def test_folder_end_to_end(folder, tmp_path, model):
    summary = run(folder, tmp_path / "cache", model, workers=2, batch_size=4, validation_prompt=["a red circle on a blue background"])
    assert summary["new"] == 24 and summary["failed"] == 0
    cache = Cache(tmp_path / "cache")
    assert len(cache) == 24 and len(cache.manifest.buckets()) >= 3
    s = cache[0]
    if model == "tiny-pixart":
        assert s["latent_mean"].shape[0] == 4 and s["latent_std"].shape == s["latent_mean"].shape
        assert float(s["latent_std"].float().min()) > 0
    else:
        assert s["latent"].shape[0] == 8
    assert s["latent_mean" if model == "tiny-pixart" else "latent"].shape[1:] == (s.bucket.height // 8, s.bucket.width // 8)
    assert s["text"].shape[0] == int(s["text_lengths"].sum()) and s["text"].dtype == torch.bfloat16
    assert bytes(s["source"].tolist()).decode().endswith(".png")
    prompts = cache.prompts()
    assert {p.text for p in prompts.values()} == {"", "a red circle on a blue background"}
    assert cache.manifest.extra["precompute"]["preset"] == model
    assert verify(tmp_path / "cache").ok


def test_text_embeddings_equal_the_pipeline_encode_prompt(folder, tmp_path):
    """Cached embeddings are exactly what the diffusers pipeline computes, padding trimmed."""
    from diffusers import SanaPipeline

    from precompute.families.sana import complex_human_instruction, tiny_text_encoder, tiny_tokenizer

    run(folder, tmp_path, storage_dtype="float32")
    cache = Cache(tmp_path)
    tok = tiny_tokenizer()
    pipe = SanaPipeline(tokenizer=tok, text_encoder=tiny_text_encoder(len(tok)), vae=None, transformer=None, scheduler=None)
    caption = (folder / bytes(cache[0]["source"].tolist()).decode()).with_suffix(".txt").read_text().strip()
    emb, mask, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu", max_sequence_length=64,
                                         complex_human_instruction=complex_human_instruction())
    assert torch.equal(cache[0]["text"], emb[0][mask[0].bool()])
    null = cache.prompts()[prompt_key("")].fields["text"]
    emb, mask, _, _ = pipe.encode_prompt("", do_classifier_free_guidance=False, device="cpu", max_sequence_length=64, complex_human_instruction=None)
    assert torch.equal(null, emb[0][mask[0].bool()])


def test_tars_end_to_end_with_several_captions(tmp_path):
    make_tars(tmp_path / "tars", count=20, per_tar=8)
    summary = run(f"{tmp_path}/tars/data-{{0000..0002}}.tar", tmp_path / "cache", workers=2)
    assert summary["new"] == 20 and summary["failed"] == 0
    cache = Cache(tmp_path / "cache")
    s = cache[0]
    # .txt plus the json's "caption" and "prompt": three captions, all encoded
    assert s["text_lengths"].shape == (3,) and s["text"].shape[0] == int(s["text_lengths"].sum())
    assert bytes(s["source"].tolist()).decode().startswith("data-000")
    with pytest.raises(ValueError, match="--allow-pipe"):
        run("pipe:cat x.tar", tmp_path / "other")


def test_rerun_is_a_noop_and_deterministic(folder, tmp_path):
    first = run(folder, tmp_path / "a", batch_size=4)
    before = files(tmp_path / "a")
    again = run(folder, tmp_path / "a", batch_size=4)
    assert again["unchanged"] == 24 and again["new"] == again["changed"] == again["removed"] == 0
    assert files(tmp_path / "a") == before
    run(folder, tmp_path / "b", batch_size=4)
    assert files(tmp_path / "b") == before  # another build of the same data is byte-identical
    assert first["encoded"] == 24


def test_add_edit_remove(folder, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    for p in sorted(data.glob("0001*")):  # hold 00010..00019 back
        p.rename(tmp_path / p.name)
    assert run(data, tmp_path / "cache")["new"] == 14
    for p in sorted(tmp_path.glob("0001*.*")):
        p.rename(data / p.name)  # add 10
    (data / "00003.txt").write_text("a large green square on a white background")  # edit 1
    (data / "00005.png").unlink()  # remove 2
    (data / "00005.txt").unlink()
    (data / "00007.png").unlink()
    (data / "00007.txt").unlink()
    s = run(data, tmp_path / "cache")
    assert (s["new"], s["changed"], s["unchanged"], s["removed"]) == (10, 1, 11, 2)
    run(data, tmp_path / "fresh")
    assert digests(tmp_path / "cache") == digests(tmp_path / "fresh")
    assert verify(tmp_path / "cache").ok


def test_fingerprint_refusal_names_the_fields(folder, tmp_path):
    run(folder, tmp_path)
    with pytest.raises(FingerprintMismatch, match="storage_dtype: cache='bfloat16' run='float32'"):
        run(folder, tmp_path, storage_dtype="fp32")  # the fingerprint names dtypes as torch does, whatever the option's spelling
    with pytest.raises(FingerprintMismatch, match="text_encoder.name: cache='tiny-gemma2' run='tiny-t5'"):
        run(folder, tmp_path, text_encoder="tiny-t5")
    out = subprocess.run([sys.executable, "-m", "precompute", str(folder), "--model", "tiny-sana", "--cache", str(tmp_path),
                          "--max-upscale", "3", "--workers", "0", "--no-progress"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "buckets.max_upscale: cache=2.0 run=3.0" in out.stderr


def test_from_pretrained_equals_the_in_memory_tiny_preset(folder, tmp_path):
    from precompute.presets import get_preset, save_tiny

    save_tiny(get_preset("tiny-pixart"), tmp_path / "weights")
    run(folder, tmp_path / "memory", "tiny-pixart")
    run(folder, tmp_path / "loaded", "tiny-pixart", pretrained=str(tmp_path / "weights"))
    a, b = Cache(tmp_path / "memory"), Cache(tmp_path / "loaded")
    assert a.fingerprint["vae"]["weights"] == b.fingerprint["vae"]["weights"]
    assert a.fingerprint["text_encoder"]["weights"] == b.fingerprint["text_encoder"]["weights"]
    assert b.fingerprint["vae"]["source"] == str(tmp_path / "weights")
    for i in range(len(a)):
        assert torch.equal(a[i]["latent_mean"], b[i]["latent_mean"]) and torch.equal(a[i]["text"], b[i]["text"])


def test_default_numerics_never_put_sdxl_vae_or_t5_in_fp16():
    from precompute.config import PrecomputeConfig
    from precompute.encode import compute_dtype
    from precompute.presets import get_preset

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for name in ("pixart-sigma-512", "pixart-sigma-1024"):
        p = get_preset(name)
        assert not p.vae.fp16_safe and not p.text.fp16_safe
        assert compute_dtype(None, p.vae.cuda_dtype, cuda) == torch.float32
        assert compute_dtype(None, p.text.cuda_dtype, cuda) == torch.bfloat16
        assert compute_dtype(None, p.text.cuda_dtype, cpu) == torch.float32
        with pytest.raises(ValueError, match="--vae-dtype fp16: the VAE overflows"):
            PrecomputeConfig("data", name, vae_dtype="fp16")
        with pytest.raises(ValueError, match="--text-dtype fp16: the text encoder overflows"):
            PrecomputeConfig("data", name, text_dtype="float16")
        assert PrecomputeConfig("data", name, vae_dtype="fp16", force_fp16=True).vae_dtype == "fp16"
    sana = get_preset("sana-1600m")
    assert compute_dtype(None, sana.vae.cuda_dtype, cuda) == torch.bfloat16
    assert PrecomputeConfig("data", "sana-1600m", vae_dtype="fp16").vae_dtype == "fp16"  # the DC-AE is fp16-safe


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import shards.writer
from precompute.run import main
from pathlib import Path

real = shards.writer.write_commit
commits = 0
def write_commit(root, commit, rank=0):
    global commits
    if commits == int(os.environ["COMMITS"]):  # this commit's shard is in place; the commit never will be
        os.kill(os.getpid(), signal.SIGKILL)
    commits += 1
    return real(root, commit, rank)
shards.writer.write_commit = write_commit
main(sys.argv[1], "tiny-sana", Path(sys.argv[2]), workers=0, progress=False, max_shard_mb=0, batch_size=4)
"""


@pytest.mark.slow
@pytest.mark.parametrize("commits", [0, 2])
def test_kill_and_resume_equals_an_uninterrupted_run(folder, tmp_path, commits, clean_cache):
    """Killed after `commits` commits (0: before the first, so no manifest exists yet), the next run
    encodes exactly what was not committed and ends with the cache an uninterrupted run builds."""
    cache = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT)), str(folder), str(cache)],
                          env={**os.environ, "COMMITS": str(commits)}, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert list(cache.glob("*/*.safetensors"))  # the shard whose commit was cut off
    if commits == 0:
        assert not (cache / "_log").exists() and verify(cache).not_a_cache
        done = 0
    else:
        done = len(Cache(cache))
        assert 0 < done < 24
    s = run(folder, cache, max_shard_mb=0, batch_size=4)
    assert s["unchanged"] == done and s["new"] == 24 - done
    assert digests(cache) == digests(clean_cache)
    assert verify(cache).ok


@pytest.mark.slow
def test_kill_and_resume_with_a_dataset_file_of_two_sources(folder, tmp_path):
    """Killed in the middle of a two-source run, the next run completes both sources: the cache equals an
    uninterrupted run's, sample by sample and source by source."""
    other = make_folder(tmp_path / "other", count=8, seed=5)
    file = tmp_path / "data.toml"
    file.write_text(f'[[source]]\nname = "shapes"\npath = "{folder}"\nrepeats = 2\n\n[[source]]\npath = "{other}"\n')
    run(file, tmp_path / "straight", max_shard_mb=0, batch_size=4)
    cache = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT)), str(file), str(cache)],
                          env={**os.environ, "COMMITS": "5"}, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    done = len(Cache(cache))
    assert 0 < done < 32
    s = run(file, cache, max_shard_mb=0, batch_size=4)
    assert s["unchanged"] == done and s["new"] == 32 - done
    assert digests(cache) == digests(tmp_path / "straight")
    assert Cache(cache).manifest.datasets().keys() == {"shapes", "other"}
    assert {n: d["samples"] for n, d in Cache(cache).manifest.datasets().items()} == {"shapes": 24, "other": 8}
    assert Cache(cache).manifest.extra["sources"] == Cache(tmp_path / "straight").manifest.extra["sources"]
    assert verify(cache).ok


@pytest.mark.slow
def test_two_processes_equal_one(folder, tmp_path, clean_cache):
    # One compute thread, as the in-process build of `clean_cache` has (conftest): CPU kernels split work by
    # thread and round differently.
    out = precompute_processes(2, folder, tmp_path / "two", "--model", "tiny-sana", "--workers", "0", "--batch-size", "4")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    aborts = [line for line in out.stderr.splitlines() if "terminate" in line or "what()" in line or "Exception" in line]
    assert out.returncode == 0, "\n".join(errors + aborts) + "\n" + out.stderr[-2000:]
    assert digests(tmp_path / "two") == digests(clean_cache)
    ranks = {s.path.split("/")[1][:6] for s in Cache(tmp_path / "two").shards}
    assert ranks == {"r00000", "r00001"}
    assert verify(tmp_path / "two").ok


def test_a_damaged_tar_is_counted_and_the_rest_encoded(tmp_path):
    tars = make_tars(tmp_path / "tars", count=24, per_tar=8)
    data = tars[1].read_bytes()
    tars[1].write_bytes(data[: len(data) // 2 + 100])  # cut inside a member
    summary = run(tmp_path / "tars", tmp_path / "cache", workers=2)
    assert summary["failed_by_reason"].get("corrupt_tar") == 1
    assert 16 <= summary["new"] < 24  # the two intact tars, plus what precedes the cut
    assert verify(tmp_path / "cache").ok
