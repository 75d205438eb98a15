"""Validation videos: decoded clips written as mp4 (H.264 through PyAV) beside a PNG contact sheet of their frames.

A clip cache's validation samples are videos. Each is written as `<name>.mp4` at the clip's frame rate into the step's
folder, and one contact sheet, `contact-sheet.png`, shows them all: a row per video (its prompt and bucket), a few
frames evenly spaced from the first to the last, which the trackers log as an image.
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import numpy as np

SHEET_FRAMES = 5  # frames of each video on the contact sheet
SHEET = "contact-sheet.png"
CODECS = ("libx264", "mpeg4")  # H.264 plays everywhere; MPEG-4 part 2 where the PyAV build has no H.264 encoder


def write_mp4(path: Path, frames: np.ndarray, fps: float) -> Path:
    """Write frames (F, H, W, 3) uint8 RGB as an mp4 at `fps` frames per second, atomically (a temporary name, then
    renamed). Odd sides are padded by one edge pixel (yuv420p takes even ones). Returns the path."""
    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise ValueError(f"a video is (frames, height, width, 3) uint8 with at least one frame, not {frames.shape} {frames.dtype}")
    pad = ((0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0))
    frames = np.pad(frames, pad, mode="edge") if any(p[1] for p in pad) else frames
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    rate = Fraction(fps).limit_denominator(1001)
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            codec = _codec()
            # H.264 at a quality where compression does not blur what a sample is judged by
            stream = container.add_stream(codec, rate=rate, options={"crf": "18"} if codec == "libx264" else {})
            stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
            container.mux(stream.encode())  # flush the encoder's delayed frames
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _codec() -> str:
    import av

    for name in CODECS:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # noqa: BLE001 (PyAV raises its own errors for an unknown codec)
            continue
    raise RuntimeError(f"this PyAV build has no video encoder of {', '.join(CODECS)}; reinstall av (pip install av)")


def sheet_indices(count: int, k: int = SHEET_FRAMES) -> list[int]:
    """`k` frame indices evenly spaced over `count` frames, the first and the last included (fewer for short clips)."""
    if count <= k:
        return list(range(count))
    return [round(j * (count - 1) / (k - 1)) for j in range(k)]


def sheet_row(frames: np.ndarray) -> list:
    """A contact sheet's row of a video (F, H, W, 3): its `sheet_indices` frames as PIL images, each labelled by its
    number (`train.decode.grid` lays the rows out)."""
    from PIL import Image, ImageDraw

    images = []
    for i in sheet_indices(len(frames)):
        im = Image.fromarray(frames[i])
        ImageDraw.Draw(im).text((2, 1), str(i), fill="white", stroke_width=1, stroke_fill="black")
        images.append(im)
    return images
