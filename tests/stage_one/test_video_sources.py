"""The clip options of a run and of a dataset file's sources, checked against the model before anything runs (no
model is built here), and what of them joins the keys and stamps of a source's clips."""

import pytest

from precompute.clips import clip_key, clip_stamp
from precompute.config import PrecomputeConfig
from precompute.sources import read_dataset_file


def config(data="data", **kw):
    return PrecomputeConfig(data, **{"model": "tiny-wan", **kw})


def test_the_defaults_are_the_familys_frame_buckets_up_to_frames():
    assert config().frame_buckets == "1,17,33,49,81" and config().frames == 81
    assert config(frames=65).frame_buckets == "1,17,33,49,65"  # --frames is the longest clip
    assert config(frame_buckets="1,17,33").frames == 33
    assert config(frame_buckets=[1, 17]).frame_buckets == "1,17"  # as --config FILE gives a list
    policy = config(clip_extraction="uniform", clips=3).policy().clip
    assert (policy.frame_rate, policy.frame_buckets, policy.extraction, policy.clips) == (16.0, (1, 17, 33, 49, 81), "uniform", 3)


@pytest.mark.parametrize("options, message", [
    (dict(frames=20), r"^--frames 20: a clip is 4k\+1 frames long .*e\.g\. 17 or 21"),
    (dict(frame_buckets="1,17,40"), r"^--frame-buckets 1,17,40: 40: a clip is 4k\+1"),
    (dict(frame_buckets="17,1"), r"^--frame-buckets 17,1: the lengths must ascend"),
    (dict(frame_buckets="1,x"), r"^--frame-buckets 1,x: 'x' is not a number of frames"),
    (dict(frames=33, frame_buckets="1,49"), r"^--frame-buckets 1,49: 49 is longer than --frames 33"),
    (dict(clips=3), r"^--clips 3: applies to --clip-extraction uniform"),
    (dict(clip_extraction="middle"), r"^--clip-extraction"),
    (dict(masks=True), r"^--masks: tiny-wan caches clips"),
    (dict(model="tiny-sana", frames=17), r"^--frames: tiny-sana takes images; clip options apply to video models \(.*tiny-wan"),
    (dict(model="tiny-sana", clip_extraction="chunk"), r"^--clip-extraction: tiny-sana takes images"),
])
def test_a_clip_option_the_model_cannot_take_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        config(**options)


def test_a_sources_clip_keys_are_read_checked_and_filled_in(tmp_path):
    toml = tmp_path / "data.toml"
    toml.write_text('[[source]]\npath = "a"\nclip_extraction = "uniform"\nclips = 4\nframes = 33\n'
                    '[[source]]\npath = "b"\nframe_buckets = [1, 17]\n[[source]]\npath = "c"\n', encoding="utf-8")
    a, b, c = config(str(toml), clip_extraction="chunk").sources()
    assert (a.clip_extraction, a.clips, a.frame_buckets) == ("uniform", 4, (1, 17, 33))
    assert (b.clip_extraction, b.clips, b.frame_buckets) == ("chunk", 1, (1, 17))
    assert (c.clip_extraction, c.frame_buckets) == ("chunk", (1, 17, 33, 49, 81))
    assert a.record()["clip_extraction"] == "uniform" and a.record()["clips"] == 4 and b.record()["frame_buckets"] == [1, 17]
    assert len({a.salt(), b.salt(), c.salt()}) == 3  # a source's choices are in its stamps: changing them reads it again


@pytest.mark.parametrize("source, message", [
    ('clip_extraction = "all"', r"data\.toml:3: source 'a': clip_extraction = 'all': must be one of head, uniform, chunk, full"),
    ("frame_buckets = [17, 1]", r"data\.toml:3: .*must be a list of frame counts ≥ 1, ascending"),
    ("clips = 0", r"data\.toml:3: .*clips = 0: must be a whole number ≥ 1"),
])
def test_a_bad_clip_key_is_refused_with_its_line(tmp_path, source, message):
    toml = tmp_path / "data.toml"
    toml.write_text(f'[[source]]\npath = "a"\n{source}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_dataset_file(toml)


@pytest.mark.parametrize("source, message", [
    ("frames = 20", r"source 'a' sets frames = 20: a clip is 4k\+1"),
    ("frames = 65", r"source 'a' sets frames = 65, not one of the run's frame buckets \(1,17,33,49,81\)"),
    ("frame_buckets = [1, 21]", r"source 'a' sets frame_buckets = \[1, 21\]: 21 is not one of the run's frame buckets"),
    ("clips = 2", r"source 'a' sets clips = 2: applies to clip_extraction = \"uniform\""),
    ("flip = true", r"source 'a' sets flip, which tiny-wan does not take"),
])
def test_a_sources_clip_choice_the_run_cannot_take_is_refused(tmp_path, source, message):
    toml = tmp_path / "data.toml"
    toml.write_text(f'[[source]]\npath = "a"\n{source}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        config(str(toml))


def test_an_image_model_refuses_a_sources_clip_keys(tmp_path):
    toml = tmp_path / "data.toml"
    toml.write_text('[[source]]\npath = "a"\nclip_extraction = "chunk"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"source 'a' sets clip_extraction, which applies to video models \(.*tiny-wan"):
        config(str(toml), model="tiny-sana")
    toml.write_text('[[source]]\npath = "a"\n', encoding="utf-8")
    assert config(str(toml), model="tiny-sana").sources()[0].salt() == 0  # an image model's stamps are as they were


def test_clip_keys_and_stamps_name_the_clip_and_the_input_s_count():
    base, choice = "ab" * 32, b"uniform\x003\x001,17\x0016.0"
    keys = {clip_key(base, choice, i, n) for n in (2, 3) for i in range(n)}
    assert len(keys) == 5  # a clip of an input of two clips is not the same clip of an input of three
    assert clip_key(base, choice, 0, 2) != clip_key(base, b"head\x001,17\x0016.0", 0, 2)
    assert clip_stamp(12345, 1) == 12345 and clip_stamp(12345, 2) not in (0, 12345) and clip_stamp(0, 3) == 0


def test_an_image_models_tar_and_dataset_name_a_video_input(tmp_path):
    """A tar sample's KEY.mp4, or a video's bytes in a dataset's image column, is a video_input failure naming the
    presets that take video, never a crash or a bad image."""
    import io
    import tarfile

    from precompute.images import Record, prepare
    from precompute.sample_video import make_video
    from precompute.tars import TarDataset

    make_video(tmp_path / "v.mp4", "shapes", 10, 24.0, (64, 64))
    make_video(tmp_path / "v.webm", "shapes", 10, 24.0, (64, 64))
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for name, blob in (("k.mp4", (tmp_path / "v.mp4").read_bytes()), ("k.txt", b"a caption")):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    policy = PrecomputeConfig("unused").policy()
    (item,) = TarDataset([str(tmp_path / "a.tar")], policy, frozenset(), ("caption",))
    assert (item["source"], item["reason"]) == ("a.tar/k", "video_input") and "tiny-wan" in item["detail"]
    for suffix in ("mp4", "webm"):  # bytes alone, as a dataset's image column holds them
        failed = prepare(Record("row", (tmp_path / f"v.{suffix}").read_bytes(), ["a caption"]), policy)
        assert failed["reason"] == "video_input"


@pytest.mark.parametrize("key, ours", [("target_frames", "frame_buckets"), ("frame_extraction", "clip_extraction"),
                                       ("frame_sample", "clips")])
def test_musubi_tuners_dataset_keys_are_refused_naming_ours(tmp_path, key, ours):
    (tmp_path / "data.toml").write_text(f'[[source]]\npath = "clips"\n{key} = 1\n')
    with pytest.raises(ValueError, match=f"unknown key '{key}' .*did you mean '{ours}'"):
        read_dataset_file(tmp_path / "data.toml")


def test_a_metadata_row_in_musubi_tuners_layout_says_which_column_names_the_file(tmp_path):
    from precompute.folders import _BadRow, _metadata_entry

    with pytest.raises(_BadRow, match="video_path, as musubi-tuner's metadata files do: here each row names its file in "
                                      "file_name"):
        _metadata_entry(tmp_path, {"video_path": "a.mp4", "caption": "a cat"}, "text", False, {}, None)
