"""The clip options of a stage-one run (`--frames`, `--frame-buckets`, `--clip-extraction`, `--clips`, `--clip-stride`,
`--clip-lengths`, `--decode-timeout`) and of its sources (`frames`, `frame_buckets`, `clip_extraction`, `clips`,
`clip_stride`, `clip_lengths`, `video_column`): checked against the model's family, and each source's filled in with what
applies to it, from which its `ClipPolicy` is built.

An image model takes none of them: given, they are refused naming the presets that take video.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace

from precompute.families import family
from precompute.images import video_presets
from precompute.sources import Source
from precompute.video import ClipPolicy
from shards.options import default_of, flag

RUN_KEYS = ("frames", "frame_buckets", "clip_extraction", "clips", "clip_stride", "clip_lengths")  # an image model refuses them
CUT_KEYS = ("clip_extraction", "clips", "clip_stride", "clip_lengths")  # which clips of a video: the order of RunClips
SOURCE_KEYS = ("frames", "frame_buckets", "clip_extraction", "clips", "clip_stride", "clip_lengths", "video_column")


def check_clip_options(config, preset) -> list[Source]:
    """The run's sources, each with its clip choices filled in (`Source.clip_extraction`, `clips`, `clip_stride`,
    `clip_lengths`, `frame_buckets`) for a video model; after checking the run's and the sources' clip options
    (`config.frames` and `config.frame_buckets` are set to what applies: the longest clip, and the buckets as "1,17,33").

    Raises:
        ValueError: an option an image model does not take, or a value the family refuses; naming the option or the
            source's key.
    """
    fam, sources = family(preset.family), config.sources()
    cls = type(config)
    # which clips to cut, given (a re-run that gives none keeps a source's recorded ones: `keep_recorded`), or the defaults
    config._clips_given = any(getattr(config, k) is not None for k in CUT_KEYS)
    if not fam.video:
        given = [k for k in RUN_KEYS if getattr(config, k) != default_of(cls, k)]
        if given:
            raise ValueError(f"{flag(given[0])}: {preset.name} takes images; clip options apply to video models "
                             f"({', '.join(video_presets())})")
        for source in sources:
            if key := next((k for k in SOURCE_KEYS if getattr(source, k) is not None), None):
                raise ValueError(f"source {source.name!r} sets {key}, which applies to video models "
                                 f"({', '.join(video_presets())}); {preset.name} takes images")
        return sources
    for name in ("control", "masks", "alpha_mask"):
        if getattr(config, name):
            raise ValueError(f"{flag(name)}: {preset.name} caches clips, which take no control images or loss masks")
    for source in sources:
        key = next((k for k in ("flip", "control", "control_column", "mask", "mask_column", "alpha_mask", "masks")
                    if getattr(source, k) not in (None, False)), None)
        if key:
            raise ValueError(f"source {source.name!r} sets {key}, which {preset.name} does not take: its cache holds clips, "
                             f"without flipped latents, control images or loss masks; remove {key} from the dataset file")
    for key, default in zip(CUT_KEYS, astuple(RunClips())):
        if getattr(config, key) is None:
            setattr(config, key, default)
    step = fam.temporal_downsample
    buckets = frame_list(config.frame_buckets, "--frame-buckets")
    for b in buckets:
        if problem := frames_problem(b, step):
            raise ValueError(f"--frame-buckets {config.frame_buckets}: {b}: {problem}")
    if buckets != sorted(set(buckets)):
        raise ValueError(f"--frame-buckets {config.frame_buckets}: the lengths must ascend, each once (e.g. 1,17,33,49,81)")
    frames = config.frames or (buckets[-1] if buckets else fam.frame_buckets[-1])
    if problem := frames_problem(frames, step):
        raise ValueError(f"--frames {frames}: {problem}")
    if not buckets:
        buckets = sorted({b for b in fam.frame_buckets if b <= frames} | {frames})
    if buckets[-1] > frames:
        raise ValueError(f"--frame-buckets {config.frame_buckets}: {buckets[-1]} is longer than --frames {frames}, the "
                         f"longest clip")
    if config.clips != 1 and config.clip_extraction != "uniform":
        raise ValueError(f"--clips {config.clips}: applies to --clip-extraction uniform (this run's is "
                         f"{config.clip_extraction}, which takes its own number of clips)")
    if config.clip_stride is not None and config.clip_extraction != "slide":
        raise ValueError(f"--clip-stride {config.clip_stride}: applies to --clip-extraction slide (this run's is "
                         f"{config.clip_extraction})")
    if config.clip_lengths == "each" and config.clip_extraction == "full":
        raise ValueError("--clip-lengths each: --clip-extraction full takes one clip of a video, the whole of it; "
                         "leave --clip-lengths at longest, or choose head, uniform, chunk or slide")
    config.frames, config.frame_buckets = frames, ",".join(map(str, buckets))
    run = RunClips(config.clip_extraction, config.clips, config.clip_stride, config.clip_lengths)
    return [clip_source(source, buckets, run, step) for source in sources]


@dataclass(frozen=True)
class RunClips:
    """The run's clip choices, which a source takes where it sets none of its own."""

    extraction: str = "head"
    clips: int = 1
    stride: int | None = None
    lengths: str = "longest"


def clip_source(source: Source, buckets: list[int], run: RunClips, step: int) -> Source:
    """A source with its clip choices filled in: its own, else the run's (`buckets`, `run`)."""
    where = f"source {source.name!r}"
    own = source.frame_buckets
    for b in own or ():
        if b not in buckets:
            raise ValueError(f"{where} sets frame_buckets = {list(own)}: {b} is not one of the run's frame buckets "
                             f"({','.join(map(str, buckets))}); add it to --frame-buckets, or leave it out")
    top = source.frames
    if top is not None:
        if problem := frames_problem(top, step):
            raise ValueError(f"{where} sets frames = {top}: {problem}")
        if top not in buckets:
            raise ValueError(f"{where} sets frames = {top}, not one of the run's frame buckets "
                             f"({','.join(map(str, buckets))}); add it to --frame-buckets")
        if own and own[-1] > top:
            raise ValueError(f"{where} sets frame_buckets = {list(own)}, longer than its frames = {top}")
    mine = tuple(own or (b for b in buckets if top is None or b <= top))
    mode = source.clip_extraction or run.extraction
    if source.clips is not None and mode != "uniform":
        raise ValueError(f"{where} sets clips = {source.clips}: applies to clip_extraction = \"uniform\" (the source's "
                         f"is {mode!r})")
    count = source.clips or (run.clips if mode == "uniform" else 1)
    stride, lengths = _stride_and_lengths(source, mode, mine, run)
    return replace(source, clip_extraction=mode, clips=count, frame_buckets=mine, clip_stride=stride, clip_lengths=lengths)


def _stride_and_lengths(source: Source, mode: str, buckets: tuple[int, ...], run: RunClips) -> tuple[int | None, str]:
    """A source's stride (None unless it slides) and lengths, checked against its extraction and frame buckets; each
    problem named as the source's key, or as the run's flag where the source took the run's value."""
    where = f"source {source.name!r}"
    if source.clip_stride is not None and mode != "slide":
        raise ValueError(f"{where} sets clip_stride = {source.clip_stride}: applies to clip_extraction = \"slide\" (the "
                         f"source's is {mode!r})")
    stride = (source.clip_stride or run.stride) if mode == "slide" else None
    if mode == "slide" and stride is None:
        raise ValueError(f"{where} cuts its videos with slide, which needs a stride: add clip_stride = N (frames from one "
                         f"clip's start to the next, at the model's frame rate) to the source, or pass --clip-stride N"
                         if source.from_file else "--clip-extraction slide needs --clip-stride N: the frames from one "
                         "clip's start to the next, at the model's frame rate (e.g. 8)")
    lengths = source.clip_lengths or run.lengths
    if mode == "full" and lengths == "each":
        if source.clip_lengths is None:
            lengths = "longest"  # the run's choice of lengths does not apply to a source that takes whole videos
        else:
            raise ValueError(f"{where} sets clip_lengths = \"each\" with clip_extraction = \"full\", which takes one "
                             f"clip of a video, the whole of it; drop clip_lengths, or choose head, uniform, chunk or slide")
    if mode == "chunk" and lengths == "each" and buckets[0] == 1 and len(buckets) > 1:
        # musubi-tuner's documentation warns against 1 in target_frames with chunk for the same reason
        what = "every frame of every video would become a one-frame sample (still images are cached as one-frame clips all the same)"
        if source.from_file:
            raise ValueError(f"{where} cuts its videos in chunks of each frame bucket, the one-frame bucket among them "
                             f"(frame_buckets {list(buckets)}): {what}; set the source's frame_buckets = "
                             f"{list(buckets[1:])}")
        raise ValueError(f"--clip-lengths each with --clip-extraction chunk and the one-frame bucket (--frame-buckets "
                         f"{','.join(map(str, buckets))}): {what}; pass --frame-buckets {','.join(map(str, buckets[1:]))}")
    return stride, lengths


def clip_policy(config, source: Source | None = None) -> ClipPolicy | None:
    """How a source's videos become clips (without a source: the run's choices, which the fingerprint records in
    part); None for an image model."""
    preset = config.preset()
    fam = family(preset.family)
    if not fam.video:
        return None
    if source is None:
        buckets, extraction, clips = tuple(int(b) for b in config.frame_buckets.split(",")), config.clip_extraction, config.clips
        stride, lengths = config.clip_stride, config.clip_lengths
    else:
        buckets, extraction, clips = source.frame_buckets, source.clip_extraction, source.clips
        stride, lengths = source.clip_stride, source.clip_lengths or "longest"
    return ClipPolicy(fam.frame_rate_of(preset), buckets, extraction, clips, config.decode_timeout, stride=stride or 1,
                      lengths=lengths)


def frames_problem(frames: object, step: int) -> str | None:
    """Why `frames` is not a clip length of a family whose VAE takes `step` frames per latent frame after the first."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        return "a clip length is a whole number of frames ≥ 1"
    if (frames - 1) % step:
        below = frames - (frames - 1) % step
        return (f"a clip is {step}k+1 frames long (its first frame, then {step} per latent frame): e.g. {below} or "
                f"{below + step}")
    return None


def frame_list(value, option: str) -> list[int]:
    """--frame-buckets as a list of frame counts ("1,17,33", a list from --config, or one number); [] when not given."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out = []
    for p in parts:
        text = str(p).strip()
        if isinstance(p, bool) or not text.isdigit():
            raise ValueError(f"{option} {value}: {p!r} is not a number of frames; write them comma-separated, e.g. "
                             f"1,17,33,49,81")
        out.append(int(text))
    return out
