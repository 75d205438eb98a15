"""A run's checkpoints and exports under faults: an existing --out that is not an export, temp names of others beside
it, checkpoint files that would run code when unpickled, damaged checkpoints, and a disk that fills during a save.
Each refusal is a message naming the file and what to do (exit 2), never a traceback, and nothing is run or lost."""

import errno
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VALIDATION_PROMPTS
from typer.testing import CliRunner

from train import checkpoint
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.export import export
from train.loop import train

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
RECORD = ".cachedit-export.json"


def cfg(cache, run, **kw):
    base = dict(model="tiny-sana", cache=[str(cache)], run=str(run), steps=2, batch_size=4, workers=0, progress=False,
                validate=False, checkpoint_every=1, keep_checkpoints=2, precision="fp32")
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny-sana cache of 8 images with validation prompts and a full fine-tuning run of 2 steps on it (a checkpoint
    after each)."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("faults")
    precompute(str(make_folder(root / "data", count=8)), "tiny-sana", root / "cache", workers=0, progress=False,
               validation_prompt=list(VALIDATION_PROMPTS))
    train(cfg(root / "cache", root / "run"))
    return root


def files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def cli(*args: str) -> tuple[int, str]:
    from train.__main__ import tools

    result = CliRunner().invoke(tools, list(map(str, args)), env=WIDE)
    assert isinstance(result.exception, SystemExit), result.exception  # a message, not an exception's traceback
    return result.exit_code, " ".join(result.output.split())


def copy_run(root: Path, to: Path) -> Path:
    """A copy of the run holding its newest checkpoint alone; returns that checkpoint."""
    newest = complete_checkpoints(root / "run")[-1]
    shutil.copytree(newest, to / "checkpoints" / newest.name)
    return to / "checkpoints" / newest.name


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_export_replaces_only_an_earlier_export_never_a_folder_that_looks_like_one(root, tmp_path):
    downloaded = tmp_path / "downloaded"  # what `hf download --local-dir` of a pushed export leaves
    (downloaded / "images").mkdir(parents=True)
    (downloaded / "images" / "grid.png").write_bytes(b"png")
    (downloaded / "transformer").mkdir()
    (downloaded / "transformer" / "config.json").write_text("{}")
    (downloaded / "README.md").write_text("someone's model")
    before = files(downloaded)
    code, message = cli("export", root / "run", "--out", downloaded)
    assert code == 2 and f"--out {downloaded} exists and is not an export" in message
    assert "choose another --out, or remove" in message and files(downloaded) == before

    empty = tmp_path / "empty"
    empty.mkdir()
    export(root / "run", empty)  # an empty directory is used
    assert (empty / "transformer" / "config.json").exists() and (empty / RECORD).exists()
    record = json.loads((empty / RECORD).read_text())
    assert record["checkpoint"] == str(complete_checkpoints(root / "run")[-1].resolve()) and record["step"] == 2
    export(complete_checkpoints(root / "run")[0], empty)  # an earlier export is replaced whole
    assert json.loads((empty / "transformer" / "training.json").read_text())["step"] == 1

    (empty / "notes.txt").write_text("mine")
    code, message = cli("export", root / "run", "--out", empty)
    assert code == 2 and "is an earlier export holding files an export does not write (notes.txt)" in message
    (empty / "notes.txt").unlink()
    (empty / RECORD).unlink()  # as an earlier version wrote it
    before = files(empty)
    code, message = cli("export", root / "run", "--out", empty)
    assert code == 2 and "exports written by earlier versions have none either" in message and files(empty) == before


def test_export_touches_no_temp_or_old_directory_but_its_own(root, tmp_path, caplog):
    out = tmp_path / "out"
    theirs = {name: tmp_path / name for name in (".tmp-out", ".old-out", ".tmp-out-keep")}
    for directory in theirs.values():
        directory.mkdir()
        (directory / "work.txt").write_text("not the export's")
    killed = tmp_path / ".tmp-out-killed"  # an export to OUT that was killed before publishing
    killed.mkdir()
    (killed / RECORD).write_text(json.dumps({"product": "cachedit", "kind": "export"}))
    export(root / "run", out)
    with caplog.at_level(logging.WARNING, logger="train"):
        export(root / "run", out)  # replacing the first
    for directory in theirs.values():
        assert files(directory) == {"work.txt": b"not the export's"}
    assert f"{killed} is left from an export to {out}" in caplog.text and ".tmp-out-keep" not in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", killed.name, *theirs])


def test_a_sharded_checkpoint_whose_metadata_would_run_code_is_refused(root, tmp_path):
    ckpt = copy_run(root, tmp_path / "run")
    marker = tmp_path / "ran"
    (ckpt / "sharded").mkdir()
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    code, message = cli("export", ckpt, "--out", tmp_path / "out")
    assert code == 2 and f"{ckpt / 'sharded' / '.metadata'} asks to load posix.system" in message
    code, message = cli("sample", ckpt, "--prompt-cache", root / "cache", "--out", tmp_path / "samples")
    assert code == 2 and ".metadata" in message
    with pytest.raises(ValueError, match="could run code"):
        train(cfg(root / "cache", tmp_path / "run", steps=4))  # resuming it
    assert not marker.exists() and not (tmp_path / "out").exists() and not (tmp_path / "samples").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # saved in one process, as the test means
def test_a_sharded_value_that_would_run_code_is_refused(root, tmp_path):
    """The metadata is sound; a value it lists as bytes would be unpickled by torch's checkpoint planner."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ckpt = copy_run(root, tmp_path / "run")
    marker = tmp_path / "ran"
    weights = load_file(ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    first = next(iter(weights))
    dcp.save({"model": {**weights, first: RunsCode(marker)}}, checkpoint_id=ckpt / "sharded", no_dist=True)
    assert not marker.exists()
    code, message = cli("export", ckpt, "--out", tmp_path / "out")
    assert code == 2 and f"the value of model.{first} cannot be loaded safely" in message
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_an_optimizer_state_that_would_run_code_is_refused_on_resume(root, tmp_path):
    ckpt = copy_run(root, tmp_path / "run")
    marker = tmp_path / "ran"
    torch.save({"state": {}, "param_groups": [RunsCode(marker)]}, ckpt / "optimizer.pt")
    with pytest.raises(ValueError, match=f"{ckpt / 'optimizer.pt'} cannot be loaded safely") as refused:
        train(cfg(root / "cache", tmp_path / "run", steps=4))
    assert "damaged or was not written by this trainer" in str(refused.value) and not marker.exists()


DAMAGES = {
    "weights missing": lambda ckpt: (ckpt / "transformer" / "diffusion_pytorch_model.safetensors").unlink(),
    "weights cut short": lambda ckpt: os.truncate(ckpt / "transformer" / "diffusion_pytorch_model.safetensors", 1000),
    "state not JSON": lambda ckpt: (ckpt / "state.json").write_text('{"step": 2, "con'),
}
NAMED = {"weights missing": "transformer/diffusion_pytorch_model.safetensors is missing",
         "weights cut short": "transformer/diffusion_pytorch_model.safetensors is damaged",
         "state not JSON": "state.json is not JSON"}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_a_clear_error_for_export_sample_and_resume(root, tmp_path, damage):
    ckpt = copy_run(root, tmp_path / "run")
    DAMAGES[damage](ckpt)
    named = f"{ckpt}/{NAMED[damage]}"
    code, message = cli("export", ckpt, "--out", tmp_path / "out")
    assert code == 2 and named in message and "earlier checkpoint" in message
    code, message = cli("sample", tmp_path / "run", "--prompt-cache", root / "cache", "--out", tmp_path / "samples")
    assert code == 2 and named in message
    with pytest.raises(ValueError, match=named):
        train(cfg(root / "cache", tmp_path / "run", steps=4))


def test_a_resume_without_the_optimizer_state_is_a_clear_error(root, tmp_path):
    ckpt = copy_run(root, tmp_path / "run")
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=f"{ckpt / 'optimizer.pt'} is missing"):
        train(cfg(root / "cache", tmp_path / "run", steps=4))
    export(ckpt, tmp_path / "out")  # the weights are whole: they still export


def test_a_full_disk_during_a_checkpoint_names_it_and_keeps_the_one_before(root, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real, calls = checkpoint.atomic_write_json, []

    def fills_up(path, obj):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint, after its weights and optimizer state were written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, obj)
    monkeypatch.setattr(checkpoint, "atomic_write_json", fills_up)
    with pytest.raises(ValueError) as full:
        train(cfg(root / "cache", run, steps=4, checkpoint_every=2))
    message = str(full.value)
    assert f"could not write checkpoint {run / 'checkpoints' / 'step-00000004'} (No space left on device" in message
    assert re.search(r"[0-9.]+ [MG]B free on its filesystem, the checkpoint needs about [0-9.]+ [MG]B", message)
    assert "fewer --keep-checkpoints" in message
    assert f"{run / 'checkpoints' / 'step-00000002'} is intact" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]  # no partial checkpoint left
    monkeypatch.undo()
    assert train(cfg(root / "cache", run, steps=4, checkpoint_every=2))["step"] == 4  # resumed from step 2


class SafetensorError(Exception):
    """As safetensors' writer raises it: the OS error in its text alone."""


@pytest.mark.parametrize("writer, error", [
    ("torch.save", RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 2304 vs 2198: "
                                "PytorchStreamWriter failed writing file data/0: file write failed")),
    ("save_pretrained", SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                        "\"No space left on device\" })")),
])
def test_a_full_disk_met_by_the_weights_writers_names_it_too(root, tmp_path, monkeypatch, writer, error):
    import shutil as shutil_module
    from collections import namedtuple

    run = tmp_path / "run"
    train(cfg(root / "cache", run, steps=2, checkpoint_every=2))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))

    def fails(*args, **kwargs):
        raise error
    if writer == "torch.save":
        monkeypatch.setattr(torch, "save", fails)
    else:
        from diffusers import SanaTransformer2DModel
        monkeypatch.setattr(SanaTransformer2DModel, "save_pretrained", fails)
    with pytest.raises(ValueError) as full:
        train(cfg(root / "cache", run, steps=4, checkpoint_every=2))
    message = str(full.value)
    assert f"could not write checkpoint {run / 'checkpoints' / 'step-00000004'} (No space left on device" in message
    assert "0.0 MB free on its filesystem" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
