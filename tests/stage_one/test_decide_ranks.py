"""The incremental decision across ranks: two ranks re-running over a changed folder (inputs removed, a caption
edited, a file touched, an input added) reach the cache one rank reaches, their tallies gathered to rank 0 alone;
and the removals decided on arrays agree with the sets they replace."""

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import precompute_processes

from precompute.removal import removals
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from precompute.tars import tar_name
from shards import Cache, verify

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)



def run(data, cache, **kw):
    return precompute(str(data), "tiny-sana", Path(cache), workers=0, progress=False, **kw)


def index(cache) -> dict[str, tuple[str, int]]:
    return dict(Cache(cache).manifest.by_source())


def reference_removals(previous: dict[str, str], seen: set[str], failed: set[str], complete: bool) -> tuple[set[str], int]:
    """The removals as sets of keys, as they were decided before the sample index was searched in place."""
    unseen = {k: s for k, s in previous.items() if k not in seen}
    if not complete:
        return set(), len(unseen)
    tars = tuple(tar_name(s) + "/" for s in failed)
    kept = {k for k, s in unseen.items() if s in failed or (tars and s.startswith(tars))}
    return set(unseen) - kept, len(kept)


@pytest.mark.parametrize("seed", range(5))
def test_removals_on_arrays_agree_with_sets(seed):
    rng = random.Random(seed)
    n = 200
    sources = [rng.choice([f"img/{i}.png", f"shard{i % 7}.tar/{i:05d}", "img/same.png"]) for i in range(n)]
    mine = np.array(sorted(rng.sample(range(n), 150)), dtype=np.int64)  # the source's samples among every global index
    seen = np.array([rng.random() < 0.7 for _ in range(n)])
    failed = {rng.choice(sources) for _ in range(rng.randrange(4))} | ({"shard3.tar"} if seed % 2 else set())
    for complete in (True, False):
        got, kept = removals(mine, seen, sources.__getitem__, failed, complete)
        expected = reference_removals({f"k{g}": sources[g] for g in mine}, {f"k{g}" for g in range(n) if seen[g]}, failed, complete)
        assert ({f"k{g}" for g in got.tolist()}, kept) == expected and list(got) == sorted(got)


@pytest.mark.slow
def test_two_ranks_decide_as_one(tmp_path):
    folder = make_folder(tmp_path / "data", count=16)
    run(folder, tmp_path / "one", batch_size=4)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    for i in (3, 11):  # gone
        (folder / f"{i:05d}.png").unlink()
        (folder / f"{i:05d}.txt").unlink()
    (folder / "00005.txt").write_text("a new caption\n")  # changed: encoded again, its old sample replaced
    os.utime(folder / "00007.png", ns=(1, 1))  # touched: read, unchanged, restamped
    shutil.copy(folder / "00001.png", folder / "extra.png")  # new: the same image under another caption
    (folder / "extra.txt").write_text("another caption\n")
    summary = run(folder, tmp_path / "one", batch_size=4)
    assert (summary["new"], summary["changed"], summary["removed"], summary["unchanged"]) == (1, 1, 2, 13)
    out = precompute_processes(2, folder, tmp_path / "two", "--model", "tiny-sana", "--workers", "0", "--batch-size", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = index(tmp_path / "one"), index(tmp_path / "two")
    assert one == two and "00003.png" not in two and two["00007.png"] == one["00007.png"] and len(two) == 15
    assert sorted(k for k, *_ in Cache(tmp_path / "two").manifest.samples()) == sorted(k for k, *_ in Cache(tmp_path / "one").manifest.samples())
    # nothing changed since: every input unchanged, read by no one
    again = run(folder, tmp_path / "two", batch_size=4)
    assert (again["unchanged"], again["new"], again["changed"], again["removed"]) == (15, 0, 0, 0)
    assert verify(tmp_path / "two").ok
