"""How a video file becomes clips of frames: probed from its container's metadata, decoded with PyAV only where the
clips are (a seek to the keyframe before each clip, decoding forward to its last frame), resampled to the family's
frame rate by presentation timestamps, rotated as its display matrix says, and converted to 8-bit RGB whatever its
pixel format; and how a clip's frames are resized and cropped to their bucket as images are.

GIF, WebP, PNG (APNG) and other image formats are read with Pillow, as images are: an animated one is a video timed
by its frame durations, a still one a one-frame clip.

`read_clips` turns a file's bytes (or the file, where it lies) into clips or a failure with a named reason
(`VIDEO_REASONS`), decoding in a helper process that is killed at the time limit; nothing raises for bad data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import torch
from PIL import Image

from precompute import video_helper
from precompute.video_images import DEFAULT_DELAY_MS, ImageReader
from precompute.video_readers import AVReader, Clip, DecodeTimeout, SizeChange, TooManyPixels, VideoFile, fit_frame

VIDEO_PREPROCESSING_VERSION = 1  # bump when anything below changes the frames produced

VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".ts", ".m2ts", ".flv", ".wmv",
                  ".3gp", ".ogv", ".gif", ".webp")

EXTRACTIONS = ("head", "uniform", "chunk", "full", "slide")
LENGTHS = ("longest", "each")  # which frame buckets a video's clips are cut at

# Reasons a video is skipped (merged into precompute.inputs.REASONS; the two shared with images mean the same).
VIDEO_REASONS = {
    "empty_file": "zero-byte file",
    "corrupt_video": "not a decodable video: unknown container, or data that fails to decode where a clip is",
    "truncated_video": "the file ends before its clips do, before the length its container states (a cut-off file)",
    "no_video_stream": "a media file without a video stream (audio only)",
    "unsupported_codec": "a video codec that this build of FFmpeg (PyAV's) cannot decode",
    "no_frames": "a video stream that decodes to no frames",
    "too_short": "shorter than the shortest frame bucket at the family's frame rate",
    "too_many_pixels": "over the pixel limit (decompression bomb guard)",
    "decode_timeout": "decoding took longer than the time limit",
}

# Image formats read with Pillow (their magic bytes); anything else is opened with PyAV.
_IMAGE_MAGIC = (b"GIF87a", b"GIF89a", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM", b"II*\x00", b"MM\x00*")


@dataclass(frozen=True)
class ClipPolicy:
    """Which clips of a video become samples.

    Args:
        frame_rate: the family's frame rate (e.g. 16): frame k of a clip is the source frame shown at k / frame_rate
            seconds after the clip's start, whatever the source's rate (variable rates included).
        frame_buckets: clip lengths in frames, ascending (4k+1 for a VAE that compresses time by 4, e.g. (1, 17, 33,
            49, 81)); the last is the longest clip.
        extraction: where clips start, for each length `lengths` takes: "head": one clip from the start; "uniform":
            `clips` clips evenly spaced from the start to the end; "chunk": consecutive clips, as many as fit;
            "slide": a clip every `stride` frames, as many as fit; "full": the whole video as one clip, the longest
            bucket not longer than it.
        clips: the number of clips of "uniform".
        stride: frames from one clip's start to the next of "slide" (at `frame_rate`).
        lengths: "longest": the clips are of the longest bucket the video holds; "each": of every bucket it holds
            (musubi-tuner's target_frames), the one-frame bucket included (a video's first frame with "head") beside
            clips of at least one longer bucket. Not for "full", which takes one clip.
        timeout_s: a video whose decoding takes longer is a failure ("decode_timeout").
    """

    frame_rate: float
    frame_buckets: tuple[int, ...]
    extraction: str = "head"
    clips: int = 1
    timeout_s: float = 60.0
    stride: int = 1
    lengths: str = "longest"

    def __post_init__(self):
        if not self.frame_rate > 0:
            raise ValueError(f"frame_rate must be positive, not {self.frame_rate}")
        if not self.frame_buckets or any(b < 1 for b in self.frame_buckets) or list(self.frame_buckets) != sorted(set(self.frame_buckets)):
            raise ValueError(f"frame_buckets must be distinct positive frame counts in ascending order, not {self.frame_buckets}")
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"extraction must be one of {', '.join(EXTRACTIONS)}, not {self.extraction!r}")
        if self.clips < 1:
            raise ValueError(f"clips must be at least 1, not {self.clips}")
        if self.stride < 1:
            raise ValueError(f"stride must be at least 1, not {self.stride}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {', '.join(LENGTHS)}, not {self.lengths!r}")
        if self.lengths == "each" and self.extraction == "full":
            raise ValueError("lengths 'each' does not apply to extraction 'full', which takes one clip of a video")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {self.timeout_s}")

    def fingerprint(self) -> dict:
        """What the policy is (a cache's fingerprint keeps the part that makes frames, `images.clips_fingerprint`);
        the stride and lengths only where they choose clips, so a policy without them is described as before."""
        return {
            "frame_rate": self.frame_rate,
            "frame_buckets": list(self.frame_buckets),
            "extraction": self.extraction,
            **({"clips": self.clips} if self.extraction == "uniform" else {}),
            **({"stride": self.stride} if self.extraction == "slide" else {}),
            **({"lengths": self.lengths} if self.lengths != "longest" else {}),
            "resample": "frame shown at each time, by presentation timestamp",
            "rotation": "display matrix applied",
            "pixel_aspect": "square",
            "animated_images": f"frame delays, {DEFAULT_DELAY_MS} ms for 10 ms or less",
            "video_preprocessing_version": VIDEO_PREPROCESSING_VERSION,
        }

    def plan(self, length: int) -> list[tuple[int, int]]:
        """(start, frames) of the clips of a video `length` frames long at `frame_rate`, by where they end and then
        start (the order their frames are complete in: a video that ends sooner than its stated length loses the
        clips from the first that runs past its end on); [] when it is shorter than the shortest bucket. The
        one-frame bucket holds still images: a video's clips are of the longer buckets, unless one frame is the only
        bucket (a run that trains on first frames) or `lengths` is "each" and the video holds a longer bucket too."""
        moving = [b for b in self.frame_buckets if b > 1] if length > 1 else []
        fits = [b for b in moving or self.frame_buckets if b <= length]
        if not fits:
            return []
        if self.lengths == "each" and moving and self.frame_buckets[0] == 1:
            fits = [1, *fits]
        clips = [(s, n) for n in (fits if self.lengths == "each" else fits[-1:]) for s in self.starts(length, n)]
        return sorted(clips, key=lambda clip: (clip[0] + clip[1], clip[0]))

    def starts(self, length: int, n: int) -> list[int]:
        """The first frames of the clips of `n` frames of a video `length` frames long (n <= length)."""
        if self.extraction == "uniform":
            return sorted({int(s) for s in np.linspace(0, length - n, self.clips)})
        if self.extraction in ("chunk", "slide"):
            return list(range(0, length - n + 1, n if self.extraction == "chunk" else self.stride))
        return [0]


def read_clips(data: bytes | VideoFile, policy: ClipPolicy, max_pixels: int, stats: dict | None = None,
               fit: Callable[[int, int], tuple[int, int]] | None = None) -> tuple[list[Clip], str | None, str]:
    """A video's clips as `policy` extracts them, decoded in a helper process (`precompute.video_helper`) that is
    killed when it overruns `policy.timeout_s`: a decoder stuck inside one FFmpeg call, or one that crashes, costs
    the video (`decode_timeout`, `corrupt_video`), never the run.

    Args:
        data: the file's bytes (any container PyAV reads, or an image Pillow reads), or the file where it lies.
        policy: the frame rate, frame buckets, extraction and time limit.
        max_pixels: a video whose frames have more pixels is refused before any frame is decoded.
        stats: when given, filled with what decoding took: "packets" read, "frames" decoded, "seeks" made,
            "length" (the video's length in frames at the policy's frame rate, when it was needed).
        fit: (height, width) of the frames as shown -> the (height, width) to resize and crop them to, as
            `fit_frames` does, frame by frame as they are decoded (a clip of a 4K video is never held at 4K);
            None: the frames as shown. Called in this process.

    Returns:
        (clips, None, "") or ([], reason, detail) with a reason of `VIDEO_REASONS`.
    """
    stats = {} if stats is None else stats
    stats.update(packets=0, frames=0, seeks=0)
    if not len(data):
        return [], "empty_file", ""
    return video_helper.read_clips(data, policy, max_pixels, stats, fit, decode=read_clips_here)


def read_clips_here(data: bytes | VideoFile, policy: ClipPolicy, max_pixels: int, stats: dict | None = None,
                    fit: Callable[[int, int], tuple[int, int]] | None = None, deadline: float | None = None,
                    alloc: Callable | None = None) -> tuple[list[Clip], str | None, str]:
    """`read_clips` in this process, the time limit checked between packets and frames only (what the helper process
    runs). `deadline`: the `time.monotonic()` the limit ends at (default: `policy.timeout_s` from now); `alloc`:
    (shape, dtype) -> the array a clip's frames are decoded into (default `np.empty`)."""
    stats = {} if stats is None else stats
    stats.update(packets=0, frames=0, seeks=0)
    if not len(data):
        return [], "empty_file", ""
    deadline = time.monotonic() + policy.timeout_s if deadline is None else deadline
    head = data.head(12) if isinstance(data, VideoFile) else bytes(data[:12])
    reader = ImageReader if head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP") else AVReader
    try:
        with reader(data, max_pixels, deadline, stats, fit) as r:
            if r.failure:
                return [], *r.failure
            if alloc is not None:
                r.alloc = alloc
            return _extract(r, policy, stats)
    except DecodeTimeout:
        return [], "decode_timeout", f"over {policy.timeout_s:g} s ({stats['frames']} frames decoded)"
    except TooManyPixels as e:
        return [], "too_many_pixels", str(e)
    except SizeChange as e:
        return [], "corrupt_video", str(e)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return [], "too_many_pixels", str(e)
    except (av.FFmpegError, OSError, ValueError, EOFError, SyntaxError) as e:
        return [], "corrupt_video", f"{type(e).__name__}: {e}"


def _extract(r: AVReader | ImageReader, policy: ClipPolicy, stats: dict) -> tuple[list[Clip], str | None, str]:
    fps = Fraction(policy.frame_rate)
    if policy.extraction == "head" and policy.lengths == "longest" and not r.still:  # its length is not needed
        plan = [(0, policy.frame_buckets[-1])]
    else:
        if r.still:
            length = 1
        else:
            end = r.stated_end() if r.stated_end() is not None else r.scan_end()
            length = _frames_before(end - r.start, fps)
        stats["length"] = length
        plan = policy.plan(length)
        if not plan:
            return [], *_short(length, policy)
    clips = []
    for index, (start, n) in enumerate(plan):
        frames = r.clip([r.start + (start + k) / fps for k in range(n)])
        if len(frames) < n:
            # the data ended before the clip did: a cut-off file, or a video shorter than its (absent) length
            if not len(frames) and not stats["frames"]:
                return [], *(("corrupt_video", r.error) if r.error else ("no_frames", "the video stream holds no frame"))
            if r.error:
                return [], r.error_reason, f"undecodable data after {float(r.end_seen):.3f} s: {r.error}"
            stated = r.stated_end()
            if stated is not None and r.start + (start + len(frames)) / fps < stated - r.slack:
                return [], "truncated_video", (f"the data ends at {float(r.end_seen):.3f} s, the container states "
                                               f"{float(stated):.3f} s")
            # the one-frame bucket holds still images, as in `ClipPolicy.plan`: a video's clip is of a longer bucket
            moving = [b for b in policy.frame_buckets if b > 1] if start + len(frames) > 1 else []
            fits = [b for b in moving or policy.frame_buckets if b <= len(frames)]
            if not fits or policy.lengths == "each":  # each: its shorter lengths are clips of the plan, not trimmed ones
                return ([], *_short(start + len(frames), policy)) if not clips else (clips, None, "")
            frames = frames[:fits[-1]]
        clips.append(Clip(index, start, frames, r.size))
        if len(frames) < n:  # the video ended: no clip after this one
            break
    return clips, None, ""


def _short(length: int, policy: ClipPolicy) -> tuple[str, str]:
    moving = [b for b in policy.frame_buckets if b > 1]
    if moving and length > 1:  # the one-frame bucket is for still images
        return "too_short", (f"{length} frames at {policy.frame_rate:g} fps, the shortest clip a video gives is {moving[0]} "
                             f"frames (one frame is for still images; --frame-buckets 1 alone takes videos' first frames)")
    return "too_short", (f"{length} frames at {policy.frame_rate:g} fps, the shortest frame bucket is "
                         f"{policy.frame_buckets[0]}")


def _frames_before(duration: Fraction, fps: Fraction) -> int:
    """How many frames k = 0, 1, ... are due at k / fps before `duration` has passed."""
    return max(0, math.ceil(duration * fps))


def fit_frames(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """A clip's frames resized to cover (height, width) and center-cropped, with the same box for every frame, as
    `precompute.images.prepare` resizes and crops an image: scale = max(height / H0, width / W0), the scaled size
    rounded, bicubic (antialiased when shrinking).

    Args:
        frames: (F, H0, W0, 3) uint8 RGB.
        height, width: the bucket's size.

    Returns:
        (3, F, height, width) uint8.
    """
    return torch.from_numpy(np.stack([fit_frame(f, height, width) for f in frames])).permute(3, 0, 1, 2).contiguous()
