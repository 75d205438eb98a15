"""A Hugging Face dataset on disk as inputs: a `save_to_disk` directory (one dataset, or a DatasetDict and a
split of it) or parquet files (one file, a glob, or a folder of them as the Hub stores a dataset), with an image
column and a caption column, and for ControlNet caches a control image column (`control_image`, in the image
column's forms).

Read with pyarrow, one parquet row group or Arrow record batch at a time, rather than through `datasets`:
`load_dataset("parquet", ...)` first copies every image into its Arrow cache (a second copy of the dataset on
disk), and its streaming mode does not say which file and row a sample came from, which the incremental stamps
need. pyarrow reads both formats `datasets` writes, memory-mapping Arrow files.

A row's input name is `FILE:ROW` (FILE relative to the dataset's folder) and its stamp digests the file's size
and mtime with the row number (and those of image files the row names by path): a re-run skips a file's unchanged rows without reading them, and rows of a
rewritten file are read again (their content keys still find what is cached).
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from precompute.folders import METADATA_FILES, metadata_captions
from precompute.paths import OutsideRoot, confined, names_under, os_reason, read_regular
from precompute.images import ImagePolicy, Record, prepare

SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")  # as Hub file names spell them
CONTROL_COLUMN = "control_image"  # the control image column of a ControlNet dataset (diffusers' training scripts' name)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError("reading a Hugging Face dataset needs pyarrow: pip install 'cachedit[hf]' "
                          "(or pip install pyarrow)") from e
    return pyarrow


def _parquet_files(root: Path, depth: int = 3) -> list[Path]:
    """Parquet files up to `depth` folders below root (a Hub snapshot keeps them in `data/` or `CONFIG/SPLIT/`),
    sorted; directories are scanned one level at a time, so an image folder costs one listing per level."""
    found, level = [], [root]
    for _ in range(depth):
        below = []
        for folder in level:
            try:
                with os.scandir(folder) as it:
                    for e in it:
                        if e.name.startswith("."):
                            continue
                        if e.is_dir(follow_symlinks=False):
                            below.append(Path(e.path))
                        elif e.name.endswith(".parquet"):
                            found.append(Path(e.path))
            except OSError:
                continue
        if found:
            return sorted(found)
        level = below
    return []


def is_hf_dataset(data: str) -> bool:
    """Whether DATA names a Hugging Face dataset on disk: a `save_to_disk` folder, a .parquet file or glob, or a
    folder holding parquet files and no metadata file of an image folder."""
    if "://" in data:
        return False
    path = Path(data)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()):
            return True
        if any((path / name).exists() for name in METADATA_FILES):
            return False
        return bool(_parquet_files(path))
    return data.endswith(".parquet")


@dataclass(frozen=True)
class Part:
    """A unit of reading: rows [start, start + rows) of one file, one parquet row group or Arrow record batch."""

    file: int  # index into HFListing.files
    index: int  # the row group's or record batch's number in its file
    start: int  # the part's first row in the file
    rows: int


@dataclass
class HFListing:
    """What `list_hf` found: the files of the split, their parts, and the columns to read."""

    root: Path  # the folder input names and relative image paths are relative to
    files: list[tuple[str, str, str]]  # (name relative to root, path, "arrow" | "parquet")
    parts: list[Part]
    image_column: str
    caption_column: str
    control_column: str | None = None  # read only for ControlNet caches
    unreadable: dict[int, str] = field(default_factory=dict)  # file -> why its header or footer could not be read

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def names(self, part: Part) -> list[str]:
        """The input names of a part's rows: `FILE:ROW`."""
        name = self.files[part.file][0]
        return [f"{name}:{row}" for row in range(part.start, part.start + part.rows)]


def _saved_split(path: Path, split: str) -> Path:
    """The folder of one dataset inside a `save_to_disk` folder: itself, or the split of a DatasetDict."""
    if not (path / "dataset_dict.json").is_file():
        return path
    splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
    if split not in splits:
        raise ValueError(f"{path} is a DatasetDict without a split {split!r}; its splits are {', '.join(splits) or 'none'}: "
                         f"set split = \"...\" in the dataset file")
    return path / split


def _split_of(name: str) -> str | None:
    """The split a Hub parquet file belongs to by its name (`train-00000-of-00002.parquet`, `data/test/0.parquet`),
    or None."""
    parts = PurePosixPath(name).parts
    for split in SPLIT_NAMES:
        if split in parts[:-1] or re.match(rf"{split}([-_.0-9]|$)", parts[-1]):
            return split
    return None


def _data_files(data: str, split: str) -> tuple[Path, list[tuple[str, str, str]]]:
    """(root, files) of DATA's split."""
    path = Path(data)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        folder = _saved_split(path, split)
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        names = [f["filename"] for f in state.get("_data_files", [])]
        if not names:
            raise ValueError(f"{folder}/state.json lists no data files; save the dataset again with save_to_disk")
        return path, [(str((folder / n).relative_to(path)), str(folder / n), "arrow") for n in names]
    if path.is_dir():
        root, found = path, _parquet_files(path)
    elif any(c in data for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(data, recursive=True) if p.endswith(".parquet"))
        root = Path(os.path.commonpath([str(p.parent) for p in found])) if found else path.parent
    else:
        root, found = path.parent, [path] if path.is_file() else []
    if not found:
        raise FileNotFoundError(f"{data}: no parquet file found")
    names = [p.relative_to(root).as_posix() for p in found]
    splits = {n: _split_of(n) for n in names}
    if any(s is not None for s in splits.values()):
        names = [n for n in names if splits[n] == split]
        if not names:
            have = sorted({s for s in splits.values() if s})
            raise ValueError(f"{data}: no parquet file of split {split!r}; its files are of the splits {', '.join(have)}: "
                             f"set split = \"...\" in the dataset file")
    return root, [(n, str(root / n), "parquet") for n in names]


def _schema_and_parts(path: str, kind: str, file: int) -> tuple[object, list[Part]]:
    pa = _pyarrow()
    parts, start = [], 0
    if kind == "parquet":
        meta = pa.parquet.ParquetFile(path).metadata
        for i in range(meta.num_row_groups):
            rows = meta.row_group(i).num_rows
            parts.append(Part(file, i, start, rows))
            start += rows
        return pa.parquet.read_schema(path), parts
    with pa.memory_map(path) as source:  # the batches' headers; their data stays on disk
        reader = pa.ipc.open_stream(source)
        for i, batch in enumerate(reader):
            parts.append(Part(file, i, start, batch.num_rows))
            start += batch.num_rows
        return reader.schema, parts


def _check_column(schema, column: str, role: str, file: str) -> None:
    if column not in schema.names:
        close = difflib.get_close_matches(column, schema.names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{file}: no {role} column {column!r}{hint}; its columns are {', '.join(schema.names)}: "
                         f"set {role}_column = \"...\" in the dataset file")
    if role == "caption":
        return
    pa = _pyarrow()
    kind = schema.field(column).type
    if pa.types.is_struct(kind):
        fits = any(kind.field(i).name in ("bytes", "path") for i in range(kind.num_fields))
    else:
        fits = any(is_kind(kind) for is_kind in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary,
                                                 pa.types.is_string, pa.types.is_large_string, pa.types.is_null))
    if not fits:
        raise ValueError(f"{file}: the {role} column {column!r} is of type {kind}; an image column holds an image's bytes "
                         f"(binary), its path (string) or an Image feature's struct {{bytes, path}}: set {role}_column = "
                         f"\"...\" in the dataset file to the column of the images")


def list_hf(data: str, split: str = "train", image_column: str = "image", caption_column: str = "text",
            control_column: str | None = None) -> HFListing:
    """The rows of DATA's split, in parts, after checking that every file has the columns (the control column too,
    when one is given) and that the image columns hold images. Only file headers and parquet footers are read. A
    file whose header or footer cannot be read (corrupt, empty) is listed as unreadable, with one part of no rows:
    its reader reports it, and the other files are read.

    Raises:
        FileNotFoundError: no data file found.
        ValueError: the split is missing, or a file lacks a column or has one of the wrong type; the message names
            the file and the fix.
    """
    pa = _pyarrow()
    root, files = _data_files(data, split)
    parts, unreadable = [], {}
    for i, (name, path, kind) in enumerate(files):
        try:
            schema, found = _schema_and_parts(path, kind, i)
        except (OSError, ValueError, pa.ArrowException) as e:
            unreadable[i] = f"{type(e).__name__}: {e}"
            parts.append(Part(i, -1, 0, 0))
            continue
        _check_column(schema, image_column, "image", path)
        _check_column(schema, caption_column, "caption", path)
        if control_column is not None:
            _check_column(schema, control_column, "control", path)
        parts += found
    return HFListing(root, files, parts, image_column, caption_column, control_column, unreadable)


def _file_stamp(path: str) -> bytes:
    st = os.stat(path)
    return f"{st.st_size}\0{st.st_mtime_ns}\0".encode()


def row_stamp(file_stamp: bytes, row: int, referenced: str | None = None, control: str | None = None) -> int:
    """A row's stamp: its file's size and mtime and the row's number, and those of the image file (and control
    image file) a row names by path instead of holding its bytes. Never 0."""
    h = hashlib.blake2b(file_stamp + row.to_bytes(8, "big"), digest_size=8)
    if referenced is not None:
        h.update(_file_stamp(referenced))
    if control is not None:
        h.update(b"control\0" + _file_stamp(control))
    return int.from_bytes(h.digest(), "big") >> 1 or 1


class BadCell(ValueError):
    """An image cell naming a path that is no image of the dataset's: `reason` is the failure's."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _image_of(value, root: Path, column: str, inside: dict[str, bool]) -> tuple[bytes | None, str | None]:
    """(image bytes, path read) of an image cell: an `Image` feature's {bytes, path}, raw bytes, or a path inside
    the dataset's folder (relative to it, or absolute), confined as a folder's metadata is. (None, None) for a row
    without an image.

    Raises:
        OSError: a named image file cannot be read.
        BadCell: the path leads outside the dataset's folder, or is no file name.
    """
    if isinstance(value, dict):
        if value.get("bytes"):
            return value["bytes"], None
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value) or None, None
    if isinstance(value, str) and value:
        try:
            # an absolute path is compared as the file system resolves it: DATA given through a symlink (or the
            # cells written through one) names the same folder
            relative = os.path.relpath(os.path.realpath(value), os.path.realpath(root)) if os.path.isabs(value) else value
            path = confined(root, relative, column, inside)
        except OutsideRoot:
            raise BadCell("outside_root", f"{column} {value!r} is outside the dataset's folder {root}: images are read "
                                          f"from inside it only; move them there and name them relative to it, or embed "
                                          f"their bytes in the dataset") from None
        except ValueError as e:
            raise BadCell("unreadable", str(e)) from None
        return read_regular(path), path
    return None, None


class HFDataset(torch.utils.data.IterableDataset):
    """The rows of some parts of a listing as prepared samples (`prepare`'s output with each row's `stamp`); the
    DataLoader's workers take every n-th part.

    Args:
        listing: the dataset's files and columns.
        parts: the parts this rank reads.
        policy: how images become pixels.
        skip_keys: keys already cached: a sample with one of them is "unchanged" after reading.
        known: input name -> (key, stamp) of the cached samples: a part whose rows are all known with their
            current stamps is not read at all.
        only: read these inputs alone (a repair).
    """

    def __init__(self, listing: HFListing, parts: list[Part], policy: ImagePolicy, skip_keys: frozenset[str],
                 known: dict[str, tuple[str, int]] | None = None, only: set[str] | None = None):
        self.listing, self.parts, self.policy, self.skip_keys = listing, parts, policy, skip_keys
        self.known, self.only = known or {}, only
        self._sorted: list[str] | None = None
        self._inside: dict[str, bool] = {}  # directory -> inside the dataset's folder (resolved once each)
        self._batches: tuple[str | None, list] = (None, [])  # the Arrow file read last, as record batches

    def __len__(self) -> int:
        return sum(p.rows for p in self.parts)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for part in self.parts[worker::workers]:
            yield from self._part(part)

    def _part(self, part: Part):
        name, path, kind = self.listing.files[part.file]
        names = self.listing.names(part)
        wanted = [self.only is None or n in self.only for n in names]
        if part.file in self.listing.unreadable:  # its cached rows failed to read this time: they stay cached
            if self._sorted is None:  # sorted once, when a file first fails
                self._sorted = sorted(self.known)
            cached = [n for n in names_under(self._sorted, f"{name}:") if self.only is None or n in self.only]
            for n in cached or ([name] if self.only is None else []):
                yield {"status": "failed", "source": n, "reason": "unreadable", "stamp": 0,
                       "detail": f"{path} cannot be read: {self.listing.unreadable[part.file]}"}
            return
        try:
            stamp = _file_stamp(path)
        except OSError as e:
            for n, want in zip(names, wanted):
                if want:
                    yield {"status": "failed", "source": n, "reason": os_reason(e), "detail": f"{type(e).__name__}: {e}", "stamp": 0}
            return
        stamps = [row_stamp(stamp, part.start + j) for j in range(part.rows)]
        if all(self.known.get(n, (None, 0))[1] == s for n, s, want in zip(names, stamps, wanted) if want):
            for n, s, want in zip(names, stamps, wanted):  # the whole part is unchanged: nothing is read
                if want:
                    yield {"status": "unchanged", "source": n, "key": self.known[n][0], "stamp": s}
            return
        try:
            table = self._read(path, kind, part)
        except Exception as e:  # a truncated or corrupt file: every row of the part fails, the run goes on
            for n, want in zip(names, wanted):
                if want:
                    yield {"status": "failed", "source": n, "reason": "unreadable", "detail": f"{type(e).__name__}: {e}", "stamp": 0}
            return
        images = table.column(self.listing.image_column)
        captions = table.column(self.listing.caption_column)
        controls = table.column(self.listing.control_column) if self.listing.control_column else None
        for j, (n, want) in enumerate(zip(names, wanted)):
            if want:
                control = controls[j].as_py() if controls is not None else None
                yield self._row(n, images[j].as_py(), captions[j].as_py(), stamp, part.start + j, self.known.get(n), control)

    def _read(self, path: str, kind: str, part: Part):
        pa = _pyarrow()
        columns = [self.listing.image_column, self.listing.caption_column]
        columns += [self.listing.control_column] if self.listing.control_column else []
        if kind == "parquet":
            return pa.parquet.ParquetFile(path).read_row_group(part.index, columns=columns)
        if self._batches[0] != path:  # a file's parts are read one after the other: map it once
            with pa.memory_map(path) as source:
                self._batches = (path, list(pa.ipc.open_stream(source)))  # views of the mapping, no copy
        batches = self._batches[1]
        if part.index >= len(batches):
            raise ValueError(f"{path} holds {len(batches)} record batches, not {part.index + 1}: it changed while being read")
        return batches[part.index].select(columns)

    def _row(self, name: str, image, caption, file_stamp: bytes, row: int, known, control_cell=None) -> dict:
        try:
            data, referenced = _image_of(image, self.listing.root, self.listing.image_column, self._inside)
        except BadCell as e:
            return {"status": "failed", "source": name, "reason": e.reason, "detail": str(e), "stamp": 0}
        except OSError as e:
            return {"status": "failed", "source": name, "reason": os_reason(e), "detail": f"{type(e).__name__}: {e}", "stamp": 0}
        control, control_path, control_error = None, None, None
        if self.listing.control_column:
            try:
                control, control_path = _image_of(control_cell, self.listing.root, self.listing.control_column, self._inside)
            except BadCell as e:
                return {"status": "failed", "source": name, "reason": e.reason, "detail": str(e), "stamp": 0}
            except OSError as e:
                control_error = e
        try:
            stamp = row_stamp(file_stamp, row, referenced, control_path)
        except OSError as e:
            return {"status": "failed", "source": name, "reason": os_reason(e), "detail": f"{type(e).__name__}: {e}", "stamp": 0}
        if known is not None and known[1] == stamp:
            return {"status": "unchanged", "source": name, "key": known[0], "stamp": stamp}
        if data is None:
            return {"status": "failed", "source": name, "reason": "no_image",
                    "detail": f"column {self.listing.image_column!r} is empty in this row", "stamp": stamp}
        texts = metadata_captions(caption, from_csv=False)
        if texts is None:
            return {"status": "failed", "source": name, "reason": "caption_not_string",
                    "detail": f"{self.listing.caption_column} is {caption!r}, not a string or a list of strings", "stamp": stamp}
        record = Record(name, data, list(texts), control=control,
                        control_detail=f"column {self.listing.control_column!r} is empty in this row")
        if control_error is not None:  # a control image named by a path that cannot be read
            record.control_missing = "missing_control" if isinstance(control_error, FileNotFoundError) else "unreadable_control"
            record.control_detail = f"{type(control_error).__name__}: {control_error}"
        return {**prepare(record, self.policy, self.skip_keys), "stamp": stamp}
