"""tiny-wan and tiny-wan-i2v train from a cache of clips end to end (full fine-tune and LoRA; from a cache written as
stage one writes one, and from stage one's own), resume exactly, train under DDP as one process does, validate with
videos (mp4 beside a contact sheet) the trackers show, and `train sample` a clip run; the image-to-video model gets its
cached first frame in every batch, the held-out loss's too; the plan of clips holds against the dry run's peak."""

import json
from pathlib import Path

import av
import pytest
import torch
from safetensors.torch import load_file
from video_testing import BUCKETS, clip_cache

from shards import Bucket
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.loop import train
from train.video import SHEET

pytestmark = pytest.mark.model  # builds tiny diffusers models (left out of make test-fast)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip-caches")
    return {"tiny-wan": clip_cache(root / "t2v", family="wan", preset="tiny-wan", decoder=True),
            "tiny-wan-i2v": clip_cache(root / "i2v", family="wan", preset="tiny-wan-i2v", decoder=True, condition=True,
                                       image_embeds=True)}


def cfg(cache, run, **kw):
    base = dict(model="tiny-wan", cache=cache, run=run, steps=4, batch_size=2, workers=1, progress=False, log_every=1,
                checkpoint_every=1000, caption_dropout=0.2, lr=1e-3, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint's weight files (the transformer's, or the adapters')."""
    ckpt = complete_checkpoints(run)[-1]
    out = {}
    for f in sorted(ckpt.rglob("*.safetensors")):
        out.update({f"{f.relative_to(ckpt)}:{k}": v for k, v in load_file(f).items()})
    return out


@pytest.mark.parametrize("adapter", [{}, {"lora_rank": 4}], ids=["full", "lora"])
def test_tiny_wan_trains_on_clips_and_resumes_exactly(caches, tmp_path, adapter):
    cache = caches["tiny-wan"]
    train(cfg(cache, tmp_path / "straight", **adapter))
    train(cfg(cache, tmp_path / "resumed", steps=2, **adapter))
    train(cfg(cache, tmp_path / "resumed", **adapter))
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(straight) == 4 and all(x == x and x > 0 for x in straight)
    assert resumed == straight  # the same batches, draws and losses
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if adapter:
        assert all("lora" in k for k in a)  # only the adapters trained and were saved


@pytest.mark.slow
def test_tiny_wan_validates_with_videos_and_samples_them_again(caches, tmp_path):
    from train.export import sample

    run = tmp_path / "run"
    train(cfg(caches["tiny-wan"], run, steps=2, validate=True, validate_every=1, validation_steps=2))
    for step in ("00000001", "00000002"):
        folder = run / "samples" / step
        videos = sorted(folder.glob("*.mp4"))
        assert [v.name for v in videos] == ["00-a-blue-circle-bouncing-17x64x64.mp4",
                                            "01-a-red-square-moving-right-17x64x64.mp4", "dataset-clip0000.mp4"]
        for v in videos:
            with av.open(str(v)) as container:
                stream = container.streams.video[0]
                frames = list(container.decode(stream))
                assert (len(frames), frames[0].width, frames[0].height, float(stream.average_rate)) == (17, 64, 64, 16.0)
        assert (folder / SHEET).stat().st_size > 1000
    written = sample(run, None, tmp_path / "again", buckets=["48x80"], frames=5, steps=1)  # the run's own cache
    assert [p.name for p in written] == ["a-blue-circle-bouncing-5x48x80-seed0.mp4",
                                         "a-red-square-moving-right-5x48x80-seed0.mp4", SHEET]
    with av.open(str(written[0])) as container:
        frames = list(container.decode(video=0))
        assert (len(frames), frames[0].width, frames[0].height) == (5, 80, 48)


@pytest.mark.slow
def test_tiny_wan_i2v_trains_with_its_cached_first_frame(caches, tmp_path, monkeypatch):
    import train.families.wan as wan

    seen = []
    forward = wan.Wan.forward

    def recording(self, model, config, xt, t, batch, guidance):
        seen.append({k: (tuple(v.shape), v.dtype) for k, v in batch.items() if k in ("condition", "image_embeds")})
        return forward(self, model, config, xt, t, batch, guidance)

    monkeypatch.setattr(wan.Wan, "forward", recording)
    train(cfg(caches["tiny-wan-i2v"], tmp_path / "run", model="tiny-wan-i2v", steps=2, precision="bf16", lora_rank=4,
              validate=True, validation_steps=1, eval_fraction=0.3, remainder="repeat"))
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval_loss"] > 0  # the held-out clips' loss, their first frames in the batch too
    clips = {b for b, _ in BUCKETS}
    trained = [s for s in seen if s["condition"][0][0] == 2]  # the training batches (validation's are the caption pair)
    assert len(trained) >= 2
    for s in trained:
        (shape, dtype), (embeds, embeds_dtype) = s["condition"], s["image_embeds"]
        assert dtype == embeds_dtype == torch.bfloat16  # the compute dtype
        assert shape[1] == 20 and Bucket(shape[3] * 8, shape[4] * 8, (shape[2] - 1) * 4 + 1) in clips
        assert embeds == (2, 257, 32)
    written = {p.name for p in (tmp_path / "run" / "samples" / "00000002").iterdir()}
    assert written == {SHEET, "00-a-blue-circle-bouncing-17x64x64.mp4", "01-a-red-square-moving-right-17x64x64.mp4",
                       "dataset-clip0000.mp4"}


@pytest.mark.slow  # wandb's offline start-up
def test_the_trackers_show_the_contact_sheet_and_wandb_the_videos(caches, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trackers import wandb_run

    for name in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR"):  # wandb offline, everything inside the test's directory
        monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / f"wandb-{name.lower()}"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(cfg(caches["tiny-wan"], run, steps=2, validate=True, validate_every=1, validation_steps=1,
              report_to=["tensorboard", "wandb"]))
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert sorted({e.step for e in events.Images("validation")}) == [1, 2]  # the contact sheets
    (directory,) = run.glob("wandb/offline-run-*")
    _, rows, files = wandb_run(directory)
    videos = [row for row in rows.values() if "validation_videos._type" in row]
    assert videos and all(row["validation_videos._type"] == "videos" for row in videos)
    logged = [name for name in files if name.endswith(".mp4")]
    assert len(logged) == 2 * 3 and all((directory / "files" / name).is_file() for name in logged)  # 3 videos a step


def test_the_plan_of_a_clip_cache_traces_its_largest_clip_bucket_and_counts_its_tokens(caches, capsys):
    from train.plan_command import plan_command

    plan_command("tiny-wan", cache=str(caches["tiny-wan"]), as_json=True)
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["bucket"] == "17x64x64"  # of 17x64x64, 17x48x80 and 1x64x64, the most pixels x frames
    assert result["tokens_per_sample"] == 5 * 4 * 4  # 17 frames -> 5 latent frames; 64 px -> 8 latent px -> 4 patches
    assert set(result["largest_batch_per_bucket"]) == {"17x64x64", "17x48x80", "1x64x64"}
    assert result["largest_batch_per_bucket"]["1x64x64"] > result["largest_batch_per_bucket"]["17x64x64"] > 0
    plan_command("tiny-wan", bucket="33x48x80", as_json=True)
    result = json.loads(capsys.readouterr().out)
    assert (result["config"]["bucket"], result["tokens_per_sample"]) == ("33x48x80", 9 * 3 * 5)
    assert result["bytes"]["activations"] > 0


@pytest.mark.slow  # stage one's encoders and a spawned decoder
def test_tiny_wan_trains_from_stage_ones_cache_of_videos(tmp_path):
    from precompute.run import main as precompute
    from precompute.sample_video import make_video_folder
    from shards import Cache

    data = make_video_folder(tmp_path / "data", count=4, seconds=(1.2, 1.5))
    precompute(str(data), "tiny-wan", tmp_path / "cache", workers=0, progress=False, check_disk=False,
               validation_prompt=["a red square moving right"])
    buckets = Cache(tmp_path / "cache").manifest.buckets()
    assert buckets and all(b.frames == 17 for b in buckets)  # 1.2 s or more at 16 fps: 17-frame clips
    summary = train(cfg(tmp_path / "cache", tmp_path / "run", steps=2, batch_size=1, validate=True, validation_steps=1))
    assert summary["step"] == 2 and summary["last_loss"] > 0
    (sheet,) = summary["grids"]
    (video,) = Path(sheet).parent.glob("00-*.mp4")
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        bucket = Bucket.parse(video.stem.rsplit("-", 1)[1])
        assert (len(frames), frames[0].height, frames[0].width, float(stream.average_rate)) == (17, bucket.height,
                                                                                                bucket.width, 16.0)


@pytest.mark.slow  # torchrun
def test_two_processes_train_clips_as_one_does_with_the_same_global_batch(caches, tmp_path):
    from conftest import train_processes

    common = ["--model", "tiny-wan-i2v", "--cache", str(caches["tiny-wan-i2v"]), "--steps", "3", "--precision", "fp32",
              "--log-every", "1", "--no-validate", "--no-progress", "--lr", "1e-3", "--caption-dropout", "0.2",
              "--lora-rank", "4"]
    train_processes(1, tmp_path / "one", *common, "--batch-size", "4")
    train_processes(2, tmp_path / "ddp", *common, "--batch-size", "2", "--parallel", "ddp")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, rel=1e-4)  # the same clips, first frames, noise, timesteps and updates


@pytest.mark.parametrize("options", [{"grad_checkpointing": "off"}, {"lora_rank": 4, "grad_checkpointing": "all"},
                                     {"lora_rank": 4, "grad_checkpointing": "all", "precision": "bf16"}],
                         ids=["full", "lora-checkpointed", "lora-bf16"])
def test_the_plan_of_clips_is_within_15_percent_of_the_dry_runs_measured_peak(tmp_path, options):
    cache = clip_cache(tmp_path / "cache", family="wan", preset="tiny-wan", decoder=True, buckets=((Bucket(128, 128, 33), 4),))
    result = train(cfg(cache, tmp_path / "run", **{"batch_size": 4, "dry_run": True, **options}))
    assert result["bucket"] == "33x128x128"  # 9 latent frames of 8 x 8 patches: 576 tokens a clip
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) < 0.15, result
