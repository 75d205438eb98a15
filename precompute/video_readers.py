"""The readers under `precompute.video.read_clips`: what every reader shares (`Reader`: frames resampled by time, the
time limit, the pixel limit, the fit to a bucket as frames are decoded) and a video container through PyAV
(`AVReader`: probe, seek to the keyframe before a clip, decode forward, frames as shown: rotated, square pixels, 8-bit
RGB); image files are `precompute.video_images`'.

They raise `DecodeTimeout`, `TooManyPixels` and `SizeChange`, which `read_clips` turns into named failures. They read
a file's bytes, or a `VideoFile` where it lies (only what the decoder asks for is read).
"""

from __future__ import annotations

import io
import math
import os
import time
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
from PIL import Image

# Tags that are not UTF-8 are read, not refused (PyAV 19 always reads them so, and has no such argument).
_OPEN_OPTIONS = {"metadata_errors": "replace"} if int(av.__version__.split(".")[0]) < 19 else {}
# Without an index, decoding forward is cheaper than a seek for a gap shorter than this (seconds).
_SEEK_GAP = 2


@dataclass
class Clip:
    """One clip of a video."""

    index: int  # which clip of the input (0..), part of the sample key
    start: int  # first frame, counted at the policy's frame rate
    frames: np.ndarray  # (F, H, W, 3) uint8 RGB, F a member of frame_buckets, turned as shown (and fitted, with `fit`)
    size: tuple[int, int] = (0, 0)  # (height, width) of the video's frames as shown, before `read_clips`' fit


class DecodeTimeout(Exception):
    pass


@dataclass(frozen=True)
class VideoFile:
    """A video file on disk, open: decoded where it lies, so that a clip of a long video holds in memory only what the
    decoder reads (a head clip, its first seconds), never the whole file. `len()` is its size in bytes."""

    path: str  # for messages
    fd: int  # open for reading; the VideoFile does not own it
    size: int

    def __len__(self) -> int:
        return self.size

    def head(self, n: int) -> bytes:
        return os.pread(self.fd, n, 0)


def open_source(data: bytes | bytearray | VideoFile):
    """A file object over a video's bytes, with a position of its own (the descriptor's offset is left alone), never a
    copy of them (`io.BytesIO` copies all but `bytes`)."""
    if isinstance(data, VideoFile):
        return _FileAt(data.fd, data.size)
    return io.BytesIO(data) if isinstance(data, bytes) else _BufferAt(data)


class _FileAt(io.RawIOBase):
    """A file object that reads a descriptor at its own position (`pread`), without owning it."""

    def __init__(self, fd: int, size: int):
        super().__init__()
        self.fd, self.size, self.pos = fd, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = os.preadv(self.fd, [b], self.pos) if hasattr(os, "preadv") else _pread_into(self.fd, b, self.pos)
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, self.size)[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos


class _BufferAt(_FileAt):
    """A file object that reads a buffer in place."""

    def __init__(self, data):
        self.view = memoryview(data).cast("B")
        super().__init__(-1, len(self.view))

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        memoryview(b).cast("B")[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n

    def close(self):
        self.view.release()
        super().close()


def _pread_into(fd: int, b, pos: int) -> int:
    chunk = os.pread(fd, len(b), pos)
    memoryview(b).cast("B")[: len(chunk)] = chunk
    return len(chunk)


@dataclass
class Frame:
    t: Fraction  # presentation time, seconds
    end: Fraction  # when the next frame is due, as far as this frame knows
    source: object  # an av.VideoFrame, or an image's frame as (H, W, 3) uint8
    pixels: np.ndarray | None = field(default=None, repr=False)




class TooManyPixels(Exception):
    pass


class SizeChange(Exception):
    pass


class Reader:
    """What `_extract` asks of a decoder: the video's start, its stated end, and the frames shown at given times."""

    start: Fraction = Fraction(0)
    slack: Fraction = Fraction(0)  # how far the data may end before the stated end without being cut off
    tolerance: Fraction = Fraction(0)  # how late a frame may be and still count as due at a time
    failure: tuple[str, str] | None = None
    still = False  # a still image: one frame, whatever the frame rate

    def __init__(self, max_pixels: int, deadline: float, stats: dict, fit=None):
        self.max_pixels, self.deadline, self.stats, self.fit = max_pixels, deadline, stats, fit
        self.alloc = np.empty  # (shape, dtype) -> the array a clip's frames are decoded into
        self.size: tuple[int, int] | None = None  # (height, width) of the frames as shown
        self.target: tuple[int, int] | None = None  # what `fit` made of it
        self.prev: Frame | None = None  # the last frame taken: the one shown until `pending` is due
        self.pending: Frame | None = None  # decoded, not yet taken
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
            raise DecodeTimeout()

    def guard(self, width: int, height: int):
        if width * height > self.max_pixels:
            raise TooManyPixels(f"{width}x{height} = {width * height} pixels, over the limit of {self.max_pixels}")

    def peek(self) -> Frame | None:
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
                out = self.alloc((len(targets), *pixels.shape), np.uint8)
            elif pixels.shape != out.shape[1:]:
                raise SizeChange(f"the frame size changes within a clip, from {out.shape[2]}x{out.shape[1]} to "
                                  f"{pixels.shape[1]}x{pixels.shape[0]}")
            out[count] = pixels
            count += 1
        return out[:count] if out is not None else np.empty((0, 0, 0, 3), np.uint8)

    def position(self, target: Fraction):
        pass

    def pixels(self, f: Frame) -> np.ndarray:
        """A frame as shown (H, W, 3) uint8, fitted to `fit`'s size when given; a frame shown at several targets is
        converted once."""
        if f.pixels is None:
            rgb = self.to_rgb(f.source)
            if self.size is None:
                self.size = rgb.shape[:2]
                self.target = self.fit(*self.size) if self.fit is not None else None
            elif rgb.shape[:2] != self.size:
                raise SizeChange(f"the frame size changes from {self.size[1]}x{self.size[0]} to {rgb.shape[1]}x{rgb.shape[0]}")
            f.pixels, f.source = rgb if self.target is None else fit_frame(rgb, *self.target), None
        return f.pixels


class AVReader(Reader):
    """A video container through PyAV."""

    def __init__(self, data: bytes | VideoFile, max_pixels: int, deadline: float, stats: dict, fit=None):
        super().__init__(max_pixels, deadline, stats, fit)
        self.data = data
        self.container = self.file = None
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
        self.close()
        self.file = open_source(self.data)
        self.container = av.open(self.file, mode="r", **_OPEN_OPTIONS)
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
            self.container = None
        if self.file is not None:
            self.file.close()
            self.file = None

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

    def decode_next(self) -> Frame | None:
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
                yield Frame(t, t + duration, frame)

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


def fit_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H0, W0, 3) -> (height, width, 3) uint8, as `precompute.images.prepare` resizes and crops an image."""
    h, w = frame.shape[:2]
    scale = max(height / h, width / w)
    rw, rh = max(width, round(w * scale)), max(height, round(h * scale))
    top, left = (rh - height) // 2, (rw - width) // 2
    img = Image.fromarray(np.ascontiguousarray(frame))
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), Image.BICUBIC)
    return np.asarray(img.crop((left, top, left + width, top + height)), dtype=np.uint8)
