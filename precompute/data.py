"""Reading the dataset: find image-caption pairs, decode, bucket, resize and crop deterministically.

Every input either becomes a prepared sample or a failure with a named reason; nothing raises out
of a worker for bad data. Sources are a folder (sidecar captions or a `metadata.jsonl` / `metadata.csv`
in the Hugging Face imagefolder convention) or webdataset tars (img2dataset layout). Only regular files
are opened, and metadata cannot name a path outside DATA. A folder entry's stamp (size and mtime of its
files) lets an incremental run skip an unchanged input without reading it.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
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
    "caption_not_string": "metadata caption is not a string or a list of strings",
    "caption_nul": "caption contains a NUL character",
    "non_finite": "an encoder produced NaN or Inf",
    "corrupt_tar": "unreadable tar shard",
    "special_file": "not a regular file (FIFO, socket, device or directory); never opened",
    "permission_denied": "no permission to read the file",
    "unreadable": "file could not be read (symlink loop, I/O error, ...)",
    "unlisted_directory": "directory could not be listed; the files in it were not seen",
    "bad_metadata_row": "metadata row that is not valid JSON/CSV or has no usable file_name",
    "outside_root": "metadata file_name is absolute or points outside DATA",
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
    detail: str = ""  # what went wrong, with `missing`


def content_key(image: bytes, captions: list[str]) -> str:
    """A sample's key: sha256 of the image bytes and every caption."""
    h = hashlib.sha256(image)
    for c in captions:
        h.update(b"\x00" + c.encode("utf-8"))
    return h.hexdigest()


def decode_captions(raw: list[bytes | str]) -> tuple[list[str] | None, str | None]:
    """Caption candidates as stripped text, empty ones dropped.

    Returns:
        (captions, None), or (None, reason) when there is no usable caption or one is malformed.
    """
    if not raw:
        return None, "missing_caption"
    out = []
    for c in raw:
        try:
            c = c.decode("utf-8") if isinstance(c, bytes) else c
            c.encode("utf-8")  # a str from JSON may hold lone surrogates, which content_key could not encode
        except UnicodeError:
            return None, "caption_not_utf8"
        if "\x00" in c:  # content_key separates captions with NUL: ["a\0b"] and ["a", "b"] would share a key
            return None, "caption_nul"
        c = c.removeprefix("\ufeff").strip()  # a byte order mark from a Windows editor is not text
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
        return failed(record.missing, record.detail)
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

METADATA_FILES = ("metadata.jsonl", "metadata.csv")  # the first one present is the dataset
REMOTE_PREFIXES = ("http://", "https://", "pipe:", "gs://", "s3://")


@dataclass(frozen=True)
class FolderEntry:
    """A folder sample before reading: paths only, so listing a million files stays cheap."""

    source: str  # relative to the dataset root
    image: str
    caption_files: tuple[str, ...] = ()
    captions: tuple[str, ...] | None = None  # from a metadata file


@dataclass
class Listing:
    """What `list_folder` found.

    Args:
        entries: the samples, sorted by source.
        failures: files and metadata rows that are not samples: dicts with `source`, `reason` and `detail`.
        complete: False when a directory or a metadata row could not be read, so a sample may exist that
            is in neither `entries` nor `failures`; such a listing must not be used to remove cached samples.
    """

    entries: list[FolderEntry]
    failures: list[dict]
    complete: bool


class SpecialFileError(OSError):
    """A path that is not a regular file (FIFO, socket, device, directory). It is never opened: opening a
    FIFO blocks until a writer appears, and opening a device can have side effects."""


class _BadRow(ValueError):
    """A metadata row that is not a sample; `source` is its file_name when it names one."""

    def __init__(self, reason: str, detail: str, source: str | None = None):
        super().__init__(detail)
        self.reason, self.source = reason, source


def _failure(source: str, reason: str, detail: str) -> dict:
    return {"source": source, "reason": reason, "detail": detail}


def _os_reason(e: OSError) -> str:
    """The failure reason of a per-file OSError."""
    if isinstance(e, SpecialFileError):
        return "special_file"
    if isinstance(e, PermissionError):
        return "permission_denied"
    if isinstance(e, FileNotFoundError):  # deleted since listing, or a dangling symlink
        return "missing_file"
    return "unreadable"  # ELOOP, EIO, ...


def _stat_regular(path: str | os.PathLike, st: os.stat_result | None = None) -> os.stat_result:
    """`os.stat` of a regular file, following symlinks (or check `st`); anything else raises SpecialFileError."""
    st = st or os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                 (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "directory"))
        kind = next((name for is_kind, name in kinds if is_kind(st.st_mode)), "special file")
        raise SpecialFileError(f"{path} is a {kind}, not a regular file")
    return st


def _read_regular(path: str | os.PathLike) -> bytes:
    """A regular file's bytes; anything else raises SpecialFileError without being opened."""
    _stat_regular(path)
    # O_NONBLOCK: should the path become a FIFO after the check, the open still returns at once
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        _stat_regular(path, os.fstat(fd))
        return f.read()


def _read_utf8(path: Path) -> str:
    """A metadata file's text without a leading byte order mark.

    Raises:
        ValueError: the file is not UTF-8; the message names the file and line.
    """
    data = _read_regular(path)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 ({e.reason}); save the file as UTF-8") from e


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict | _BadRow]]:
    """(line number, row) of a metadata.jsonl; a line that is not a JSON object yields a _BadRow instead."""
    # split on "\n" only: str.splitlines also splits at U+2028, which a JSON string may hold unescaped
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, _BadRow("bad_metadata_row", f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        yield n, row if isinstance(row, dict) else _BadRow("bad_metadata_row", f"a JSON {type(row).__name__}, not an object")


def _csv_rows(text: str, path: Path) -> Iterator[tuple[int, dict | _BadRow]]:
    """(line number, row) of a metadata.csv; after a CSV syntax error, one _BadRow and no more rows."""
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        if reader.fieldnames and "file_name" not in reader.fieldnames:
            raise ValueError(f"{path}: no 'file_name' column (columns: {reader.fieldnames}); "
                             "name the column of image paths file_name")
        for row in reader:
            yield reader.line_num, row
    except csv.Error as e:
        yield reader.line_num, _BadRow("bad_metadata_row", f"not valid CSV ({e}); the rest of the file was not read")


def _metadata_captions(value: object, from_csv: bool) -> tuple[str, ...] | None:
    """A metadata caption cell as captions: a string or a list of strings (None items and cells are no
    caption); in a CSV, a cell holding a JSON list is that list. Any other type is None: not stringified."""
    if value is None:
        return ()
    if from_csv and isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) or v is None for v in value):
        return tuple(v for v in value if v is not None)
    return None


def _metadata_path(root: Path, name: str, inside: dict[str, bool]) -> str:
    """The path a metadata `file_name` names under root.

    The name must be relative, without `..`, and its directory must resolve inside root. The file itself
    may be a symlink, followed as in a folder listing (the Hugging Face hub cache stores a snapshot's files
    as symlinks into ../../blobs): the text of a row reaches nothing a folder listing would not.
    `inside` caches the answer per directory.
    """
    if os.path.isabs(name) or ".." in PurePosixPath(name).parts:
        raise _BadRow("outside_root", f"file_name {name!r} is not a relative path inside DATA", name)
    path = root / name
    parent = str(path.parent)
    if parent not in inside:
        real_root, real_parent = os.path.realpath(root), os.path.realpath(parent)
        inside[parent] = os.path.commonpath([real_root, real_parent]) == real_root
    if not inside[parent]:
        raise _BadRow("outside_root", f"file_name {name!r} leads outside DATA through a symlinked directory", name)
    return str(path)


def _metadata_entry(root: Path, row: dict, caption_column: str, from_csv: bool, inside: dict[str, bool]) -> FolderEntry:
    """A metadata row as an entry; a row that is not a sample raises _BadRow."""
    name = row.get("file_name")
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise _BadRow("bad_metadata_row", f"file_name {name!r} is not a non-empty string")
    path = _metadata_path(root, name, inside)
    captions = _metadata_captions(row.get(caption_column), from_csv)
    if captions is None:
        raise _BadRow("caption_not_string", f"{caption_column} is {row.get(caption_column)!r}, "
                      "not a string or a list of strings", name)
    return FolderEntry(name, path, captions=captions)


def _list_metadata(root: Path, path: Path, caption_column: str) -> Listing:
    text, from_csv = _read_utf8(path), path.suffix == ".csv"
    entries, failures, complete, inside = [], [], True, {}
    for n, row in _csv_rows(text, path) if from_csv else _jsonl_rows(text):
        try:
            if isinstance(row, _BadRow):
                raise row
            entries.append(_metadata_entry(root, row, caption_column, from_csv, inside))
        except _BadRow as e:
            # a row naming no file may be a cached sample's: the listing cannot say it is gone
            complete = complete and e.source is not None
            failures.append(_failure(e.source or f"{path.name}:{n}", e.reason, f"{path.name} line {n}: {e}"))
    return Listing(sorted(entries, key=lambda e: e.source), failures, complete)


def _walk_folder(root: Path) -> Listing:
    entries, failures = [], []

    def unlisted(e: OSError) -> None:
        source = Path(os.path.relpath(e.filename, root)).as_posix() if e.filename else "."
        failures.append(_failure(source, "unlisted_directory", f"{type(e).__name__}: {e}"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlisted):
        dirnames.sort()
        names = set(filenames)
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext.lower() not in IMAGE_EXTENSIONS:
                continue
            path = Path(dirpath) / name
            source = path.relative_to(root).as_posix()
            try:
                _stat_regular(path)  # follows symlinks: a loop or a dangling one fails here
            except OSError as e:
                failures.append(_failure(source, _os_reason(e), f"{type(e).__name__}: {e}"))
                continue
            sidecars = tuple(str(Path(dirpath) / (stem + c)) for c in CAPTION_EXTENSIONS if stem + c in names)
            entries.append(FolderEntry(source, str(path), sidecars))
    complete = not any(f["reason"] == "unlisted_directory" for f in failures)
    return Listing(sorted(entries, key=lambda e: e.source), failures, complete)


def list_folder(root: str | os.PathLike, caption_column: str = "text") -> Listing:
    """Every image under `root` with its captions, and what could not be listed.

    With `metadata.jsonl` or `metadata.csv` at the root (columns `file_name` and `caption_column`),
    those rows are the dataset; otherwise each image's captions are the sidecar files beside it
    with the same stem (`x.jpg` + `x.txt` and/or `x.caption`). Symlinks to files are followed, symlinks
    to directories are not; nothing is opened but the metadata file.

    Returns:
        A Listing. Bad rows and unreadable or special files are failures; the listing goes on.

    Raises:
        ValueError: the metadata file is not UTF-8, or a CSV has no `file_name` column.
        OSError: the metadata file cannot be read.
    """
    root = Path(root)
    for name in METADATA_FILES:
        if os.path.lexists(root / name):
            return _list_metadata(root, root / name, caption_column)
    return _walk_folder(root)


def entry_stamp(entry: FolderEntry) -> int:
    """What an incremental run compares instead of reading an entry's files.

    A 63-bit blake2b digest of (size, mtime_ns) of the image and of each sidecar caption file, and of the
    metadata captions; `os.stat` only, nothing is opened. Never 0, which stands for "unknown".

    Raises:
        OSError: a file cannot be stat'ed, or is not a regular file (SpecialFileError).
    """
    h = hashlib.blake2b(digest_size=8)
    for path in (entry.image, *entry.caption_files):
        st = _stat_regular(path)
        h.update(f"{os.path.splitext(path)[1]}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for c in entry.captions or ():
        text = c.encode("utf-8", "surrogatepass")
        h.update(len(text).to_bytes(8, "big") + text)
    return int.from_bytes(h.digest(), "big") >> 1 or 1


def read_folder_entry(entry: FolderEntry) -> Record:
    """An entry's image bytes and raw captions; a file that cannot be read makes a Record with its reason."""
    try:
        image = _read_regular(entry.image)
        if entry.captions is not None:
            return Record(entry.source, image, list(entry.captions))
        return Record(entry.source, image, [_read_regular(p) for p in entry.caption_files])
    except OSError as e:
        return Record(entry.source, None, missing=_os_reason(e), detail=f"{type(e).__name__}: {e}")


class FolderDataset(torch.utils.data.Dataset):
    """Map-style dataset over folder entries; each item is `prepare`'s output with the entry's `stamp`.

    Args:
        entries: the entries to read.
        policy: how images become pixels.
        skip_keys: keys already cached: a sample with one of them is "unchanged" after reading.
        known: source -> (key, stamp) of the cached samples. An entry whose stamp is its known stamp is
            "unchanged" without being read: `{"status": "unchanged", "source", "key": known key, "stamp"}`.
    """

    def __init__(self, entries: list[FolderEntry], policy: ImagePolicy, skip_keys: frozenset[str],
                 known: dict[str, tuple[str, int]] | None = None):
        self.entries, self.policy, self.skip_keys, self.known = entries, policy, skip_keys, known or {}

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict:
        entry = self.entries[i]
        try:
            stamp = entry_stamp(entry)
        except OSError as e:
            return {"status": "failed", "source": entry.source, "reason": _os_reason(e),
                    "detail": f"{type(e).__name__}: {e}", "stamp": 0}
        known = self.known.get(entry.source)
        if known is not None and known[1] == stamp:  # a known stamp of 0 never matches
            return {"status": "unchanged", "source": entry.source, "key": known[0], "stamp": stamp}
        return {**prepare(read_folder_entry(entry), self.policy, self.skip_keys), "stamp": stamp}


# ---- webdataset tars -------------------------------------------------------------------------

def is_tar_source(data: str) -> bool:
    """Whether DATA names webdataset tars: a .tar path, a brace pattern, a URL, or a folder holding tars
    and no images or metadata. An existing folder is never a pattern, whatever its name."""
    path = Path(data)
    if path.is_dir():
        return any(path.glob("*.tar")) and not any(
            p.suffix.lower() in IMAGE_EXTENSIONS for p in path.iterdir()
        ) and not any((path / name).exists() for name in METADATA_FILES)
    return data.startswith(REMOTE_PREFIXES) or "{" in data or data.endswith(".tar")


def expand_tar_urls(data: str, allow_pipe: bool = False) -> list[str]:
    """The list of tar shards DATA names, in order.

    Raises:
        ValueError: DATA names no shard, or a shard is a `pipe:` command and `allow_pipe` is False.
        FileNotFoundError: a local shard does not exist.
    """
    import braceexpand

    path = Path(data)
    if path.is_dir():
        urls = sorted(str(p) for p in path.glob("*.tar"))
    else:
        urls = [u for u in braceexpand.braceexpand(data) if u]
    if not urls:
        raise ValueError(f"DATA={data} names no tar shards")
    piped = [u for u in urls if u.startswith("pipe:")]
    if piped and not allow_pipe:  # checked per shard: a brace pattern can expand to commands
        raise ValueError(f"DATA={data} runs shell commands ({piped[0]!r}, ...); pass --allow-pipe if you trust them")
    for u in urls:
        if not u.startswith(REMOTE_PREFIXES) and not Path(u).exists():
            raise FileNotFoundError(f"tar shard {u} does not exist (from DATA={data})")
    return urls


def tar_name(url: str) -> str:
    """The name a tar's samples carry as the prefix of their source: `{tar_name(url)}/{key}`."""
    return Path(url).name


def tar_records(sample: dict, caption_keys: tuple[str, ...]) -> Record:
    """A webdataset sample dict (raw bytes per extension) as a Record."""
    source = f"{tar_name(sample.get('__url__', ''))}/{sample['__key__']}"
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
            found = _metadata_captions(meta.get(k) if isinstance(meta, dict) else None, from_csv=False)
            if found is None:
                return Record(source, None, missing="caption_not_string", detail=f"json {k!r} is {meta[k]!r}")
            captions += found
    return Record(source, image, captions)


def tar_ends_properly(url: str) -> bool:
    """Whether a local tar ends with the end-of-archive marker (two zero blocks, padded to 512-byte blocks). A tar
    cut at a member boundary reads without an error in tarfile, its last members silently missing; only the
    marker tells. Remote tars cannot be checked without reading them again and pass."""
    path = Path(url)
    if url.startswith(REMOTE_PREFIXES) or not path.is_file():
        return True
    size = path.stat().st_size
    if size < 1024 or size % 512:
        return False
    with open(path, "rb") as f:
        f.seek(size - 1024)
        return f.read(1024) == bytes(1024)


class TarDataset(torch.utils.data.IterableDataset):
    """This rank's tar shards, split further over DataLoader workers; yields `prepare`'s output with
    `stamp` 0 (unknown: a tar's samples are always read).

    A tar that cannot be read is reported once as a `corrupt_tar` failure whose source is the tar's URL,
    after the samples read before the error, and the run goes on; a local tar that lacks its end-of-archive
    marker (cut short) is reported without reading any of it.
    """

    def __init__(self, urls: list[str], policy: ImagePolicy, skip_keys: frozenset[str], caption_keys: tuple[str, ...]):
        self.urls, self.policy, self.skip_keys, self.caption_keys = urls, policy, skip_keys, caption_keys

    def __iter__(self) -> Iterator[dict]:
        import webdataset as wds

        info = torch.utils.data.get_worker_info()
        urls = self.urls[info.id :: info.num_workers] if info else self.urls
        for url in urls:
            if not tar_ends_properly(url):  # read nothing of it: its last sample may have lost members too
                yield {"status": "failed", "source": url, "reason": "corrupt_tar", "stamp": 0,
                       "detail": "ends without the end-of-archive blocks: a partial download or copy?"}
                continue
            stream = iter(wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False))
            while True:
                try:
                    sample = next(stream)
                except StopIteration:
                    break
                except Exception as e:  # tarfile / gopen errors: the shard is unreadable from here on
                    yield {"status": "failed", "source": url, "reason": "corrupt_tar", "detail": f"{type(e).__name__}: {e}",
                           "stamp": 0}
                    break
                yield {**prepare(tar_records(sample, self.caption_keys), self.policy, self.skip_keys), "stamp": 0}
