"""Aspect-ratio buckets: integer (height, width) pixel sizes and nearest-bucket assignment.

The tables are the published PixArt / Sana multi-aspect tables (the `ASPECT_RATIO_{256,512,1024,2048}_BIN`
dicts of the diffusers PixArt-alpha / PixArt-Sigma pipelines, which the Sana pipeline reuses). They are
kept here as data because this package must not import diffusers; a test checks they equal diffusers'.
A table for another area (`resolution_table`) is built as the 256 and 512 tables were: the 1024 table's
aspect ratios scaled to the area, each side rounded to the model's pixel granularity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import NamedTuple


class Bucket(NamedTuple):
    """A bucket's identity: its pixel height and width (integers, never float strings) and, for a clip, its number of
    frames.

    `frames` 0 is an image (a latent without a frame axis, as every image family stores it); F >= 1 is a clip of F
    pixel frames (a video family's latent has a frame axis; a one-frame clip is an image in a video cache). A batch
    never mixes buckets, hence never mixes frame counts. Named "HxW" for an image, "FxHxW" for a clip."""

    height: int
    width: int
    frames: int = 0

    @property
    def name(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}" if self.frames else f"{self.height}x{self.width}"

    @property
    def aspect(self) -> float:
        return self.height / self.width

    @property
    def pixels(self) -> int:
        """Pixels of one frame."""
        return self.height * self.width

    def with_frames(self, frames: int) -> Bucket:
        return Bucket(self.height, self.width, frames)

    @classmethod
    def parse(cls, text: str) -> Bucket:
        """Parse `"HxW"` (e.g. `"1024x768"`) or a clip's `"FxHxW"` (e.g. `"81x480x832"`)."""
        m = re.fullmatch(r"\s*(?:(\d+)\s*[xX×]\s*)?(\d+)\s*[xX×]\s*(\d+)\s*", text)
        if not m:
            raise ValueError(f"bucket {text!r} is not of the form HEIGHTxWIDTH (an image, e.g. 1024x768) or "
                             f"FRAMESxHEIGHTxWIDTH (a clip, e.g. 81x480x832)")
        if m.group(1) is not None and int(m.group(1)) < 1:
            raise ValueError(f"bucket {text!r}: a clip has at least one frame")
        return cls(int(m.group(2)), int(m.group(3)), int(m.group(1) or 0))

    def __str__(self) -> str:
        return self.name


# The published tables, in their published order (by aspect ratio). They are not symmetric under
# transposition (e.g. 2688x1408 is absent from the 2048 table), so they are listed whole.
_TABLE_1024 = """
512x2048 512x1856 576x1792 576x1728 576x1664 640x1600 640x1536 704x1472 704x1408 704x1344 768x1344
768x1280 832x1216 832x1152 896x1152 896x1088 960x1088 960x1024 1024x1024 1024x960 1088x960 1088x896
1152x896 1152x832 1216x832 1280x768 1344x768 1408x704 1472x704 1536x640 1600x640 1728x576 2048x512
"""
_TABLE_2048 = """
1024x4096 1024x3968 1024x3840 1024x3712 1152x3584 1152x3456 1152x3328 1280x3200 1280x3072 1408x2944
1408x2816 1408x2688 1536x2688 1536x2560 1664x2432 1664x2304 1792x2304 1792x2176 1920x2176 1920x2048
2048x2048 2048x1920 2176x1920 2176x1792 2304x1792 2304x1664 2432x1664 2560x1536 2688x1536 2816x1408
2944x1408 3072x1280 3200x1280 3328x1152 3456x1152 3584x1152 3712x1024 3840x1024 3968x1024 4096x1024
"""


def _parse_table(text: str) -> tuple[Bucket, ...]:
    return tuple(Bucket.parse(item) for item in text.split())


def _scaled(table: tuple[Bucket, ...], divisor: int) -> tuple[Bucket, ...]:
    return tuple(Bucket(b.height // divisor, b.width // divisor) for b in table)


ASPECT_RATIO_1024 = _parse_table(_TABLE_1024)
ASPECT_RATIO_2048 = _parse_table(_TABLE_2048)
# The published 256 and 512 tables are exactly the 1024 table divided by 4 and 2.
ASPECT_RATIO_512 = _scaled(ASPECT_RATIO_1024, 2)
ASPECT_RATIO_256 = _scaled(ASPECT_RATIO_1024, 4)

ASPECT_RATIO_TABLES: dict[int, tuple[Bucket, ...]] = {
    256: ASPECT_RATIO_256,
    512: ASPECT_RATIO_512,
    1024: ASPECT_RATIO_1024,
    2048: ASPECT_RATIO_2048,
}


def bucket_table(base_resolution: int) -> tuple[Bucket, ...]:
    """The published aspect-ratio table for a base resolution (256, 512, 1024 or 2048)."""
    try:
        return ASPECT_RATIO_TABLES[base_resolution]
    except KeyError:
        raise ValueError(
            f"no published bucket table for base resolution {base_resolution}; "
            f"choose one of {sorted(ASPECT_RATIO_TABLES)}"
        ) from None


# Resolutions a stage-one run may ask for: square areas of MIN_RESOLUTION..(the family's maximum) pixels a side,
# in steps of RESOLUTION_STEP (every published table's area is one).
MIN_RESOLUTION, RESOLUTION_STEP = 256, 64


def resolution_problem(resolution: object, maximum: int) -> str | None:
    """Why `resolution` is not a resolution a table can be built for (below `maximum`), or None."""
    if isinstance(resolution, bool) or not isinstance(resolution, int):
        return f"{resolution!r} is not a whole number of pixels"
    if resolution % RESOLUTION_STEP or not MIN_RESOLUTION <= resolution <= maximum:
        return (f"{resolution} is not a multiple of {RESOLUTION_STEP} from {MIN_RESOLUTION} to {maximum} "
                f"(the model's largest)")
    return None


def scaled_table(resolution: int, granularity: int) -> tuple[Bucket, ...]:
    """The 1024 table's aspect ratios at an area of `resolution`² pixels: each side scaled by `resolution / 1024`
    and rounded (halves up) to a multiple of `granularity`, at least one step; a bucket that rounds onto an earlier
    one is dropped. `scaled_table(512, 32)` and `scaled_table(256, 16)` are the published 512 and 256 tables.

    Args:
        resolution: the side of the square bucket, in pixels.
        granularity: pixels per side of one image token (the VAE's downsampling times the transformer's patch).
    """
    if granularity < 1:
        raise ValueError(f"granularity {granularity}: must be at least 1")
    scale = resolution / 1024

    def side(pixels: int) -> int:
        return max(granularity, math.floor(pixels * scale / granularity + 0.5) * granularity)

    return tuple(dict.fromkeys(Bucket(side(b.height), side(b.width)) for b in ASPECT_RATIO_1024))


def resolution_table(resolution: int, granularity: int) -> tuple[Bucket, ...]:
    """The bucket table of a resolution for a model whose bucket sides are multiples of `granularity`: the published
    table where one exists and fits that granularity, otherwise `scaled_table`."""
    published = ASPECT_RATIO_TABLES.get(resolution)
    if published is not None and all(b.height % granularity == 0 and b.width % granularity == 0 for b in published):
        return published
    return scaled_table(resolution, granularity)


def nearest_bucket(height: int, width: int, buckets: Iterable[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is closest to `height / width`, in log space.

    Log distance treats 1:2 and 2:1 alike (a linear distance favours tall buckets). Ties go to the
    earlier bucket in the table, so assignment is deterministic.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        buckets: the candidate buckets, e.g. `bucket_table(1024)`.

    Returns:
        The nearest bucket.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    target = math.log(height / width)
    return min(buckets, key=lambda b: abs(math.log(b.aspect) - target))


def aspect_error(height: int, width: int, bucket: Bucket) -> float:
    """How far an image's aspect ratio is from a bucket's, as a factor >= 1 (1.0 is an exact fit)."""
    return math.exp(abs(math.log(height / width) - math.log(bucket.aspect)))
