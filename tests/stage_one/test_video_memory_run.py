"""A cache built when a folder's videos were read whole keeps its keys now that they are read where they lie: a re-run
after every file was touched (so each is read and hashed again) encodes nothing and decodes nothing."""

from pathlib import Path

import pytest

from precompute import clips, folders, video
from precompute.images import Record
from precompute.paths import read_regular
from precompute.run import main as precompute
from precompute.sample_video import make_video_folder

pytestmark = pytest.mark.model  # builds the tiny Wan VAE and umT5

RUN = dict(workers=0, progress=False, check_disk=False, clip_extraction="uniform", clips=2, frames=17)


def read_whole(entry) -> Record:
    """How a folder's video was read before: its bytes, whole."""
    return Record(entry.source, read_regular(entry.image), [read_regular(p) for p in entry.caption_files],
                  video=folders.is_video_name(entry.image))


def test_a_cache_of_videos_read_whole_reruns_with_nothing_to_encode(tmp_path, monkeypatch):
    data = make_video_folder(tmp_path / "data", count=3, seconds=(1.2, 2.2))
    with monkeypatch.context() as m:
        m.setattr(folders, "read_folder_entry", read_whole)
        first = precompute(str(data), "tiny-wan", tmp_path / "cache", **RUN)
    assert first["new"] > 3 and first["failed"] == 0  # two clips of some videos
    for path in data.iterdir():  # touched: every video is read and hashed again, by its file
        path.touch()
    decoded, real = [], video.read_clips
    monkeypatch.setattr(video, "read_clips", lambda data, *a, **kw: decoded.append(data) or real(data, *a, **kw))
    hashed, real_hash = [], clips.hash_file
    monkeypatch.setattr(clips, "hash_file", lambda f: hashed.append(f.path) or real_hash(f))
    again = precompute(str(data), "tiny-wan", tmp_path / "cache", **RUN)
    assert again["unchanged"] == first["new"] and again["new"] == again["changed"] == again["failed"] == 0
    assert sorted(Path(p).name for p in hashed) == sorted(p.name for p in data.glob("*.mp4")) and not decoded
