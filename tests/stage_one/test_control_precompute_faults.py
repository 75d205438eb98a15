"""Stage one with --control refuses what cannot hold: control keys and flips checked against --control, missing or
undecodable control images named failures, a cache of the other kind refused by its fingerprint; and editing one
control image re-encodes that sample alone."""

import os
from pathlib import Path

import pytest
import torch
from control_testing import RUN, failures, sidecar_folder, triples
from PIL import Image, ImageOps
from typer.testing import CliRunner

from precompute.config import PrecomputeConfig
from precompute.run import main as precompute
from shards import CONTROL_PREFIX, Cache, CacheSpec, load

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


@pytest.fixture(scope="module")
def items():
    return triples(3, seed=1)


def test_control_keys_and_flip_are_checked_against_control(tmp_path):
    file = tmp_path / "data.toml"
    file.write_text('[[source]]\npath = "photos"\ncontrol = "edges"\n')
    with pytest.raises(ValueError, match="sets control, which applies to ControlNet caches only: pass --control"):
        PrecomputeConfig(str(file))
    file.write_text('[[source]]\nname = "dogs"\npath = "photos"\nflip = true\n')
    with pytest.raises(ValueError, match="source 'dogs' sets flip = true, which --control does not support"):
        PrecomputeConfig(str(file), control=True)
    file.write_text('[[source]]\npath = "photos"\ncontrl = "edges"\n')
    with pytest.raises(ValueError, match="did you mean 'control'"):
        PrecomputeConfig(str(file), control=True)
    file.write_text('[[source]]\npath = "photos"\ncontrol = 3\n')
    with pytest.raises(ValueError, match="control = 3: must be a string"):
        PrecomputeConfig(str(file), control=True)
    from precompute.__main__ import HELP

    assert "control_column" in HELP and "control:" in HELP


def test_missing_or_undecodable_control_images_are_named_failures(tmp_path, items):
    data = sidecar_folder(tmp_path / "data", items + triples(4, seed=5))
    (data / "003.control.png").unlink()  # missing
    (data / "004.control.png").write_bytes(b"\x89PNG\r\n\x1a\n but cut short")  # undecodable
    img = Image.open(data / "005.png")
    Image.new("RGB", (img.width, 2 * img.height)).save(data / "005.control.png")  # another shape
    (data / "006.control.png").unlink()
    os.mkfifo(data / "006.control.png")  # not a regular file: never opened (opening a FIFO would block)
    cache = tmp_path / "cache"
    summary = precompute(str(data), "tiny-sana", cache, control=True, **RUN)
    assert summary["new"] == 3
    expected = {"003.png": "missing_control", "004.png": "corrupt_control", "005.png": "control_aspect",
                "006.png": "unreadable_control"}
    assert failures(cache) == expected
    assert summary["failed_by_reason"] == {"control_aspect": 1, "corrupt_control": 1, "missing_control": 1, "unreadable_control": 1}
    assert sorted(bytes(Cache(cache)[i]["source"].tolist()).decode() for i in range(3)) == ["000.png", "001.png", "002.png"]

    from precompute.inputs import REASONS

    assert all(reason in REASONS for reason in expected.values())


def test_the_fingerprint_holds_control_and_the_other_kind_of_run_is_refused(tmp_path, items):
    from precompute.__main__ import app

    data = sidecar_folder(tmp_path / "data", items)
    control_cache, plain_cache = tmp_path / "control", tmp_path / "plain"
    precompute(str(data), "tiny-sd3", control_cache, control=True, **RUN)
    manifest = load(control_cache)
    spec = CacheSpec.of(manifest)
    assert manifest.fingerprint["control"] == spec.latent.control_fingerprint() == spec.control
    for name in spec.latent.control_fields:  # stacked like the latent, in the storage dtype
        field, twin = manifest.schema[name], manifest.schema[name.removeprefix(CONTROL_PREFIX)]
        assert not field.ragged and field.dtype == twin.dtype == torch.float32
    assert set(spec.latent.control_fields) == {"control_latent_mean", "control_latent_std"}

    with pytest.raises(ValueError, match="holds control latents .* pass --control"):
        precompute(str(data), "tiny-sd3", control_cache, **RUN)
    out = CliRunner().invoke(app, [str(data), "--model", "tiny-sd3", "--cache", str(control_cache), "--workers", "0",
                                   "--storage-dtype", "fp32", "--no-progress"])
    assert out.exit_code == 2 and "holds control latents" in out.output

    precompute(str(data), "tiny-sd3", plain_cache, **RUN)
    assert "control" not in load(plain_cache).fingerprint and CacheSpec.of(load(plain_cache)).control is None
    with pytest.raises(ValueError, match="built without control images"):
        precompute(str(data), "tiny-sd3", plain_cache, control=True, **RUN)
    assert len(Cache(control_cache)) == len(Cache(plain_cache)) == 3  # nothing was touched

    # a control cache takes validation prompts without its dataset, and stays a control cache
    from precompute.prompts import PromptsConfig, add_prompts

    assert add_prompts(PromptsConfig(control_cache, prompt=["a red circle"]))["added"] == ["a red circle"]
    after = load(control_cache)
    assert (after.fingerprint, after.schema) == (manifest.fingerprint, manifest.schema)
    assert "a red circle" in {p.text for p in Cache(control_cache).prompts().values()}


def test_editing_one_control_image_re_encodes_that_sample_alone(tmp_path, items, monkeypatch):
    data = sidecar_folder(tmp_path / "data", items)
    cache = tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, control=True, **RUN)
    before = {bytes(s["source"].tolist()).decode(): (s.key, s["control_latent"]) for s in map(Cache(cache).__getitem__, range(3))}

    again = precompute(str(data), "tiny-sana", cache, control=True, **RUN)
    assert (again["unchanged"], again["new"], again["changed"]) == (3, 0, 0)
    ImageOps.mirror(items[1][1]).save(data / "001.control.png")
    summary = precompute(str(data), "tiny-sana", cache, control=True, **RUN)
    assert (summary["changed"], summary["unchanged"], summary["new"], summary["removed"]) == (1, 2, 0, 0)
    after = {bytes(s["source"].tolist()).decode(): (s.key, s["control_latent"]) for s in map(Cache(cache).__getitem__, range(3))}
    assert after.keys() == before.keys()
    for name in ("000.png", "002.png"):
        assert after[name][0] == before[name][0] and torch.equal(after[name][1], before[name][1])
    assert after["001.png"][0] != before["001.png"][0] and not torch.equal(after["001.png"][1], before["001.png"][1])

    # the stamp holds the control image's size and mtime: touched, it is read again (and found unchanged by its
    # content); unchanged, nothing is read
    from precompute import folders

    read, real = [], folders.read_regular
    monkeypatch.setattr(folders, "read_regular", lambda path: read.append(Path(path).name) or real(path))
    assert precompute(str(data), "tiny-sana", cache, control=True, **RUN)["unchanged"] == 3
    assert read == []
    os.utime(data / "000.control.png", ns=(10**18, 10**18))
    assert precompute(str(data), "tiny-sana", cache, control=True, **RUN)["unchanged"] == 3
    assert sorted(read) == ["000.control.png", "000.png", "000.txt"]
