"""Small procedural videos: coloured shapes moving over a background, each with a caption that says what moves where
("a red circle moving left to right on a blue background"); and the bad videos a video dataset holds (cut-off,
corrupt, audio only, without frames) with the reason each is skipped for.

`python -m precompute.sample_video DIR [--count N]` writes a folder of NAME.mp4 + NAME.txt caption sidecars.
Deterministic for a given seed; written with PyAV (H.264, or MPEG-4 part 2 where the build lacks libx264) and, for
animated GIF and WebP, with Pillow. Used by `make demo-video` and the tests.
"""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import typer
from PIL import Image, ImageDraw

from precompute.sample_data import COLORS, SHAPES, draw_shape

MOTIONS = ("left to right", "right to left", "top to bottom", "bottom to top")
# (height, width) of the generated videos: landscape, square and portrait
SIZES = ((64, 96), (64, 64), (96, 64))

# Bad videos: kind -> the reason `precompute.video.read_clips` gives for it (see `write_bad`).
BAD_VIDEOS = {
    "garbage": "corrupt_video",  # bytes that are no container at all
    "truncated": "corrupt_video",  # an mp4 cut off before its index (moov written last, as by default)
    "truncated_faststart": "truncated_video",  # an mp4 with its index first, cut off after a quarter of its frames
    "truncated_in_packet": "truncated_video",  # the same, cut off in the middle of a frame's data
    "corrupt_frames": "corrupt_video",  # random bytes over a frame's data a second into the video
    "audio_only": "no_video_stream",
    "zero_frames": "no_frames",  # an AVI whose video stream holds no frame (MP4 and Matroska drop such a stream)
    "too_short": "too_short",  # 0.25 s: shorter than a 17-frame clip at 16 fps (with no 1-frame bucket)
    "empty": "empty_file",
}


def frame_color(k: int) -> tuple[int, int, int]:
    """The colour of frame k of an "index" video: k in base 16 in red (low digit) and green (high digit), in steps
    of 16 so that lossy coding cannot move it to a neighbour's (k < 256)."""
    return 16 * (k % 16) + 8, 16 * (k // 16 % 16) + 8, 128


def frame_index(rgb) -> int:
    """The k of `frame_color(k)` nearest to an RGB colour."""
    r, g = (min(15, max(0, round((float(c) - 8) / 16))) for c in rgb[:2])
    return r + 16 * g


def draw_frames(kind: str, frames: int, size: tuple[int, int], seed: int = 0) -> tuple[list[np.ndarray], str]:
    """A video's frames, each (H, W, 3) uint8, and its caption.

    kind: "shapes": a shape of one colour moving across a background of another, in a straight line from one edge
    to the other over the video; "index": frame k is `frame_color(k)` all over but for a white square in its top-left
    corner (which shows how the frame is turned).
    """
    h, w = size
    if kind == "index":
        out = []
        for k in range(frames):
            a = np.empty((h, w, 3), np.uint8)
            a[:] = frame_color(k)
            a[: max(1, h // 4), : max(1, w // 4)] = 255
            out.append(a)
        return out, f"{frames} frames of colours counting up"
    if kind != "shapes":
        raise ValueError(f"unknown kind of video {kind!r}: shapes or index")
    rng = random.Random(seed)
    bg, fg = rng.sample(sorted(COLORS), 2)
    shape, motion = rng.choice(SHAPES), rng.choice(MOTIONS)
    r = min(h, w) * rng.uniform(0.15, 0.25)
    across = rng.uniform(0.3, 0.7)  # where on the other axis the path runs
    out = []
    for k in range(frames):
        p = k / max(1, frames - 1)
        p = 1 - p if motion in ("right to left", "bottom to top") else p
        if motion in ("left to right", "right to left"):
            cx, cy = r + p * (w - 2 * r), across * h
        else:
            cx, cy = across * w, r + p * (h - 2 * r)
        img = Image.new("RGB", (w, h), COLORS[bg])
        draw_shape(ImageDraw.Draw(img), shape, cx, cy, r, COLORS[fg])
        out.append(np.asarray(img))
    return out, f"{_a(fg)} {fg} {shape} moving {motion} on {_a(bg)} {bg} background"


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def video_codec(suffix: str) -> str:
    """The encoder this PyAV build has for a container: VP9 (else VP8) for WebM, H.264 (else MPEG-4 part 2)
    for the others."""
    wanted = ("libvpx-vp9", "libvpx") if suffix == ".webm" else ("libx264", "mpeg4")
    for name in wanted:
        try:
            av.codec.Codec(name, "w")
            return name
        except (av.FFmpegError, ValueError):
            continue
    raise RuntimeError(f"this PyAV build has none of the encoders {', '.join(wanted)} for {suffix} files")


def make_video(path: Path | str, kind: str = "shapes", frames: int = 48, fps: float = 24.0,
               size: tuple[int, int] = (64, 96), seed: int = 0, *, times: list[float] | None = None,
               pix_fmt: str | None = None, rotate: int = 0, codec: str | None = None, faststart: bool = False,
               lossless: bool = False, gop: int | None = None, mirror: bool = False, pixel_aspect: float = 1.0,
               rotate_tag: bool = False) -> str:
    """Write a video of `draw_frames(kind, frames, size, seed)`; returns its caption.

    Args:
        path: where; the suffix picks the container (.mp4, .mov, .mkv, .webm; .gif and .webp: animated, by Pillow).
        frames, fps, size: how many frames, at what rate, of (height, width) pixels.
        times: each frame's presentation time in seconds, for a variable frame rate (`fps` is then the nominal
            rate the stream states).
        pix_fmt: the encoder's pixel format ("yuv420p10le" for 10-bit; default yuv420p, yuv444p for odd sizes).
        rotate: clockwise degrees a player turns the frames by (the display matrix of a phone held upright).
        mirror: a player also mirrors them left to right, after turning (a front camera's).
        rotate_tag: `rotate` is written as the legacy `rotate` tag (older FFmpeg's, kept by Matroska) instead.
        codec: the encoder (default `video_codec`).
        faststart: mp4/mov: the index before the frames (as streaming sites serve them).
        lossless: H.264 at constant quality 0 (colours survive but for the RGB <-> YUV rounding).
        gop: frames from one keyframe to the next (default: the encoder's, 250 for H.264).
        pixel_aspect: the width of a pixel over its height as players show it (anamorphic video: 4/3, 2, ...).
    """
    path = Path(path)
    pictures, caption = draw_frames(kind, frames, size, seed)
    if times is not None and len(times) != frames:
        raise ValueError(f"{len(times)} times for {frames} frames")
    if path.suffix in (".gif", ".webp"):
        starts = times if times is not None else [k / fps for k in range(frames)]
        ends = [*starts[1:], starts[-1] + 1 / fps]
        durations = [round((b - a) * 1000) for a, b in zip(starts, ends)]
        images = [Image.fromarray(p) for p in pictures]
        extra = {"lossless": True} if path.suffix == ".webp" else {}
        images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0, **extra)
        return caption
    codec = codec or video_codec(path.suffix)
    odd = size[0] % 2 or size[1] % 2
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = size
        stream.pix_fmt = pix_fmt or ("yuv444p" if odd else "yuv420p")
        stream.codec_context.thread_count = 1  # the same bytes on every run: one thread, and no macroblock tree
        if codec == "libx264":  # (x264's mbtree differs from run to run in its last bits)
            stream.options = {"x264-params": "mbtree=0", **({"crf": "0"} if lossless else {})}
        if gop:
            stream.codec_context.gop_size = gop
        if pixel_aspect != 1:
            stream.codec_context.sample_aspect_ratio = Fraction(pixel_aspect).limit_denominator(1000)
        tick = Fraction(1, 1000) if times is not None else 1 / Fraction(stream.average_rate)
        stream.codec_context.time_base = tick
        if rotate_tag:
            stream.metadata["rotate"] = str(rotate)
        elif rotate or mirror:
            stream.set_display_rotation(-rotate, hflip=mirror)  # PyAV takes counterclockwise degrees
        for k, picture in enumerate(pictures):
            # converted here, in one thread: the encoder's own conversion differs from run to run in its last bits
            frame = av.VideoFrame.from_ndarray(picture, format="rgb24").reformat(format=stream.pix_fmt, threads=1)
            frame.pts, frame.time_base = (round(times[k] * 1000) if times is not None else k), tick
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return caption


def make_video_folder(root: Path | str, count: int = 16, seed: int = 0, fps: float = 24.0,
                      seconds: tuple[float, float] = (1.5, 3.0), suffix: str = ".mp4") -> Path:
    """`count` shape videos NAME.mp4 with their captions in NAME.txt, of the `SIZES`, `seconds` long at `fps`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        frames = round(rng.uniform(*seconds) * fps)
        caption = make_video(root / f"{i:05d}{suffix}", "shapes", frames, fps, rng.choice(SIZES), seed=rng.randrange(2**31))
        (root / f"{i:05d}.txt").write_text(caption + "\n", encoding="utf-8")
    return root


def write_bad(path: Path | str, kind: str, seed: int = 0) -> Path:
    """A bad video of a `BAD_VIDEOS` kind at `path` (an .mp4 name; .m4a is as good for audio_only)."""
    path = Path(path)
    if kind == "garbage":
        path.write_bytes(random.Random(seed).randbytes(4096))
    elif kind in ("truncated", "truncated_faststart"):
        make_video(path, "index", 96, 24.0, (64, 96), seed, faststart=kind == "truncated_faststart")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if kind == "truncated" else data[: _byte_of_frame(path, 24)])
    elif kind in ("truncated_in_packet", "corrupt_frames"):
        make_video(path, "index", 96, 24.0, (64, 96), seed, faststart=True, gop=24)
        data, at = bytearray(path.read_bytes()), _byte_of_frame(path, 24)
        if kind == "corrupt_frames":
            data[at:at + 200] = random.Random(seed).randbytes(200)
        else:
            data = data[:at + 40]
        path.write_bytes(bytes(data))
    elif kind == "audio_only":
        with av.open(str(path), "w", format="mp4") as out:
            stream = out.add_stream("aac", rate=16000, layout="mono")
            tone = np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000).astype(np.float32)
            for at in range(0, 16000, 1024):
                frame = av.AudioFrame.from_ndarray(tone[None, at:at + 1024], format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 16000, at
                out.mux(stream.encode(frame))
            out.mux(stream.encode())
    elif kind == "zero_frames":
        with av.open(str(path), "w", format="avi") as out:
            stream = out.add_stream(video_codec(".avi"), rate=24)
            stream.height, stream.width, stream.pix_fmt = 64, 96, "yuv420p"
            out.start_encoding()  # the header and the stream's parameters are written, never a frame
    elif kind == "too_short":
        make_video(path, "shapes", 6, 24.0, (64, 96), seed)
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise ValueError(f"unknown kind of bad video {kind!r}: one of {', '.join(BAD_VIDEOS)}")
    return path


def _byte_of_frame(path: Path, k: int) -> int:
    """Where frame k's packet starts in a file (in decoding order)."""
    with av.open(str(path)) as c:
        for i, packet in enumerate(c.demux(c.streams.video[0])):
            if i == k:
                return packet.pos
    raise ValueError(f"{path} has no frame {k}")


def main(
    root: Path = typer.Argument(..., help="Directory to write the videos (NAME.mp4) and captions (NAME.txt) into."),
    count: int = typer.Option(16, help="Number of videos."),
    fps: float = typer.Option(24.0, help="Their frame rate."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    make_video_folder(root, count, seed, fps)
    typer.echo(f"wrote {count} videos to {root}")


if __name__ == "__main__":
    typer.run(main)
