"""A Hugging Face dataset on disk as inputs: a `save_to_disk` directory (one dataset, or a DatasetDict and a
split of it) or parquet files (one file, a glob, or a folder of them as the Hub stores a dataset), with an image
column and a caption column, for ControlNet caches a control image column (`control_image`, in the image
column's forms), for masked training a loss mask column (`mask`, in the image column's forms), and for an edit model
a reference image column (`reference_image`: an image in those forms, or a list of them, in order).

Read with pyarrow, one parquet row group or Arrow record batch at a time, rather than through `datasets`:
`load_dataset("parquet", ...)` first copies every image into its Arrow cache (a second copy of the dataset on
disk), and its streaming mode does not say which file and row a sample came from, which the incremental stamps
need. pyarrow reads both formats `datasets` writes, memory-mapping Arrow files; finding a split's files and reading
their parts is `precompute.hffiles`, what becomes of each row is here.

A row's input name is `FILE:ROW` (FILE relative to the dataset's folder) and its stamp digests the file's size
and mtime with the row number (and those of image files the row names by path): a re-run skips a file's unchanged rows without reading them, and rows of a
rewritten file are read again (their content keys still find what is cached).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from precompute.clips import cached_unchanged, prepare_clips
from precompute.folders import METADATA_FILES, is_video_name, metadata_captions
from precompute.hffiles import Part, PartReader, check_column, data_files, load_pyarrow, parquet_files, schema_and_parts
from precompute.images import ImagePolicy, Record, prepare
from precompute.paths import OutsideRoot, confined, names_under, os_reason, read_regular

CONTROL_COLUMN = "control_image"  # the control image column of a ControlNet dataset (diffusers' training scripts' name)
MASK_COLUMN = "mask"  # the loss mask column of a dataset for masked training
REFERENCE_COLUMN = "reference_image"  # an edit dataset's reference images: an image or a list of them per row
VIDEO_COLUMN = "video"  # a video dataset's column of videos (the `Video` feature's {bytes, path}, bytes or a path)


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
        return bool(parquet_files(path))
    return data.endswith(".parquet")


@dataclass
class HFListing:
    """What `list_hf` found: the files of the split, their parts, and the columns to read."""

    root: Path  # the folder input names and relative image paths are relative to
    files: list[tuple[str, str, str]]  # (name relative to root, path, "arrow" | "parquet")
    parts: list[Part]
    image_column: str
    caption_column: str
    control_column: str | None = None  # read only for ControlNet caches
    mask_column: str | None = None  # read only for sources with loss masks
    reference_column: str | None = None  # read only for sources with reference images
    unreadable: dict[int, str] = field(default_factory=dict)  # file -> why its header or footer could not be read

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def names(self, part: Part) -> list[str]:
        """The input names of a part's rows: `FILE:ROW`."""
        name = self.files[part.file][0]
        return [f"{name}:{row}" for row in range(part.start, part.start + part.rows)]


def list_hf(data: str, split: str = "train", image_column: str = "image", caption_column: str = "text",
            control_column: str | None = None, mask_column: str | None = None, video_column: str | None = None,
            video: bool = False, reference_column: str | None = None) -> HFListing:
    """The rows of DATA's split, in parts, after checking that every file has the columns (the control, mask and
    reference columns too, when given) and that the image columns hold images. Only file headers and parquet footers
    are read. A file whose header or footer cannot be read (corrupt, empty) is listed as unreadable, with one part of
    no rows: its reader reports it, and the other files are read.

    With `video` (a video model's cache) the input column is `video_column`, or when that is not given the `video`
    column of a dataset that has one, else `image_column`; its cells are videos or images (one-frame clips).

    Raises:
        FileNotFoundError: no data file found.
        ValueError: the split is missing, or a file lacks a column or has one of the wrong type; the message names
            the file and the fix.
    """
    pa = load_pyarrow()
    root, files = data_files(data, split)
    parts, unreadable = [], {}
    for i, (_, path, kind) in enumerate(files):
        try:
            schema, found = schema_and_parts(path, kind, i)
        except (OSError, ValueError, pa.ArrowException) as e:
            unreadable[i] = f"{type(e).__name__}: {e}"
            parts.append(Part(i, -1, 0, 0))
            continue
        if video and not parts and not unreadable:  # the first file's columns say which holds the inputs
            image_column = video_column or (VIDEO_COLUMN if VIDEO_COLUMN in schema.names else image_column)
        elif not video and image_column not in schema.names and VIDEO_COLUMN in schema.names:
            from precompute.images import video_presets

            raise ValueError(f"{path}: no image column {image_column!r} but a {VIDEO_COLUMN!r} column: a dataset of videos, "
                             f"which video models cache ({', '.join(video_presets())}); or set image_column = \"...\" in "
                             f"the dataset file to a column of images")
        check_column(schema, image_column, "video" if video and image_column in (video_column, VIDEO_COLUMN) else "image", path)
        check_column(schema, caption_column, "caption", path)
        if control_column is not None:
            check_column(schema, control_column, "control", path)
        if mask_column is not None:
            check_column(schema, mask_column, "mask", path)
        if reference_column is not None:
            check_column(schema, reference_column, "reference", path)
        parts += found
    return HFListing(root, files, parts, image_column, caption_column, control_column, mask_column, reference_column,
                     unreadable)


def _file_stamp(path: str) -> bytes:
    st = os.stat(path)
    return f"{st.st_size}\0{st.st_mtime_ns}\0".encode()


def row_stamp(file_stamp: bytes, row: int, referenced: str | None = None, control: str | None = None,
              mask: str | None = None, references: list[str] = ()) -> int:
    """A row's stamp: its file's size and mtime and the row's number, and those of the image file (and control
    image file, loss mask file and reference image files) a row names by path instead of holding its bytes. Never 0."""
    h = hashlib.blake2b(file_stamp + row.to_bytes(8, "big"), digest_size=8)
    if referenced is not None:
        h.update(_file_stamp(referenced))
    if control is not None:
        h.update(b"control\0" + _file_stamp(control))
    if mask is not None:
        h.update(b"mask\0" + _file_stamp(mask))
    for i, path in enumerate(references):
        h.update(b"reference%d\0" % i + _file_stamp(path))
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
        columns = [listing.image_column, listing.caption_column]
        columns += [c for c in (listing.control_column, listing.mask_column, listing.reference_column) if c]
        self._reader = PartReader(columns)

    def __len__(self) -> int:
        return sum(p.rows for p in self.parts)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for part in self.parts[worker::workers]:
            yield from self._part(part)

    def _known_all(self, names: list[str]) -> list[tuple[str, int, int | None] | None]:
        """(key, stamp, global index or None) of each cached input of `names`, None for the others: a stamp table
        searched in place is asked for a part's rows at once."""
        if hasattr(self.known, "find_all"):
            return [self.known.entry(p) if p >= 0 else None for p in self.known.find_all(names).tolist()]
        return [(f[0], f[1], None) if (f := self.known.get(n)) is not None else None for n in names]

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
        found = self._known_all(names) if self.policy.clip is None else []
        if self.policy.clip is not None:  # a video model's: each row's cached clips, unchanged by their stamps
            same = [cached_unchanged(n, s, self.known.get(n)) for n, s, want in zip(names, stamps, wanted) if want]
            if all(same):  # the whole part is unchanged: nothing is read
                yield from (item for items in same for item in items)
                return
        elif all(f is not None and f[1] == s for f, s, want in zip(found, stamps, wanted) if want):
            for n, f, s, want in zip(names, found, stamps, wanted):  # the whole part is unchanged: nothing is read
                if want:
                    yield {"status": "unchanged", "source": n, "key": f[0], "stamp": s, **({"index": f[2]} if f[2] is not None else {})}
            return
        try:
            table = self._reader.read(path, kind, part)
        except Exception as e:  # a truncated or corrupt file: every row of the part fails, the run goes on
            for n, want in zip(names, wanted):
                if want:
                    yield {"status": "failed", "source": n, "reason": "unreadable", "detail": f"{type(e).__name__}: {e}", "stamp": 0}
            return
        images = table.column(self.listing.image_column)
        captions = table.column(self.listing.caption_column)
        controls = table.column(self.listing.control_column) if self.listing.control_column else None
        masks = table.column(self.listing.mask_column) if self.listing.mask_column else None
        references = table.column(self.listing.reference_column) if self.listing.reference_column else None
        for j, (n, want) in enumerate(zip(names, wanted)):
            if want:
                control = controls[j].as_py() if controls is not None else None
                mask = masks[j].as_py() if masks is not None else None
                refs = references[j].as_py() if references is not None else None
                yield from self._row(n, images[j].as_py(), captions[j].as_py(), stamp, part.start + j, self.known.get(n),
                                     control, mask, refs)

    def _companion(self, cell, column: str | None) -> tuple[bytes | None, str | None, OSError | None]:
        """A control image's or loss mask's bytes and path from its column's cell (nothing when no such column is read).
        A path that cannot be read comes back as its error, for the record to report; a bad cell raises `BadCell`."""
        if not column:
            return None, None, None
        try:
            data, path = _image_of(cell, self.listing.root, column, self._inside)
        except OSError as e:
            return None, None, e
        return data, path, None

    def _references(self, cell) -> tuple[list[bytes] | None, list[str], list[str], OSError | None]:
        """A reference cell's images (one image, or a list of them) as (their bytes, the paths read, their names for
        messages, the error reading a path); (None, ...) for an empty cell or list, or when no such column is read.
        A bad cell raises `BadCell`."""
        column = self.listing.reference_column
        if not column or cell is None:
            return None, [], [], None
        cells = cell if isinstance(cell, list) else [cell]
        found, paths, names = [], [], []
        for i, one in enumerate(cells):
            try:
                data, path = _image_of(one, self.listing.root, column, self._inside)
            except OSError as e:
                return None, [], [], e
            if data is None:
                if len(cells) > 1:  # one empty image among several: the row's references are not what it says
                    raise BadCell("missing_reference", f"column {column!r}: reference {i + 1} of {len(cells)} is empty")
                return None, [], [], None
            found.append(data)
            names.append(os.path.relpath(path, self.listing.root) if path else f"{column}[{i}]")
            if path:
                paths.append(path)
        return found or None, paths, names, None

    def _row(self, name: str, image, caption, file_stamp: bytes, row: int, known, control_cell=None, mask_cell=None,
             reference_cell=None):
        """A row's items: its sample (each of its clips, in a video model's cache), unchanged or prepared, or its failure."""
        clips = self.policy.clip is not None
        try:
            data, referenced = _image_of(image, self.listing.root, self.listing.image_column, self._inside)
            control, control_path, control_error = self._companion(control_cell, self.listing.control_column)
            mask, mask_path, mask_error = self._companion(mask_cell, self.listing.mask_column)
            references, reference_paths, reference_names, reference_error = self._references(reference_cell)
        except BadCell as e:
            yield {"status": "failed", "source": name, "reason": e.reason, "detail": str(e), "stamp": 0}
            return
        except OSError as e:  # the image's own path (a companion's is reported with its record)
            yield {"status": "failed", "source": name, "reason": os_reason(e), "detail": f"{type(e).__name__}: {e}", "stamp": 0}
            return
        try:
            stamp = row_stamp(file_stamp, row, referenced, control_path, mask_path, reference_paths)
        except OSError as e:
            yield {"status": "failed", "source": name, "reason": os_reason(e), "detail": f"{type(e).__name__}: {e}", "stamp": 0}
            return
        same = cached_unchanged(name, stamp, known) if clips else None
        if same or not clips and known is not None and known[1] == stamp:
            yield from same or [{"status": "unchanged", "source": name, "key": known[0], "stamp": stamp}]
            return
        if data is None:
            yield {"status": "failed", "source": name, "reason": "no_image",
                   "detail": f"column {self.listing.image_column!r} is empty in this row", "stamp": stamp}
            return
        texts = metadata_captions(caption, from_csv=False)
        if texts is None:
            yield {"status": "failed", "source": name, "reason": "caption_not_string",
                   "detail": f"{self.listing.caption_column} is {caption!r}, not a string or a list of strings", "stamp": stamp}
            return
        record = Record(name, data, list(texts), control=control, video=referenced is not None and is_video_name(referenced),
                        control_detail=f"column {self.listing.control_column!r} is empty in this row")
        if control_error is not None:  # a control image named by a path that cannot be read
            record.control_missing = "missing_control" if isinstance(control_error, FileNotFoundError) else "unreadable_control"
            record.control_detail = f"{type(control_error).__name__}: {control_error}"
        record.mask, record.mask_detail = mask, f"column {self.listing.mask_column!r} is empty in this row"
        if mask_error is not None:  # a loss mask named by a path that cannot be read
            record.mask_missing = "missing_mask" if isinstance(mask_error, FileNotFoundError) else "unreadable_mask"
            record.mask_detail = f"{type(mask_error).__name__}: {mask_error}"
        record.references, record.reference_names = references, reference_names
        record.references_detail = f"column {self.listing.reference_column!r} is empty in this row"
        if reference_error is not None:  # a reference named by a path that cannot be read
            missing = isinstance(reference_error, FileNotFoundError)
            record.references_missing = "missing_reference" if missing else "unreadable_reference"
            record.references_detail = f"{type(reference_error).__name__}: {reference_error}"
        if clips:
            yield from prepare_clips(record, self.policy, self.skip_keys, stamp, known)
        else:
            yield {**prepare(record, self.policy, self.skip_keys), "stamp": stamp}
