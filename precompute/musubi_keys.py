"""musubi-tuner's video keys of a dataset .toml (`target_frames`, `frame_extraction`, `frame_stride`, `frame_sample`,
`max_frames`, `source_fps`) written as this product's source keys, so that the refusal of one of them says exactly
what to write instead.

What musubi-tuner does with them (its `VideoDataset`): every length of `target_frames` is rounded down to 4k+1; "head"
takes a clip of each length from the start, "chunk" consecutive clips of each length, "slide" a clip of each length
every `frame_stride` frames, "uniform" `frame_sample` clips of each length evenly spaced (with `frame_sample = 1` it is
"head"); "full" ignores `target_frames` and takes the whole video, cut to `max_frames` (default 129) and down to 4k+1.
Here that is `clip_extraction`, `clip_stride`, `clips`, `clip_lengths = "each"` (a set of clips per length) and
`frame_buckets` (the lengths); "full" picks the longest frame bucket a video holds, so its equivalent lists every 4k+1
length up to `max_frames`.
"""

from __future__ import annotations

MUSUBI_KEYS = ("target_frames", "frame_extraction", "frame_stride", "frame_sample", "max_frames", "source_fps")
_DEFAULTS = {"target_frames": [1], "frame_extraction": "head", "frame_stride": 1, "frame_sample": 1, "max_frames": 129}
_MODES = ("head", "chunk", "slide", "uniform", "full")
_STEP = 4  # musubi-tuner rounds lengths to 4k+1 for every architecture


def ours(table: dict) -> str | None:
    """What to write in a [[source]] table instead of its musubi-tuner video keys, as a sentence naming theirs and
    ours; None when it holds none, or a value musubi-tuner would refuse (the caller's message stands alone then)."""
    given = {k: table[k] for k in MUSUBI_KEYS if k in table}
    if not given or not _valid(given):
        return None
    v = {**_DEFAULTS, **given}
    mode = v["frame_extraction"]
    if mode == "uniform" and v["frame_sample"] == 1:
        mode = "head"  # musubi-tuner's own reading of one uniform sample
    lengths = sorted({(f - 1) // _STEP * _STEP + 1 for f in v["target_frames"]})
    keys, notes = {"clip_extraction": f'"{mode}"'}, []
    if mode == "full":
        top = (v["max_frames"] - 1) // _STEP * _STEP + 1
        lengths = list(range(1, top + 1, _STEP))
        notes.append(f"full takes the longest frame bucket a video holds, so every 4k+1 length up to max_frames = "
                     f"{v['max_frames']} is one (fewer, e.g. [1, 17, 33, 49, 81], batch better)")
    else:
        if mode == "slide":
            keys["clip_stride"] = str(v["frame_stride"])
        if mode == "uniform":
            keys["clips"] = str(v["frame_sample"])
        if mode == "chunk" and lengths[0] == 1 and len(lengths) > 1:
            lengths = lengths[1:]
            notes.append("1 is left out: chunk with the one-frame bucket would make every frame a sample, which "
                         "musubi-tuner's documentation also warns against")
        if len(lengths) > 1:
            keys["clip_lengths"] = '"each"'
    keys["frame_buckets"] = str(lengths)
    rounded = [f for f in given.get("target_frames", ()) if (f - 1) % _STEP]
    if rounded and mode != "full":
        notes.append(f"musubi-tuner rounds {', '.join(map(str, rounded))} down to 4k+1")
    unused = [k for k, applies in (("frame_stride", "slide"), ("frame_sample", "uniform"), ("max_frames", "full"))
              if k in given and mode != applies]
    unused += ["target_frames"] if "target_frames" in given and mode == "full" else []
    if unused:
        notes.append(f"{', '.join(unused)}: no equivalent needed, musubi-tuner ignores {'it' if len(unused) == 1 else 'them'} "
                     f"with {mode}")
    if "source_fps" in given:
        notes.append("source_fps: none needed, every video is resampled to the model's frame rate by its timestamps")
    theirs = ", ".join(f"{k} = {_toml(given[k])}" for k in MUSUBI_KEYS if k in given)
    text = (f"musubi-tuner's {theirs} becomes here: {', '.join(f'{k} = {x}' for k, x in keys.items())}, with each of "
            f"{lengths} among the run's --frame-buckets (e.g. --frame-buckets {','.join(map(str, lengths))}); frames "
            f"and strides count at the model's frame rate")
    return text + "".join(f"; {n}" for n in notes)


def _valid(given: dict) -> bool:
    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    frames = given.get("target_frames", [1])
    fps = given.get("source_fps", 1.0)
    return (isinstance(frames, list) and bool(frames) and all(count(f) for f in frames)
            and given.get("frame_extraction", "head") in _MODES
            and all(count(given.get(k, 1)) for k in ("frame_stride", "frame_sample", "max_frames"))
            and isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0)


def _toml(value) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)
