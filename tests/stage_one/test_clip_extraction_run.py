"""Stage one (tiny-wan) with clips of every frame bucket and a sliding window: the cache holds the clips the source
asks for, each encoded from its own frames; a re-run decodes nothing; a new stride cuts that source's video again and
leaves the other source alone."""

from pathlib import Path

import pytest
import torch

from precompute import video
from precompute.run import main as precompute
from precompute.sample_video import make_video
from shards import Cache

pytestmark = pytest.mark.model  # builds the tiny Wan VAE and umT5


@pytest.fixture
def decodes(monkeypatch):
    """The inputs the run decodes as videos (workers=0: in this process)."""
    calls = []
    real = video.read_clips
    monkeypatch.setattr(video, "read_clips", lambda data, *a, **kw: calls.append(len(data)) or real(data, *a, **kw))
    return calls


def samples_by_source(cache: Path) -> dict[str, dict[tuple[int, int, int], dict]]:
    """source name -> (index, first frame, frames) -> the cached sample."""
    c = Cache(cache)
    index = dict(c.keys())
    out = {}
    for name in c.manifest.datasets():
        for key, *_ in c.manifest.samples(name):
            s = c[index[key]]
            out.setdefault(name, {})[tuple(s["clip"].tolist())] = s
    return out


def test_slide_over_each_length_caches_every_clip_once_and_a_new_stride_cuts_again(tmp_path, decodes):
    for name in ("slide", "head"):
        (tmp_path / name).mkdir()
        make_video(tmp_path / name / "v.mp4", "index", 40, 16.0, (64, 64))  # frame k shows k: 40 frames at 16 fps
        (tmp_path / name / "v.txt").write_text("frames counting up", encoding="utf-8")
    toml = tmp_path / "data.toml"

    def write(stride: int):
        toml.write_text(f'[[source]]\npath = "slide"\nclip_extraction = "slide"\nclip_stride = {stride}\n'
                        f'clip_lengths = "each"\n[[source]]\npath = "head"\nframes = 17\n', encoding="utf-8")

    def run():
        return precompute(str(toml), "tiny-wan", tmp_path / "cache", workers=0, progress=False, check_disk=False,
                          frame_buckets="1,17,33", storage_dtype="fp32")

    write(10)
    first = run()
    # one frame from 0, 10, 20, 30; 17 frames from 0, 10, 20; 33 frames from 0; indexed by where they end, then start
    expected = [(0, 0, 1), (1, 10, 1), (2, 0, 17), (3, 20, 1), (4, 10, 17), (5, 30, 1), (6, 0, 33), (7, 20, 17)]
    assert first["failed"] == 0 and first["new"] == len(expected) + 1 and len(decodes) == 2
    cached = samples_by_source(tmp_path / "cache")
    assert sorted(cached["slide"]) == expected and sorted(cached["head"]) == [(0, 0, 17)]
    assert {n: first["buckets"][f"{n}x64x64"] for n in (1, 17, 33)} == {1: 4, 17: 3 + 1, 33: 1}
    for (_, start, frames), s in cached["slide"].items():
        assert s.bucket.frames == frames and s["latent_mean"].shape[1] == (frames - 1) // 4 + 1
    # Wan's VAE is causal: a clip's first latent frame is its first frame's alone, so each one-frame clip is the first
    # latent frame of the longer clips that start where it does, and clips that start elsewhere differ
    one = {start: s["latent_mean"] for (_, start, frames), s in cached["slide"].items() if frames == 1}
    for (_, start, frames), s in cached["slide"].items():
        torch.testing.assert_close(s["latent_mean"][:, :1], one[start], rtol=0, atol=1e-4)
    assert all(not torch.allclose(one[0], one[s], atol=1e-2) for s in (10, 20, 30))

    decodes.clear()
    again = run()
    assert again["unchanged"] == first["new"] and again["new"] + again["changed"] + again["removed"] == 0 and not decodes

    write(20)  # that source's video alone is decoded and cut again
    changed = run()
    assert len(decodes) == 1 and changed["sources"]["head"]["unchanged"] == 1
    cached = samples_by_source(tmp_path / "cache")
    assert sorted(cached["slide"]) == [(0, 0, 1), (1, 0, 17), (2, 20, 1), (3, 0, 33), (4, 20, 17)]
    assert changed["sources"]["slide"]["changed"] + changed["sources"]["slide"]["new"] == 5
    decodes.clear()
    assert run()["unchanged"] == 5 + 1 and not decodes
