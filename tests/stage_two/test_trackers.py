"""--report-to: TensorBoard and wandb (offline) receive what metrics.jsonl records, the validation grids and the run's
config; a resumed run continues its wandb run; nothing is opened unless asked; a tracker asked for but not installed
stops the run before its first step, naming the extra to install."""

import json
import shutil
import struct
import sys

import pytest
from conftest import VALIDATION_PROMPTS

from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.loop import train
from train.metrics import SCALARS

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A tiny-sana cache of 8 sample images with two validation prompts."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("trackers")
    precompute(str(make_folder(root / "data", count=8)), "tiny-sana", root / "cache", workers=0, progress=False,
               validation_prompt=VALIDATION_PROMPTS)
    return root / "cache"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, its settings and caches inside the test's directory."""
    settings = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": tmp_path / "wandb-dir",
                "WANDB_CONFIG_DIR": tmp_path / "wandb-config", "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                "WANDB_DATA_DIR": tmp_path / "wandb-data"}
    for name, value in settings.items():
        monkeypatch.setenv(name, str(value))


def config(cache, run, steps=4, **kwargs) -> TrainConfig:
    return TrainConfig(model="tiny-sana", cache=cache, run=run, steps=steps, batch_size=4, workers=0, progress=False,
                       log_every=1, checkpoint_every=2, validation_steps=2, validate_every=2, precision="fp32",
                       **kwargs)


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def wandb_records(path) -> list:
    """The records of a `.wandb` file: a W&B header, then protobuf records in LevelDB's log format (32 KiB blocks,
    each record or fragment behind a 7-byte header: checksum, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, records, part = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def wandb_run(directory):
    """(run record, history rows by step as {key: value}, files logged) of an offline run directory."""
    (path,) = directory.glob("run-*.wandb")
    run, rows, files = None, {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            rows.setdefault(items["_step"], {}).update(items)
        elif kind == "files":
            files += [f.path for f in record.files.files]
    return run, rows, files


@pytest.mark.slow
def test_wandb_receives_the_scalars_grids_and_config_and_a_resume_continues_its_run(cache, tmp_path, offline):
    run = tmp_path / "run"
    train(config(cache, run, report_to=["wandb"]))
    run_id = (run / "wandb" / "run-id").read_text()
    (first,) = run.glob(f"wandb/offline-run-*-{run_id}")
    info, rows, files = wandb_run(first)
    assert (info.run_id, info.project, info.display_name) == (run_id, "cachedit", "run")
    options = {u.key: json.loads(u.value_json) for u in info.config.update}
    assert (options["model"], options["steps"], options["report_to"]) == ("tiny-sana", 4, ["wandb"])
    for record in metrics(run):
        assert {name: rows[record["step"]][f"train/{name}"] for name in SCALARS} == {n: record[n] for n in SCALARS}
    grids = [row for row in rows.values() if "validation._type" in row]  # a row's grids, the last list logged to it
    assert sorted(caption for row in grids for caption in row["validation.captions"]) == ["step 2", "step 4"]
    images = [name for row in grids for name in row["validation.filenames"]]
    assert len(images) == 2 and set(images) <= set(files) and all((first / "files" / name).is_file() for name in images)

    train(config(cache, run, steps=6, report_to=["wandb"], tracker_run_name="renamed"))
    assert (run / "wandb" / "run-id").read_text() == run_id
    (second,) = set(run.glob(f"wandb/offline-run-*-{run_id}")) - {first}
    info, rows, _ = wandb_run(second)
    assert (info.run_id, info.display_name, info.resume) == (run_id, "renamed", True)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]
    for record in metrics(run)[4:]:
        assert {name: rows[record["step"]][f"train/{name}"] for name in SCALARS} == {n: record[n] for n in SCALARS}


def test_tensorboard_receives_the_scalars_grids_and_config_and_hides_redone_steps(cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(config(cache, run, report_to=["tensorboard"]))
    shutil.rmtree(complete_checkpoints(run)[-1])  # killed after logging steps 3 and 4, before their checkpoint
    train(config(cache, run, report_to=["tensorboard"]))  # redoes them
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for name in SCALARS:
        logged = [(e.step, e.value) for e in events.Scalars(f"train/{name}")]
        assert logged == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in records], name
    assert sorted({e.step for e in events.Images("validation")}) == [2, 4]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```"))["report_to"] == ["tensorboard"]


def test_no_tracker_unless_asked(cache, tmp_path, offline):
    import tensorboard  # noqa: F401 installed, and still not used

    run = tmp_path / "run"
    train(config(cache, run, steps=2))
    assert len(metrics(run)) == 2
    assert not (run / "tensorboard").exists() and not (run / "wandb").exists()
    assert not list(tmp_path.rglob("*.wandb")) and not list(tmp_path.rglob("events.out.tfevents.*"))


@pytest.mark.parametrize("tracker, module", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")])
def test_a_tracker_not_installed_stops_the_run_before_its_first_step(cache, tmp_path, monkeypatch, tracker, module):
    monkeypatch.setitem(sys.modules, module, None)  # what `import` finds when the package is missing
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"pip install -e '\.\[{tracker}\]'"):
        train(config(cache, run, report_to=[tracker]))
    assert not (run / "metrics.jsonl").exists() and not complete_checkpoints(run)


@pytest.mark.slow
def test_under_two_processes_rank_0_alone_reports(cache, tmp_path, offline):
    from conftest import train_processes

    run = tmp_path / "run"
    train_processes(2, run, "--model", "tiny-sana", "--cache", str(cache), "--steps", "2", "--batch-size", "2",
                    "--workers", "0", "--no-progress", "--log-every", "1", "--validation-steps", "2", "--precision",
                    "fp32", "--report-to", "tensorboard", "--report-to", "wandb")
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (directory,) = run.glob("wandb/offline-run-*")
    _, rows, _ = wandb_run(directory)
    for record in metrics(run):
        assert rows[record["step"]]["train/loss"] == record["loss"]
