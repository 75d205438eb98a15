"""Every option of a stage-one run, in one typed dataclass: its default, its choices and its help.

`python -m precompute --help` is built from these fields (a `Literal` type is the list of valid values) and
`__post_init__` is where every value is checked (a number against the range declared with it, which --help shows),
so a run built in code refuses what the command line refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

from precompute.clip_options import check_clip_options, clip_policy
from precompute.families import DEFAULT_PRESET, family
from precompute.families.base import Preset
from precompute.folders import CAPTION_COLUMN
from precompute.images import ImagePolicy
from precompute.presets import get_preset, get_text_encoder, preset_names, text_encoder_names
from precompute.sources import MAX_VARIANTS, TAG_KEYS, Source, check_tags, is_dataset_file, sources_of
from shards import Bucket
from shards.options import Dtype, check_options, flag, opt

# Images per VAE batch. Large batches pay on GPUs; on CPUs a batch's activations fall out of the caches
# and every image costs more (make bench, its default tiny preset: 42 img/s at batch 1, 31 at 4, 21 at 8).
DEFAULT_BATCH = {"cuda": 16, "cpu": 1}
# Scripts written before the product had one dtype vocabulary say `--storage-dtype bfloat16`; still accepted.
LONG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DtypeOption = Literal[Dtype, Literal["float32", "bfloat16", "float16"]]
DTYPE_HELP = "fp32, bf16 or fp16 (float32, bfloat16 and float16 mean the same)"
# Each published preset's caption token limit, for --help.
MAX_LENGTHS = ", ".join(f"{name} {get_preset(name).text.max_length}" for name in preset_names() if not name.startswith("tiny-"))
# The published presets by their largest --resolution and bucket granularity, for --help.
_LIMITS: dict[tuple[int, int], list[str]] = {}
for _name in preset_names():
    if not _name.startswith("tiny-"):
        _LIMITS.setdefault((get_preset(_name).max_resolution, get_preset(_name).granularity), []).append(_name)
# The presets of edit models, which take reference images (--references), for --help.
EDIT_PRESETS = ", ".join(name for name in preset_names() if get_preset(name).references) or "none installed"
RESOLUTION_LIMITS = "; ".join(f"{largest} ({step} px): {', '.join(names)}" for (largest, step), names in sorted(_LIMITS.items()))


def _valid_examples(preset: Preset, problem_of, value: object) -> tuple[int, str]:
    """Resolutions to suggest for a refused `value`: the valid one nearest to it (the preset's base one for a value
    that is no number), and two valid ones for several ("256,384"), as the model's family accepts them."""
    top = max(preset.max_resolution, preset.base_resolution, 720)
    valid = [r for r in range(16, top + 1, 16) if problem_of(preset, r) is None]
    if not valid:
        return preset.base_resolution, str(preset.base_resolution)
    near = preset.base_resolution
    if isinstance(value, int) and not isinstance(value, bool):
        near = min(valid, key=lambda r: (abs(r - value), -r))
    other = preset.base_resolution if preset.base_resolution != near and preset.base_resolution in valid else next(
        (r for r in reversed(valid) if r < near), None) or next((r for r in valid if r > near), near)
    return near, ",".join(map(str, sorted({near, other})))


@dataclass
class PrecomputeConfig:
    """Every option of a stage-one run; the CLI is built from it (see `python -m precompute --help`)."""

    data: str = field(metadata={"help": "A dataset file (.toml) listing several sources, or one source: a folder of images "
                                        "with sidecar captions (x.jpg + x.txt/.caption) or a "
                                        "metadata.jsonl/.csv (file_name, text); or webdataset tars: a .tar, a folder of tars, "
                                        "a brace pattern data-{0000..0099}.tar, http(s) URLs, or any fsspec URL (s3://bucket/data-{0000..0099}.tar, "
                                        "gs://, hf://; the `remote` extra installs s3fs and gcsfs); or a Hugging Face dataset on disk: a save_to_disk "
                                        "folder or parquet files (a file, a glob, a Hub snapshot folder) with columns image and text "
                                        "(the `hf` extra installs pyarrow). Videos are inputs too (x.mp4 + x.txt, a "
                                        "metadata row's file_name, a tar's KEY.mp4, a dataset's video column): clips for a "
                                        "video model (an image there is a one-frame clip), a video_input failure for an "
                                        "image model."})
    model: str = opt(DEFAULT_PRESET, f"Preset: {', '.join(preset_names())}.")
    cache: Path | None = opt(None, "Cache directory to create or extend (default: cache/MODEL, where `make train` looks).")
    text_encoder: str | None = opt(None, f"Override the preset's text encoder: {', '.join(text_encoder_names())}.")
    pretrained: str | None = opt(None, "Local directory (diffusers layout: vae/, text_encoder/, tokenizer/, and the "
                                       "family's text_encoder_2/, tokenizer_2/... where it has several text encoders) or Hub "
                                       "id to load the encoders from instead of the preset's.")
    drop_t5: bool = opt(False, "Presets that encode with CLIP-L + CLIP-G + T5: leave T5 out (CLIP-L + CLIP-G only), as "
                               "their pipeline does with text_encoder_3=None; its tokens are zeros in training and inference.")
    max_length: int | None = opt(None, "Token limit of a caption (default: the preset's; where CLIP runs beside T5, of the "
                                       f"T5 part): {MAX_LENGTHS}.", at_least=1)
    batch_size: int | None = opt(None, f"Images (a video model's: clips) per VAE batch, one bucket per batch (default: "
                                       f"{DEFAULT_BATCH['cuda']} images on CUDA, {DEFAULT_BATCH['cpu']} on CPU; 1 clip).",
                                 at_least=1)
    text_batch_size: int = opt(64, "Captions per text-encoder batch.", at_least=1)
    dedup_texts: bool = opt(True, "Store each distinct caption's text embeddings once, in text shards every sample with "
                                  "that caption refers to (a DreamBooth set of one prompt stores it once), and encode it "
                                  "once. Applies to a new cache; an existing cache keeps the layout it was built with. "
                                  "--no-dedup-texts stores them with each sample, as caches before it did.")
    resolution: str | None = opt(None, "Cache the images at this resolution: the side of a square of the same area, a "
                                       "multiple of 64 from 256 to the model's largest (a video model: a multiple of its "
                                       "granularity, with 480 and 720 its 480p and 720p tables, areas 480x832 and 720x1280, "
                                       "which hold those sizes). Its bucket table is the published "
                                       "one where there is one (256, 512, 1024, 2048) and it fits the model, otherwise built "
                                       "as they are: the 1024 table's aspect ratios scaled to the area, each side rounded "
                                       "to the model's granularity (the VAE's downsampling times the patch size). Largest "
                                       f"(granularity): {RESOLUTION_LIMITS}. Several, comma-separated (512,1024): every "
                                       "image is cached at each, and training draws from each (--resolution-weight). A "
                                       "source of a dataset file may set its own (resolution = 512 or [512, 1024]). Default: "
                                       "the resolutions the cache holds the source at, else the preset's base resolution "
                                       "(1024; tiny presets 256).")
    workers: int = opt(2, "DataLoader worker processes that read, decode and resize images (0: in the main process).",
                       at_least=0)
    storage_dtype: DtypeOption = opt("bf16", f"Dtype of cached latents and embeddings: {DTYPE_HELP}.")
    vae_dtype: DtypeOption | None = opt(None, f"VAE compute dtype: {DTYPE_HELP} (default: fp32 on CPU; the preset's on CUDA).")
    text_dtype: DtypeOption | None = opt(None, f"Text-encoder compute dtype: {DTYPE_HELP} (default: fp32 on CPU; bf16 on CUDA).")
    force_fp16: bool = opt(False, "Allow fp16 for encoders that overflow in it (SDXL VAE, T5); only for fp16-fixed weights.")
    max_upscale: float = opt(2.0, "Skip images needing more upscaling than this to cover their bucket (reason too_small; "
                                  "1: never upscale).", at_least=1)
    allow_upscale: bool = opt(False, "Never skip small images; upscale them.")
    extreme_aspect: Literal["skip", "clamp"] = opt("skip", "Images whose aspect ratio lies beyond the bucket table: skip or "
                                                           "clamp (crop into the extreme bucket).")
    max_pixels: int = opt(178_956_970, "Refuse images with more pixels than this (decompression bombs; twice Pillow's "
                                       "warning limit).", at_least=1)
    caption_column: str = opt(CAPTION_COLUMN, "Caption column of metadata.jsonl/.csv (a string or a list of captions).")
    caption_key: list[str] = opt(["caption", "text", "prompt"], "Keys of a tar sample's .json whose values are captions "
                                                                "(repeatable); all found are encoded.")
    caption_variants: int | None = opt(None, "DATA as one source: cache up to N versions of each caption, drawn "
                                             "uniformly by training (1: the caption as written). Variant 0 is the "
                                             "caption's tags in written order; the others are shuffled (--shuffle-tags) "
                                             "and thinned (--tag-dropout), never the caption prefix or the kept tags. "
                                             "Each variant stores the caption's text embeddings again. A dataset file "
                                             "sets caption_variants per [[source]]. Default: what the cache records for "
                                             "the source (a re-run keeps its variants and their tag options unless one "
                                             "of these options is given: then they state them all), else 1.",
                                       at_least=1, at_most=MAX_VARIANTS)
    shuffle_tags: bool | None = opt(None, "DATA as one source: the caption variants shuffle the caption's tags (kohya's "
                                          "--shuffle_caption, precomputed: needs --caption-variants 2 or more). Default: "
                                          "as --caption-variants says.")
    keep_tokens: int | None = opt(None, "DATA as one source: the first N tags of a caption stay in place and are never "
                                        "dropped (kohya's --keep_tokens). Default: as --caption-variants says, else 0.",
                                  at_least=0)
    tag_separator: str | None = opt(None, "DATA as one source: what separates a caption's tags (kohya's "
                                          "--caption_separator); variants join them as the caption does (its first "
                                          "separator, with the spaces around it). Default: as --caption-variants says, "
                                          "else ','.")
    keep_tokens_separator: str | None = opt(None, "DATA as one source: kohya's --keep_tokens_separator (e.g. '|||'): in "
                                                  "a caption holding it, the text before it stays in place (instead of "
                                                  "--keep-tokens) and the text after a second one stays at the end.")
    tag_dropout: float | None = opt(None, "DATA as one source: the probability of leaving out each tag that is not "
                                          "kept, per variant (kohya's --caption_tag_dropout_rate; needs "
                                          "--caption-variants 2 or more). Default: as --caption-variants says, else 0.",
                                    at_least=0, below=1)
    control: bool = opt(False, "ControlNet training: every image pairs with a control image whose latent is cached beside "
                               "its own, encoded by the same VAE after the image's bucket, resize and crop (a control "
                               "image of another size but the same aspect ratio, within 1 %, is resized to match). Found "
                               "as x.control.png (any image extension) beside x.jpg in a folder; in a metadata.jsonl/.csv's "
                               "control_file_name column (else the sidecar); as the KEY.control.png / KEY.control.jpg "
                               "member of a tar sample; in the control_image column of a Hugging Face dataset; or, for a "
                               "dataset file's source, under the images' relative names in its control = \"DIR\" folder "
                               "(control_column renames the column). An image without one is skipped (missing_control). A "
                               "cache is built with or without control latents; the other kind of run is refused.")
    masks: bool | None = opt(None, "Masked training (stage two's --masked-loss): cache a loss mask per image beside its latent, a "
                             "grayscale image of the image's size (white: trained, black: ignored), resized and cropped as "
                             "the image and area-averaged to latent resolution (a latent cell's weight is the fraction of "
                             "its pixels kept), never encoded by the VAE. Found as x.mask.png (any image extension) beside "
                             "x.jpg in a folder (files named so are never training images); in a metadata.jsonl/.csv's "
                             "mask_file_name column (else the sidecar); as the KEY.mask.png member of a tar sample; in the "
                             "mask column of a Hugging Face dataset; or, for a dataset file's source, under the images' "
                             "relative names in its mask = \"DIR\" folder (a source may also set masks = true alone). An "
                             "image without one (missing_mask) or with one of another size (mask_size) is skipped. Changing "
                             "only masks or captions re-encodes no latent: the cached one is copied. Not given, DATA "
                             "as one source keeps what the cache records for it (a re-run keeps its masks; --no-masks "
                             "drops them); a dataset file's sources say it themselves.")
    alpha_mask: bool | None = opt(None, "Like --masks, with every image's loss mask taken from its own alpha channel "
                                        "(opaque: trained, transparent: ignored; the image itself is still composited on "
                                        "white). An image without an alpha channel is skipped (missing_mask). Not with "
                                        "--masks (masks come from one place). Not given: as --masks says.")
    references: bool = opt(False, f"Edit models ({EDIT_PRESETS}): every image is an edit's target and pairs with 1..N "
                                  "reference images (the images the edit starts from), each prepared as the model's "
                                  "pipeline prepares an input image and cached as a latent of its own size beside the "
                                  "target's. Found as x.ref.png, or x.ref0.png, x.ref1.png, ... in that order (any image "
                                  "extension; from 0 or 1, without gaps; x.ref is number 0) beside x.jpg in a folder (files "
                                  "named so are never training images, with or without --references); in a "
                                  "metadata.jsonl/.csv's reference_file_name column (a path or a list of paths, relative "
                                  "to the folder; else the sidecars); as the KEY.ref.png / KEY.ref0.png ... members of a "
                                  "tar sample; in the reference_image column of a Hugging Face dataset (an image or a list "
                                  "of images); or, for a dataset file's source, in its reference_folder = \"DIR\" "
                                  "(DIR/a/x.png, or DIR/a/x_0.png, x_1.png, ..., for a/x.jpg; or a list of folders, one per "
                                  "reference). A dataset file's source may set references = true alone instead. An image "
                                  "without them is skipped (missing_reference), as is one whose reference cannot be read "
                                  "(unreadable_reference) or decoded (corrupt_reference), with two files for one reference "
                                  "(ambiguous_reference) or with more than the model takes (too_many_references). Editing "
                                  "one reference re-encodes that sample alone.")
    frames: int | None = opt(None, "Video models: the longest clip, in frames at the model's frame rate; a multiple of "
                                   "its temporal factor plus one (4k+1: 17, 33, 49, 81). Default: the family's longest "
                                   "frame bucket (81).", at_least=1)
    frame_buckets: str | None = opt(None, "Video models: the clip lengths a cache holds, comma-separated and ascending, "
                                          "each 4k+1 and at most --frames (e.g. 1,17,33,49,81). A video's clip is the "
                                          "longest of them it holds (--clip-lengths each: a clip of every one); 1 is an "
                                          "image's (a one-frame clip). Default: the family's (1,17,33,49,81) up to "
                                          "--frames, and --frames itself. The cache "
                                          "records them: a run with others is refused. A dataset file's source may "
                                          "keep fewer (frames, frame_buckets).")
    clip_extraction: Literal["head", "uniform", "chunk", "full", "slide"] | None = opt(
        None, "Video models: which clips of each video become samples (musubi-tuner's frame_extraction), of the "
                "lengths --clip-lengths takes. head: one clip from the start; uniform: --clips clips evenly spaced from "
                "the start to the end; chunk: every whole clip, one after the other; slide: a clip every --clip-stride "
                "frames, as many as fit; full: the whole video as one clip, the longest bucket not longer than it. A "
                "dataset file's source may set its own (clip_extraction); changing it cuts that source's videos again "
                "(their samples are replaced). Default: for DATA as one source, the clips the cache records for it (a "
                "re-run keeps them unless one of --clip-extraction, --clips, --clip-stride, --clip-lengths is given: "
                "then they state them all), else head.")
    clips: int | None = opt(None, "Video models, --clip-extraction uniform: clips per video (a source's clips = N). "
                                  "Default: as --clip-extraction says, else 1.", at_least=1)
    clip_stride: int | None = opt(None, "Video models, --clip-extraction slide (which needs it): frames from one clip's "
                                        "start to the next, at the model's frame rate (musubi-tuner's frame_stride; e.g. 8 "
                                        "at 16 fps: a clip every half second). A source's clip_stride = N; changing it "
                                        "cuts that source's videos again.", at_least=1)
    clip_lengths: Literal["longest", "each"] | None = opt(
        None, "Video models: the lengths of a video's clips. longest: the longest frame bucket the video holds, one "
                   "length per video; each: every frame bucket the video holds, one set of clips per length, as "
                   "musubi-tuner cuts target_frames. With each, the one-frame bucket (1 in --frame-buckets) cuts one-frame "
                   "samples from videos too: head takes the first frame, uniform --clips frames, slide a frame every "
                   "--clip-stride (chunk refuses it: every frame would be one); a video shorter than every longer bucket "
                   "is still too_short. Not with full. A source's clip_lengths; changing it cuts that source's videos "
                   "again. Default: as --clip-extraction says, else longest.")
    decode_timeout: float = opt(60.0, "Video models: seconds a video may take to decode its clips; one that takes longer "
                                      "(a file that hangs the decoder) is skipped (decode_timeout): its decoding process "
                                      "is killed, even inside a stuck FFmpeg call.", above=0)
    validation_prompt: list[str] = opt([], "A prompt to encode for validation images (repeatable).")
    validation_file: Path | None = opt(None, "A file of validation prompts, one per line (added to --validation-prompt).")
    allow_pipe: bool = opt(False, "Allow pipe: URLs, which run a shell command (checked on every URL a brace pattern expands to).")
    allow_removal: bool = opt(False, "Remove cached samples whose inputs are gone even when DATA lists no input or more than "
                                     "--max-removal-fraction of the cache would go. Samples whose input failed to read, or "
                                     "whose tar or folder could not be listed completely, are never removed.")
    max_removal_fraction: float = opt(0.5, "Refuse (exit 4) to remove more than this share of the cache's samples in one run "
                                           "without --allow-removal; what was encoded is kept.",
                                           at_least=0, at_most=1)
    max_failure_fraction: float = opt(0.1, "Exit non-zero (1) when more than this fraction of inputs was skipped; what was "
                                           "encoded is kept.", at_least=0, at_most=1)
    remove_source: list[str] = opt([], "Remove every sample of this source (a name `python -m shards inspect CACHE` lists) from "
                                       "the cache before encoding DATA (repeatable); DATA must not list it.")
    max_shard_mb: int = opt(128, "Target shard size in MiB (0: a shard per sample).", at_least=0)
    check_disk: bool = opt(True, "Estimate the cache size first and refuse if the disk is short.")
    repair: bool = opt(False, "Re-encode exactly the samples of shards that are missing or fail their checks (python -m "
                              "shards verify lists them), from the same DATA and options that built the cache; each "
                              "repaired shard keeps its samples' order, so training runs resume on it.")
    progress: bool = opt(True, "Show the progress bar when stderr (where stage one reports) is a terminal; --no-progress "
                               "prints the plain lines of --log-seconds instead, as output to a file or a pipe gets.")
    log_seconds: float = opt(60.0, "Where no progress bar is shown (stderr is not a terminal, or --no-progress): a plain line "
                                   "every this many seconds, and one at the end: inputs done (of how many), inputs/s, new, "
                                   "unchanged and failed so far, ETA (0: a line per input).", at_least=0)

    def __post_init__(self) -> None:
        for name in ("storage_dtype", "vae_dtype", "text_dtype"):
            value = getattr(self, name)
            setattr(self, name, LONG_DTYPES.get(value, value))
        check_options(self)
        self.cache = Path(self.cache) if self.cache is not None else Path("cache") / self.model
        self.caption_key = list(self.caption_key)
        if self.validation_file is not None:
            # read once: the file is consumed into the list, so a copy of this config does not add its prompts again
            try:
                lines = Path(self.validation_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--validation-file {self.validation_file}: {e}") from None
            self.validation_prompt = [*self.validation_prompt, *(line.strip() for line in lines if line.strip())]
            self.validation_file = None
        self.validation_prompt = list(self.validation_prompt)

        if not self.data:
            raise ValueError("DATA is empty: name a folder of images, a metadata file's folder, webdataset tars or a dataset file")
        self.remove_source = list(self.remove_source)
        self.check_tags()
        listed = {s.name for s in self.sources()}
        if both := sorted(listed & set(self.remove_source)):
            raise ValueError(f"--remove-source {both[0]}: DATA lists that source too; remove it from the dataset file first")
        if self.model not in preset_names():
            raise ValueError(f"--model {self.model!r}: choose one of {', '.join(preset_names())}")
        if self.text_encoder is not None and self.text_encoder not in text_encoder_names():
            raise ValueError(f"--text-encoder {self.text_encoder!r}: choose one of {', '.join(text_encoder_names())}")
        preset = self.preset()
        # a family whose transformer needs its own set of encoders takes no other's, and its set serves no other
        own, theirs = family(preset.family), family(preset.text.family)
        if theirs is not own and (own.own_text_encoder or theirs.own_text_encoder):
            raise ValueError(f"--text-encoder {preset.text.name}: the {preset.family} family needs "
                             + (own.own_text_encoder or "a single text encoder"))
        theirs.check_text_options(preset)
        self.resolution = self._check_resolutions(preset)
        for name, safe, what in (("vae_dtype", preset.vae.fp16_safe, "VAE"), ("text_dtype", preset.text.fp16_safe, "text encoder")):
            if getattr(self, name) == "fp16" and not safe and not self.force_fp16:
                raise ValueError(f"{flag(name)} fp16: the {what} overflows to NaN/Inf in fp16; use bf16 or fp32 (or pass "
                                 f"--force-fp16 with an fp16-safe checkpoint such as the fp16-fix SDXL VAE)")
        for source in self.sources():
            where = f"source {source.name!r}" if source.from_file else f"DATA={self.data}"
            if self.control and source.flip:
                # the flipped image would need its flipped control image, which is not cached
                raise ValueError(f"{where} sets flip = true, which --control does not support: a flipped image's control "
                                 f"latent is not cached. Drop flip for this source, or build a cache without --control")
            keys = [k for k in ("control", "control_column") if getattr(source, k) is not None]
            if keys and not self.control:
                raise ValueError(f"{where} sets {keys[0]}, which applies to ControlNet caches only: pass --control (every "
                                 f"image of the cache then needs a control image) or remove {keys[0]} from the dataset file")
            files = [k for k in ("mask", "mask_column") if getattr(source, k) is not None]
            if source.alpha_mask and files:
                raise ValueError(f"{where} takes its loss masks from the images' alpha channel (alpha_mask, --alpha-mask) "
                                 f"and sets {files[0]}: masks come from one place; drop one of the two")
        self._check_references(preset)
        self._sources = check_clip_options(self, preset)
        if self.repair and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--repair runs in one process (it re-encodes only the damaged shards' samples); run it without torchrun")

    def _check_references(self, preset: Preset) -> None:
        """Reference images go with edit presets: a source asking for them needs one, and an edit-only preset needs
        every source to have them; a source of them flips none of its images (the references would need flipping too)."""
        edit = [name for name in preset_names() if get_preset(name).references]
        asking = [s for s in self.sources() if s.takes_references]
        for source in asking:
            where = f"source {source.name!r}" if source.from_file else f"DATA={self.data}"
            keys = [k for k in ("reference_folder", "reference_column") if getattr(source, k) is not None]
            option = "--references" if self.references else (keys[0] if keys else "references = true")
            if not preset.references:
                raise ValueError(f"{where}: {option} pairs images with reference images, which only an edit model takes: "
                                 f"--model {preset.name} takes none. Choose an edit preset ("
                                 f"{', '.join(edit) or 'none is installed'}), or drop {option}")
            if source.flip:
                raise ValueError(f"{where} sets flip = true with reference images: a flipped target would need its "
                                 f"references flipped, which are cached as they are. Drop flip for this source")
            if len(keys) == 2:
                raise ValueError(f"{where} sets reference_folder and reference_column: references come from one place; "
                                 f"drop one of the two")
        without = [s for s in self.sources() if not s.takes_references]
        if preset.requires_references and without:  # an edit-only model: a sample without references is no edit
            which = f"source {without[0].name!r}" if without[0].from_file else f"DATA={self.data}"
            raise ValueError(f"--model {preset.name} is an edit model: every sample pairs a target image with its reference "
                             f"images, and {which} has none. Pass --references (x.ref.png, or x.ref0.png, x.ref1.png, ... "
                             f"beside each x.jpg; see --help) or set references = true (or reference_folder = \"DIR\", "
                             f"reference_column = \"NAME\") for every source of the dataset file")

    def check_tags(self) -> None:
        """The caption-variant options: for DATA as one source, valid together (those not given at their defaults);
        a dataset file sets them per source. Masks come from one place: --masks or --alpha-mask."""
        given = {key for key in TAG_KEYS if getattr(self, key) is not None}
        if given and is_dataset_file(self.data):
            key = min(given, key=TAG_KEYS.index)
            raise ValueError(f"{flag(key)}: DATA is a dataset file, whose sources set their own caption variants: write "
                             f"{key} = ... in the [[source]] tables it applies to")
        problem = check_tags(self._tag_values(), given, flag)
        if problem:
            key, message = problem
            value = self._tag_values()[key]
            raise ValueError(f"{flag(key)}{'' if isinstance(value, bool) else f' {value!r}'}: {message}")
        if self.masks and self.alpha_mask:
            raise ValueError("--masks and --alpha-mask: masks come from one place, mask images (--masks) or the images' "
                             "alpha channel (--alpha-mask); give one of the two")

    def _tag_values(self) -> dict:
        """The caption-variant options as given, a default where not (`Source`'s)."""
        return {key: getattr(Source, key) if getattr(self, key) is None else getattr(self, key) for key in TAG_KEYS}

    def keep_recorded(self, manifest) -> list[str]:
        """For DATA as one source, keep what the cache records for it (`manifest`, a `shards.Manifest`) where this run
        does not say: its loss masks when neither --masks nor --alpha-mask is given (either way), its caption variants
        and their tag options when no caption-variant option is given, as a re-run without --resolution keeps its
        resolutions. A dataset file states its sources in full: nothing is kept. Returns the kept settings as flags
        (["--masks", "--caption-variants 4 --shuffle-tags"]), for the run to say so."""
        if is_dataset_file(self.data) or manifest is None:
            return []
        source = self.sources()[0]
        record = manifest.extra.get("sources", {}).get(source.name) or {}
        kept: dict = {}
        if self.masks is None and self.alpha_mask is None and record.get("masks") and not source.mask_mode:
            kept["alpha_mask" if record.get("alpha_mask") else "masks"] = True
        if all(getattr(self, key) is None for key in TAG_KEYS) and record.get("caption_variants", 1) > 1:
            kept.update({key: record[key] for key in TAG_KEYS if key in record})
        if not getattr(self, "_clips_given", True) and "clip_extraction" in record:  # a video model's source
            cut = {"clip_extraction": record["clip_extraction"], "clips": record.get("clips", 1),
                   "clip_stride": record.get("clip_stride"), "clip_lengths": record.get("clip_lengths", "longest")}
            if cut != {key: getattr(source, key) for key in cut}:
                kept.update(cut)
        if not kept:
            return []
        self._sources = [replace(source, **kept), *self._sources[1:]]
        return [flag(key) + ("" if value is True else f" {value}") for key, value in kept.items()
                if value not in (getattr(Source, key), None) and (key, value) not in (("clips", 1), ("clip_lengths", "longest"))]

    def _check_resolutions(self, preset: Preset) -> str | None:
        """--resolution as its canonical text ("512,1024"), every resolution (and every source's) checked against
        the model's range."""
        given = self.resolution
        if given is None:
            wanted: list = []
        elif isinstance(given, int) and not isinstance(given, bool):
            wanted = [given]
        elif isinstance(given, (list, tuple)):
            wanted = list(given)
        else:
            parts = [p.strip() for p in str(given).split(",")]
            wanted = [int(p) if p.isdigit() else p for p in parts]
        problem_of = family(preset.family).resolution_problem
        for value in wanted:
            if problem := problem_of(preset, value):
                one, several = _valid_examples(preset, problem_of, value)
                raise ValueError(f"--resolution {given}: {problem} for {preset.name}; e.g. --resolution {one} or "
                                 f"--resolution {several}")
        for source in self.sources():
            for value in source.resolution or ():
                if problem := problem_of(preset, value):
                    raise ValueError(f"source {source.name!r} sets resolution = {value}: {problem} for {preset.name}")
        return ",".join(str(r) for r in dict.fromkeys(wanted)) if wanted else None

    def resolutions(self, source: Source | None = None) -> tuple[int, ...]:
        """The resolutions a source's images are cached at: its own, else --resolution, else those the cache holds
        it at (`keep_resolutions`), else the preset's base one. Without a source, every resolution of the run."""
        if source is None:
            return tuple(dict.fromkeys(r for s in self.sources() for r in self.resolutions(s)))
        if source.resolution:
            return source.resolution
        if self.resolution:
            return tuple(int(r) for r in self.resolution.split(","))
        return getattr(self, "_held", {}).get(source.name) or (self.preset().base_resolution,)

    def keep_resolutions(self, manifest) -> None:
        """Let a source for which neither the dataset file nor --resolution names resolutions keep those the cache
        holds its samples at (`manifest`, a `shards.Manifest`), so a re-run without --resolution drops none."""
        base = self.preset().base_resolution
        held: dict[str, set[int]] = {}
        for name, tag in zip(manifest.shards.datasets(), manifest.shards.column("resolution").tolist()):
            held.setdefault(name, set()).add(tag or base)
        self._held = {name: tuple(sorted(r)) for name, r in held.items()}

    def resolution_tag(self, resolution: int) -> int:
        """How the cache records a resolution (`ShardEntry.resolution`, and in keys): 0 for the preset's base one."""
        return 0 if resolution == self.preset().base_resolution else resolution

    def table(self, resolution: int) -> tuple[Bucket, ...]:
        """The bucket table of a resolution, as the model's family builds it (image families: the base resolution's
        published table as it always was, others by `resolution_table`)."""
        preset = self.preset()
        return family(preset.family).bucket_table(preset, resolution)

    def sources(self) -> list[Source]:
        """DATA as its sources: a dataset file's, or one source named after the path with the run's caption-variant
        options (checked once, then kept)."""
        if not hasattr(self, "_sources"):
            self._sources = sources_of(self.data)
            if not is_dataset_file(self.data):
                self._sources = [replace(self._sources[0], **self._tag_values())]
            # --masks / --alpha-mask / --references ask every source for masks or references, as a dataset file's
            # masks = true / references = true asks one
            asked = {k: True for k, on in (("masks", self.masks), ("alpha_mask", self.alpha_mask),
                                           ("references", self.references)) if on}
            for source in self._sources:
                off = next((f for f, key in (("--no-masks", "masks"), ("--no-alpha-mask", "alpha_mask"))
                            if getattr(self, key) is False and source.mask_mode == ("alpha" if key == "alpha_mask" else "file")), None)
                if off and source.from_file:  # a dataset file says which of its sources have masks
                    raise ValueError(f"{off}: source {source.name!r} of {self.data} asks for loss masks, and a dataset "
                                     f"file states its sources in full: remove its masks from the [[source]] table "
                                     f"instead of passing {off}")
                other = (("--alpha-mask", "masks") if self.alpha_mask and source.masks else
                         ("--masks", "alpha_mask") if self.masks and source.alpha_mask else None)
                if other:
                    raise ValueError(f"{other[0]}: source {source.name!r} of {self.data} sets {other[1]} = true; masks "
                                     f"come from one place, mask images (masks) or the images' alpha channel "
                                     f"(alpha_mask): drop {other[0]} or the source's {other[1]}")
            self._sources = [replace(s, **asked) if asked else s for s in self._sources]
        return self._sources

    def preset(self) -> Preset:
        """The model's preset with this run's text-encoder options applied."""
        preset = get_preset(self.model)
        text = get_text_encoder(self.text_encoder) if self.text_encoder else preset.text
        if self.drop_t5:
            text = replace(text, drop_t5=True)
        if self.max_length:
            text = replace(text, max_length=self.max_length)
        return replace(preset, text=text)

    def policy(self, resolution: int | None = None) -> ImagePolicy:
        """How this run turns images into bucket-sized pixels, on the bucket table of `resolution` (default: the
        preset's base resolution, whose table the fingerprint records)."""
        preset = self.preset()
        resolution = resolution or preset.base_resolution
        # an edit preset's references are prepared in the loader's workers, as its family's pipeline prepares them
        prepare_reference = partial(family(preset.family).prepare_reference, preset) if preset.references else None
        return ImagePolicy(self.table(resolution), max_upscale=self.max_upscale,
                           allow_upscale=self.allow_upscale, extreme_aspect=self.extreme_aspect, max_pixels=self.max_pixels,
                           control=self.control, resolution=self.resolution_tag(resolution), clip=clip_policy(self),
                           max_references=preset.references, prepare_reference=prepare_reference)

    @property
    def video(self) -> bool:
        """The model caches clips (a video family): every sample a clip, an image a one-frame one."""
        return family(self.preset().family).video
