"""Clip extraction as musubi-tuner's users know it: a clip of every frame bucket (`clip_lengths = "each"`, its
target_frames), a sliding window (`slide`, its frame_stride); the keys, fingerprints and salts of caches made before
these choices existed stay as they were; and the options are checked before anything runs (no model is built here)."""

import hashlib

import pytest

from precompute.clips import clip_choice, clip_key
from precompute.config import PrecomputeConfig
from precompute.images import clips_fingerprint
from precompute.sample_video import frame_index, make_video
from precompute.sources import Source, read_dataset_file
from precompute.video import ClipPolicy, read_clips


def config(data="data", **kw):
    return PrecomputeConfig(data, **{"model": "tiny-wan", **kw})


def by_end(clip: tuple[int, int]) -> tuple[int, int]:
    """The order of a plan's clips: where they end, then where they start."""
    start, frames = clip
    return start + frames, start


def x_rows(plan, length=40) -> set[str]:
    """A plan drawn as musubi-tuner's documentation draws it: a row per clip, x for a frame of it, o for the others."""
    return {"o" * s + "x" * n + "o" * (length - s - n) for s, n in plan}


# musubi-tuner's documentation (docs/dataset_config.md, "frame_extraction Options"), a video of 40 frames; the third
# one-frame row of uniform is at frame 26 as its code computes it (np.linspace(0, 39, 4, dtype=int)), not at 25 as drawn
MUSUBI_DIAGRAMS = {
    ("head", (1, 13, 25)): """
        xooooooooooooooooooooooooooooooooooooooo
        xxxxxxxxxxxxxooooooooooooooooooooooooooo
        xxxxxxxxxxxxxxxxxxxxxxxxxooooooooooooooo""",
    ("chunk", (13, 25)): """
        xxxxxxxxxxxxxooooooooooooooooooooooooooo
        oooooooooooooxxxxxxxxxxxxxoooooooooooooo
        ooooooooooooooooooooooooooxxxxxxxxxxxxxo
        xxxxxxxxxxxxxxxxxxxxxxxxxooooooooooooooo""",
    ("slide", (1, 13, 25)): """
        xooooooooooooooooooooooooooooooooooooooo
        ooooooooooxooooooooooooooooooooooooooooo
        ooooooooooooooooooooxooooooooooooooooooo
        ooooooooooooooooooooooooooooooxooooooooo
        xxxxxxxxxxxxxooooooooooooooooooooooooooo
        ooooooooooxxxxxxxxxxxxxooooooooooooooooo
        ooooooooooooooooooooxxxxxxxxxxxxxooooooo
        xxxxxxxxxxxxxxxxxxxxxxxxxooooooooooooooo
        ooooooooooxxxxxxxxxxxxxxxxxxxxxxxxxooooo""",
    ("uniform", (1, 13, 25)): """
        xooooooooooooooooooooooooooooooooooooooo
        oooooooooooooxoooooooooooooooooooooooooo
        ooooooooooooooooooooooooooxooooooooooooo
        ooooooooooooooooooooooooooooooooooooooox
        xxxxxxxxxxxxxooooooooooooooooooooooooooo
        oooooooooxxxxxxxxxxxxxoooooooooooooooooo
        ooooooooooooooooooxxxxxxxxxxxxxooooooooo
        oooooooooooooooooooooooooooxxxxxxxxxxxxx
        xxxxxxxxxxxxxxxxxxxxxxxxxooooooooooooooo
        oooooxxxxxxxxxxxxxxxxxxxxxxxxxoooooooooo
        ooooooooooxxxxxxxxxxxxxxxxxxxxxxxxxooooo
        oooooooooooooooxxxxxxxxxxxxxxxxxxxxxxxxx""",
}


@pytest.mark.parametrize("mode, buckets", list(MUSUBI_DIAGRAMS))
def test_each_length_cuts_a_40_frame_video_as_musubi_tuners_documentation_draws_it(mode, buckets):
    policy = ClipPolicy(16.0, buckets, mode, clips=4, stride=10, lengths="each")
    plan = policy.plan(40)
    assert x_rows(plan) == {row.strip() for row in MUSUBI_DIAGRAMS[mode, buckets].strip().splitlines()}
    assert len(plan) == len(set(plan)) and plan == sorted(plan, key=by_end)  # the clips' indices


def test_the_longest_length_stays_the_default_and_slide_takes_it_too():
    buckets = (1, 17, 33, 49, 81)
    assert ClipPolicy(16.0, buckets).plan(40) == [(0, 33)]
    assert ClipPolicy(16.0, buckets, "chunk").plan(100) == [(0, 81)]
    assert ClipPolicy(16.0, buckets, "uniform", clips=3).plan(40) == [(0, 33), (3, 33), (7, 33)]
    assert ClipPolicy(16.0, buckets, "slide", stride=8).plan(50) == [(0, 49)]
    assert ClipPolicy(16.0, buckets, "slide", stride=8).plan(48) == [(0, 33), (8, 33)]
    assert ClipPolicy(16.0, buckets, "slide", stride=100).plan(48) == [(0, 33)]


def test_each_takes_the_one_frame_bucket_beside_longer_clips_and_a_short_video_is_still_too_short():
    each = ClipPolicy(16.0, (1, 17, 33), "head", lengths="each")
    assert each.plan(40) == [(0, 1), (0, 17), (0, 33)]  # the video's first frame is a one-frame sample
    assert each.plan(20) == [(0, 1), (0, 17)]
    assert each.plan(10) == []  # shorter than every longer bucket: too_short, not a first frame alone
    assert each.plan(1) == [(0, 1)]  # a one-frame video (a still) is one
    assert ClipPolicy(16.0, (17, 33), "head", lengths="each").plan(40) == [(0, 17), (0, 33)]  # 1 only when asked for
    assert ClipPolicy(16.0, (1,), "slide", stride=16, lengths="each").plan(40) == [(0, 1), (16, 1), (32, 1)]


def test_a_policy_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="stride must be at least 1"):
        ClipPolicy(16.0, (17,), "slide", stride=0)
    with pytest.raises(ValueError, match="lengths must be one of longest, each"):
        ClipPolicy(16.0, (17,), lengths="all")
    with pytest.raises(ValueError, match="does not apply to extraction 'full'"):
        ClipPolicy(16.0, (17,), "full", lengths="each")


# Captured from the code before `slide` and `clip_lengths` existed: the keys of every cached clip, the cache's
# fingerprint and the sources' salts (the stamps of their inputs) must come out the same, or an old cache would be
# encoded again.
BEFORE = [
    (ClipPolicy(16.0, (1, 17, 33, 49, 81)), b"head\x001,17,33,49,81\x0016.0",
     "a8108d3ed3ea65f49e44e6af0368d98e3778b504e51ddf86d014f068118259f9"),
    (ClipPolicy(16.0, (1, 17, 33), "uniform", 3), b"uniform\x003\x001,17,33\x0016.0",
     "d45a74ffbc78eb41dc7ddbc50385e83b6484256c2b18639705ad3e8e0d9b5151"),
    (ClipPolicy(16.0, (1, 17), "chunk"), b"chunk\x001,17\x0016.0",
     "3cf27ff746f79493462aba4d964fd5f51be9c2610bd46d6fd0151ab674e6c7b3"),
    (ClipPolicy(24.0, (1, 17, 33, 49, 81, 121), "full"), b"full\x001,17,33,49,81,121\x0024.0",
     "4dc8b50331c08ce9a40e56ca4caac19618289a1d337eba4b041c713816a0a067"),
]
BASE = hashlib.sha256(b"golden").hexdigest()


@pytest.mark.parametrize("policy, choice, key", BEFORE)
def test_the_keys_and_fingerprint_of_a_cache_made_before_are_unchanged(policy, choice, key):
    assert clip_choice(policy) == choice and clip_key(BASE, choice, 1, 3) == key
    fingerprint = policy.fingerprint()
    assert "stride" not in fingerprint and "lengths" not in fingerprint
    assert set(clips_fingerprint(policy)) == {"frame_rate", "frame_buckets", "resample", "rotation", "pixel_aspect",
                                              "animated_images", "video_preprocessing_version"}


def test_stride_and_lengths_join_the_clip_keys_and_only_the_policy_fingerprint():
    policies = [ClipPolicy(16.0, (1, 17, 33), "slide", stride=8), ClipPolicy(16.0, (1, 17, 33), "slide", stride=4),
                ClipPolicy(16.0, (1, 17, 33), "slide", stride=8, lengths="each"),
                ClipPolicy(16.0, (1, 17, 33), "head", lengths="each"), ClipPolicy(16.0, (1, 17, 33)),
                ClipPolicy(16.0, (1, 17, 33), "uniform", 3, lengths="each"), ClipPolicy(16.0, (1, 17, 33), "uniform", 3)]
    assert len({clip_choice(p) for p in policies}) == len(policies)  # every change of choice is another clip's key
    assert len({clip_key(BASE, clip_choice(p), 0, 2) for p in policies}) == len(policies)
    assert policies[0].fingerprint()["stride"] == 8 and "lengths" not in policies[0].fingerprint()
    assert policies[3].fingerprint()["lengths"] == "each" and "stride" not in policies[3].fingerprint()
    # the cache's fingerprint keeps what cuts frames, not which clips are taken: a source may change these
    assert len({str(clips_fingerprint(p)) for p in policies}) == 1


def test_a_sources_salt_and_record_are_unchanged_without_the_new_keys_and_change_with_them():
    old = [(Source("a", "/d", clip_extraction="head", clips=1, frame_buckets=(1, 17, 33, 49, 81)), 17036238139229176,
            {"path": "/d", "repeats": 1, "clip_extraction": "head", "frame_buckets": [1, 17, 33, 49, 81]}),
           (Source("b", "/d", clip_extraction="uniform", clips=3, frame_buckets=(1, 17)), 5342594262709195155,
            {"path": "/d", "repeats": 1, "clip_extraction": "uniform", "clips": 3, "frame_buckets": [1, 17]}),
           (Source("c", "/d", clip_extraction="chunk", clips=1, frame_buckets=(17,), video_column="v"), 1995773990314092090,
            {"path": "/d", "repeats": 1, "clip_extraction": "chunk", "frame_buckets": [17], "video_column": "v"})]
    for source, salt, record in old:
        assert source.salt() == salt and source.record() == record
    # the run fills clip_lengths = "longest" in: the same salt as before it existed
    assert Source("a", "/d", clip_extraction="head", clips=1, clip_lengths="longest", frame_buckets=(1, 17, 33, 49, 81)).salt() == old[0][1]
    slide = Source("s", "/d", clip_extraction="slide", clips=1, clip_stride=8, frame_buckets=(1, 17))
    each = Source("s", "/d", clip_extraction="slide", clips=1, clip_stride=8, clip_lengths="each", frame_buckets=(1, 17))
    assert len({slide.salt(), each.salt(), Source("s", "/d", clip_extraction="slide", clips=1, clip_stride=4,
                                                  frame_buckets=(1, 17)).salt()}) == 3
    assert each.record()["clip_stride"] == 8 and each.record()["clip_lengths"] == "each"


def test_the_run_and_its_sources_take_stride_and_lengths(tmp_path):
    policy = config(clip_extraction="slide", clip_stride=8, clip_lengths="each").policy().clip
    assert (policy.extraction, policy.stride, policy.lengths) == ("slide", 8, "each")
    toml = tmp_path / "data.toml"
    toml.write_text('[[source]]\npath = "a"\nclip_extraction = "slide"\nclip_stride = 4\n'
                    '[[source]]\npath = "b"\nclip_lengths = "each"\nframe_buckets = [1, 17]\n'
                    '[[source]]\npath = "c"\nclip_extraction = "full"\n[[source]]\npath = "d"\n', encoding="utf-8")
    a, b, c, d = config(str(toml), clip_lengths="each").sources()
    assert (a.clip_extraction, a.clip_stride, a.clip_lengths) == ("slide", 4, "each")
    assert (b.clip_extraction, b.clip_stride, b.clip_lengths, b.frame_buckets) == ("head", None, "each", (1, 17))
    assert (c.clip_extraction, c.clip_lengths) == ("full", "longest")  # a whole video is one clip whatever the run's lengths
    assert d.clip_lengths == "each"
    from precompute.clip_options import clip_policy

    # a 40-frame video: one frame every 4 up to 36, 17 frames every 4 up to 23, 33 frames every 4 up to 7
    assert clip_policy(config(str(toml), clip_lengths="each"), a).plan(40) == sorted(
        [(s, 1) for s in range(0, 40, 4)] + [(s, 17) for s in range(0, 24, 4)] + [(0, 33), (4, 33)], key=by_end)
    # without the new options, sources are filled in as before
    (plain,) = config().sources()
    assert (plain.clip_stride, plain.clip_lengths) == (None, "longest") and "clip_lengths" not in plain.record()


@pytest.mark.parametrize("options, message", [
    (dict(clip_stride=8), r"^--clip-stride 8: applies to --clip-extraction slide \(this run's is head\)"),
    (dict(clip_extraction="slide"), r"^--clip-extraction slide needs --clip-stride N"),
    (dict(clip_extraction="full", clip_lengths="each"), r"^--clip-lengths each: --clip-extraction full takes one clip"),
    (dict(clip_extraction="chunk", clip_lengths="each"),
     r"^--clip-lengths each with --clip-extraction chunk and the one-frame bucket \(--frame-buckets 1,17,33,49,81\): every "
     r"frame of every video would become a one-frame sample .*; pass --frame-buckets 17,33,49,81"),
    (dict(clip_lengths="every"), r"^--clip-lengths"),
    (dict(model="tiny-sana", clip_lengths="each"), r"^--clip-lengths: tiny-sana takes images"),
    (dict(model="tiny-sana", clip_stride=4), r"^--clip-stride: tiny-sana takes images"),
])
def test_a_run_option_that_cannot_apply_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        config(**options)


def test_chunks_of_each_length_are_taken_without_the_one_frame_bucket():
    (source,) = config(clip_extraction="chunk", clip_lengths="each", frame_buckets="17,33").sources()
    assert (source.clip_extraction, source.clip_lengths, source.frame_buckets) == ("chunk", "each", (17, 33))


@pytest.mark.parametrize("source, message", [
    ("clip_stride = 4", r"source 'a' sets clip_stride = 4: applies to clip_extraction = \"slide\" \(the source's is 'head'\)"),
    ('clip_extraction = "slide"', r"source 'a' cuts its videos with slide, which needs a stride: add clip_stride = N"),
    ('clip_extraction = "full"\nclip_lengths = "each"', r"source 'a' sets clip_lengths = \"each\" with clip_extraction = "
                                                        r"\"full\", which takes one clip"),
    ('clip_extraction = "chunk"\nclip_lengths = "each"', r"source 'a' cuts its videos in chunks of each frame bucket, the "
                                                         r"one-frame bucket among them .*set the source's frame_buckets = "
                                                         r"\[17, 33, 49, 81\]"),
])
def test_a_sources_stride_or_lengths_that_cannot_apply_is_refused(tmp_path, source, message):
    toml = tmp_path / "data.toml"
    toml.write_text(f'[[source]]\npath = "a"\n{source}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        config(str(toml))


@pytest.mark.parametrize("source, message", [
    ('clip_lengths = "all"', r"data\.toml:3: source 'a': clip_lengths = 'all': must be one of longest, each"),
    ("clip_stride = 0", r"data\.toml:3: source 'a': clip_stride = 0: must be a whole number ≥ 1"),
    ('clip_extraction = "window"', r"must be one of head, uniform, chunk, full, slide"),
])
def test_a_bad_stride_or_lengths_key_is_refused_with_its_line(tmp_path, source, message):
    toml = tmp_path / "data.toml"
    toml.write_text(f'[[source]]\npath = "a"\n{source}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_dataset_file(toml)


@pytest.mark.parametrize("suffix", [".mp4", ".webm"])
def test_every_clip_of_every_length_holds_the_frames_it_names(tmp_path, suffix):
    """Decoded, not only planned: with each length, frame k of a clip starting at s is the video's frame s + k. This
    WebM's container states 41 frames (its millisecond timestamps round 2.5 s up) and holds 40: the clips that would
    run past its end are left out, not cut short into copies of the shorter clips at their start."""
    make_video(tmp_path / f"v{suffix}", "index", 40, 16.0, (64, 64))
    data = (tmp_path / f"v{suffix}").read_bytes()
    policies = [ClipPolicy(16.0, (1, 17, 33), "slide", stride=8, lengths="each"),
                ClipPolicy(16.0, (1, 17, 33), "head", lengths="each"),
                ClipPolicy(16.0, (17, 33), "chunk", lengths="each")]
    if suffix == ".mp4":  # uniform's starts depend on the length: the WebM's last clip of each length is left out
        policies.append(ClipPolicy(16.0, (1, 17, 33), "uniform", clips=3, lengths="each"))
    for policy in policies:
        stats = {}
        clips, reason, _ = read_clips(data, policy, 10**9, stats)
        assert reason is None and stats.get("length", 40) == (41 if suffix == ".webm" else 40)
        assert [(c.index, c.start, len(c.frames)) for c in clips] == [(i, s, n) for i, (s, n) in enumerate(policy.plan(40))]
        for c in clips:
            assert [frame_index(f[40, 40]) for f in c.frames] == list(range(c.start, c.start + len(c.frames)))
