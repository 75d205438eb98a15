"""The sources of a run: `DATA` as one path, or a TOML dataset file listing several.

```toml
[[source]]
name = "photos"            # defaults to the path's last component
path = "/data/photos"      # anything DATA accepts: folder, metadata folder, tar pattern, URL, HF dataset
repeats = 3                # or: weight = 0.25 (a share of each epoch); default repeats = 1
caption_prefix = "sks dog, "
default_caption = "a photo of sks dog"   # for images without a caption
flip = true                # also cache the horizontally flipped latent; training draws one of the two
caption_variants = 4       # tag-list captions: up to 4 versions of each caption, one drawn per step
shuffle_tags = true        # ... with the tags shuffled (kohya's shuffle_caption)
keep_tokens = 1            # ... except the first tag (after caption_prefix, which always stays first)
tag_dropout = 0.1          # ... and each other tag dropped with this probability
# eval = true              # held out of training: a run reports its loss (the held-out loss), never trains on it
resolution = [512, 1024]   # cache its images at these resolutions (default: the run's --resolution)
# a video model's cache (every sample a clip; an image is a one-frame clip):
clip_extraction = "uniform"  # which clips of each video: head, uniform, chunk, slide or full (default: --clip-extraction)
clips = 3                  # uniform: this many clips, evenly spaced (default: --clips)
# clip_stride = 8          # slide: a clip every 8 frames (default: --clip-stride)
# clip_lengths = "each"    # clips of every frame bucket a video holds, not only the longest (default: --clip-lengths)
frames = 49                # the longest clip, in frames at the model's frame rate (default: --frames)
frame_buckets = [1, 17, 33, 49]  # the clip lengths (default: --frame-buckets, cut at frames)
# with --control (ControlNet caches), where a folder's control images are, when not beside the images:
control = "/data/photos-canny"   # /data/photos-canny/a/x.png is the control image of /data/photos/a/x.jpg
masks = true               # cache a loss mask per image (x.mask.png beside x.jpg; masked training's --masked-loss)
mask = "/data/photos-masks"      # or where the masks are: /data/photos-masks/a/x.png is the mask of a/x.jpg
# an edit model's (--references): each target image pairs with reference images (x.ref.png / x.ref0.png, x.ref1.png
# beside x.jpg, a metadata row's reference_file_name, a tar sample's KEY.ref.png, a dataset's reference_image column)
references = true
reference_folder = "/data/photos-before"  # or where they are: /data/photos-before/a/x.png (or x_0.png, x_1.png, ...)
# reference_folder = ["/data/before-1", "/data/before-2"]  # or one folder per reference: reference i in folder i

[[source]]                 # DreamBooth's class (regularisation) images, as kohya's is_reg
path = "/data/dogs"
default_caption = "a photo of a dog"
is_reg = true              # a class source: training weights its batches' loss by prior_loss_weight
prior_loss_weight = 1.0    # default 1.0; stage two's --prior-loss-weight overrides it
```

`tag_separator` (default ",") separates a caption's tags; `keep_tokens_separator` (kohya's, e.g. "|||") keeps the text
before it in place instead of `keep_tokens` (`precompute.captions` says how variants are made).

`control_column` names the control image column of a Hugging Face dataset (default `control_image`) or of a
folder's metadata.jsonl/.csv (default `control_file_name`); `reference_column` likewise names the reference images'
column (default `reference_image`, and `reference_file_name` in a metadata file).

Every source is a named dataset of the cache: a run touches only the sources it lists (new / changed /
removed count within each), and training draws each by its repeats or weight, recorded in the manifest.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path, PurePath, PurePosixPath
from urllib.parse import urlsplit

from precompute.captions import TagOptions
from precompute.musubi_keys import ours as musubi_equivalent
from precompute.video import EXTRACTIONS, LENGTHS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib


@dataclass(frozen=True)
class Source:
    """One source of samples.

    Args:
        name: the dataset of the cache its samples belong to.
        path: a folder of images (sidecar captions or a metadata file), webdataset tars (a .tar, a folder or a
            brace pattern, local or a URL) or a Hugging Face dataset on disk (`save_to_disk`, parquet).
        repeats: how many times an epoch of training draws each of its samples.
        weight: instead of repeats, the share of each epoch's draws that come from this source.
        caption_prefix: put before every caption (e.g. a trigger word).
        default_caption: the caption of images that have none (otherwise they are skipped, reason
            `missing_caption` / `empty_caption`).
        flip: also cache the latent of the horizontally flipped image; training draws one of the two each time.
        image_column, caption_column, split: of a Hugging Face dataset; `caption_column` also names the
            caption column of a folder's metadata.jsonl/.csv (default: the run's --caption-column).
        control: with --control, a folder holding the control images of a folder source under the images'
            relative names, with any image extension (`control/a/x.png` for `a/x.jpg`), instead of sidecars.
        control_column: with --control, the control image column of a Hugging Face dataset (default
            `control_image`) or of a folder's metadata.jsonl/.csv (default `control_file_name`).
        caption_variants, shuffle_tags, keep_tokens, tag_separator, keep_tokens_separator, tag_dropout: each
            caption cached as up to `caption_variants` versions, its tags shuffled and dropped
            (`precompute.captions.TagOptions`, which `tags()` builds); 1: the caption as written.
        eval: held out of training: stage two never draws its samples and reports their loss (the held-out loss);
            recorded in the manifest, so it changes no sample of the cache.
        is_reg: a class (regularisation) source, as kohya's `is_reg`: DreamBooth's prior preservation images, whose
            batches' loss training multiplies by `prior_loss_weight` (or, with `--preservation output`, takes against
            the base model's own prediction). Its share of the epoch is its repeats or weight, as any source's.
        prior_loss_weight: the loss weight of a class source's batches (default 1.0).
        masks: every image has a loss mask, cached beside its latent (`x.mask.png` beside `x.jpg`, a metadata row's
            `mask_file_name`, a tar sample's `mask.png`, a Hugging Face dataset's `mask` column).
        mask: a folder holding the loss masks of a folder source under the images' relative names, with any image
            extension (`mask/a/x.png` for `a/x.jpg`), instead of sidecars; implies `masks`.
        mask_column: the loss mask column of a Hugging Face dataset (default `mask`) or of a folder's
            metadata.jsonl/.csv (default `mask_file_name`); implies `masks`.
        alpha_mask: every image's loss mask is its own alpha channel; implies `masks`.
        references: an edit model's: every image (the edit's target) pairs with 1..N reference images, found as
            `precompute.folders` says (sidecars `x.ref.png` or `x.ref0.png`, `x.ref1.png`, ...; a metadata row's
            `reference_file_name`; a tar sample's `KEY.ref.png` / `KEY.ref0.png`...; a Hugging Face dataset's
            `reference_image` column); an image without them is skipped (`missing_reference`).
        reference_folder: where a folder source's references are instead of sidecars: one folder, holding
            `DIR/a/x.png` (any image extension) for `a/x.jpg`, or several for it as `DIR/a/x_0.png`, `x_1.png`, ...;
            or a list of folders, reference i of `a/x.jpg` being `a/x.EXT` in the i-th. Implies `references`.
        reference_column: the reference images' column of a Hugging Face dataset (default `reference_image`) or of a
            folder's metadata.jsonl/.csv (default `reference_file_name`): an image or a list of them, a path or a
            list of paths. Implies `references`.
        resolution: the resolutions its images are cached at, each on its own bucket table (None: the run's).
        video_column: a video model's input column of a Hugging Face dataset (default: `video` where the dataset has
            one, else `image_column`).
        clip_extraction, clips, clip_stride, clip_lengths, frames, frame_buckets: a video model's cache: which clips of
            its videos become samples (`precompute.video.ClipPolicy`); None: the run's (`PrecomputeConfig.sources`
            fills them in, and they join the keys of the source's clips and its salt).
    """

    name: str
    path: str
    repeats: int | None = None
    weight: float | None = None
    caption_prefix: str = ""
    default_caption: str | None = None
    flip: bool = False
    image_column: str = "image"
    caption_column: str | None = None
    split: str = "train"
    control: str | None = None
    control_column: str | None = None
    caption_variants: int = 1
    shuffle_tags: bool = False
    keep_tokens: int = 0
    tag_separator: str = ","
    keep_tokens_separator: str | None = None
    tag_dropout: float = 0.0
    eval: bool = False
    is_reg: bool = False
    prior_loss_weight: float | None = None
    masks: bool = False
    mask: str | None = None
    mask_column: str | None = None
    alpha_mask: bool = False
    references: bool = False
    reference_folder: tuple[str, ...] | None = None
    reference_column: str | None = None
    resolution: tuple[int, ...] | None = None
    video_column: str | None = None
    clip_extraction: str | None = None
    clips: int | None = None
    clip_stride: int | None = None
    clip_lengths: str | None = None
    frames: int | None = None
    frame_buckets: tuple[int, ...] | None = None
    from_file: bool = False  # listed by a dataset file (messages name it), rather than DATA itself

    def tags(self) -> TagOptions | None:
        """How the source's captions become variants; None: each caption is cached as written."""
        if self.caption_variants == 1:
            return None
        return TagOptions(self.caption_variants, self.shuffle_tags, self.keep_tokens, self.tag_separator,
                          self.keep_tokens_separator, self.tag_dropout)

    def tag_record(self) -> dict:
        """The caption-variant options, as the manifest records them (nothing for a source without variants)."""
        if self.tags() is None:
            return {}
        return {key: getattr(self, key) for key in TAG_KEYS if getattr(self, key) is not None}

    @property
    def mask_mode(self) -> str:
        """Where the source's loss masks come from: "alpha" (the image's alpha channel), "file" (a mask image), or ""
        (no masks)."""
        if self.alpha_mask:
            return "alpha"
        return "file" if self.masks or self.mask is not None or self.mask_column is not None else ""

    @property
    def takes_references(self) -> bool:
        """The source's images pair with reference images (`references`, or a `reference_folder` / `reference_column`,
        which imply it)."""
        return self.references or self.reference_folder is not None or self.reference_column is not None

    def salt(self) -> int:
        """Mixed into every input stamp of the source (0: nothing to mix), so that editing its caption options
        (variants included), `flip`, where its control images are, its masks or its reference images makes an
        incremental run read its inputs again instead of calling them unchanged."""
        if not (self.caption_prefix or self.default_caption is not None or self.flip or self.control or self.control_column
                or self.tags() is not None or self.mask_mode or self.clip_extraction is not None or self.takes_references):
            return 0
        text = f"{self.caption_prefix}\0{self.default_caption}\0{self.flip}"
        if self.control or self.control_column:  # absent from the text otherwise: the salts of older caches stay
            text += f"\0{self.control}\0{self.control_column}"
        if self.tags() is not None:  # likewise
            text += "\0tags" + "".join(f"\0{key}={getattr(self, key)!r}" for key in TAG_KEYS)
        if self.mask_mode:  # the same
            text += f"\0mask\0{self.mask_mode}\0{self.mask}\0{self.mask_column}"
        if self.clip_extraction is not None:  # a video model's source: which clips its videos are cut into
            text += f"\0clips\0{self.clip_extraction}\0{self.clips}\0{self.frame_buckets}\0{self.video_column}"
            if self.clip_stride is not None:  # a stride or lengths only where they are chosen: older salts stay
                text += f"\0stride\0{self.clip_stride}"
            if self.clip_lengths not in (None, "longest"):
                text += f"\0lengths\0{self.clip_lengths}"
        if self.takes_references:  # likewise: where its reference images are found
            text += f"\0references\0{self.reference_folder}\0{self.reference_column}"
        return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big") >> 1 or 1

    def record(self) -> dict:
        """What the manifest keeps of the source (`extra["sources"][name]`): training reads its share here."""
        share = {"weight": self.weight} if self.weight is not None else {"repeats": self.repeats or 1}
        optional = {k: v for k, v in (("caption_prefix", self.caption_prefix), ("default_caption", self.default_caption),
                                      ("flip", self.flip), ("control", self.control),
                                      ("control_column", self.control_column), ("eval", self.eval),
                                      ("masks", bool(self.mask_mode)), ("mask", self.mask), ("mask_column", self.mask_column),
                                      ("alpha_mask", self.alpha_mask), ("references", self.takes_references),
                                      ("reference_column", self.reference_column)) if v}
        if self.reference_folder is not None:
            optional["reference_folder"] = list(self.reference_folder)
        # a class source's role is written only for one (the records of other sources stay as they were)
        role = {"is_reg": True, "prior_loss_weight": float(self.prior_loss_weight or 1.0)} if self.is_reg else {}
        if self.resolution:
            optional["resolution"] = list(self.resolution)
        if self.clip_extraction is not None:  # a video model's source
            optional["clip_extraction"] = self.clip_extraction
            if self.clip_extraction == "uniform":
                optional["clips"] = self.clips
            if self.clip_stride is not None:
                optional["clip_stride"] = self.clip_stride
            if self.clip_lengths not in (None, "longest"):
                optional["clip_lengths"] = self.clip_lengths
            optional["frame_buckets"] = list(self.frame_buckets or ())
        if self.video_column is not None:
            optional["video_column"] = self.video_column
        return {"path": self.path, **share, **optional, **self.tag_record(), **role}


# the caption-variant keys, which `check_tags` checks together
TAG_KEYS = ("caption_variants", "shuffle_tags", "keep_tokens", "tag_separator", "keep_tokens_separator", "tag_dropout")
MAX_VARIANTS = 64  # each variant stores the caption's text embeddings again
KEYS = {f.name for f in fields(Source)} - {"from_file"}  # what a [[source]] table may set
# keys of other trainers' dataset files (musubi-tuner's, kohya's) that a user may bring, and the key that does their job
# here: the hint names it where a spelling match would mislead (target_frames is not frames)
THEIR_NAMES = {"target_frames": "frame_buckets", "frame_extraction": "clip_extraction", "frame_sample": "clips",
               "frame_stride": "clip_stride", "max_frames": "frames",
               "video_directory": "path", "image_directory": "path", "num_repeats": "repeats"}
KEY_HELP = {  # `python -m precompute --help` lists these
    "name": "the source's name in the cache (default: the path's last component)",
    "path": "a folder, metadata folder, tar pattern, URL or Hugging Face dataset on disk, as DATA (relative: to the "
            "dataset file)",
    "repeats": "draws of each sample per epoch, a whole number >= 1 (default 1)",
    "weight": "instead of repeats, the source's share of each epoch (> 0; then every source has one)",
    "caption_prefix": "text put before every caption (a trigger word)",
    "default_caption": "the caption of images without one (otherwise skipped)",
    "flip": "true: also cache the horizontally flipped image's latent; training draws one of the two",
    "caption_column": "the caption column of the folder's metadata.jsonl/.csv or of a Hugging Face dataset",
    "image_column": "the image column of a Hugging Face dataset on disk",
    "split": "the split of a saved DatasetDict or of Hub parquet files (default train)",
    "control": "with --control: a folder of the control images of a folder source, under the images' relative names "
               "with any image extension (DIR/a/x.png for a/x.jpg; relative: to the dataset file), instead of sidecars "
               "x.control.png",
    "control_column": "with --control: the control image column of a Hugging Face dataset (default control_image) or "
                      "of the folder's metadata.jsonl/.csv (default control_file_name)",
    "caption_variants": f"cache up to N versions of each caption (1 to {MAX_VARIANTS}; default 1, the caption as written); "
                        "training draws one of a sample's captions uniformly each time. Variant 0 is the caption's tags "
                        "in written order; the others are shuffled (shuffle_tags) and thinned (tag_dropout). Each variant "
                        "stores the caption's text embeddings again",
    "shuffle_tags": "true: variants shuffle the caption's tags (kohya's shuffle_caption, precomputed); needs "
                    "caption_variants >= 2",
    "keep_tokens": "the first N tags of a caption stay in place and are never dropped (after caption_prefix, which "
                   "always stays first; default 0)",
    "tag_separator": "what separates a caption's tags (default \",\"; kohya's caption_separator); variants join them "
                     "as the caption does (its first separator, with the spaces around it)",
    "keep_tokens_separator": "kohya's keep_tokens_separator (e.g. \"|||\"): in a caption holding it, the text before "
                             "it stays in place (instead of keep_tokens) and the text after a second one stays at the end",
    "tag_dropout": "the probability of leaving out each tag that is not kept, per variant (0 <= p < 1; kohya's "
                   "caption_tag_dropout_rate); needs caption_variants >= 2",
    "eval": "true: hold the source out of training; stage two reports its loss every --eval-every steps (the held-out "
            "loss) and never trains on it",
    "is_reg": "true: a class (regularisation) source, DreamBooth's prior preservation images (kohya's is_reg); training "
              "weights its batches' loss by prior_loss_weight",
    "prior_loss_weight": "with is_reg: the loss weight of the source's batches (> 0, default 1.0; stage two's "
                         "--prior-loss-weight overrides it)",
    "masks": "true: cache a loss mask per image (x.mask.png beside x.jpg, a metadata row's mask_file_name, a tar "
             "sample's KEY.mask.png, a Hugging Face dataset's mask column) for --masked-loss; an image without one is "
             "skipped (missing_mask)",
    "mask": "a folder of the loss masks of a folder source, under the images' relative names with any image extension "
            "(DIR/a/x.png for a/x.jpg; relative: to the dataset file), instead of sidecars x.mask.png; implies masks",
    "mask_column": "the loss mask column of a Hugging Face dataset (default mask) or of the folder's metadata.jsonl/.csv "
                   "(default mask_file_name); implies masks",
    "alpha_mask": "true: every image's loss mask is its own alpha channel (an image without one is skipped); implies "
                  "masks, and is refused beside masks = true, mask or mask_column (masks come from one place)",
    "references": "true: an edit model's source (--references for every source): each image is an edit's target and "
                  "pairs with 1..N reference images (x.ref.png, or x.ref0.png, x.ref1.png, ... beside x.jpg; a metadata "
                  "row's reference_file_name; a tar sample's KEY.ref.png / KEY.ref0.png ...; a Hugging Face dataset's "
                  "reference_image column); an image without them is skipped (missing_reference)",
    "reference_folder": "a folder of the reference images of a folder source, under the images' relative names with any "
                        "image extension (DIR/a/x.png for a/x.jpg, or DIR/a/x_0.png, x_1.png, ... for several; relative: "
                        "to the dataset file), instead of sidecars x.ref.png; or a list of folders, the i-th holding "
                        "every image's reference i (DIR_i/a/x.png); implies references",
    "reference_column": "the reference images' column of a Hugging Face dataset (default reference_image; an image or a "
                        "list of images) or of the folder's metadata.jsonl/.csv (default reference_file_name; a path or a "
                        "list of paths, relative to the folder); implies references",
    "resolution": "the resolution its images are cached at, or a list of several (each a multiple of 64 from 256 to the "
                  "model's largest; default: --resolution)",
    "video_column": "a video model's column of videos in a Hugging Face dataset (default: video where the dataset has "
                    "one, else image_column; its cells may also hold images, cached as one-frame clips)",
    "clip_extraction": "a video model's: which clips of each video become samples: head (one, from the start), uniform "
                       "(clips of them, evenly spaced), chunk (every whole clip, one after the other), slide (a clip every "
                       "clip_stride frames) or full (the whole video as one clip); default --clip-extraction. Changing it "
                       "cuts the source's videos again",
    "clips": "a video model's, with clip_extraction = \"uniform\": how many clips of each video (default --clips)",
    "clip_stride": "a video model's, with clip_extraction = \"slide\": frames from one clip's start to the next, at the "
                   "model's frame rate (default --clip-stride; musubi-tuner's frame_stride)",
    "clip_lengths": "a video model's: \"longest\" (clips of the longest frame bucket a video holds) or \"each\" (one set "
                    "of clips per frame bucket it holds, the one-frame bucket included, as musubi-tuner cuts "
                    "target_frames); default --clip-lengths",
    "frames": "a video model's: the source's longest clip, in frames at the model's frame rate (4k+1 for a temporal "
              "factor of 4; default --frames); its frame buckets are the run's up to it",
    "frame_buckets": "a video model's: the source's clip lengths, ascending, each one of the run's --frame-buckets "
                     "(default: the run's, up to frames)",
}
assert set(KEY_HELP) == KEYS
NAME = re.compile(r"[^\t\n\r/\\]+")  # printable in `shards ls`' tab-separated lines; not a path


def default_name(path: str) -> str:
    """A source's name from its path: the last component that is not a file pattern or a tar, so
    `/data/photos` is "photos" and `s3://bucket/laion/{00000..00999}.tar` is "laion"."""
    parts = [p for p in PurePosixPath(urlsplit(path).path if "://" in path else path.replace("\\", "/")).parts if p != "/"]
    while len(parts) > 1 and (any(c in parts[-1] for c in "{*?[") or parts[-1].endswith((".tar", ".parquet"))):
        parts.pop()
    if not parts and "://" in path:
        parts = [urlsplit(path).netloc]
    return parts[-1] if parts else "data"


def single(path: str) -> list[Source]:
    """`DATA` as one source, named after its path."""
    return [Source(default_name(path), path)]


def is_dataset_file(data: str) -> bool:
    return data.endswith(".toml") and "://" not in data


def read_dataset_file(file: str | Path) -> list[Source]:
    """The sources a dataset file lists, checked: a key this product does not know, a value of the wrong type
    or range, both `repeats` and `weight`, or two sources of one name are refused, naming the line.

    Raises:
        ValueError: the file is not valid TOML or a source is refused; the message names file and line.
        OSError: the file cannot be read.
    """
    file = Path(file)
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{file}:{line}: not valid UTF-8 ({e.reason}); save the dataset file "
                         f"as UTF-8") from None
    try:
        doc = tomllib.loads(text)
    except (ValueError, RecursionError) as e:  # TOMLDecodeError, an integer of too many digits, arrays nested too deep
        raise ValueError(f"{file}: not valid TOML: {str(e) or type(e).__name__}") from None
    lines = text.split("\n")

    def where(index: int, key: str | None = None) -> str:
        return f"{file}:{_line_of(lines, index, key)}"

    extra = sorted(set(doc) - {"source"})
    if extra:
        theirs = (" (musubi-tuner's [[datasets]] are [[source]] tables here, each with path = its video_directory or "
                  "image_directory, and its [general] keys written in each)") if extra[0] in ("datasets", "general") else ""
        raise ValueError(f"{file}:{_top_level_line(lines, extra[0])}: unknown table or key {extra[0]!r}; a dataset file "
                         f"lists [[source]] tables only{theirs}")
    tables = doc.get("source")
    if isinstance(tables, dict):
        raise ValueError(f"{file}:{_top_level_line(lines, 'source')}: [source] is one table; write each source as "
                         f"[[source]] (two brackets), a table of the list of sources")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{file}: lists no source; add one [[source]] table per folder or shard set (see "
                         f"`python -m precompute --help`)")
    sources: list[Source] = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise ValueError(f"{where(i)}: source holds {table!r}, not a table; write each source as a [[source]] "
                             "table of keys (path = '...')")
        for key in table:
            if key not in KEYS:
                close = [THEIR_NAMES[key]] if key in THEIR_NAMES else difflib.get_close_matches(key, sorted(KEYS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(sorted(KEYS))}"
                theirs = musubi_equivalent(table)  # the whole of a musubi-tuner clip setting, in one step
                raise ValueError(f"{where(i, key)}: unknown key {key!r} in [[source]]{hint}" + (f"; {theirs}" if theirs else ""))
        if "path" not in table:
            raise ValueError(f"{where(i)}: this [[source]] has no path")
        for key, value in table.items():
            problem = _check(key, value)
            if problem:
                raise ValueError(f"{where(i, key)}: {_label(table)}{key} = {value!r}: {problem}")
        if "repeats" in table and "weight" in table:
            raise ValueError(f"{where(i, 'weight')}: give repeats or weight, not both")
        tag_values = {key: table.get(key, getattr(Source, key)) for key in TAG_KEYS}
        problem = check_tags(tag_values, {key for key in TAG_KEYS if tag_values[key] != getattr(Source, key)})
        if problem:
            key, message = problem
            raise ValueError(f"{where(i, key)}: {_label(table)}{key} = {tag_values[key]!r}: {message}")
        if "prior_loss_weight" in table and not table.get("is_reg"):
            raise ValueError(f"{where(i, 'prior_loss_weight')}: prior_loss_weight weights the loss of a class source's "
                             f"batches; add is_reg = true to this source, or drop prior_loss_weight")
        if table.get("alpha_mask") and (both := [k for k in ("masks", "mask", "mask_column") if k in table
                                                 and table[k] is not False]):
            raise ValueError(f"{where(i, 'alpha_mask')}: {_label(table)}alpha_mask and {both[0]}: masks come from one "
                             f"place, the images' alpha channel (alpha_mask) or mask images ({both[0]}); drop one of the two")
        if table.get("is_reg") and table.get("eval"):
            raise ValueError(f"{where(i, 'is_reg')}: {_label(table)}is_reg and eval: an eval source is held out of "
                             f"training, a class source trains; choose one")
        values = dict(table)
        values.setdefault("name", default_name(values["path"]))
        if not NAME.fullmatch(values["name"]):
            raise ValueError(f"{where(i, 'name' if 'name' in table else 'path')}: source name {values['name']!r} must be "
                             f"non-empty, without tabs, newlines or slashes")
        if any(s.name == values["name"] for s in sources):
            raise ValueError(f"{where(i, 'name' if 'name' in table else 'path')}: a second source named "
                             f"{values['name']!r}; give each source its own name")
        path = values["path"]
        if "://" not in path and not Path(path).is_absolute() and not path.startswith("pipe:"):
            values["path"] = str(file.parent / path)  # relative to the dataset file, wherever it is run from
        if "frame_buckets" in values:
            values["frame_buckets"] = tuple(values["frame_buckets"])
        if "resolution" in values:
            values["resolution"] = tuple(dict.fromkeys(values["resolution"] if isinstance(values["resolution"], list)
                                                       else [values["resolution"]]))
        for key in ("control", "mask"):
            if key in values and "://" not in values[key] and not Path(values[key]).is_absolute():
                values[key] = str(file.parent / values[key])
        if "reference_folder" in values:  # one folder, or one per reference
            many = values["reference_folder"]
            many = many if isinstance(many, list) else [many]
            values["reference_folder"] = tuple(v if "://" in v or Path(v).is_absolute() else str(file.parent / v) for v in many)
        sources.append(Source(**values, from_file=True))
        overlap = _overlap(sources[:-1], sources[-1])
        if overlap is not None:
            other, how = overlap
            j = sources.index(other)
            raise ValueError(
                f"{where(i, 'path')}: source {values['name']!r} ({sources[-1].path}) {how} source {other.name!r} "
                f"({other.path}, {where(j, 'path')}): every input there would be read by both, and a cached sample "
                f"belongs to one source, so one of them would get only duplicates (or the images twice, under two "
                f"captions). List each folder once: give it the repeats or weight it should have, and move a subfolder "
                f"that needs its own share or captions beside the other folder, not inside it")
    weighted = {s.weight is not None for s in sources}
    if len(weighted) > 1:
        first = next(i for i, s in enumerate(sources) if s.weight is not None)
        raise ValueError(f"{where(first, 'weight')}: some sources have a weight and others repeats; use one of the two "
                         f"for every source (weights are shares of each epoch, repeats multiply its samples)")
    return sources


def _label(table: dict) -> str:
    """How a message names the source of a [[source]] table: "source 'name': ", or nothing when its name and path
    are themselves amiss."""
    name = table.get("name")
    if isinstance(name, str):
        return f"source {name!r}: "
    return f"source {default_name(table['path'])!r}: " if isinstance(table.get("path"), str) else ""


def _check(key: str, value) -> str | None:
    """Why `value` is not a valid `key` of a source, or None."""
    if key in ("flip", "shuffle_tags", "eval", "is_reg", "masks", "alpha_mask", "references"):
        return None if isinstance(value, bool) else "must be true or false"
    if key == "keep_tokens":
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else "must be a whole number ≥ 0"
    if key == "caption_variants":
        ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_VARIANTS
        return None if ok else f"must be a whole number from 1 to {MAX_VARIANTS} (each variant stores the caption's text again)"
    if key == "tag_dropout":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
        return None if ok else "must be a number from 0 up to (not including) 1"
    if key in ("tag_separator", "keep_tokens_separator"):
        if not isinstance(value, str):
            return "must be a string"
        if not value:
            return "must not be empty"
        return "must not hold a NUL character" if "\x00" in value else None
    if key in ("name", "path", "caption_prefix", "image_column", "caption_column", "split", "default_caption", "control",
               "control_column", "mask", "mask_column", "video_column", "reference_column"):
        if not isinstance(value, str):
            return "must be a string"
        if key != "caption_prefix" and not value.strip():
            return "must not be empty"
        if "\x00" in value:  # no path, column or caption holds one (a caption's NUL would also blur its sample's key)
            return "must not hold a NUL character"
        return None
    if key == "reference_folder":
        many = value if isinstance(value, list) else [value]
        if not many or not all(isinstance(v, str) and v.strip() and "\x00" not in v for v in many):
            return "must be a folder (a non-empty string) or a non-empty list of folders, one per reference"
        return None
    if key == "repeats":
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "must be a whole number ≥ 1"
    if key == "clip_extraction":
        return None if value in EXTRACTIONS else f"must be one of {', '.join(EXTRACTIONS)}"
    if key == "clip_lengths":
        return None if value in LENGTHS else f"must be one of {', '.join(LENGTHS)}"
    if key in ("clips", "frames", "clip_stride"):
        return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "must be a whole number ≥ 1"
    if key == "frame_buckets":
        ok = (isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
              and value == sorted(set(value)))
        return None if ok else "must be a list of frame counts ≥ 1, ascending, e.g. [1, 17, 33]"
    if key == "resolution":
        many = value if isinstance(value, list) else [value]
        if not many or any(isinstance(v, bool) or not isinstance(v, int) or v % 64 or v < 256 for v in many):
            return "must be a resolution, or a list of them, each a multiple of 64 from 256 to the model's largest"
        return None
    if key in ("weight", "prior_loss_weight"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)
        return None if ok else "must be a finite number above 0"
    return None


def check_tags(values: dict, given: set[str], name=lambda key: key) -> tuple[str, str] | None:
    """Why a source's caption-variant options (`TAG_KEYS` -> value) are refused, alone or together, as (the key to
    change, the problem), or None. `given`: the keys set to other than their default (a default is not a mistake);
    `name`: how the message names another key (a dataset file's key, or a command line's flag)."""
    for key in TAG_KEYS:
        problem = _check(key, values[key]) if values[key] is not None else None
        if problem:
            return key, problem
    variants, shuffle, dropout = values["caption_variants"], values["shuffle_tags"], values["tag_dropout"]
    varies = shuffle or dropout > 0
    if variants > 1 and not varies:
        return "caption_variants", (f"nothing varies the caption: set {name('shuffle_tags')} (and/or "
                                    f"{name('tag_dropout')}), or leave {name('caption_variants')} at 1")
    if varies and variants == 1:
        key = "shuffle_tags" if shuffle else "tag_dropout"
        return key, (f"the text embeddings are cached, so shuffled or thinned captions are precomputed: set "
                     f"{name('caption_variants')} to the number of versions to cache per caption (2 or more, e.g. 4; "
                     f"each stores the caption's text again)")
    for key in ("keep_tokens", "tag_separator", "keep_tokens_separator"):
        if key in given and not varies:
            return key, f"applies to caption variants only: set {name('shuffle_tags')} or {name('tag_dropout')} too"
    if values["keep_tokens_separator"] is not None and values["keep_tokens_separator"] == values["tag_separator"]:
        return "keep_tokens_separator", f"must differ from {name('tag_separator')} ({values['tag_separator']!r})"
    return None


def _location(source: Source) -> tuple[str, PurePath]:
    """Where a source reads: (scheme and host of a URL, or "" for a local path resolved through symlinks, its path)."""
    if "://" in source.path or source.path.startswith("pipe:"):
        url = urlsplit(source.path)
        return f"{url.scheme}://{url.netloc}", PurePosixPath(url.path or "/")
    return "", Path(os.path.realpath(source.path))  # realpath, unlike Path.resolve, never raises (a symlink loop)


def _overlap(earlier: list[Source], source: Source) -> tuple[Source, str] | None:
    """The earlier source whose inputs `source` would read too, and how: the same path, or one inside the other.
    Splits of one Hugging Face dataset are distinct inputs (`split` names them)."""
    where, path = _location(source)
    for other in earlier:
        there, other_path = _location(other)
        if there != where or other.split != source.split:
            continue
        if path == other_path:
            return other, "reads the same path as"
        if path.is_relative_to(other_path):
            return other, "lies inside"
        if other_path.is_relative_to(path):
            return other, "holds"
    return None


def _line_of(lines: list[str], index: int, key: str | None) -> int:
    """The 1-based line of the `index`-th [[source]] header, or of `key` inside that table."""
    header = re.compile(r"^\s*\[\[\s*source\s*\]\]")
    starts = [n for n, line in enumerate(lines) if header.match(line)]
    if index >= len(starts):  # an inline array of tables: the line of `source =`
        return next((n + 1 for n, line in enumerate(lines) if re.match(r"^\s*source\s*=", line)), 1)
    start, end = starts[index], starts[index + 1] if index + 1 < len(starts) else len(lines)
    if key is not None:
        pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for n in range(start + 1, end):
            if pattern.match(lines[n]):
                return n + 1
    return start + 1


def _top_level_line(lines: list[str], key: str) -> int:
    pattern = re.compile(rf"^\s*(\[+\s*)?[\"']?{re.escape(key)}[\"']?\s*(=|\])")
    return next((n + 1 for n, line in enumerate(lines) if pattern.match(line)), 1)


def sources_of(data: str) -> list[Source]:
    """`DATA` as its sources: a dataset file's, or one source named after the path."""
    return read_dataset_file(data) if is_dataset_file(data) else single(data)
