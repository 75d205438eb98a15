"""Videos become clips of the right frames: resampled by timestamp, turned upright, in RGB whatever the pixel format,
decoded only where the clips are; bad videos are named failures; clip frames are resized as images are."""

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from precompute.images import ImagePolicy, Record, prepare
from precompute.sample_video import BAD_VIDEOS, frame_color, frame_index, make_video, make_video_folder, write_bad
from precompute.video import VIDEO_REASONS, ClipPolicy, fit_frames, read_clips
from shards import Bucket

WAN = (1, 17, 33, 49, 81)
MAX_PIXELS = 10**8


def video(tmp_path, name="v.mp4", kind="index", frames=240, fps=24.0, **kw) -> bytes:
    make_video(tmp_path / name, kind, frames, fps, **kw)
    return (tmp_path / name).read_bytes()


def clips_of(data, stats=None, max_pixels=MAX_PIXELS, fit=None, **policy):
    clips, reason, detail = read_clips(data, ClipPolicy(**{"frame_rate": 16.0, "frame_buckets": WAN, **policy}),
                                       max_pixels, stats, fit)
    assert reason is None, (reason, detail)
    return clips


def indices(clip, at=(40, 60)) -> list[int]:
    """The source frame each frame of an "index" video's clip shows (read away from the top-left marker)."""
    return [frame_index(f[at]) for f in clip.frames]


def test_index_video_colours_survive_encoding(tmp_path):
    clip = clips_of(video(tmp_path, frames=17, fps=16.0))[0]
    assert indices(clip) == list(range(17))
    assert np.abs(clip.frames[5, 40, 60].astype(int) - frame_color(5)).max() <= 4


@pytest.mark.parametrize("extraction, clips, buckets, expected", [
    ("head", 1, WAN, [(0, 81)]),
    ("full", 1, WAN, [(0, 81)]),
    ("uniform", 3, WAN, [(0, 81), (39, 81), (79, 81)]),  # 160 frames at 16 fps: the last clip ends at the end
    ("uniform", 1, WAN, [(0, 81)]),
    ("chunk", 1, (1, 17, 33), [(0, 33), (33, 33), (66, 33), (99, 33)]),  # 132 frames fit of 160
])
def test_extraction_starts_lengths_and_frames(tmp_path, extraction, clips, buckets, expected):
    """240 frames at 24 fps (10 s) are 160 at 16 fps; frame j of a clip starting at s is the source frame shown at
    (s + j) / 16 s, source frame floor((s + j) * 24 / 16)."""
    got = clips_of(video(tmp_path), extraction=extraction, clips=clips, frame_buckets=buckets)
    assert [(c.index, c.start, c.frames.shape[0]) for c in got] == [(i, s, n) for i, (s, n) in enumerate(expected)]
    for c in got:
        assert c.frames.shape[1:] == (64, 96, 3) and c.frames.dtype == np.uint8
        assert indices(c) == [(c.start + j) * 3 // 2 for j in range(c.frames.shape[0])]


@pytest.mark.parametrize("extraction", ["head", "full", "uniform", "chunk"])
def test_short_video_takes_the_longest_bucket_that_fits(tmp_path, extraction):
    got = clips_of(video(tmp_path, frames=40), extraction=extraction, clips=3)  # 40 / 24 s = 27 frames at 16 fps
    assert {c.frames.shape[0] for c in got} == {17}
    if extraction in ("head", "full"):
        assert [c.start for c in got] == [0]
    if extraction == "uniform":
        assert [c.start for c in got] == [0, 5, 10]
    if extraction == "chunk":
        assert [c.start for c in got] == [0]


def test_plan_of_uniform_never_repeats_a_clip():
    policy = ClipPolicy(16.0, (1, 17), "uniform", clips=5)
    assert policy.plan(19) == [(0, 17), (1, 17), (2, 17)]
    assert policy.plan(0) == []
    # the one-frame bucket holds still images: a video shorter than the shortest longer bucket is too short...
    assert policy.plan(16) == []
    # ...unless one frame is the only bucket (a run on first frames): then evenly spaced frames, none twice
    assert ClipPolicy(16.0, (1,), "uniform", clips=5).plan(16) == [(0, 1), (3, 1), (7, 1), (11, 1), (15, 1)]


def test_low_frame_rate_repeats_frames(tmp_path):
    """8 fps to 16 fps: each source frame is shown at two target times."""
    clip = clips_of(video(tmp_path, frames=24, fps=8.0))[0]
    assert indices(clip) == [j // 2 for j in range(33)]


def test_variable_frame_rate_resampled_by_timestamp(tmp_path):
    times = [0, 0.05, 0.1, 0.3, 0.32, 0.5, 0.9, 1.0, 1.05, 1.2, 1.5, 1.6, 1.61, 1.9, 2.0, 2.2]
    clip = clips_of(video(tmp_path, frames=len(times), times=times, lossless=True))[0]
    assert clip.frames.shape[0] == 33  # frames are due up to 2.2 s + 1/24 s
    assert indices(clip) == [max(i for i, t in enumerate(times) if t <= j / 16) for j in range(33)]


@pytest.mark.parametrize("name, rotate, mirror, tag", [("v.mp4", 90, False, False), ("v.mp4", 180, False, False),
                                                       ("v.mp4", 270, False, False), ("v.mp4", 90, True, False),
                                                       ("v.mp4", 0, True, False), ("v.mkv", 90, False, True)])
def test_display_matrix_applied(tmp_path, name, rotate, mirror, tag):
    """A phone video stored sideways comes out as the phone showed it: the white corner marker moves with the turn
    (the display matrix, or the legacy rotate tag)."""
    frame = clips_of(video(tmp_path, name, frames=1, size=(64, 96), rotate=rotate, mirror=mirror, rotate_tag=tag))[0].frames[0]
    stored = np.zeros((64, 96), bool)
    stored[:16, :24] = True  # the marker, top left as stored
    shown = np.rot90(stored, -rotate // 90)  # clockwise
    shown = shown[:, ::-1] if mirror else shown
    assert frame.shape[:2] == shown.shape
    white = frame.min(axis=2) > 200
    assert (white == shown).mean() > 0.97


@pytest.mark.parametrize("pix_fmt, size", [("yuv420p10le", (64, 96)), ("yuv444p", (47, 65)), ("yuv444p10le", (47, 65)),
                                           ("yuv422p", (64, 96))])
def test_pixel_formats_and_odd_sizes(tmp_path, pix_fmt, size):
    clip = clips_of(video(tmp_path, frames=20, fps=16.0, size=size, pix_fmt=pix_fmt))[0]
    assert clip.frames.shape == (17, *size, 3) and clip.frames.dtype == np.uint8
    assert indices(clip, at=(size[0] - 8, size[1] - 8)) == list(range(17))
    assert np.abs(clip.frames[3, -8, -8].astype(int) - frame_color(3)).max() <= 4


def test_anamorphic_video_gets_square_pixels(tmp_path):
    """A 64x48 picture of pixels twice as wide as tall is shown 128 wide: the corner marker is 32 wide, not 16."""
    clip = clips_of(video(tmp_path, frames=17, fps=16.0, size=(48, 64), pixel_aspect=2.0))[0]
    assert clip.frames.shape == (17, 48, 128, 3)
    white = clip.frames[0].min(axis=2) > 200
    assert white[:12, :30].all() and not white[:12, 34:].any() and not white[14:].any()
    assert indices(clip, at=(30, 100)) == list(range(17))


@pytest.mark.parametrize("name, codec", [("v.mov", None), ("v.mkv", None), ("v.webm", None), ("v.mp4", "mpeg4"),
                                         ("v.avi", None), ("v.ts", None), ("v.mpg", "mpeg2video"), ("v.gif", None),
                                         ("v.webp", None)])
def test_containers(tmp_path, name, codec):
    """20 fps (50 ms, exact in a GIF's centiseconds) to 16 fps: frame j of a clip starting at s is source frame
    floor((s + j) * 20 / 16). Two clips: the second is reached by a seek where the container allows one (AVI's
    timestamps are decoding positions, MPEG-TS guesses its index: both still give the right frames)."""
    clips = clips_of(video(tmp_path, name, frames=30, fps=20.0, codec=codec), extraction="uniform", clips=2)
    assert len(clips) == 2 and clips[0].start == 0 and clips[1].start in (6, 7)  # MPEG-PS states 23 frames, not 24
    for c in clips:
        assert c.frames.shape == (17, 64, 96, 3)
        assert indices(c) == [(c.start + j) * 5 // 4 for j in range(17)]


@pytest.mark.parametrize("name", ["v.gif", "v.mp4"])
def test_overlapping_uniform_clips(tmp_path, name):
    """30 frames at 20 fps are 24 at 16 fps: three 17-frame clips start at 0, 3 and 7, each overlapping the last."""
    clips = clips_of(video(tmp_path, name, frames=30, fps=20.0), extraction="uniform", clips=3)
    assert [(c.start, c.frames.shape[0]) for c in clips] == [(0, 17), (3, 17), (7, 17)]
    for c in clips:
        assert indices(c) == [(c.start + j) * 5 // 4 for j in range(17)]


def test_still_image_is_a_one_frame_clip(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (200, 30, 30)).save(buf, format="PNG")
    for extraction in ("head", "uniform", "chunk", "full"):
        (clip,) = clips_of(buf.getvalue(), extraction=extraction, clips=3)
        assert clip.frames.shape == (1, 64, 96, 3) and (clip.frames == (200, 30, 30)).all()
    clips, reason, _ = read_clips(buf.getvalue(), ClipPolicy(16.0, (17, 33)), MAX_PIXELS)
    assert (clips, reason) == ([], "too_short")


def test_head_of_a_long_video_decodes_only_the_clip(tmp_path):
    """60 s at 24 fps (1440 frames, a keyframe every 2 s): the head clip decodes its 122 source frames, not 1440."""
    data = video(tmp_path, frames=1440, gop=48)
    stats = {}
    clip = clips_of(data, stats)[0]
    assert clip.frames.shape[0] == 81 and indices(clip) == [j * 3 // 2 for j in range(81)]
    assert stats["frames"] <= 125 and stats["packets"] <= 127 and stats["seeks"] == 0


def test_uniform_clips_of_a_long_video_seek(tmp_path):
    """Three clips spread over 60 s: each is reached by a seek to the keyframe before it, and decoding stops after its
    last frame; frames far from any clip are never decoded."""
    data = video(tmp_path, frames=1440, gop=48)
    stats = {}
    clips = clips_of(data, stats, extraction="uniform", clips=3)
    assert [c.start for c in clips] == [0, 439, 879] and stats["length"] == 960
    for c in clips:  # the index colours count modulo 256
        assert indices(c) == [(c.start + j) * 3 // 2 % 256 for j in range(81)]
    assert stats["seeks"] == 2
    assert stats["frames"] <= 3 * (122 + 48 + 2) < 1440 // 2


def test_chunks_decode_forward_without_seeking_back(tmp_path):
    stats = {}
    clips = clips_of(video(tmp_path, frames=480, gop=48), stats, extraction="chunk")  # 320 frames at 16 fps
    assert [c.start for c in clips] == [0, 81, 162]
    assert stats["frames"] <= 480 and stats["seeks"] <= 3


@pytest.mark.parametrize("kind", sorted(BAD_VIDEOS))
def test_bad_videos_are_named_failures(tmp_path, kind):
    path = write_bad(tmp_path / "bad.mp4", kind)
    clips, reason, detail = read_clips(path.read_bytes(), ClipPolicy(16.0, (17, 33)), MAX_PIXELS)
    assert (clips, reason) == ([], BAD_VIDEOS[kind]), detail
    assert reason in VIDEO_REASONS


@pytest.mark.parametrize("kind", ["truncated_faststart", "truncated_in_packet", "corrupt_frames"])
def test_damage_after_the_clips_is_never_read(tmp_path, kind):
    """A file cut off or corrupt a second in still gives its head clip of 0.5 s: nothing past the clip is decoded;
    a clip that reaches the damage fails the file."""
    data = write_bad(tmp_path / "cut.mp4", kind).read_bytes()
    (clip,) = clips_of(data, frame_buckets=(1, 9))
    assert clip.frames.shape[0] == 9 and indices(clip) == [j * 3 // 2 for j in range(9)]
    _, reason, detail = read_clips(data, ClipPolicy(16.0, (1, 9), "chunk"), MAX_PIXELS)
    assert reason == BAD_VIDEOS[kind]
    assert "4.000 s" in detail if kind == "truncated_faststart" else "undecodable data after" in detail


def test_decode_timeout(tmp_path):
    data = video(tmp_path, frames=48)
    clips, reason, detail = read_clips(data, ClipPolicy(16.0, WAN, timeout_s=1e-9), MAX_PIXELS)
    assert (clips, reason) == ([], "decode_timeout") and "1e-09 s" in detail
    clips, reason, _ = read_clips(video(tmp_path, "v.gif", frames=48), ClipPolicy(16.0, WAN, timeout_s=1e-9), MAX_PIXELS)
    assert (clips, reason) == ([], "decode_timeout")
    assert clips_of(data, timeout_s=60.0)[0].frames.shape[0] == 17


@pytest.mark.parametrize("name", ["v.mp4", "v.gif"])
def test_too_many_pixels_refused_before_decoding(tmp_path, name):
    data = video(tmp_path, name, frames=20, fps=16.0)
    stats = {}
    clips, reason, detail = read_clips(data, ClipPolicy(16.0, WAN), 64 * 96 - 1, stats)
    assert (clips, reason) == ([], "too_many_pixels") and "96x64" in detail
    assert stats["frames"] == 0
    assert clips_of(data, max_pixels=64 * 96)[0].frames.shape[0] == 17


def test_fit_frames_resizes_each_frame_as_images_are(tmp_path):
    frames = np.stack([np.asarray(Image.effect_noise((97, 61), 40 + 10 * k).convert("RGB")) for k in range(3)])
    policy = ImagePolicy(buckets=(Bucket(48, 80),), max_upscale=8.0, allow_upscale=True, extreme_aspect="clamp",
                         max_pixels=MAX_PIXELS)
    expected = []
    for f in frames:
        buf = io.BytesIO()
        Image.fromarray(f).save(buf, format="PNG")
        expected.append(prepare(Record("f.png", buf.getvalue(), ["a frame"]), policy)["pixels"])
    got = fit_frames(frames, 48, 80)
    assert got.shape == (3, 3, 48, 80) and got.dtype == torch.uint8
    assert torch.equal(got, torch.stack(expected, dim=1))


@pytest.mark.parametrize("name", ["v.mp4", "v.gif"])
def test_fit_while_decoding_equals_fit_frames(tmp_path, name):
    """`fit` resizes each frame as it is decoded, to the size it picks from the frames' shown size: the clip is
    what `fit_frames` makes of the clip at full size, and `Clip.size` is the size as shown (after turning)."""
    data = video(tmp_path, name, kind="shapes", frames=30, fps=20.0, size=(64, 96), rotate=90 if name == "v.mp4" else 0)
    asked = []

    def fit(height, width):
        asked.append((height, width))
        return (40, 24) if height > width else (24, 40)

    full = clips_of(data, extraction="uniform", clips=2)
    fitted = clips_of(data, extraction="uniform", clips=2, fit=fit)
    shown = (96, 64) if name == "v.mp4" else (64, 96)
    assert asked == [shown] and [c.size for c in fitted] == [c.size for c in full] == [shown, shown]
    for a, b in zip(full, fitted):
        assert (a.index, a.start) == (b.index, b.start)
        assert b.frames.shape == (17, *fit(*shown), 3)
        assert torch.equal(torch.from_numpy(b.frames).permute(3, 0, 1, 2), fit_frames(a.frames, *fit(*shown)))


def test_policy_fingerprint_and_checks():
    base = ClipPolicy(16.0, WAN)
    assert base.fingerprint() == ClipPolicy(16.0, WAN, timeout_s=5.0).fingerprint()  # the limit changes no frame
    for other in (ClipPolicy(24.0, WAN), ClipPolicy(16.0, WAN[:-1]), ClipPolicy(16.0, WAN, "uniform", 2),
                  ClipPolicy(16.0, WAN, "chunk")):
        assert other.fingerprint() != base.fingerprint()
    for bad in ({"frame_rate": 0}, {"frame_buckets": (17, 1)}, {"frame_buckets": ()}, {"extraction": "middle"},
                {"clips": 0}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            ClipPolicy(**{"frame_rate": 16.0, "frame_buckets": WAN, **bad})


def test_sample_video_folder(tmp_path):
    make_video_folder(tmp_path, count=3, seed=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00000.mp4", "00000.txt", "00001.mp4", "00001.txt", "00002.mp4", "00002.txt"]
    caption = (tmp_path / "00000.txt").read_text()
    assert caption.startswith("a ") and " moving " in caption and caption.endswith(" background\n")
    clip = clips_of((tmp_path / "00000.mp4").read_bytes())[0]
    assert clip.frames.shape[0] in (17, 33) and clip.frames.std() > 10  # a shape over a background, not a blank
    again = tmp_path / "again"
    make_video_folder(again, count=3, seed=1)
    assert (again / "00002.mp4").read_bytes() == (tmp_path / "00002.mp4").read_bytes()


def test_mutated_files_never_raise(tmp_path):
    """Bytes flipped, runs overwritten, cut and deleted in mp4, webm, avi, gif and webp files: every outcome is clips or
    a named reason, never an exception (a fixed seed: the same files on every run)."""
    sources = []
    for name in ("v.mp4", "v.webm", "v.avi", "v.gif", "v.webp"):
        sources.append(video(tmp_path, name, kind="shapes", frames=20, fps=20.0, faststart=name == "v.mp4"))
    rng = random.Random(0)
    reasons = set()
    for _ in range(120):
        data = bytearray(rng.choice(sources))
        for _ in range(rng.randint(1, 6)):
            at, op = rng.randrange(len(data)), rng.random()
            if op < 0.5:
                data[at] = rng.randrange(256)
            elif op < 0.7:
                data = data[:max(1, at)]
            elif op < 0.85:
                data[at:at + 32] = rng.randbytes(32)
            else:
                del data[at:at + rng.randint(1, 64)]
        extraction = rng.choice(["head", "uniform", "chunk", "full"])
        clips, reason, _ = read_clips(bytes(data), ClipPolicy(16.0, (1, 9, 17), extraction, 3, timeout_s=10), 10**7)
        assert (reason is None) == bool(clips) and (reason is None or reason in VIDEO_REASONS)
        assert all(c.frames.shape[0] in (1, 9, 17) for c in clips)
        reasons.add(reason)
    assert {None, "corrupt_video"} <= reasons
