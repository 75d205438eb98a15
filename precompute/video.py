"""How a video file becomes clips of frames: probed from its container's metadata, decoded with PyAV only where the
clips are (a seek to the keyframe before each clip, decoding forward to its last frame), resampled to the family's
frame rate by presentation timestamps, rotated as its display matrix says, and converted to 8-bit RGB whatever its
pixel format; and how a clip's frames are resized and cropped to their bucket as images are.

GIF, WebP, PNG (APNG) and other image formats are read with Pillow, as images are: an animated one is a video timed
by its frame durations, a still one a one-frame clip.

`read_clips` turns a file's bytes into clips or a failure with a named reason (`VIDEO_REASONS`); nothing raises
for bad data.
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
import torch
from PIL import Image

from precompute.images import allow_pixels, to_rgb

VIDEO_PREPROCESSING_VERSION = 1  # bump when anything below changes the frames produced

VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".ts", ".m2ts", ".flv", ".wmv",
                  ".3gp", ".ogv", ".gif", ".webp")

EXTRACTIONS = ("head", "uniform", "chunk", "full")

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
# A GIF or WebP frame without a usable delay is shown for 100 ms, as browsers do (they also stretch delays of
# 10 ms or less, which ancient encoders wrote for "as fast as possible", to 100 ms).
_DEFAULT_DELAY_MS = 100
# Tags that are not UTF-8 are read, not refused (PyAV 19 always reads them so, and has no such argument).
_OPEN_OPTIONS = {"metadata_errors": "replace"} if int(av.__version__.split(".")[0]) < 19 else {}
# Without an index, decoding forward is cheaper than a seek for a gap shorter than this (seconds).
_SEEK_GAP = 2


@dataclass(frozen=True)
class ClipPolicy:
    """Which clips of a video become samples.

    Args:
        frame_rate: the family's frame rate (e.g. 16): frame k of a clip is the source frame shown at k / frame_rate
            seconds after the clip's start, whatever the source's rate (variable rates included).
        frame_buckets: clip lengths in frames, ascending (4k+1 for a VAE that compresses time by 4, e.g. (1, 17, 33,
            49, 81)); the last is the longest clip.
        extraction: "head": one clip from the start, the longest bucket that fits; "uniform": `clips` clips of the
            longest bucket that fits, evenly spaced from the start to the end; "chunk": consecutive clips of the
            longest bucket that fits, as many as fit; "full": the whole video as one clip, the longest bucket not
            longer than it.
        clips: the number of clips of "uniform".
        timeout_s: a video whose decoding takes longer is a failure ("decode_timeout").
    """

    frame_rate: float
    frame_buckets: tuple[int, ...]
    extraction: str = "head"
    clips: int = 1
    timeout_s: float = 60.0

    def __post_init__(self):
        if not self.frame_rate > 0:
            raise ValueError(f"frame_rate must be positive, not {self.frame_rate}")
        if not self.frame_buckets or any(b < 1 for b in self.frame_buckets) or list(self.frame_buckets) != sorted(set(self.frame_buckets)):
            raise ValueError(f"frame_buckets must be distinct positive frame counts in ascending order, not {self.frame_buckets}")
        if self.extraction not in EXTRACTIONS:
            raise ValueError(f"extraction must be one of {', '.join(EXTRACTIONS)}, not {self.extraction!r}")
        if self.clips < 1:
            raise ValueError(f"clips must be at least 1, not {self.clips}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {self.timeout_s}")

    def fingerprint(self) -> dict:
        return {
            "frame_rate": self.frame_rate,
            "frame_buckets": list(self.frame_buckets),
            "extraction": self.extraction,
            **({"clips": self.clips} if self.extraction == "uniform" else {}),
            "resample": "frame shown at each time, by presentation timestamp",
            "rotation": "display matrix applied",
            "pixel_aspect": "square",
            "animated_images": f"frame delays, {_DEFAULT_DELAY_MS} ms for 10 ms or less",
            "video_preprocessing_version": VIDEO_PREPROCESSING_VERSION,
        }

    def plan(self, length: int) -> list[tuple[int, int]]:
        """(start, frames) of the clips of a video `length` frames long at `frame_rate`, by start; [] when it is
        shorter than the shortest bucket. The one-frame bucket holds still images: a video's clips are of the longer
        buckets, unless one frame is the only bucket (a run that trains on first frames)."""
        moving = [b for b in self.frame_buckets if b > 1] if length > 1 else []
        fits = [b for b in moving or self.frame_buckets if b <= length]
        if not fits:
            return []
        n = fits[-1]
        if self.extraction == "uniform":
            starts = sorted({int(s) for s in np.linspace(0, length - n, self.clips)})
        elif self.extraction == "chunk":
            starts = list(range(0, length - n + 1, n))
        else:
            starts = [0]
        return [(s, n) for s in starts]


@dataclass
class Clip:
    """One clip of a video."""

    index: int  # which clip of the input (0..), part of the sample key
    start: int  # first frame, counted at the policy's frame rate
    frames: np.ndarray  # (F, H, W, 3) uint8 RGB, F a member of frame_buckets, turned as shown (and fitted, with `fit`)
    size: tuple[int, int] = (0, 0)  # (height, width) of the video's frames as shown, before `read_clips`' fit


class _DecodeTimeout(Exception):
    pass


@dataclass
class _Frame:
    t: Fraction  # presentation time, seconds
    end: Fraction  # when the next frame is due, as far as this frame knows
    source: object  # an av.VideoFrame, or an image's frame as (H, W, 3) uint8
    pixels: np.ndarray | None = field(default=None, repr=False)


def read_clips(data: bytes, policy: ClipPolicy, max_pixels: int, stats: dict | None = None,
               fit: Callable[[int, int], tuple[int, int]] | None = None) -> tuple[list[Clip], str | None, str]:
    """A video's clips as `policy` extracts them.

    Args:
        data: the file's bytes (any container PyAV reads, or an image Pillow reads).
        policy: the frame rate, frame buckets and extraction.
        max_pixels: a video whose frames have more pixels is refused before any frame is decoded.
        stats: when given, filled with what decoding took: "packets" read, "frames" decoded, "seeks" made,
            "length" (the video's length in frames at the policy's frame rate, when it was needed).
        fit: (height, width) of the frames as shown -> the (height, width) to resize and crop them to, as
            `fit_frames` does, frame by frame as they are decoded (a clip of a 4K video is never held at 4K);
            None: the frames as shown.

    Returns:
        (clips, None, "") or ([], reason, detail) with a reason of `VIDEO_REASONS`.
    """
    stats = {} if stats is None else stats
    stats.update(packets=0, frames=0, seeks=0)
    if not data:
        return [], "empty_file", ""
    deadline = time.monotonic() + policy.timeout_s
    reader = _ImageReader if data.startswith(_IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP") else _AVReader
    try:
        with reader(data, max_pixels, deadline, stats, fit) as r:
            if r.failure:
                return [], *r.failure
            return _extract(r, policy, stats)
    except _DecodeTimeout:
        return [], "decode_timeout", f"over {policy.timeout_s:g} s ({stats['frames']} frames decoded)"
    except _TooManyPixels as e:
        return [], "too_many_pixels", str(e)
    except _SizeChange as e:
        return [], "corrupt_video", str(e)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return [], "too_many_pixels", str(e)
    except (av.FFmpegError, OSError, ValueError, EOFError, SyntaxError) as e:
        return [], "corrupt_video", f"{type(e).__name__}: {e}"


def _extract(r: _AVReader | _ImageReader, policy: ClipPolicy, stats: dict) -> tuple[list[Clip], str | None, str]:
    fps = Fraction(policy.frame_rate)
    if policy.extraction == "head" and not r.still:  # the longest bucket from the start: its length is not needed
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
            fits = [b for b in policy.frame_buckets if b <= len(frames)]
            if not fits:
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


class _TooManyPixels(Exception):
    pass


class _SizeChange(Exception):
    pass


class _Reader:
    """What `_extract` asks of a decoder: the video's start, its stated end, and the frames shown at given times."""

    start: Fraction = Fraction(0)
    slack: Fraction = Fraction(0)  # how far the data may end before the stated end without being cut off
    tolerance: Fraction = Fraction(0)  # how late a frame may be and still count as due at a time
    failure: tuple[str, str] | None = None
    still = False  # a still image: one frame, whatever the frame rate

    def __init__(self, max_pixels: int, deadline: float, stats: dict, fit=None):
        self.max_pixels, self.deadline, self.stats, self.fit = max_pixels, deadline, stats, fit
        self.size: tuple[int, int] | None = None  # (height, width) of the frames as shown
        self.target: tuple[int, int] | None = None  # what `fit` made of it
        self.prev: _Frame | None = None  # the last frame taken: the one shown until `pending` is due
        self.pending: _Frame | None = None  # decoded, not yet taken
        self.eof = False
        self.end_seen = Fraction(0)
        self.error = ""  # why decoding stopped before the end of the data
        self.error_reason = "corrupt_video"  # or truncated_video: the undecodable data was where the file is cut off

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass

    def check(self):
        if time.monotonic() > self.deadline:
            raise _DecodeTimeout()

    def guard(self, width: int, height: int):
        if width * height > self.max_pixels:
            raise _TooManyPixels(f"{width}x{height} = {width * height} pixels, over the limit of {self.max_pixels}")

    def peek(self) -> _Frame | None:
        if self.pending is None and not self.eof:
            self.check()
            self.pending = self.decode_next()
            self.eof = self.pending is None
            if self.pending is not None:
                self.end_seen = max(self.end_seen, self.pending.end)
        return self.pending

    def take(self):
        self.prev, self.pending = self.pending, None

    def clip(self, targets: list[Fraction]) -> np.ndarray:
        """The frames shown at `targets` (ascending), (F, H, W, 3) uint8, fewer when the video ends before the last;
        decodes from the current position, or seeks when the first target is far ahead."""
        self.position(targets[0])
        out, count = None, 0
        for target in targets:
            while (nxt := self.peek()) is not None and nxt.t <= target + self.tolerance:
                self.take()
            if self.prev is None:  # the target is before the first frame: the first frame is what is shown
                if nxt is None:
                    break
                self.take()
            if self.peek() is None and target >= self.prev.end:
                break  # past the last frame's display time
            pixels = self.pixels(self.prev)  # (H, W, 3)
            if out is None:  # filled in place: a long clip of large frames is held once
                out = np.empty((len(targets), *pixels.shape), np.uint8)
            elif pixels.shape != out.shape[1:]:
                raise _SizeChange(f"the frame size changes within a clip, from {out.shape[2]}x{out.shape[1]} to "
                                  f"{pixels.shape[1]}x{pixels.shape[0]}")
            out[count] = pixels
            count += 1
        return out[:count] if out is not None else np.empty((0, 0, 0, 3), np.uint8)

    def position(self, target: Fraction):
        pass

    def pixels(self, f: _Frame) -> np.ndarray:
        """A frame as shown (H, W, 3) uint8, fitted to `fit`'s size when given; a frame shown at several targets is
        converted once."""
        if f.pixels is None:
            rgb = self.to_rgb(f.source)
            if self.size is None:
                self.size = rgb.shape[:2]
                self.target = self.fit(*self.size) if self.fit is not None else None
            elif rgb.shape[:2] != self.size:
                raise _SizeChange(f"the frame size changes from {self.size[1]}x{self.size[0]} to {rgb.shape[1]}x{rgb.shape[0]}")
            f.pixels, f.source = rgb if self.target is None else _fit_frame(rgb, *self.target), None
        return f.pixels


class _AVReader(_Reader):
    """A video container through PyAV."""

    def __init__(self, data: bytes, max_pixels: int, deadline: float, stats: dict, fit=None):
        super().__init__(max_pixels, deadline, stats, fit)
        self.data = data
        self.container = None
        try:
            self.probe()
        except BaseException:
            self.close()
            raise

    def probe(self):
        self.open()
        streams = self.container.streams.video
        if not streams:
            kinds = sorted({s.type for s in self.container.streams})
            self.failure = ("no_video_stream", f"streams: {', '.join(kinds) or 'none'}")
            return
        s = self.stream
        if s.codec_context is None:
            self.failure = ("unsupported_codec", "PyAV's FFmpeg has no decoder for the video stream's codec")
            return
        self.tb = _fraction(s.time_base) or Fraction(1, 90000)
        rate = _fraction(s.average_rate) or _fraction(s.guessed_rate) or _fraction(s.base_rate)
        self.interval = 1 / rate if rate else Fraction(1, 25)  # a frame's duration when unknown
        self.sar = _fraction(s.sample_aspect_ratio)
        # timestamps are rounded to the time base (Matroska's is a millisecond): a frame up to one tick late counts as
        # due, never more than a millisecond late
        self.tolerance = min(self.tb, Fraction(1, 1000))
        self.start = (s.start_time or 0) * self.tb
        if s.codec_context.width and s.codec_context.height:
            self.guard(s.codec_context.width, s.codec_context.height)
        self.rotate = _rotate_tag(s.metadata)
        self.slack = 2 * self.interval

    def open(self):
        if self.container is not None:
            self.container.close()
        self.container = av.open(io.BytesIO(self.data), mode="r", **_OPEN_OPTIONS)
        if self.container.streams.video:
            self.stream = self.container.streams.video[0]
        # AVI has no presentation timestamps (what it stores are decoding positions, out of order with B-frames):
        # its frames are counted from the start at the stated rate, and it is never seeked into
        self.counted = "avi" in self.container.format.name.split(",")
        self.packets = None
        self.last_t = None
        self.prev = self.pending = None
        self.eof = False

    def close(self):
        if self.container is not None:
            self.container.close()

    def stated_end(self) -> Fraction | None:
        """When the video's last frame ends, as its container states (per stream: mp4's duration, Matroska's
        DURATION tag); None when it does not."""
        s = self.stream
        if s.duration:
            return self.start + s.duration * self.tb
        tag = s.metadata.get("DURATION") or s.metadata.get("duration")
        if tag:
            try:
                h, m, sec = tag.split(":")
                return self.start + Fraction(int(h) * 3600 + int(m) * 60) + Fraction(sec)
            except ValueError:
                pass
        if len(self.container.streams) == 1 and self.container.duration:  # the container's is the stream's
            return Fraction((self.container.start_time or 0) + self.container.duration, av.time_base)
        return None

    def scan_end(self) -> Fraction:
        """When the last frame ends, from the packets' timestamps (read, not decoded), for a container that does not
        state it."""
        end = self.start
        for packet in self.container.demux(self.stream):
            self.check()
            if packet.pts is not None:
                end = max(end, (packet.pts + (packet.duration or 0)) * self.tb)
        self.open()
        return end

    def position(self, target: Fraction):
        """Seek to the keyframe before `target` unless decoding forward from here reaches it as soon."""
        here = self.prev.t if self.prev is not None else None
        if self.counted:  # never seeked into: forward from here, or from the start again
            if here is not None and here > target:
                self.seek(None)
            return
        if here is None and self.packets is None and target - self.start < _SEEK_GAP:
            return  # from the start
        if here is not None and here <= target:
            keyframe = self.keyframe_before(target)
            if keyframe is None and target - here < _SEEK_GAP or keyframe is not None and keyframe <= here:
                return
        self.seek(target)
        if ((nxt := self.peek()) is None or nxt.t > target + self.tb) and target > self.start:
            # landed after the target, or on a frame that is not a keyframe (an index that MPEG-TS guesses):
            # decode from the start instead
            self.seek(None)

    def keyframe_before(self, target: Fraction) -> Fraction | None:
        entries = getattr(self.stream, "index_entries", ())  # older PyAV has none
        if len(entries) == 0:
            return None
        ts = target / self.tb
        lo, hi, best = 0, len(entries) - 1, None
        while lo <= hi:  # the last keyframe entry at or before ts (entries are sorted by timestamp)
            mid = (lo + hi) // 2
            if entries[mid].timestamp <= ts:
                lo = mid + 1
            else:
                hi = mid - 1
        for i in range(hi, max(-1, hi - 1000), -1):
            if entries[i].is_keyframe:
                best = entries[i].timestamp * self.tb
                break
        return best

    def seek(self, target: Fraction | None):
        self.stats["seeks"] += 1
        if target is None:
            self.open()
            return
        try:
            self.container.seek(math.floor(target / self.tb), stream=self.stream, backward=True)
            self.packets, self.last_t = None, None
            self.prev = self.pending = None
            self.eof = False
        except av.FFmpegError:  # not seekable: decode from the start
            self.open()

    def decode_next(self) -> _Frame | None:
        if self.packets is None:
            self.packets = self._frames()
        return next(self.packets, None)

    def _frames(self):
        for packet in self.container.demux(self.stream):
            self.check()
            self.stats["packets"] += 1
            try:
                decoded = packet.decode()
            except av.FFmpegError as e:  # undecodable data ends the video here (a cut-off last packet, corrupt bytes)
                self.error = f"{type(e).__name__}: {e}"
                if packet.pos is not None and packet.pos + packet.size >= len(self.data):
                    self.error_reason = "truncated_video"  # the last packet, cut off
                return
            for frame in decoded:
                self.check()
                self.stats["frames"] += 1
                self.guard(frame.width, frame.height)
                if frame.pts is not None and not self.counted:
                    t = frame.pts * self.tb
                elif self.last_t is not None:
                    t = self.last_t + self.interval
                else:
                    t = self.start
                if self.last_t is not None and t <= self.last_t:
                    continue  # a timestamp going backwards: a broken stream's duplicate
                duration = frame.duration * self.tb if getattr(frame, "duration", None) else self.interval
                self.last_t = t
                yield _Frame(t, t + duration, frame)

    def to_rgb(self, frame) -> np.ndarray:
        width, height = frame.width, frame.height
        sar = self.sar
        if sar and sar != 1:  # anamorphic: stretched to square pixels, as players show it
            width, height = (round(width * sar), height) if sar > 1 else (width, round(height / sar))
        # one thread: decoding runs in worker processes, and swscale's threads cost more than they give there
        rgb = frame.to_ndarray(format="rgb24", width=width, height=height, src_color_range=frame.color_range,
                               interpolation="BICUBIC", threads=1)  # (H, W, 3) uint8
        turns, mirror = _orientation(frame)
        if turns is None:  # no display matrix: the legacy tag, clockwise degrees
            turns, mirror = round(-self.rotate / 90) % 4, False
        if turns or mirror:
            rgb = np.rot90(rgb, k=turns)
            rgb = rgb[:, ::-1] if mirror else rgb  # a view: copied into the clip
        return rgb


# The display matrix's signs (a, b, c, d of its rotation part, in FFmpeg's layout) -> how a player turns the frame:
# quarter turns counterclockwise, then whether it mirrors left and right (a front camera's selfie).
_ORIENTATIONS = {
    (1, 0, 0, 1): (0, False), (0, -1, 1, 0): (1, False), (-1, 0, 0, -1): (2, False), (0, 1, -1, 0): (3, False),
    (-1, 0, 0, 1): (0, True), (0, -1, -1, 0): (1, True), (1, 0, 0, -1): (2, True), (0, 1, 1, 0): (3, True),
}


def _orientation(frame) -> tuple[int | None, bool]:
    """(quarter turns counterclockwise, mirrored) as the frame's display matrix says; (None, False) without one."""
    side_data = getattr(frame, "side_data", ())
    for data in (side_data[i] for i in range(len(side_data))):  # by position: what iterating yields differs by version
        if getattr(data.type, "name", "") == "DISPLAYMATRIX":
            a, b, _, c, d = np.frombuffer(bytes(data), "<i4")[:5].tolist()
            key = tuple(int(np.sign(v)) if abs(v) > 0x8000 else 0 for v in (a, b, c, d))  # 16.16 fixed point
            if key in _ORIENTATIONS:
                return _ORIENTATIONS[key]
            return round(frame.rotation / 90) % 4, False  # not a multiple of 90 degrees: the nearest one
    return None, False


def _fraction(rational) -> Fraction | None:
    """A PyAV rational (a Fraction, or an AVRational from PyAV 19) as a Fraction; None when unset or zero."""
    return Fraction(rational.numerator, rational.denominator) if rational else None


def _rotate_tag(metadata: dict) -> int:
    """The legacy `rotate` tag (clockwise degrees) of older demuxers and muxers (Matroska's is ROTATE); 0 when absent."""
    try:
        return int(float(metadata.get("rotate") or metadata.get("ROTATE") or 0))
    except ValueError:
        return 0


@contextlib.contextmanager
def _pillow_errors():
    """Pillow's plugins meet corrupt data with whatever their parsing raises: as an OSError, like the rest."""
    try:
        yield
    except (IndexError, KeyError, struct.error) as e:
        raise OSError(f"corrupt image data ({type(e).__name__}: {e})") from e


class _ImageReader(_Reader):
    """A GIF, WebP, APNG or still image through Pillow, timed by its frame durations."""

    def __init__(self, data: bytes, max_pixels: int, deadline: float, stats: dict, fit=None):
        super().__init__(max_pixels, deadline, stats, fit)
        allow_pixels(max_pixels)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the header's size is checked below
            self.img = Image.open(io.BytesIO(data))
        try:
            self.guard(*self.img.size)
        except _TooManyPixels:
            self.img.close()
            raise
        with _pillow_errors():
            self.count = getattr(self.img, "n_frames", 1)  # GIF: read through every frame's header
        self.still = self.count == 1
        self.index = 0
        self.t = Fraction(0)

    def close(self):
        self.img.close()

    def stated_end(self) -> Fraction | None:
        return None

    def scan_end(self) -> Fraction:
        end = Fraction(0)
        for i in range(self.count):
            self.check()
            with _pillow_errors():
                self.img.seek(i)
                self.img.load()  # WebP reads a frame's duration with its pixels
            end += self.delay()
        self.img.seek(0)
        return end

    def delay(self) -> Fraction:
        ms = self.img.info.get("duration") or 0
        return Fraction(_DEFAULT_DELAY_MS if ms <= 10 else round(ms), 1000)

    def position(self, target):
        if self.prev is not None and self.prev.t > target:  # overlapping clips: decoded again from the first frame
            self.index, self.t, self.prev, self.pending, self.eof = 0, Fraction(0), None, None, False

    def decode_next(self) -> _Frame | None:
        if self.index >= self.count:
            return None
        with warnings.catch_warnings(), _pillow_errors():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            self.img.seek(self.index)
            self.img.load()
        self.stats["frames"] += 1
        self.stats["packets"] += 1
        t, delay = self.t, self.delay()
        self.index += 1
        self.t += delay
        # a frame's pixels depend on the frames before it (disposal): converted now, while it is the current one
        return _Frame(t, t + delay, np.asarray(to_rgb(self.img)))

    def to_rgb(self, source) -> np.ndarray:
        return source


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
    return torch.from_numpy(np.stack([_fit_frame(f, height, width) for f in frames])).permute(3, 0, 1, 2).contiguous()


def _fit_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H0, W0, 3) -> (height, width, 3) uint8, as `precompute.images.prepare` resizes and crops an image."""
    h, w = frame.shape[:2]
    scale = max(height / h, width / w)
    rw, rh = max(width, round(w * scale)), max(height, round(h * scale))
    top, left = (rh - height) // 2, (rw - width) // 2
    img = Image.fromarray(np.ascontiguousarray(frame))
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), Image.BICUBIC)
    return np.asarray(img.crop((left, top, left + width, top + height)), dtype=np.uint8)
