"""Reading the sources of DATA: folders (`precompute.folders`), webdataset tars (`precompute.tars`) or Hugging Face
datasets on disk (`precompute.hfdata`) as this rank's stream of prepared samples, read by DataLoader workers while the encoders run.

Every input either becomes a prepared sample or a failure with a named reason (`REASONS`); nothing raises
out of a worker for bad data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from precompute.clip_options import clip_policy
from precompute.config import PrecomputeConfig
from precompute.distributed import die_with_parent
from precompute.folders import (
    CONTROL_COLUMN,
    MASK_COLUMN,
    REFERENCE_COLUMN,
    FolderDataset,
    list_folder,
    with_control_folder,
    with_mask_folder,
    with_reference_folder,
)
from precompute.hfdata import CONTROL_COLUMN as HF_CONTROL_COLUMN
from precompute.hfdata import MASK_COLUMN as HF_MASK_COLUMN
from precompute.hfdata import REFERENCE_COLUMN as HF_REFERENCE_COLUMN
from precompute.hfdata import HFDataset, is_hf_dataset, list_hf
from precompute.images import ImagePolicy
from precompute.sources import Source
from precompute.tars import TarDataset, expand_tar_urls, is_tar_source
from precompute.video import VIDEO_REASONS
from shards.sample_index import StampTable

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
    "no_image": "a dataset row whose image column is empty",
    "missing_control": "--control: no control image found for the image",
    "unreadable_control": "--control: the control image could not be read (permission, I/O error, special file)",
    "corrupt_control": "--control: the control image is not a decodable image",
    "control_aspect": "--control: the control image's aspect ratio differs from the image's by more than 1 %",
    "missing_mask": "masks: no loss mask found for the image (or, --alpha-mask, the image has no alpha channel)",
    "unreadable_mask": "masks: the loss mask could not be read (permission, I/O error, special file)",
    "corrupt_mask": "masks: the loss mask is not a decodable image",
    "mask_size": "masks: the loss mask's size differs from the image's",
    "missing_reference": "references: no reference image found for the image (or a numbered one missing between others)",
    "unreadable_reference": "references: a reference image could not be read (permission, I/O error, special file)",
    "corrupt_reference": "references: a reference image is not a decodable image (or is over --max-pixels)",
    "too_many_references": "references: more reference images than the model takes (the detail says how many it takes)",
    "unusable_reference": "references: the model's pipeline cannot take the reference image (the detail says why: too "
                          "small, ...)",
    "ambiguous_reference": "references: two files for one reference (x.ref.png and x.ref0.png, or one name in two "
                           "image extensions); keep one",
    "video_input": "a video given to a model that takes images (the detail names the presets that take video)",
}
REASONS.update({reason: text for reason, text in VIDEO_REASONS.items() if reason not in REASONS})


@dataclass
class Inputs:
    """This rank's part of one source and what the listing found."""

    dataset: torch.utils.data.Dataset
    total: int | None  # inputs of this rank, when known before reading (folders)
    listed: int | None  # inputs of every rank (folders)
    complete: bool  # the listing saw every input without error: removal may use it
    failures: list[dict] = field(default_factory=list)  # listing errors of this rank's part
    workers: int = 0


def open_inputs(config: PrecomputeConfig, source: Source, policy: ImagePolicy, known: dict[str, tuple[str, int]],
                keys: frozenset[str], *, rank: int, world: int, only: set[str] | None = None) -> Inputs:
    """One source as a dataset of prepared samples, split disjointly by rank; with `only`, a folder's inputs of
    those sources alone.

    Args:
        known: source -> (key, stamp) of the cached samples: a folder input whose stamp is unchanged is not read (a
            video model's: source -> its cached clips, `precompute.clips.cached_clips`).
        keys: keys already cached: an input of one of them is reported unchanged after reading.
    """
    data = source.path
    policy = replace(policy, caption_prefix=source.caption_prefix, default_caption=source.default_caption, flip=source.flip,
                     tags=source.tags(), mask=source.mask_mode, clip=clip_policy(config, source),
                     references=source.takes_references)
    tar = is_tar_source(data)
    hf = not tar and is_hf_dataset(data)
    in_tar = "a tar sample holds its control image as its KEY.control.png member"
    if source.control is not None and (tar or hf):
        instead = in_tar if tar else "a Hugging Face dataset holds its control images in a column (control_column)"
        raise ValueError(f"source {source.name!r}: control = {source.control!r} pairs a folder's images with a folder of "
                         f"control images by name; {instead}: remove control from the dataset file")
    if source.control_column is not None and tar:
        raise ValueError(f"source {source.name!r}: control_column names a column of a Hugging Face dataset or of a "
                         f"folder's metadata file; {in_tar}: remove control_column from the dataset file")
    mask_in_tar = "a tar sample holds its loss mask as its KEY.mask.png member"
    if source.mask is not None and (tar or hf):
        instead = mask_in_tar if tar else "a Hugging Face dataset holds its loss masks in a column (mask_column)"
        raise ValueError(f"source {source.name!r}: mask = {source.mask!r} pairs a folder's images with a folder of masks "
                         f"by name; {instead}: remove mask from the dataset file and set masks = true")
    if source.mask_column is not None and tar:
        raise ValueError(f"source {source.name!r}: mask_column names a column of a Hugging Face dataset or of a folder's "
                         f"metadata file; {mask_in_tar}: remove mask_column from the dataset file and set masks = true")
    ref_in_tar = "a tar sample holds its reference images as its KEY.ref.png (or KEY.ref0.png, KEY.ref1.png, ...) members"
    if source.reference_folder is not None and (tar or hf):
        instead = ref_in_tar if tar else "a Hugging Face dataset holds its reference images in a column (reference_column)"
        raise ValueError(f"source {source.name!r}: reference_folder pairs a folder's images with folders of reference "
                         f"images by name; {instead}: remove reference_folder from the dataset file and set "
                         f"references = true")
    if source.reference_column is not None and tar:
        raise ValueError(f"source {source.name!r}: reference_column names a column of a Hugging Face dataset or of a "
                         f"folder's metadata file; {ref_in_tar}: remove reference_column from the dataset file and set "
                         f"references = true")
    files = source.mask_mode == "file"  # masks in files of their own (not the alpha channel)
    if tar:
        urls = expand_tar_urls(data, config.allow_pipe)
        mine = urls[rank::world]
        return Inputs(TarDataset(mine, policy, keys, tuple(config.caption_key), known), None, None, True,
                      workers=min(config.workers, len(mine)))
    if hf:
        listing = list_hf(data, source.split, source.image_column, source.caption_column or config.caption_column,
                          (source.control_column or HF_CONTROL_COLUMN) if config.control else None,
                          (source.mask_column or HF_MASK_COLUMN) if files else None, source.video_column, config.video,
                          (source.reference_column or HF_REFERENCE_COLUMN) if source.takes_references else None)
        parts = listing.parts[rank::world]
        if only is not None:
            parts = [p for p in parts if not only.isdisjoint(listing.names(p))]
        dataset = HFDataset(listing, parts, policy, keys, known, only)
        return Inputs(dataset, len(dataset), listing.rows, True, workers=min(config.workers, len(parts)))
    if not Path(data).is_dir():
        raise FileNotFoundError(f"{where(source)}={data} is neither a folder of images, webdataset tars nor a Hugging Face dataset on disk")
    sidecar_references = source.takes_references and source.reference_folder is None
    listing = list_folder(data, source.caption_column or config.caption_column, config.control and source.control is None,
                          source.control_column or CONTROL_COLUMN, files and source.mask is None, source.mask_column or MASK_COLUMN,
                          sidecar_references, source.reference_column or REFERENCE_COLUMN)
    entries = listing.entries if only is None else [e for e in listing.entries if e.source in only]
    if config.control and source.control is not None:
        try:
            entries = with_control_folder(entries, source.control)
        except FileNotFoundError:
            raise FileNotFoundError(f"source {source.name!r}: control = {source.control} is not a folder") from None
    if source.mask is not None:
        try:
            entries = with_mask_folder(entries, source.mask)
        except FileNotFoundError:
            raise FileNotFoundError(f"source {source.name!r}: mask = {source.mask} is not a folder") from None
    if source.reference_folder is not None:
        try:
            entries = with_reference_folder(entries, source.reference_folder)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"source {source.name!r}: reference_folder: {e}") from None
    mine = entries[rank::world]
    return Inputs(FolderDataset(mine, policy, keys, known), len(mine), len(entries), listing.complete,
                  failures=listing.failures[rank::world], workers=config.workers)


def where(source: Source) -> str:
    """How messages name a source: DATA itself, or the dataset file's source."""
    return f"source {source.name!r}: path" if source.from_file else "DATA"


# A folder's inputs stat'ed and compared with their cached stamps at once; those unchanged cross from the loader's
# workers as one item (`FolderDataset.block`), not one each.
BLOCK = 4096


class SourcesDataset(torch.utils.data.IterableDataset):
    """The sources of a run, one after the other, as one stream for one DataLoader (its workers fork once,
    before any encoder exists). Every item is tagged with its source's name (`"dataset"`), the resolution its part
    is read at (`"resolution"`, `ShardEntry.resolution`) and its stamp salted with the source's caption options
    (`Source.salt`); `known` stamps given to the parts are unsalted to match. A map-style part is split over the
    loader's workers by index (each index's items: an input's clips are several), an iterable one splits itself."""

    def __init__(self, parts: list[tuple[Source, torch.utils.data.Dataset, int]]):
        self.parts = parts

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for source, part, resolution in self.parts:
            salt = source.salt()
            if isinstance(part, torch.utils.data.IterableDataset):
                items = iter(part)
            elif hasattr(part, "block"):  # a folder: its unchanged inputs come back as one item per block
                mine = range(worker, len(part), workers)
                blocks = (mine[a : a + BLOCK] for a in range(0, len(mine), BLOCK))
                items = (item for r in blocks for item in part.block(np.arange(r.start, r.stop, r.step)))
            else:
                items = (item for i in range(worker, len(part), workers) for item in part.items(i))
            for item in items:
                if salt and item.get("stamp"):
                    item["stamp"] = (item["stamp"] ^ salt) or 1
                item["dataset"], item["flip"], item["resolution"] = source.name, source.flip, resolution
                yield item


def unsalted(known: dict[str, tuple[str, int]], source: Source) -> dict[str, tuple[str, int]]:
    """A source's cached (key, stamp) with its salt taken out, as its dataset compares them to fresh stamps."""
    salt = source.salt()
    if not salt:
        return known
    if isinstance(known, StampTable):  # searched in place, its stamps XORed as they are read
        return known.salted(salt)
    return {k: (key, stamp ^ salt) for k, (key, stamp) in known.items()}


def pixels_as_array(item: dict) -> dict:
    """A worker's item with its pixels (control, mask pixels, and each prepared reference's tensors) as numpy arrays: sent
    through the pipe in one copy. A tensor goes through shared memory instead (a file, a descriptor passed over a socket
    and a mapping per image), which costs the receiving process more than the copy for the image sizes a CPU encodes."""
    out = {**item, **{name: item[name].numpy() for name in ("pixels", "control_pixels", "mask_pixels") if name in item}}
    if item.get("reference_pixels"):
        out["reference_pixels"] = [{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in ref.items()}
                                   for ref in item["reference_pixels"]]
    return out


def build_loader(dataset: torch.utils.data.Dataset, workers: int, device: torch.device) -> torch.utils.data.DataLoader:
    """The loader of prepared samples, one at a time; its workers fork when it is first iterated."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
        prefetch_factor=4 if workers else None, multiprocessing_context="fork" if workers else None,
        collate_fn=None if device.type == "cuda" or not workers else pixels_as_array,
        worker_init_fn=partial(die_with_parent, os.getpid()),  # no worker outlives a killed run
    )
