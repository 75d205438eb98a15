"""A folder of images as inputs: find image-caption pairs, read them, and stamp them.

Captions are sidecar files (`x.jpg` + `x.txt`) or a `metadata.jsonl` / `metadata.csv` in the Hugging Face
imagefolder convention. A control image (ControlNet caches) is the sidecar `x.control.png` (any image
extension; such files are never images of their own), a metadata row's `control_file_name`, or the file of the
same relative name in a separate folder (`with_control_folder`). A loss mask (masked training) is found the same ways:
the sidecar `x.mask.png` (never an image of its own, with or without masks), a metadata row's `mask_file_name`, or a
mask folder (`with_mask_folder`). An edit sample's reference images (`references`) are the sidecars `x.ref.png`, or
`x.ref0.png`, `x.ref1.png`, ... in their numbers' order (never images of their own, with or without references), a
metadata row's `reference_file_name` (a path or a list of paths), or a reference folder (`with_reference_folder`).
Only regular files are opened, and metadata cannot name a path outside DATA (`confined`). An entry's stamp (size and
mtime of its files) lets an incremental run skip an unchanged input without reading it.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from precompute.clips import cached_unchanged, prepare_clips
from precompute.images import ImagePolicy, Record, prepare
from precompute.paths import OutsideRoot, confined, os_reason, read_regular, stat_regular
from precompute.video import VIDEO_SUFFIXES

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# Videos are inputs too: clips in a video model's cache, a named failure (video_input) in an image model's. An animated
# GIF or WebP is an image of an image model and a video of a video model.
VIDEO_EXTENSIONS = tuple(s for s in VIDEO_SUFFIXES if s not in IMAGE_EXTENSIONS)
INPUT_EXTENSIONS = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
CAPTION_EXTENSIONS = (".txt", ".caption")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")  # the first one present is the dataset
CAPTION_COLUMN = "text"  # the imagefolder convention's caption column
CONTROL_COLUMN = "control_file_name"  # a metadata file's column of control images, relative to the folder
CONTROL_SUFFIX = ".control"  # x.control.png is the control image of x.jpg, never an image of its own
MASK_COLUMN = "mask_file_name"  # a metadata file's column of loss masks, relative to the folder
MASK_SUFFIX = ".mask"  # x.mask.png is the loss mask of x.jpg, never an image of its own
REFERENCE_COLUMN = "reference_file_name"  # a metadata file's column of reference images (a path or a list of them)
# x.ref.png, x.ref0.png, x.ref1.png ... are the reference images of x.jpg (x.ref is number 0), never images of their own
REFERENCE_SUFFIX = re.compile(r"\.ref(\d*)", re.IGNORECASE)
# a reference folder's numbered names: DIR/a/x_0.png, x_1.png ... (or x_0000.png) for the image a/x.jpg
FOLDER_NUMBER = re.compile(r"(.+)_(\d+)")


def is_control_file(name: str) -> bool:
    """Whether a file name is a control image's sidecar (`x.control.png`), which is never listed as an image."""
    stem, ext = os.path.splitext(name)
    return ext.lower() in IMAGE_EXTENSIONS and os.path.splitext(stem)[1].lower() == CONTROL_SUFFIX


def is_mask_file(name: str) -> bool:
    """Whether a file name is a loss mask's sidecar (`x.mask.png`), which is never listed as an image."""
    stem, ext = os.path.splitext(name)
    return ext.lower() in IMAGE_EXTENSIONS and os.path.splitext(stem)[1].lower() == MASK_SUFFIX


def reference_number(name: str) -> int | None:
    """The number of a reference image's sidecar (`x.ref.png` is 0, `x.ref3.png` 3); None for any other file."""
    stem, ext = os.path.splitext(name)
    if ext.lower() not in IMAGE_EXTENSIONS:
        return None
    match = REFERENCE_SUFFIX.fullmatch(os.path.splitext(stem)[1])
    return int(match[1] or 0) if match else None


def is_reference_file(name: str) -> bool:
    """Whether a file name is a reference image's sidecar (`x.ref.png`, `x.ref0.png`...), never listed as an image."""
    return reference_number(name) is not None


def in_order(numbered: list[tuple[int, str]], what: str) -> tuple[list[str] | None, str, str]:
    """Numbered reference files as the list of them in their numbers' order, or (None, reason, detail) when they do
    not make one: two files of one number (`x.ref.png` and `x.ref0.png`, or `x.ref1.png` and `x.ref1.jpg`) are
    `ambiguous_reference`, a number missing between them `missing_reference`. Numbers run from 0 or from 1.
    `what`: how the detail names a reference of number N (a format string with {n})."""
    by_number: dict[int, list[str]] = {}
    for n, name in numbered:
        by_number.setdefault(n, []).append(name)
    for n, names in sorted(by_number.items()):
        if len(names) > 1:
            return None, "ambiguous_reference", (f"{' and '.join(sorted(names))} are both reference {n} "
                                                 f"({what.format(n=n)}): keep one")
    first = min(by_number, default=0)
    for n in range(min(first, 1), max(by_number, default=-1) + 1):
        if n not in by_number:
            found = ", ".join(by_number[k][0] for k in sorted(by_number))
            return None, "missing_reference", f"no {what.format(n=n)}: numbered references run from 0 (or 1) without gaps, and {found} were found"
    return [by_number[n][0] for n in sorted(by_number)], "", ""


def pick_control(candidates: list[str], image: str) -> str:
    """The control image among several of one stem: the one with the image's extension, else the first in
    `IMAGE_EXTENSIONS` order (then by name)."""
    ext = os.path.splitext(image)[1].lower()
    rank = {e: i for i, e in enumerate(IMAGE_EXTENSIONS)}
    return min(candidates, key=lambda c: (os.path.splitext(c)[1].lower() != ext, rank[os.path.splitext(c)[1].lower()], c))


@dataclass(frozen=True)
class FolderEntry:
    """A folder sample before reading: paths only, so listing a million files stays cheap."""

    source: str  # relative to the dataset root
    image: str
    caption_files: tuple[str, ...] = ()
    captions: tuple[str, ...] | None = None  # from a metadata file
    control: str | None = None  # the control image's path, when control images are looked for and one was found
    control_looked: str = ""  # where it was looked for (the failure's detail when none was found)
    mask: str | None = None  # the loss mask's path, when masks are looked for and one was found
    mask_looked: str = ""  # where it was looked for (the failure's detail when none was found)
    references: tuple[str, ...] | None = None  # the reference images' paths in order, when looked for and found
    references_missing: str = "missing_reference"  # why `references` is None (missing_reference, ambiguous_reference)
    references_looked: str = ""  # where they were looked for, or what is amiss with those found (the failure's detail)


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


class _BadRow(ValueError):
    """A metadata row that is not a sample; `source` is its file_name when it names one."""

    def __init__(self, reason: str, detail: str, source: str | None = None):
        super().__init__(detail)
        self.reason, self.source = reason, source


def _failure(source: str, reason: str, detail: str) -> dict:
    return {"source": source, "reason": reason, "detail": detail}


def _read_utf8(path: Path) -> str:
    """A metadata file's text without a leading byte order mark.

    Raises:
        ValueError: the file is not UTF-8; the message names the file and line.
    """
    data = read_regular(path)
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
        except (ValueError, RecursionError) as e:  # an integer of too many digits, arrays nested too deep
            yield n, _BadRow("bad_metadata_row", f"not readable JSON ({str(e) or type(e).__name__})")
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


def metadata_captions(value: object, from_csv: bool) -> tuple[str, ...] | None:
    """A metadata caption cell as captions: a string or a list of strings (None items and cells are no
    caption); in a CSV, a cell holding a JSON list is that list. Any other type is None: not stringified."""
    if value is None:
        return ()
    if from_csv and isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON after all (or too deep to be a list of captions): the text
            pass
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) or v is None for v in value):
        return tuple(v for v in value if v is not None)
    return None


def _metadata_path(root: Path, name: str, inside: dict[str, bool], column: str = "file_name") -> str:
    """`confined`, refusing with the failure of a metadata row."""
    try:
        return confined(root, name, column, inside)
    except OutsideRoot as e:
        raise _BadRow("outside_root", str(e), name) from None
    except ValueError as e:
        raise _BadRow("bad_metadata_row", str(e), name) from None  # a name no file has: no cached sample's


def _metadata_entry(root: Path, row: dict, caption_column: str, from_csv: bool, inside: dict[str, bool],
                    control_column: str | None, listed: dict | None = None, mask_column: str | None = None,
                    reference_column: str | None = None) -> FolderEntry:
    """A metadata row as an entry; a row that is not a sample raises _BadRow. With `control_column`, its control
    image is the file that column names, or else the sidecar beside the image (`x.control.png`); with `mask_column`,
    its loss mask likewise (`x.mask.png`); with `reference_column`, its reference images are the file or files that
    column names, or else the sidecars beside the image (`x.ref.png`, `x.ref0.png`, ...)."""
    name = row.get("file_name")
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        theirs = [k for k in ("video_path", "image_path") if k in row and "file_name" not in row]
        hint = (f" (this row has {theirs[0]}, as musubi-tuner's metadata files do: here each row names its file in "
                f"file_name, relative to the metadata file's folder)" if theirs else "")
        raise _BadRow("bad_metadata_row", f"file_name {name!r} is not a non-empty string{hint}")
    if is_mask_file(name):
        raise _BadRow("bad_metadata_row", f"file_name {name!r} names a loss mask (x.mask.png), which is never a training "
                      f"image; name the image it belongs to (its mask goes in {MASK_COLUMN} or beside it)", name)
    if is_reference_file(name):
        raise _BadRow("bad_metadata_row", f"file_name {name!r} names a reference image (x.ref.png, x.ref0.png...), which "
                      f"is never a training image; name the target image it belongs to (its references go in "
                      f"{REFERENCE_COLUMN} or beside it)", name)
    path = _metadata_path(root, name, inside)
    captions = metadata_captions(row.get(caption_column), from_csv)
    if captions is None:
        raise _BadRow("caption_not_string", f"{caption_column} is {row.get(caption_column)!r}, "
                      "not a string or a list of strings", name)
    listed = {} if listed is None else listed
    entry = FolderEntry(name, path, captions=captions)
    if control_column is not None:
        control, looked = _metadata_pair(root, row, name, path, control_column, CONTROL_SUFFIX, inside, listed)
        entry = replace(entry, control=control, control_looked=looked)
    if mask_column is not None:
        mask, looked = _metadata_pair(root, row, name, path, mask_column, MASK_SUFFIX, inside, listed)
        entry = replace(entry, mask=mask, mask_looked=looked)
    if reference_column is not None:
        entry = _metadata_references(root, row, entry, reference_column, from_csv, inside, listed)
    return entry


def _metadata_references(root: Path, row: dict, entry: FolderEntry, column: str, from_csv: bool, inside: dict[str, bool],
                         listed: dict) -> FolderEntry:
    """The entry with the reference images of its metadata row: the path or list of paths `column` holds (in a CSV, a
    cell holding a JSON list is that list), or else the sidecars beside the image."""
    value, name = row.get(column), entry.source
    if from_csv and isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise _BadRow("bad_metadata_row", f"{column} {value!r} is not a path or a JSON list of paths", name) from None
    paths = [value] if isinstance(value, str) else value
    if value is not None and not (isinstance(paths, list) and all(isinstance(v, str) and "\x00" not in v for v in paths)):
        raise _BadRow("bad_metadata_row", f"{column} {value!r} is not a path or a list of paths", name)
    paths = [v for v in paths or () if v.strip()]
    if paths:
        try:
            found = tuple(_metadata_path(root, v, inside, column) for v in paths)
        except _BadRow as e:  # the row's input is its image
            raise _BadRow(e.reason, str(e), name) from None
        return replace(entry, references=found, references_looked=f"{column} {value!r}")
    return _sidecar_references(entry, listed, f"no {column} and ")


def _sidecar_references(entry: FolderEntry, listed: dict, also: str = "") -> FolderEntry:
    """The entry with its reference sidecars (`x.ref.png`, or `x.ref0.png`, `x.ref1.png`, ...) from the listing of its
    folder, in their numbers' order; none or a set that is no sequence leaves `references` None with the reason.
    `listed` caches each folder's sidecars by lower-cased image stem under `(folder, "references")`, built once from
    its listing (`_names`), so a folder of a million rows is not scanned per row."""
    folder, base = os.path.split(os.path.splitext(entry.image)[0])
    if (folder, "references") not in listed:
        index: dict[str, list[tuple[int, str]]] = {}
        for key, name in _names(folder, listed).items():
            if (n := reference_number(name)) is not None:
                index.setdefault(os.path.splitext(os.path.splitext(key)[0])[0], []).append((n, os.path.join(folder, name)))
        listed[(folder, "references")] = index
    numbered = listed[(folder, "references")].get(base.lower(), [])
    return _with_numbered(entry, numbered, f"{also}no {base}.ref.<image extension> (or {base}.ref0.<image extension>, "
                                          f"{base}.ref1..., numbered) beside the image", base + ".ref{n}.<image extension>")


def _with_numbered(entry: FolderEntry, numbered: list[tuple[int, str]], none: str, what: str) -> FolderEntry:
    """The entry with the numbered reference files found for it in order (`in_order`), or with why not."""
    if not numbered:
        return replace(entry, references=None, references_looked=none)
    found, reason, detail = in_order(numbered, what)
    if found is None:
        return replace(entry, references=None, references_missing=reason, references_looked=detail)
    return replace(entry, references=tuple(found), references_looked="")


def _metadata_pair(root: Path, row: dict, name: str, path: str, column: str, suffix: str, inside: dict[str, bool],
                   listed: dict) -> tuple[str | None, str]:
    """(path, where it was looked for) of the file paired with a metadata row's image (its control image or loss
    mask): the one `column` names, or else the sidecar `x{suffix}.EXT` beside the image; None when neither is there."""
    value = row.get(column)
    if value is not None and (not isinstance(value, str) or "\x00" in value):
        raise _BadRow("bad_metadata_row", f"{column} {value!r} is not a path", name)
    if value and value.strip():
        try:
            return _metadata_path(root, value, inside, column), f"{column} {value!r}"
        except _BadRow as e:  # the row's input is its image
            raise _BadRow(e.reason, str(e), name) from None
    stem = os.path.splitext(path)[0] + suffix
    found = _sidecars(stem, listed)
    return (pick_control(found, path) if found else None,
            f"no {column} and no {Path(stem).name}.<image extension> beside the image")


def _sidecars(stem: str, listed: dict[str, dict[str, str]]) -> list[str]:
    """Paths of `stem` + any image extension (in any case, as the folder walk matches them), from one listing per
    directory (`listed`: directory -> lower-cased name -> name, filled on first use) instead of a stat per extension."""
    folder, base = os.path.split(stem)
    names = _names(folder, listed)
    return [os.path.join(folder, names[key]) for ext in IMAGE_EXTENSIONS if (key := (base + ext).lower()) in names]


def _names(folder: str, listed: dict) -> dict[str, str]:
    """A directory's lower-cased file names -> names, listed once (`listed` caches them)."""
    if folder not in listed:
        try:
            listed[folder] = {n.lower(): n for n in os.listdir(folder or ".")}
        except OSError:  # a missing or unreadable folder holds no sidecar; the image's own read reports it
            listed[folder] = {}
    return listed[folder]


def _list_metadata(root: Path, path: Path, caption_column: str, control_column: str | None,
                   mask_column: str | None = None, reference_column: str | None = None) -> Listing:
    text, from_csv = _read_utf8(path), path.suffix == ".csv"
    entries, failures, complete, inside, listed = [], [], True, {}, {}
    for n, row in _csv_rows(text, path) if from_csv else _jsonl_rows(text):
        try:
            if isinstance(row, _BadRow):
                raise row
            entries.append(_metadata_entry(root, row, caption_column, from_csv, inside, control_column, listed, mask_column,
                                           reference_column))
        except _BadRow as e:
            # a row naming no file may be a cached sample's: the listing cannot say it is gone
            complete = complete and e.source is not None
            failures.append(_failure(e.source or f"{path.name}:{n}", e.reason, f"{path.name} line {n}: {e}"))
    return Listing(sorted(entries, key=lambda e: e.source), failures, complete)


def _walk_folder(root: Path, control: bool, mask: bool = False, references: bool = False) -> Listing:
    entries, failures = [], []

    def unlisted(e: OSError) -> None:
        source = Path(os.path.relpath(e.filename, root)).as_posix() if e.filename else "."
        failures.append(_failure(source, "unlisted_directory", f"{type(e).__name__}: {e}"))

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlisted):
        dirnames.sort()
        names = set(filenames)
        controls: dict[str, list[str]] = {}  # image stem -> its control sidecars
        masks: dict[str, list[str]] = {}  # image stem -> its mask sidecars
        refs: dict[str, list[tuple[int, str]]] = {}  # image stem -> its reference sidecars with their numbers
        for name in filenames:
            if is_control_file(name):
                controls.setdefault(os.path.splitext(os.path.splitext(name)[0])[0], []).append(name)
            elif is_mask_file(name):
                masks.setdefault(os.path.splitext(os.path.splitext(name)[0])[0], []).append(name)
            elif (n := reference_number(name)) is not None:
                refs.setdefault(os.path.splitext(os.path.splitext(name)[0])[0], []).append((n, str(Path(dirpath) / name)))
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext.lower() not in INPUT_EXTENSIONS or is_control_file(name) or is_mask_file(name) or is_reference_file(name):
                continue
            path = Path(dirpath) / name
            source = path.relative_to(root).as_posix()
            try:
                stat_regular(path)  # follows symlinks: a loop or a dangling one fails here
            except OSError as e:
                failures.append(_failure(source, os_reason(e), f"{type(e).__name__}: {e}"))
                continue
            sidecars = tuple(str(Path(dirpath) / (stem + c)) for c in CAPTION_EXTENSIONS if stem + c in names)
            entry = FolderEntry(source, str(path), sidecars)
            if control:
                found = pick_control(controls[stem], name) if stem in controls else None
                entry = replace(entry, control=str(Path(dirpath) / found) if found else None,
                                control_looked=f"no {stem}{CONTROL_SUFFIX}.<image extension> beside the image")
            if mask:
                found = pick_control(masks[stem], name) if stem in masks else None
                entry = replace(entry, mask=str(Path(dirpath) / found) if found else None,
                                mask_looked=f"no {stem}{MASK_SUFFIX}.<image extension> beside the image")
            if references:
                none = f"no {stem}.ref.<image extension> (or {stem}.ref0.<image extension>, {stem}.ref1..., numbered) beside the image"
                entry = _with_numbered(entry, refs.get(stem, []), none, stem + ".ref{n}.<image extension>")
            entries.append(entry)
    complete = not any(f["reason"] == "unlisted_directory" for f in failures)
    return Listing(sorted(entries, key=lambda e: e.source), failures, complete)


def list_folder(root: str | os.PathLike, caption_column: str = CAPTION_COLUMN, control: bool = False,
                control_column: str = CONTROL_COLUMN, mask: bool = False, mask_column: str = MASK_COLUMN,
                references: bool = False, reference_column: str = REFERENCE_COLUMN) -> Listing:
    """Every image under `root` with its captions (and control image), and what could not be listed.

    With `metadata.jsonl` or `metadata.csv` at the root (columns `file_name` and `caption_column`),
    those rows are the dataset; otherwise each image's captions are the sidecar files beside it
    with the same stem (`x.jpg` + `x.txt` and/or `x.caption`), and files named `x.control.EXT` are never images.
    With `control`, each entry's control image is the row's `control_column` (a path relative to root, checked
    as `file_name` is) or else the sidecar `x.control.EXT` beside the image (with several, the one of the image's
    extension); an entry without one has `control` None. With `mask`, each entry's loss mask likewise: the row's
    `mask_column` or else the sidecar `x.mask.EXT` (files named so are never images either). With `references`, each
    entry's reference images: the row's `reference_column` (a path or a list of paths) or else the sidecars `x.ref.EXT`,
    or `x.ref0.EXT`, `x.ref1.EXT`, ... in their numbers' order, from 0 or 1 without gaps (`x.ref.EXT` is number 0; two
    files of one number are `ambiguous_reference`); files named so are never images, with or without `references`.
    Symlinks to files are followed, symlinks to directories are not; nothing is opened but the metadata file.

    Returns:
        A Listing. Bad rows and unreadable or special files are failures; the listing goes on.

    Raises:
        ValueError: the metadata file is not UTF-8, or a CSV has no `file_name` column.
        OSError: the metadata file cannot be read.
    """
    root = Path(root)
    for name in METADATA_FILES:
        if os.path.lexists(root / name):
            return _list_metadata(root, root / name, caption_column, control_column if control else None,
                                  mask_column if mask else None, reference_column if references else None)
    return _walk_folder(root, control, mask, references)


def with_control_folder(entries: list[FolderEntry], folder: str | os.PathLike) -> list[FolderEntry]:
    """The entries with their control images in `folder`, under the same relative names as the images, with any
    image extension (kohya's conditioning_data_dir): `folder/a/x.png` for the image `a/x.jpg`. Sidecars are not
    looked at. The folder is listed once (names only); symlinks to files are followed, to directories not. A control
    folder inside the images' folder is not a folder of images: its files are dropped from the entries.

    Raises:
        FileNotFoundError: `folder` is not a directory.
    """
    return [replace(e, control=found, control_looked=looked) for e, found, looked in _paired_in_folder(entries, folder)]


def with_mask_folder(entries: list[FolderEntry], folder: str | os.PathLike) -> list[FolderEntry]:
    """The entries with their loss masks in `folder`, under the same relative names as the images, with any image
    extension (`folder/a/x.png` for the image `a/x.jpg`), as `with_control_folder` pairs control images.

    Raises:
        FileNotFoundError: `folder` is not a directory.
    """
    return [replace(e, mask=found, mask_looked=looked) for e, found, looked in _paired_in_folder(entries, folder)]


def with_reference_folder(entries: list[FolderEntry], folders: tuple[str | os.PathLike, ...]) -> list[FolderEntry]:
    """The entries with their reference images in a reference folder, under the same relative names as the images
    with any image extension, as `with_control_folder` pairs control images (musubi-tuner's control_directory): with
    one folder, `DIR/a/x.png` is the one reference of the image `a/x.jpg`, or when there is no such file
    `DIR/a/x_0.png`, `DIR/a/x_1.png`, ... (from 0 or 1, any zero-padding) are its references in order; with several
    folders (ai-toolkit's control_path_1, _2, ...), reference i is `a/x.EXT` in the i-th. Sidecars are not looked at;
    a folder inside the images' folder is not a folder of images (its files are dropped from the entries). Two files
    for one reference (`x.png` and `x.jpg`) are `ambiguous_reference`.

    Raises:
        FileNotFoundError: a folder is not a directory.
    """
    listed = [_images_by_stem(folder) for folder in folders]
    within = [os.path.abspath(folder) + os.sep for folder in folders]
    numbered_in: dict[str, list[tuple[int, str]]] = {}  # relative stem x -> (N, path) of the one folder's x_N.EXT files
    for key, paths in listed[0].items() if len(folders) == 1 else ():
        if match := FOLDER_NUMBER.fullmatch(key):
            numbered_in.setdefault(match[1], []).extend((int(match[2]), path) for path in paths)
    out = []
    for e in entries:
        if any(os.path.abspath(e.image).startswith(w) for w in within):  # a reference folder inside the source's
            continue
        stem = os.path.splitext(PurePosixPath(e.source).as_posix())[0]
        if len(folders) > 1:  # reference i in folder i, by the image's name
            numbered = [(i, path) for i, found in enumerate(listed) for path in found.get(stem, [])]
            missing = [i for i, found in enumerate(listed) if stem not in found]
            if missing:
                looked = f"no {stem}.<image extension> in {folders[missing[0]]} (reference {missing[0] + 1} of {len(folders)})"
                out.append(replace(e, references=None, references_looked=looked))
                continue
            out.append(_with_numbered(e, numbered, "", f"{stem}.<image extension> in reference folder {{n}} (from 0)"))
            continue
        found, folder = listed[0], folders[0]
        exact = found.get(stem, [])
        if exact:
            out.append(_with_numbered(e, [(0, path) for path in exact], "", f"{stem}.<image extension> in {folder}"))
            continue
        none = f"no {stem}.<image extension> (or {stem}_0.<image extension>, {stem}_1..., numbered) in {folder}"
        out.append(_with_numbered(e, numbered_in.get(stem, []), none, f"{stem}_{{n}}.<image extension> in {folder}"))
    return out


def _images_by_stem(folder: str | os.PathLike) -> dict[str, list[str]]:
    """relative stem -> paths of the image files under `folder` (walked once, names only)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    found: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext.lower() in IMAGE_EXTENSIONS:
                found.setdefault((Path(dirpath) / stem).relative_to(folder).as_posix(), []).append(str(Path(dirpath) / name))
    return found


def _paired_in_folder(entries: list[FolderEntry], folder: str | os.PathLike) -> list[tuple[FolderEntry, str | None, str]]:
    """(entry, its file in `folder` or None, where it was looked for) of every entry not inside `folder`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    found: dict[str, list[str]] = {}  # relative stem -> paired files
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in filenames:
            stem, ext = os.path.splitext(name)
            if ext.lower() in IMAGE_EXTENSIONS:
                found.setdefault((Path(dirpath) / stem).relative_to(folder).as_posix(), []).append(str(Path(dirpath) / name))
    out = []
    within = os.path.abspath(folder) + os.sep
    for e in entries:
        if os.path.abspath(e.image).startswith(within):  # the folder inside the source's: its files are not images
            continue
        stem = os.path.splitext(PurePosixPath(e.source).as_posix())[0]
        candidates = found.get(stem)
        out.append((e, pick_control(candidates, e.image) if candidates else None, f"no {stem}.<image extension> in {folder}"))
    return out


def stamp_or_zero(entry: FolderEntry) -> int:
    """`entry_stamp`, or 0 when the files cannot be stat'ed (never a stamp an entry has)."""
    try:
        return entry_stamp(entry)
    except OSError:
        return 0


def entry_stamp(entry: FolderEntry) -> int:
    """What an incremental run compares instead of reading an entry's files.

    A 63-bit blake2b digest of (size, mtime_ns) of the image and of each sidecar caption file, and of the
    metadata captions, and of the control image, the loss mask and each reference image (each: its path relative to
    the image's folder, size and mtime; one that cannot be stat'ed stamps as absent, and reading the entry says why),
    so editing any of them makes the entry changed; `os.stat` only, nothing is opened. Never 0, which stands for
    "unknown".

    Raises:
        OSError: the image or a caption file cannot be stat'ed, or is not a regular file (SpecialFileError).
    """
    h = hashlib.blake2b(digest_size=8)
    for path in (entry.image, *entry.caption_files):
        st = stat_regular(path)
        h.update(f"{os.path.splitext(path)[1]}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for c in entry.captions or ():
        text = c.encode("utf-8", "surrogatepass")
        h.update(len(text).to_bytes(8, "big") + text)
    companions = [("control", entry.control), ("mask", entry.mask)]
    companions += [(f"reference{i}", path) for i, path in enumerate(entry.references or ())]
    for kind, path in companions:
        if path is None:
            continue
        try:
            st = stat_regular(path)
            known = f"{st.st_size}\0{st.st_mtime_ns}"
        except OSError:
            known = "absent"
        where = os.path.relpath(path, os.path.dirname(entry.image))
        h.update(f"\0{kind}\0{where}\0{known}\0".encode("utf-8", "surrogateescape"))
    return int.from_bytes(h.digest(), "big") >> 1 or 1


def is_video_name(path: str) -> bool:
    """Whether a file's name says it is a video (an animated GIF or WebP is told by its content instead)."""
    return os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS


def read_folder_entry(entry: FolderEntry) -> Record:
    """An entry's image bytes, raw captions, control image, loss mask and reference images; a file that cannot be read
    makes a Record with its reason (a control image: `missing_control` or `unreadable_control`, a mask `missing_mask` or
    `unreadable_mask`, a reference `missing_reference` or `unreadable_reference`, left for `prepare` to report). A file
    named as a video is not read but named (`Record.path`), for `prepare_clips` to read where it lies."""
    by_path = False
    try:
        if is_video_name(entry.image) and stat_regular(entry.image).st_size:
            image, by_path = None, True
        else:
            image = read_regular(entry.image)
        captions = list(entry.captions) if entry.captions is not None else [read_regular(p) for p in entry.caption_files]
    except OSError as e:
        return Record(entry.source, None, missing=os_reason(e), detail=f"{type(e).__name__}: {e}")
    record = Record(entry.source, image, captions, control_detail=entry.control_looked, mask_detail=entry.mask_looked,
                    video=is_video_name(entry.image), path=entry.image if by_path else None)
    for kind, path in (("control", entry.control), ("mask", entry.mask)):  # its control image, its loss mask
        if path is not None:
            try:
                setattr(record, kind, read_regular(path))
            except OSError as e:  # kept as the reason the sample is skipped (missing_mask, unreadable_control, ...)
                setattr(record, f"{kind}_missing", f"{'missing' if isinstance(e, FileNotFoundError) else 'unreadable'}_{kind}")
                setattr(record, f"{kind}_detail", f"{type(e).__name__}: {e}")
    record.references_missing, record.references_detail = entry.references_missing, entry.references_looked
    if entry.references is not None:
        record.reference_names = [os.path.relpath(p, os.path.dirname(entry.image)) for p in entry.references]
        try:
            record.references = [read_regular(p) for p in entry.references]
        except OSError as e:
            record.references_missing = f"{'missing' if isinstance(e, FileNotFoundError) else 'unreadable'}_reference"
            record.references_detail = f"{type(e).__name__}: {e}"
    return record


class FolderDataset(torch.utils.data.Dataset):
    """Map-style dataset over folder entries; each item is `prepare`'s output with the entry's `stamp` (in a video
    model's cache, `items(i)` gives each of an entry's clips, `precompute.clips`).

    Args:
        entries: the entries to read.
        policy: how images become pixels.
        skip_keys: keys already cached: a sample with one of them is "unchanged" after reading.
        known: source -> (key, stamp) of the cached samples. An entry whose stamp is its known stamp is
            "unchanged" without being read: `{"status": "unchanged", "source", "key": known key, "stamp"}`. In a
            video model's cache, source -> its cached clips ((key, stamp), ...), unchanged as `cached_unchanged` says.
    """

    def __init__(self, entries: list[FolderEntry], policy: ImagePolicy, skip_keys: frozenset[str],
                 known: dict[str, tuple[str, int]] | None = None):
        self.entries, self.policy, self.skip_keys = entries, policy, skip_keys
        self.known = known if known is not None else {}
        # a stamp table searched in place (`shards.sample_index.StampTable`): every entry looked up at once, here,
        # before the loader's workers fork; its position in the table, -1 for an input not cached (an array, no object
        # per entry). An unchanged input's item then names its cached sample's global index (`index`).
        self.positions = None
        if hasattr(self.known, "find_all") and policy.clip is None:
            self.positions = np.empty(len(entries), dtype=np.int32 if len(self.known.index) < 2**31 else np.int64)
            for a in range(0, len(entries), 1 << 16):
                self.positions[a : a + (1 << 16)] = self.known.find_all([e.source for e in entries[a : a + (1 << 16)]])

    def __len__(self) -> int:
        return len(self.entries)

    def block(self, indices: list[int]) -> Iterator[dict]:
        """The items of entries `indices`, those unchanged by their stamps (`positions`) as one item: `{"status":
        "unchanged", "index": (n,) int64 global indices of their cached samples, "inputs": n}`, after the others'.
        Without a stamp table searched in place (a dict, a video model's clips), each entry's own items."""
        if self.positions is None:
            for i in indices:
                yield from self.items(i)
            return
        indices = np.asarray(indices, dtype=np.int64)
        positions = self.positions[indices].astype(np.int64)
        cached = np.flatnonzero(positions >= 0)
        entries = self.entries
        stamps = np.fromiter((stamp_or_zero(entries[i]) for i in indices[cached].tolist()), dtype=np.int64, count=len(cached))
        same = np.zeros(len(indices), dtype=bool)  # a stamp of 0 (stat failed: its own item says why) is never a cached one
        same[cached] = (stamps != 0) & (self.known.stamps_at(positions[cached]) == stamps)
        for i in indices[~same].tolist():
            yield from self.items(i)
        if same.any():
            yield {"status": "unchanged", "index": self.known.index.global_index(positions[same]), "inputs": int(same.sum())}

    def __getitem__(self, i: int) -> dict:
        """Entry i's item (its first clip's, in a video model's cache: `items` gives them all)."""
        return next(self.items(i))

    def items(self, i: int) -> Iterator[dict]:
        """Entry i's items: one per sample it is (an image; each clip of a video), or its failure."""
        entry = self.entries[i]
        try:
            stamp = entry_stamp(entry)
        except OSError as e:
            yield {"status": "failed", "source": entry.source, "reason": os_reason(e),
                   "detail": f"{type(e).__name__}: {e}", "stamp": 0}
            return
        if self.positions is not None:
            p = int(self.positions[i])
            if p >= 0:
                key, known_stamp, index = self.known.entry(p)
                if known_stamp == stamp:
                    yield {"status": "unchanged", "source": entry.source, "key": key, "stamp": stamp, "index": index}
                    return
            yield {**prepare(read_folder_entry(entry), self.policy, self.skip_keys), "stamp": stamp}
            return
        known = self.known.get(entry.source)
        if self.policy.clip is not None:
            yield from cached_unchanged(entry.source, stamp, known) or prepare_clips(
                read_folder_entry(entry), self.policy, self.skip_keys, stamp, known)
            return
        if known is not None and known[1] == stamp:  # a known stamp of 0 never matches
            yield {"status": "unchanged", "source": entry.source, "key": known[0], "stamp": stamp}
            return
        yield {**prepare(read_folder_entry(entry), self.policy, self.skip_keys), "stamp": stamp}
