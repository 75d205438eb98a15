"""The files of a Hugging Face dataset on disk, read with pyarrow: which hold a split (a `save_to_disk` folder's
Arrow files, or parquet files by their Hub names), the parts each is read in (parquet row groups, Arrow record
batches), the check that a file has the columns asked for, and the reading of one part.
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")  # as Hub file names spell them


def load_pyarrow():
    """pyarrow with its parquet and IPC modules; an optional dependency, so its absence says how to install it."""
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        from shards.options import install_extra

        raise ImportError(f"reading a Hugging Face dataset needs pyarrow: {install_extra('hf')} "
                          f"(or pip install pyarrow)") from e
    return pyarrow


def parquet_files(root: Path, depth: int = 3) -> list[Path]:
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


@dataclass(frozen=True)
class Part:
    """A unit of reading: rows [start, start + rows) of one file, one parquet row group or Arrow record batch."""

    file: int  # index into HFListing.files
    index: int  # the row group's or record batch's number in its file
    start: int  # the part's first row in the file
    rows: int


def saved_split(path: Path, split: str) -> Path:
    """The folder of one dataset inside a `save_to_disk` folder: itself, or the split of a DatasetDict."""
    if not (path / "dataset_dict.json").is_file():
        return path
    splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
    if split not in splits:
        raise ValueError(f"{path} is a DatasetDict without a split {split!r}; its splits are {', '.join(splits) or 'none'}: "
                         f"set split = \"...\" in the dataset file")
    return path / split


def split_of(name: str) -> str | None:
    """The split a Hub parquet file belongs to by its name (`train-00000-of-00002.parquet`, `data/test/0.parquet`),
    or None."""
    parts = PurePosixPath(name).parts
    for split in SPLIT_NAMES:
        if split in parts[:-1] or re.match(rf"{split}([-_.0-9]|$)", parts[-1]):
            return split
    return None


def data_files(data: str, split: str) -> tuple[Path, list[tuple[str, str, str]]]:
    """(root, files) of DATA's split."""
    path = Path(data)
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        folder = saved_split(path, split)
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        names = [f["filename"] for f in state.get("_data_files", [])]
        if not names:
            raise ValueError(f"{folder}/state.json lists no data files; save the dataset again with save_to_disk")
        return path, [(str((folder / n).relative_to(path)), str(folder / n), "arrow") for n in names]
    if path.is_dir():
        root, found = path, parquet_files(path)
    elif any(c in data for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(data, recursive=True) if p.endswith(".parquet"))
        root = Path(os.path.commonpath([str(p.parent) for p in found])) if found else path.parent
    else:
        root, found = path.parent, [path] if path.is_file() else []
    if not found:
        raise FileNotFoundError(f"{data}: no parquet file found")
    names = [p.relative_to(root).as_posix() for p in found]
    splits = {n: split_of(n) for n in names}
    if any(s is not None for s in splits.values()):
        names = [n for n in names if splits[n] == split]
        if not names:
            have = sorted({s for s in splits.values() if s})
            raise ValueError(f"{data}: no parquet file of split {split!r}; its files are of the splits {', '.join(have)}: "
                             f"set split = \"...\" in the dataset file")
    return root, [(n, str(root / n), "parquet") for n in names]


def schema_and_parts(path: str, kind: str, file: int) -> tuple[object, list[Part]]:
    """The schema of file number `file` (at `path`, "parquet" or "arrow") and its parts; reads its footer or its
    record batches' headers only."""
    pa = load_pyarrow()
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


def check_column(schema, column: str, role: str, file: str) -> None:
    """Refuse a file without `column`, or whose image column (`role` "image", "control", "mask" or "video"; a
    "reference" column may also hold a list of images per row) holds no images, naming the file and the fix."""
    if column not in schema.names:
        close = difflib.get_close_matches(column, schema.names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{file}: no {role} column {column!r}{hint}; its columns are {', '.join(schema.names)}: "
                         f"set {role}_column = \"...\" in the dataset file")
    if role == "caption":
        return
    pa = load_pyarrow()
    kind = schema.field(column).type
    listed = role == "reference" and (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
    if listed:  # a row's several reference images
        kind = kind.value_type
    if pa.types.is_struct(kind):
        fits = any(kind.field(i).name in ("bytes", "path") for i in range(kind.num_fields))
    else:
        fits = any(is_kind(kind) for is_kind in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary,
                                                 pa.types.is_string, pa.types.is_large_string, pa.types.is_null))
    if not fits:
        several = " (or, a reference column, a list of them)" if role == "reference" else ""
        raise ValueError(f"{file}: the {role} column {column!r} is of type {schema.field(column).type}; an image column "
                         f"holds an image's bytes (binary), its path (string) or an Image feature's struct {{bytes, path}}"
                         f"{several}: set {role}_column = \"...\" in the dataset file to the column of the images")


class PartReader:
    """Reads the columns of one part at a time; an Arrow file is mapped once for all its parts (they are read one
    after the other), its record batches views of the mapping."""

    def __init__(self, columns: list[str]):
        self.columns = columns
        self._batches: tuple[str | None, list] = (None, [])  # the Arrow file read last, as record batches

    def read(self, path: str, kind: str, part: Part):
        """The part's rows of `self.columns`, as a pyarrow table (parquet) or record batch (Arrow).

        Raises:
            ValueError: the Arrow file holds fewer record batches than it was listed with (it changed).
            OSError, pyarrow.ArrowException: the file cannot be read.
        """
        pa = load_pyarrow()
        if kind == "parquet":
            return pa.parquet.ParquetFile(path).read_row_group(part.index, columns=self.columns)
        if self._batches[0] != path:
            with pa.memory_map(path) as source:
                self._batches = (path, list(pa.ipc.open_stream(source)))  # views of the mapping, no copy
        batches = self._batches[1]
        if part.index >= len(batches):
            raise ValueError(f"{path} holds {len(batches)} record batches, not {part.index + 1}: it changed while being read")
        return batches[part.index].select(self.columns)
