"""`python -m precompute prompts`: prompts added to a built cache without its dataset are the embeddings a full
stage-one run with `--validation-prompt` stores, bit for bit; only the cache's own text encoder is accepted."""

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from precompute.__main__ import prompts_app
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Cache, CacheLock, load, prompt_key
from train.validate import resolve_prompts

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = "a large red circle on a blue background", "a small green triangle on a white background"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny-sana cache with one validation prompt, and a reference built from the same images with the new prompt
    too; the images are deleted afterwards, as `prompts` never needs them."""
    root = tmp_path_factory.mktemp("prompts")
    data = make_folder(root / "data", count=6)
    precompute(str(data), "tiny-sana", root / "cache", workers=0, progress=False, validation_prompt=[OLD])
    precompute(str(data), "tiny-sana", root / "reference", workers=0, progress=False, validation_prompt=[OLD, NEW])
    shutil.rmtree(data)
    return root


@pytest.fixture
def cache(built, tmp_path):
    """A fresh copy of the cache for one test to change."""
    return shutil.copytree(built / "cache", tmp_path / "cache")


def invoke(*args):
    return CliRunner().invoke(prompts_app, [str(a) for a in args])


def assert_same_prompts(a: dict, b: dict, keys) -> None:
    for key in keys:
        assert a[key].text == b[key].text
        assert a[key].fields.keys() == b[key].fields.keys()
        for name in a[key].fields:
            x, y = a[key].fields[name], b[key].fields[name]
            assert x.dtype == y.dtype and torch.equal(x, y), (a[key].text, name)


def test_prompts_are_added_without_the_data_and_equal_a_full_run(built, cache, monkeypatch):
    before = Cache(cache).prompts()
    assert set(before) == {prompt_key(""), prompt_key(OLD)}

    def no_vae(*args, **kwargs):
        raise AssertionError("the VAE was built")

    monkeypatch.setattr("precompute.families.sana.Sana.load_vae", no_vae)
    out = invoke(cache, "--prompt", NEW, "--prompt", OLD)
    assert out.exit_code == 0, out.output
    assert "1 prompt(s) added, 1 already cached" in out.output

    after = Cache(cache).prompts()
    assert set(after) == {prompt_key(""), prompt_key(OLD), prompt_key(NEW)}
    assert_same_prompts(after, Cache(built / "reference").prompts(), after)  # the new one as a full run stores it
    assert_same_prompts(after, before, before)  # the old ones kept as they were
    assert len(Cache(cache)) == len(Cache(built / "reference"))  # no sample touched

    generation = load(cache).generation
    again = invoke(cache, "--prompt", NEW)
    assert again.exit_code == 0 and "0 prompt(s) added, 1 already cached" in again.output
    assert load(cache).generation == generation  # nothing committed


def test_the_entry_point_adds_prompts_from_a_file(built, cache, tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text(f"\n  {NEW}  \n\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "precompute", "prompts", str(cache), "--prompt-file", str(file)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "1 prompt(s) added" in out.stdout
    assert_same_prompts(Cache(cache).prompts(), Cache(built / "reference").prompts(), [prompt_key(NEW)])


def test_the_trainers_error_names_the_command_that_adds_the_prompt(cache):
    missing = "a green triangle at dusk's edge"
    with pytest.raises(ValueError) as e:
        resolve_prompts(Cache(cache), [OLD, missing], "tiny-sana")
    command = f"python -m precompute prompts {shlex.quote(str(cache))} --prompt {shlex.quote(missing)}"
    assert command in str(e.value)

    argv = shlex.split(command)
    out = invoke(*argv[4:])  # the command as printed, after `python -m precompute prompts`
    assert out.exit_code == 0, out.output
    assert [p.text for p in resolve_prompts(Cache(cache), [OLD, missing], "tiny-sana")] == [OLD, missing]


def test_another_text_encoder_is_refused(cache, tmp_path):
    from precompute.families.sana import tiny_text_encoder, tiny_tokenizer

    # the tiny Gemma-2 in the diffusers layout, with other weights than the seeded one the cache was built with
    tokenizer = tiny_tokenizer()
    model = tiny_text_encoder(len(tokenizer))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(tmp_path / "other" / "text_encoder")
    tokenizer.save_pretrained(tmp_path / "other" / "tokenizer")
    stored = load(cache).files["prompts"]

    out = invoke(cache, "--prompt", NEW, "--pretrained", tmp_path / "other")
    assert out.exit_code == 2
    assert "text_encoder.weights" in out.output and "text_encoder.source" not in out.output
    out = invoke(cache, "--prompt", NEW, "--text-dtype", "bf16")
    assert out.exit_code == 2
    assert "text_encoder.compute_dtype: cache='float32' this run='bfloat16'" in out.output
    assert load(cache).files["prompts"] == stored


def test_a_copy_of_the_same_weights_elsewhere_is_accepted(built, cache, tmp_path):
    from precompute.presets import get_preset, save_tiny

    save_tiny(get_preset("tiny-sana"), tmp_path / "copy")  # as a local snapshot of the weights the cache names
    out = invoke(cache, "--prompt", NEW, "--pretrained", tmp_path / "copy")
    assert out.exit_code == 0, out.output
    assert_same_prompts(Cache(cache).prompts(), Cache(built / "reference").prompts(), [prompt_key(NEW)])


def test_a_cache_being_written_is_refused(cache):
    lock = CacheLock(cache)  # what a running stage one holds
    try:
        out = invoke(cache, "--prompt", NEW)
    finally:
        lock.release()
    assert out.exit_code == 3 and "being written" in out.output


def test_no_cache_and_an_empty_prompt_are_refused(tmp_path, cache):
    out = invoke(tmp_path / "nothing", "--prompt", NEW)
    assert out.exit_code == 2 and "holds no cache" in out.output
    out = invoke(cache, "--prompt", "")
    assert out.exit_code == 2 and "empty caption is always cached" in out.output


def test_a_damaged_prompts_file_is_not_carried_into_the_next(built, cache):
    path = cache / load(cache).files["prompts"]["path"]
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header])["text"]["data_offsets"]
    data[8 + header + begin + 5] ^= 0xFF  # in an embedding: the file still reads, its digest does not match
    path.write_bytes(bytes(data))
    out = invoke(cache, "--prompt", NEW)
    assert out.exit_code == 0, out.output
    assert str(path) in out.output and "damaged" in out.output and OLD in out.output  # the lost prompt is named
    after = Cache(cache).prompts()
    assert set(after) == {prompt_key(""), prompt_key(NEW)}  # rebuilt from what was given, the empty caption too
    assert_same_prompts(after, Cache(built / "reference").prompts(), after)  # bit for bit what a full run stores
