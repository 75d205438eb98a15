"""Image files as clips (`precompute.video.read_clips` reads them through Pillow, as images are read): an animated GIF,
WebP or APNG is a video timed by its frame delays, a still image a one-frame clip."""

from __future__ import annotations

import contextlib
import struct
import warnings
from fractions import Fraction

import numpy as np
from PIL import Image

from precompute.images import allow_pixels, to_rgb
from precompute.video_readers import Frame, Reader, VideoFile, open_source

# A GIF or WebP frame without a usable delay is shown for 100 ms, as browsers do (they also stretch delays of
# 10 ms or less, which ancient encoders wrote for "as fast as possible", to 100 ms).
DEFAULT_DELAY_MS = 100


@contextlib.contextmanager
def _pillow_errors():
    """Pillow's plugins meet corrupt data with whatever their parsing raises: as an OSError, like the rest."""
    try:
        yield
    except (IndexError, KeyError, struct.error) as e:
        raise OSError(f"corrupt image data ({type(e).__name__}: {e})") from e


class ImageReader(Reader):
    """A GIF, WebP, APNG or still image through Pillow, timed by its frame durations."""

    def __init__(self, data: bytes | VideoFile, max_pixels: int, deadline: float, stats: dict, fit=None):
        super().__init__(max_pixels, deadline, stats, fit)
        allow_pixels(max_pixels)
        self.file = open_source(data)  # Pillow leaves a file it was given open: closed with the reader
        self.img = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the header's size is checked below
                self.img = Image.open(self.file)
            self.guard(*self.img.size)
            with _pillow_errors():
                self.count = getattr(self.img, "n_frames", 1)  # GIF: read through every frame's header
        except BaseException:
            self.close()
            raise
        self.still = self.count == 1
        self.index = 0
        self.t = Fraction(0)

    def close(self):
        if self.img is not None:
            self.img.close()
        self.file.close()

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
        return Fraction(DEFAULT_DELAY_MS if ms <= 10 else round(ms), 1000)

    def position(self, target):
        if self.prev is not None and self.prev.t > target:  # overlapping clips: decoded again from the first frame
            self.index, self.t, self.prev, self.pending, self.eof = 0, Fraction(0), None, None, False

    def decode_next(self) -> Frame | None:
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
        return Frame(t, t + delay, np.asarray(to_rgb(self.img)))

    def to_rgb(self, source) -> np.ndarray:
        return source
