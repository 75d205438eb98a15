"""Reading the dataset: find image-caption pairs, decode, bucket, resize and crop deterministically.

Every input either becomes a prepared sample or a failure with a named reason; nothing raises out
of a worker for bad data. Sources are a folder (sidecar captions or a `metadata.jsonl` / `metadata.csv`
in the Hugging Face imagefolder convention) or webdataset tars (img2dataset layout).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from shards import Bucket, aspect_error, nearest_bucket

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_EXTENSIONS = (".txt", ".caption")
PREPROCESSING_VERSION = 1  # bump when anything below changes the pixels or captions produced

# Reasons a sample is skipped; each is counted and written to failures.jsonl.
REASONS = {
    "missing_file": "file listed but not found",
    "empty_file": "zero-byte file",
    "not_an_image": "not a decodable image",
    "corrupt_image": "corrupt or truncated image data",
    "too_many_pixels": "over the pixel limit (decompression bomb guard)",
    "too_small": "smaller than its bucket by more than the upscale limit",
    "extreme_aspect": "aspect ratio beyond the bucket table",
    "missing_caption": "no caption found",
    "empty_caption": "caption is empty",
    "caption_not_utf8": "caption is not valid UTF-8",
    "non_finite": "an encoder produced NaN or Inf",
    "corrupt_tar": "unreadable tar shard",
}


@dataclass(frozen=True)
class ImagePolicy:
    """How images become bucket-sized pixels. Everything here is part of the cache fingerprint.

    Args:
        buckets: the bucket table.
        max_upscale: skip images that would need more than this upscaling to cover their bucket.
        allow_upscale: never skip for size (tiny images are upscaled).
        extreme_aspect: "skip" or "clamp" images whose aspect ratio is beyond the table's range
            by more than `aspect_tolerance`.
        aspect_tolerance: factor by which an aspect ratio may exceed the table's extremes.
        max_pixels: refuse images with more pixels (decompression bombs).
    """

    buckets: tuple[Bucket, ...]
    max_upscale: float = 2.0
    allow_upscale: bool = False
    extreme_aspect: str = "skip"
    aspect_tolerance: float = 1.25
    max_pixels: int = 178_956_970  # twice Pillow's default warning limit

    def fingerprint(self) -> dict:
        return {
            "table": [b.name for b in self.buckets],
            "resize": "cover, bicubic, antialiased",
            "crop": "center",
            "max_upscale": None if self.allow_upscale else self.max_upscale,
            "extreme_aspect": self.extreme_aspect,
            "aspect_tolerance": self.aspect_tolerance,
            "alpha": "composited on white",
            "exif_orientation": "applied",
            "preprocessing_version": PREPROCESSING_VERSION,
        }


@dataclass
class Record:
    """One source's input: where it came from, its image bytes and raw caption candidates."""

    source: str
    image: bytes | None
    captions: list[bytes | str] = field(default_factory=list)
    missing: str | None = None  # a failure reason known before decoding


def content_key(image: bytes, captions: list[str]) -> str:
    """A sample's key: sha256 of the image bytes and every caption."""
    h = hashlib.sha256(image)
    for c in captions:
        h.update(b"\x00" + c.encode("utf-8"))
    return h.hexdigest()


def decode_captions(raw: list[bytes | str]) -> tuple[list[str] | None, str | None]:
    if not raw:
        return None, "missing_caption"
    out = []
    for c in raw:
        if isinstance(c, bytes):
            try:
                c = c.decode("utf-8")
            except UnicodeDecodeError:
                return None, "caption_not_utf8"
        c = c.strip()
        if c:
            out.append(c)
    return (out, None) if out else (None, "empty_caption")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: EXIF rotation applied, alpha composited on white, 16-bit scaled."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        return Image.fromarray(np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def prepare(record: Record, policy: ImagePolicy, skip_keys: frozenset[str] | set[str] = frozenset()) -> dict:
    """Turn a record into a prepared sample, an `unchanged` marker, or a failure.

    Returns:
        A dict with `status` ("ok", "unchanged" or "failed") and `source`; "ok" adds `key`, `bucket`,
        `pixels` (3, H, W) uint8, `captions`, `original_size` (h, w) and `crop` (top, left, h, w);
        "unchanged" adds `key`; "failed" adds `reason` and `detail`.
    """
    def failed(reason: str, detail: str = "") -> dict:
        return {"status": "failed", "source": record.source, "reason": reason, "detail": detail}

    if record.missing:
        return failed(record.missing)
    if not record.image:
        return failed("empty_file")
    captions, reason = decode_captions(record.captions)
    if reason:
        return failed(reason)
    key = content_key(record.image, captions)
    if key in skip_keys:
        return {"status": "unchanged", "source": record.source, "key": key}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(record.image))
            w, h = img.size
            if w * h > policy.max_pixels:
                return failed("too_many_pixels", f"{w}x{h}")
            img.load()
            img = to_rgb(img)
    except UnidentifiedImageError as e:
        return failed("not_an_image", str(e))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return failed("too_many_pixels", str(e))
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        return failed("corrupt_image", f"{type(e).__name__}: {e}")

    h, w = img.height, img.width
    bucket = nearest_bucket(h, w, policy.buckets)
    extremes = (policy.buckets[0], policy.buckets[-1]) if len(policy.buckets) > 1 else (bucket,)
    if bucket in extremes and aspect_error(h, w, bucket) > policy.aspect_tolerance and policy.extreme_aspect == "skip":
        return failed("extreme_aspect", f"{w}x{h} (width x height)")
    scale = max(bucket.height / h, bucket.width / w)
    if scale > policy.max_upscale and not policy.allow_upscale:
        return failed("too_small", f"{w}x{h} needs {scale:.2f}x upscaling for bucket {bucket}")
    # cover the bucket, then center-crop
    rw, rh = max(bucket.width, round(w * scale)), max(bucket.height, round(h * scale))
    img = img.resize((rw, rh), Image.BICUBIC)
    top, left = (rh - bucket.height) // 2, (rw - bucket.width) // 2
    img = img.crop((left, top, left + bucket.width, top + bucket.height))
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # (3, H, W)
    return {
        "status": "ok",
        "source": record.source,
        "key": key,
        "bucket": bucket,
        "pixels": pixels,
        "captions": captions,
        "original_size": (h, w),
        "crop": (top, left, bucket.height, bucket.width),
    }


# ---- folders ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class FolderEntry:
    """A folder sample before reading: paths only, so listing a million files stays cheap."""

    source: str  # relative to the dataset root
    image: str
    caption_files: tuple[str, ...] = ()
    captions: tuple[str, ...] | None = None  # from a metadata file


def _metadata_captions(value) -> tuple[str, ...]:
    if isinstance(value, list):
        return tuple(str(v) for v in value if v is not None)
    if value is None:
        return ()
    text = str(value)
    if text.startswith("["):  # a JSON list in a CSV cell
        try:
            return tuple(str(v) for v in json.loads(text))
        except json.JSONDecodeError:
            pass
    return (text,)


def list_folder(root: str | os.PathLike, caption_column: str = "text") -> list[FolderEntry]:
    """Every image under `root` with its captions, sorted by relative path.

    With `metadata.jsonl` or `metadata.csv` at the root (columns `file_name` and `caption_column`),
    those rows are the dataset; otherwise each image's captions are the sidecar files beside it
    with the same stem (`x.jpg` + `x.txt` and/or `x.caption`).
    """
    root = Path(root)
    jsonl, csv_path = root / "metadata.jsonl", root / "metadata.csv"
    if jsonl.exists() or csv_path.exists():
        rows = []
        if jsonl.exists():
            for n, line in enumerate(jsonl.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{jsonl}:{n}: not valid JSON ({e})") from e
        else:
            with open(csv_path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        entries = []
        for n, row in enumerate(rows, 1):
            if "file_name" not in row:
                raise ValueError(f"{jsonl if jsonl.exists() else csv_path}: row {n} has no 'file_name' column")
            entries.append(FolderEntry(row["file_name"], str(root / row["file_name"]), captions=_metadata_captions(row.get(caption_column))))
        return sorted(entries, key=lambda e: e.source)
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        names = set(filenames)
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext.lower() not in IMAGE_EXTENSIONS:
                continue
            path = Path(dirpath) / name
            sidecars = tuple(str(Path(dirpath) / (stem + c)) for c in CAPTION_EXTENSIONS if stem + c in names)
            entries.append(FolderEntry(path.relative_to(root).as_posix(), str(path), sidecars))
    return sorted(entries, key=lambda e: e.source)


def read_folder_entry(entry: FolderEntry) -> Record:
    try:
        image = Path(entry.image).read_bytes()
    except FileNotFoundError:
        return Record(entry.source, None, missing="missing_file")
    if entry.captions is not None:
        return Record(entry.source, image, list(entry.captions))
    return Record(entry.source, image, [Path(p).read_bytes() for p in entry.caption_files])


class FolderDataset(torch.utils.data.Dataset):
    """Map-style dataset over folder entries; each item is `prepare`'s output."""

    def __init__(self, entries: list[FolderEntry], policy: ImagePolicy, skip_keys: frozenset[str]):
        self.entries, self.policy, self.skip_keys = entries, policy, skip_keys

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict:
        return prepare(read_folder_entry(self.entries[i]), self.policy, self.skip_keys)


# ---- webdataset tars -------------------------------------------------------------------------

def is_tar_source(data: str) -> bool:
    """Whether DATA names webdataset tars (a .tar path, a brace pattern, a URL, or a folder of tars)."""
    if data.startswith(("http://", "https://", "pipe:", "gs://", "s3://")) or "{" in data or data.endswith(".tar"):
        return True
    path = Path(data)
    return path.is_dir() and any(path.glob("*.tar")) and not any(
        p.suffix.lower() in IMAGE_EXTENSIONS for p in path.iterdir()
    ) and not (path / "metadata.jsonl").exists()


def expand_tar_urls(data: str, allow_pipe: bool = False) -> list[str]:
    """The list of tar shards DATA names, in order."""
    import braceexpand

    if data.startswith("pipe:") and not allow_pipe:
        raise ValueError(f"{data!r} runs a shell command; pass --allow-pipe if you trust it")
    path = Path(data)
    if path.is_dir():
        return sorted(str(p) for p in path.glob("*.tar"))
    urls = list(braceexpand.braceexpand(data))
    for u in urls:
        if not u.startswith(("http://", "https://", "pipe:", "gs://", "s3://")) and not Path(u).exists():
            raise FileNotFoundError(f"tar shard {u} does not exist (from DATA={data})")
    return urls


def tar_records(sample: dict, caption_keys: tuple[str, ...]) -> Record:
    """A webdataset sample dict (raw bytes per extension) as a Record."""
    source = f"{Path(sample.get('__url__', '')).name}/{sample['__key__']}"
    image = next((sample[ext] for ext in ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif") if ext in sample), None)
    if image is None:
        return Record(source, None, missing="not_an_image")
    captions: list[bytes | str] = []
    if "txt" in sample:
        captions.append(sample["txt"])
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            meta = {}
        for k in caption_keys:
            v = meta.get(k) if isinstance(meta, dict) else None
            captions += [str(x) for x in v] if isinstance(v, list) else ([str(v)] if v else [])
    return Record(source, image, captions)


class TarDataset(torch.utils.data.IterableDataset):
    """This rank's tar shards, split further over DataLoader workers; yields `prepare`'s output.

    A tar that cannot be read is reported once as a `corrupt_tar` failure and the run goes on.
    """

    def __init__(self, urls: list[str], policy: ImagePolicy, skip_keys: frozenset[str], caption_keys: tuple[str, ...]):
        self.urls, self.policy, self.skip_keys, self.caption_keys = urls, policy, skip_keys, caption_keys

    def __iter__(self) -> Iterator[dict]:
        import webdataset as wds

        info = torch.utils.data.get_worker_info()
        urls = self.urls[info.id :: info.num_workers] if info else self.urls
        for url in urls:
            stream = iter(wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False))
            while True:
                try:
                    sample = next(stream)
                except StopIteration:
                    break
                except Exception as e:  # tarfile / gopen errors: the shard is unreadable from here on
                    yield {"status": "failed", "source": url, "reason": "corrupt_tar", "detail": f"{type(e).__name__}: {e}"}
                    break
                yield prepare(tar_records(sample, self.caption_keys), self.policy, self.skip_keys)
