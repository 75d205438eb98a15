"""Stage one's options: the command line is the config dataclass, every value is checked in one place, and the
code written around the config still builds the caches earlier code built."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import precompute.run
from precompute.__main__ import app
from precompute.config import PrecomputeConfig
from precompute.sample_data import make_folder
from shards import Cache
from shards.options import default_of, flag, help_of, shown

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

LEGACY = Path(__file__).resolve().parents[1] / "data" / "cache-v2-3b95788"
FIELDS = [f.name for f in dataclasses.fields(PrecomputeConfig)]


@pytest.fixture
def captured(monkeypatch):
    """The config each CLI invocation builds; nothing is encoded."""
    configs = []

    def run(config):
        configs.append(config)
        return {}

    monkeypatch.setattr(precompute.run, "run", run)
    return configs


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def test_every_field_is_an_option_with_its_help_and_default():
    params = {p.name: p for p in typer.main.get_command(app).params}
    assert set(params) == set(FIELDS) | {"config"}
    assert params["data"].param_type_name == "argument" and params["data"].required
    for name in FIELDS:
        assert params[name].help == shown(help_of(PrecomputeConfig, name)), name  # as rich prints it
        if name != "data":
            assert params[name].default == default_of(PrecomputeConfig, name), name
    assert set(params["model"].opts + params["model"].secondary_opts) == {"--model", "-m"}
    assert set(params["cache"].opts) == {"--cache", "-c"}
    out = invoke("--help")
    assert out.exit_code == 0
    assert all(flag(name) in out.output for name in FIELDS if name != "data")
    assert "<skip|clamp>" in out.output and "<fp32|bf16|fp16|" in out.output  # the choices, from the Literal types


@pytest.mark.parametrize("args, message", [
    (["--extreme-aspect", "sideways"], "--extreme-aspect"),
    (["--storage-dtype", "int8"], "--storage-dtype"),
    (["--vae-dtype", "float64"], "--vae-dtype"),
    (["--max-failure-fraction", "-0.1"], "--max-failure-fraction -0.1: must be in [0, 1]"),
    (["--max-removal-fraction", "1.5"], "--max-removal-fraction 1.5: must be in [0, 1]"),
    (["--workers", "-1"], "--workers -1: must be at least 0"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--max-upscale", "0"], "--max-upscale 0.0: must be at least 1"),
    (["--model", "huge-sana"], "--model 'huge-sana': choose one of"),
    (["--text-encoder", "tiny-clip-l-g-t5"], "--text-encoder tiny-clip-l-g-t5: the sana family needs a single text encoder"),
    (["--drop-t5"], "--drop-t5 applies to SD3 presets"),
    (["--model", "pixart-sigma-512", "--text-dtype", "fp16"], "--text-dtype fp16: the text encoder overflows"),
])
def test_a_bad_value_is_refused_naming_its_flag(args, message, captured):
    out = invoke("data", *args)
    assert out.exit_code == 2 and message in out.output and not captured, out.output


def test_the_config_refuses_in_code_what_the_cli_refuses():
    with pytest.raises(ValueError, match="--extreme-aspect 'sideways': choose one of skip, clamp"):
        PrecomputeConfig("data", extreme_aspect="sideways")
    with pytest.raises(ValueError, match="--storage-dtype 'int8': choose one of fp32, bf16, fp16"):
        PrecomputeConfig("data", storage_dtype="int8")
    with pytest.raises(ValueError, match="--max-failure-fraction -0.5"):
        PrecomputeConfig("data", max_failure_fraction=-0.5)
    with pytest.raises(ValueError, match="--validation-file .*missing.txt"):
        PrecomputeConfig("data", validation_file="missing.txt")


def test_long_dtype_names_mean_the_short_ones(captured):
    config = PrecomputeConfig("data", storage_dtype="float32", vae_dtype="bfloat16", text_dtype="float16")
    assert (config.storage_dtype, config.vae_dtype, config.text_dtype) == ("fp32", "bf16", "fp16")
    assert invoke("data", "--storage-dtype", "bfloat16", "--vae-dtype", "float32").exit_code == 0
    assert invoke("data", "--storage-dtype", "fp16").exit_code == 0
    assert [(c.storage_dtype, c.vae_dtype) for c in captured] == [("bf16", "fp32"), ("fp16", None)]


def test_config_file_values_are_defaults_and_flags_win(tmp_path, captured):
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"workers": 0, "max_upscale": 3.0, "storage_dtype": "float32", "caption_key": ["alt"],
                                   "validation_prompt": ["a red circle"], "model": "tiny-pixart"}))
    out = invoke("data", "--config", options, "--workers", "1", "-c", tmp_path / "cache")
    assert out.exit_code == 0, out.output
    config = captured[0]
    assert (config.workers, config.max_upscale, config.storage_dtype, config.model) == (1, 3.0, "fp32", "tiny-pixart")
    assert config.caption_key == ["alt"] and config.validation_prompt == ["a red circle"]
    assert config.cache == tmp_path / "cache" and config.max_shard_mb == default_of(PrecomputeConfig, "max_shard_mb")
    assert PrecomputeConfig("data", "tiny-pixart").cache == Path("cache/tiny-pixart")


def test_an_unknown_config_key_is_refused_naming_the_file(tmp_path, captured):
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"wokers": 0}))
    out = invoke("data", "--config", options)
    assert out.exit_code == 2 and "options.json" in out.output and "wokers" in out.output and not captured


def test_validation_prompts_come_from_the_flags_and_the_file_once(tmp_path, captured):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a blue square\n\n  a green star  \n", encoding="utf-8")
    config = PrecomputeConfig("data", validation_prompt=["a red circle"], validation_file=prompts)
    assert config.validation_prompt == ["a red circle", "a blue square", "a green star"]
    assert dataclasses.replace(config).validation_prompt == config.validation_prompt  # a copy does not read the file again
    assert invoke("data", "--validation-prompt", "a red circle", "--validation-file", prompts).exit_code == 0
    assert captured[0].validation_prompt == config.validation_prompt


def test_the_failure_threshold_is_the_configs(monkeypatch):
    monkeypatch.setattr(precompute.run, "run", lambda config: {"failure_fraction": 0.3})
    assert invoke("data").exit_code == 1
    assert invoke("data", "--max-failure-fraction", "0.5").exit_code == 0


@pytest.fixture(scope="module")
def legacy_data(tmp_path_factory):
    """The dataset the legacy caches were built from (their README)."""
    return make_folder(tmp_path_factory.mktemp("legacy") / "DATA", count=6)


def without_clip_vocabularies(fingerprint: dict) -> dict:
    """The fingerprint without the digests of the tiny CLIP tokenizers' vocabularies: at 3b95788 the trainer of
    those tokenizers numbered some tokens in an order that changed from process to process, so those digests
    are not reproducible (they are now the same in every process)."""
    fingerprint = json.loads(json.dumps(fingerprint))
    for module in fingerprint["text_encoder"].get("modules", {}).values():
        if module["tokenizer"] == "CLIPTokenizer":
            del module["tokenizer_vocab_sha256"]
    return fingerprint


VOCABULARY_DIGESTS = """
import hashlib, json, sys
sys.path.insert(0, {root!r})
from precompute.families import parts, sana
print(json.dumps([hashlib.sha256(json.dumps(sorted(tokenizer().get_vocab().items())).encode()).hexdigest()
                  for tokenizer in (parts.tiny_clip_tokenizer, parts.tiny_t5_tokenizer, sana.tiny_tokenizer)]))
"""


@pytest.mark.slow
def test_the_tiny_tokenizers_are_the_same_in_every_process():
    """Else a tiny-sd3 cache could not be extended by another run: its fingerprint records the vocabularies."""
    code = VOCABULARY_DIGESTS.format(root=str(Path(__file__).resolve().parents[2]))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1] and len(json.loads(runs[0])) == 3


@pytest.mark.parametrize("model", ["tiny-sana", "tiny-sd3"])
def test_the_cache_is_the_one_earlier_code_built(legacy_data, tmp_path, model):
    """Built as the legacy caches were (tests/data/cache-v2-3b95788/README.md): the same fingerprint, the same
    record of stage one, byte for byte and key for key, the same decoder files and the same samples in the
    same shards."""
    precompute.run.main(str(legacy_data), model, tmp_path / model, validation_prompt=["a red circle"], workers=0, progress=False)
    new, old = Cache(tmp_path / model).manifest, Cache(LEGACY / model).manifest
    if model == "tiny-sana":
        assert new.fingerprint_sha256 == old.fingerprint_sha256
        assert json.loads((tmp_path / model / "index.json").read_text())["fingerprint_sha256"] == old.fingerprint_sha256
    assert without_clip_vocabularies(new.fingerprint) == without_clip_vocabularies(old.fingerprint)
    assert json.dumps(new.extra["precompute"]) == json.dumps(old.extra["precompute"])  # keys in the same order
    decoder = {role: entry for role, entry in new.files.items() if role.startswith("decoder:")}
    assert decoder == {role: entry for role, entry in old.files.items() if role.startswith("decoder:")} and decoder

    def samples(manifest):
        paths = list(manifest.shards.paths())
        return [(paths[shard], key, source, row) for key, source, _, shard, row in manifest.samples()]

    assert samples(new) == samples(old)
