"""musubi-tuner's video keys in a dataset file are refused, and the refusal gives the exact equivalent in ours: the
keys it suggests, written into the file with the --frame-buckets it names, cut a video into the clips musubi-tuner
cuts (no model is built here)."""

import re

import numpy as np
import pytest

from precompute.clip_options import clip_policy
from precompute.config import PrecomputeConfig
from precompute.sources import read_dataset_file, tomllib  # tomli on Python 3.10


def musubi_clips(frame_count: int, target_frames=(1,), frame_extraction="head", frame_stride=1, frame_sample=1,
                 max_frames=129) -> set[tuple[int, int]]:
    """(start, frames) of the clips musubi-tuner's video dataset cuts from a video of `frame_count` frames, as its
    documentation describes each frame_extraction (target_frames rounded down to 4k+1; uniform of one sample is head)."""
    lengths = sorted({(f - 1) // 4 * 4 + 1 for f in target_frames})
    if frame_extraction == "uniform" and frame_sample == 1:
        frame_extraction = "head"
    fits = [n for n in lengths if n <= frame_count]
    if frame_extraction == "full":
        n = min(frame_count, max_frames)
        return {(0, (n - 1) // 4 * 4 + 1)}
    if frame_extraction == "head":
        return {(0, n) for n in fits}
    if frame_extraction == "chunk":
        return {(s, n) for n in fits for s in range(0, frame_count - n + 1, n)}
    if frame_extraction == "slide":
        return {(s, n) for n in fits for s in range(0, frame_count - n + 1, frame_stride)}
    return {(int(s), n) for n in fits for s in np.linspace(0, frame_count - n, frame_sample)}


def refusal(tmp_path, keys: str) -> str:
    toml = tmp_path / "musubi.toml"
    toml.write_text(f'[[source]]\npath = "clips"\n{keys}\n', encoding="utf-8")
    with pytest.raises(ValueError) as e:
        read_dataset_file(toml)
    return str(e.value)


def suggested(message: str) -> tuple[str, str]:
    """The source keys a refusal suggests, as TOML lines, and the --frame-buckets it names."""
    ours = message.split(" becomes here: ", 1)[1].split(", with each of", 1)[0]
    lines = "\n".join(f"{k} = {v}" for k, v in re.findall(r'(\w+) = ("[^"]*"|\[[^\]]*\]|\d+)', ours))
    return lines, re.search(r"--frame-buckets ([\d,]+)\)", message).group(1)


CASES = [  # musubi-tuner's keys, ours as the message gives them, and what the message adds
    ('frame_extraction = "slide"\nframe_stride = 10\ntarget_frames = [1, 13, 25]',
     'clip_extraction = "slide", clip_stride = 10, clip_lengths = "each", frame_buckets = [1, 13, 25]', None),
    ('target_frames = [1, 25, 45]\nframe_extraction = "head"',
     'clip_extraction = "head", clip_lengths = "each", frame_buckets = [1, 25, 45]', None),
    ("target_frames = [33]", 'clip_extraction = "head", frame_buckets = [33]', None),
    ('target_frames = [1, 17, 33]\nframe_extraction = "uniform"\nframe_sample = 4',
     'clip_extraction = "uniform", clips = 4, clip_lengths = "each", frame_buckets = [1, 17, 33]', None),
    ('target_frames = [17]\nframe_extraction = "uniform"\nframe_sample = 1', 'clip_extraction = "head", frame_buckets = [17]',
     "frame_sample: no equivalent needed, musubi-tuner ignores it with head"),
    ('target_frames = [13, 25]\nframe_extraction = "chunk"',
     'clip_extraction = "chunk", clip_lengths = "each", frame_buckets = [13, 25]', None),
    ('target_frames = [1, 13, 25]\nframe_extraction = "chunk"',
     'clip_extraction = "chunk", clip_lengths = "each", frame_buckets = [13, 25]',
     "1 is left out: chunk with the one-frame bucket would make every frame a sample"),
    ('frame_extraction = "full"\nmax_frames = 45', 'clip_extraction = "full", frame_buckets = [1, 5, 9, 13, 17, 21, 25, 29, '
                                                   '33, 37, 41, 45]', "every 4k+1 length up to max_frames = 45"),
    ('frame_extraction = "full"\nmax_frames = 47\ntarget_frames = [1, 25]',
     'clip_extraction = "full", frame_buckets = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]',
     "target_frames: no equivalent needed, musubi-tuner ignores it with full"),
    ('target_frames = [1, 24, 48]\nframe_extraction = "slide"\nframe_stride = 8\nmax_frames = 81',
     'clip_extraction = "slide", clip_stride = 8, clip_lengths = "each", frame_buckets = [1, 21, 45]',
     "musubi-tuner rounds 24, 48 down to 4k+1; max_frames: no equivalent needed, musubi-tuner ignores it with slide"),
    ('frame_extraction = "slide"', 'clip_extraction = "slide", clip_stride = 1, frame_buckets = [1]', None),
    ("target_frames = [17]\nsource_fps = 30.0", 'clip_extraction = "head", frame_buckets = [17]',
     "source_fps: none needed, every video is resampled to the model's frame rate by its timestamps"),
]


@pytest.mark.parametrize("theirs, ours, note", CASES)
def test_a_musubi_setting_is_refused_with_its_exact_equivalent(tmp_path, theirs, ours, note):
    message = refusal(tmp_path, theirs)
    first = theirs.split("\n")[0].split(" = ")[0]
    assert re.search(rf"musubi\.toml:3: unknown key '{first}' in \[\[source\]\] \(did you mean '\w+'\?\); musubi-tuner's ",
                     message), message
    assert f" becomes here: {ours}, with each of " in message, message
    if note:
        assert note in message, message


@pytest.mark.parametrize("theirs, ours, note", [c for c in CASES if "source_fps" not in c[0]])
def test_the_suggested_keys_cut_the_clips_musubi_tuner_cuts(tmp_path, theirs, ours, note):
    lines, buckets = suggested(refusal(tmp_path, theirs))
    toml = tmp_path / "ours.toml"
    toml.write_text(f'[[source]]\npath = "clips"\n{lines}\n', encoding="utf-8")
    config = PrecomputeConfig(str(toml), model="tiny-wan", frame_buckets=buckets)
    policy = clip_policy(config, config.sources()[0])
    settings = tomllib.loads(theirs)
    one_frame_chunks = settings.get("frame_extraction") == "chunk" and 1 in settings.get("target_frames", [1])
    for length in (30, 40, 64, 100):
        expected = musubi_clips(length, **{k: v for k, v in settings.items() if k != "source_fps"})
        if one_frame_chunks:  # refused here (every frame a sample); the rest is musubi-tuner's
            expected = {(s, n) for s, n in expected if n > 1}
        assert set(policy.plan(length)) == expected, (length, theirs)


def test_the_unknown_key_hint_names_ours_for_each_musubi_key(tmp_path):
    for key, ours in (("frame_stride", "clip_stride"), ("max_frames", "frames"), ("target_frames", "frame_buckets")):
        assert f"unknown key '{key}' in [[source]] (did you mean '{ours}'?)" in refusal(tmp_path, f"{key} = 9")


def test_a_value_musubi_tuner_would_refuse_gets_no_equivalent(tmp_path):
    for keys in ('frame_extraction = "sideways"', "target_frames = 17", "frame_stride = 0", "target_frames = [1, true]"):
        message = refusal(tmp_path, keys)
        assert "unknown key" in message and "musubi-tuner's" not in message, message


def test_musubi_tuners_datasets_tables_say_what_a_source_is_here(tmp_path):
    toml = tmp_path / "musubi.toml"
    toml.write_text('[general]\nresolution = [960, 544]\n[[datasets]]\nvideo_directory = "v"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown table or key 'datasets'; a dataset file lists \[\[source\]\] tables only "
                                         r"\(musubi-tuner's \[\[datasets\]\] are \[\[source\]\] tables here"):
        read_dataset_file(toml)
