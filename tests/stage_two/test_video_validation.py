"""A cache of clips validates with videos: sampled at its most common clip bucket, decoded by the cache's video VAE
(un-normalised per channel first), written as mp4 at the clip frame rate beside a PNG contact sheet of their frames,
which the trackers log; a stand-in transformer samples, the real decoder decodes."""

import av
import numpy as np
import pytest
import torch
from PIL import Image
from video_testing import MEAN, PROMPTS, STD, StandIn, clip_cache, register, tiny_video_vae

from shards import Bucket, Cache
from train.decode import Decoder, decode_clip, decoder_recipe, load_decoder, unscale
from train.families.base import ModelPreset
from train.objectives import FlowMatching
from train.validate import Validator
from train.video import SHEET, sheet_indices, write_mp4

pytestmark = pytest.mark.model


class Denoiser(torch.nn.Module):
    """A transformer stand-in: one 3D convolution over the noisy clip."""

    config: dict = {}

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(16, 16, 1)

    def forward(self, x):
        return self.conv(x)


class Sampled(StandIn):
    def forward(self, model, config, xt, t, batch, guidance):
        seen.append(tuple(xt.shape))
        return model(xt)


seen: list[dict] = []


def read_video(path):
    """(frames (F, H, W, 3), average rate) of an mp4, read back with PyAV."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


def test_an_mp4_plays_back_with_its_frames_size_and_rate(tmp_path):
    frames = np.zeros((17, 48, 80, 3), dtype=np.uint8)
    frames[:, :, :, 0] = np.linspace(0, 255, 17, dtype=np.uint8)[:, None, None]  # red ramps up frame by frame
    write_mp4(tmp_path / "clip.mp4", frames, 16.0)
    back, rate = read_video(tmp_path / "clip.mp4")
    assert back.shape == (17, 48, 80, 3) and rate == 16.0
    assert np.abs(back[:, 24, 40, 0].astype(int) - frames[:, 24, 40, 0]).max() <= 8  # H.264 at crf 18: close
    assert not list(tmp_path.glob(".*tmp"))  # written under a temporary name, renamed
    write_mp4(tmp_path / "odd.mp4", np.zeros((3, 33, 35, 3), dtype=np.uint8), 24.0)  # odd sides padded for yuv420p
    assert read_video(tmp_path / "odd.mp4")[0].shape == (3, 34, 36, 3)
    assert sheet_indices(17) == [0, 4, 8, 12, 16] and sheet_indices(3) == [0, 1, 2]


def test_a_clip_is_decoded_as_the_pipeline_decodes_it(tmp_path):
    cache = Cache(clip_cache(tmp_path / "cache", decoder=True, buckets=((Bucket(64, 64, 17), 1),)))
    recipe = decoder_recipe(cache)
    z = torch.randn(1, 16, 5, 8, 8)
    # WanPipeline: latents / (1 / std) + mean per channel, then vae.decode
    expected = z / (1.0 / torch.tensor(STD).view(1, 16, 1, 1, 1)) + torch.tensor(MEAN).view(1, 16, 1, 1, 1)
    assert torch.allclose(unscale(recipe, z), expected)
    vae = load_decoder(recipe, torch.device("cpu"))
    with torch.no_grad():
        pixels = tiny_video_vae().decode(expected).sample[0].clamp(-1, 1)  # (3, F, H, W)
    frames = decode_clip(vae, recipe, z)
    assert frames.shape == (17, 64, 64, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames, ((pixels + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy())


def test_validation_writes_a_video_per_prompt_and_a_contact_sheet(monkeypatch, tmp_path):
    import train.decode
    import train.families

    monkeypatch.setattr(train.decode, "_kept", {})  # nothing decoded before
    family = Sampled()
    monkeypatch.setattr(train.families, "FAMILIES", [*train.families.FAMILIES, family])
    cache = Cache(clip_cache(tmp_path / "cache", decoder=True, family=family.name))
    config = {"out_channels": 16, "patch_size": (1, 2, 2), "text_dim": 32}
    preset = ModelPreset("stand-in", family.name, None, config, "flow", "flow", base_resolution=64)
    seen.clear()
    validator = Validator(cache, preset, FlowMatching(shift=3.0), prompts=[], buckets=[], steps=2, guidance=1.0, seed=0,
                          decode_device="cpu", out=tmp_path / "run", model_name="stand-in")
    assert validator.buckets == [Bucket(64, 64, 17)]  # the most populous clip bucket
    assert validator.fps == 16.0
    validator.decoder = Decoder(validator.recipe, torch.device("cpu"))  # in-process: no decoder process to start
    path = validator.run(Denoiser(), 7, torch.float32)
    assert validator.finished() == [("ok", str(path))]
    assert path == tmp_path / "run" / "samples" / "00000007" / SHEET
    assert set(seen) == {(2, 16, 5, 8, 8)}  # noisy clips (B, C, T, h, w), the prompt's and the empty caption's
    videos = sorted(path.parent.glob("*.mp4"))
    assert [v.name for v in videos] == ["00-a-blue-circle-bouncing-17x64x64.mp4", "01-a-red-square-moving-right-17x64x64.mp4",
                                        "dataset-clip0000.mp4"]
    for v in videos:
        frames, rate = read_video(v)
        assert frames.shape == (17, 64, 64, 3) and rate == 16.0
    sheet = Image.open(path)
    # a row per video (2 prompts and the dataset clip), 5 frames each, beside the labels
    assert sheet.width >= 5 * 64 and sheet.height >= 3 * 64
    # the next validation decodes the sampled clips again, the dataset clip's frames are kept
    decoded = []
    monkeypatch.setattr(train.decode, "decode_clip", lambda *args: decoded.append(args) or decode_clip(*args))
    again = validator.run(Denoiser(), 8, torch.float32)
    assert len(decoded) == 2 and validator.finished() == [("ok", str(again))]
    assert read_video(again.parent / "dataset-clip0000.mp4")[0].shape == (17, 64, 64, 3)


def test_validation_frames_choose_the_clip_length(monkeypatch, tmp_path):
    register(monkeypatch)
    cache = Cache(clip_cache(tmp_path / "cache", decoder=True))
    preset = ModelPreset("stand-in", "stand-in-video", None, {}, "flow", "flow", base_resolution=64)

    def buckets(**kw):
        return Validator(cache, preset, FlowMatching(), prompts=[PROMPTS[0]], steps=1, guidance=1.0, seed=0,
                         decode_device="cpu", out=tmp_path, model_name="stand-in", **{"buckets": [], **kw}).buckets

    assert buckets(frames=33) == [Bucket(64, 64, 33)]
    assert buckets(buckets=["48x80"], frames=9) == [Bucket(48, 80, 9)]
    assert buckets(buckets=["81x48x80"]) == [Bucket(48, 80, 81)]
    with pytest.raises(ValueError, match="k x 4 \\+ 1 frames"):
        buckets(frames=16)


def test_videos_play_at_the_rate_the_cache_records(monkeypatch, tmp_path):
    from train.validate import frame_rate

    family = register(monkeypatch)
    preset = ModelPreset("stand-in", family.name, None, {}, "flow", "flow", base_resolution=64)
    buckets = ((Bucket(64, 64, 5), 1),)
    assert frame_rate(Cache(clip_cache(tmp_path / "24", buckets=buckets, frame_rate=24.0)), preset) == 24.0
    # a cache that records none: the family's models' rate
    assert frame_rate(Cache(clip_cache(tmp_path / "none", buckets=buckets, frame_rate=None)), preset) == family.frame_rate == 16.0


def test_an_export_card_shows_a_run_of_clips_contact_sheet(tmp_path):
    """The card of a run of clips copies its newest contact sheet at or before the exported step (a run of images:
    its grid), named by its step."""
    from train.card import copy_grid, grid_step

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    for step in (2, 4, 6):
        (run / "samples" / f"{step:08d}").mkdir(parents=True)
        Image.new("RGB", (4, 4), (step, 0, 0)).save(run / "samples" / f"{step:08d}" / "contact-sheet.png")
    copied = copy_grid(run / "checkpoints" / "step-00000004", 4, tmp_path / "export")
    assert copied is not None and copied.name == "samples-step00000004-contact-sheet.png" and grid_step(copied) == 4
    assert Image.open(copied).getpixel((0, 0)) == (4, 0, 0)
    assert copy_grid(run / "checkpoints" / "step-00000004", 1, tmp_path / "export2") is None
