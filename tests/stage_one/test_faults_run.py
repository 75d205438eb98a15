"""How a stage-one run stops: killed or stopped runs let go of the cache, refused runs leave no trace, a repair
that cannot finish says why, and every stop of the command lands on its documented exit code."""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from precompute.__main__ import app
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Cache, CacheLock, verify
from shards.lock import WRITERS_LOCK

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-sana", "--no-progress"]


def run(data, cache, **kw):
    return precompute(str(data), "tiny-sana", Path(cache), workers=0, progress=False, **kw)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("data") / "shapes", count=12)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the loader's workers of a run)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def take_every_lock(cache: Path) -> None:
    """The run's lock, a rank's and the writers' lock (as `shards gc` takes it): each free at once."""
    for name in (".lock", ".lock-r00000", WRITERS_LOCK):
        CacheLock(cache, name).release()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_run_lets_go_of_the_cache(folder, tmp_path, sig):
    """Killed or stopped in the middle with the default loader workers, the run leaves no process holding the
    cache: its locks are free at once, its workers are gone, and the next run completes the cache."""
    cache = tmp_path / "cache"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "precompute", str(folder), *TINY, "--cache", str(cache),
                                 "--max-shard-mb", "0"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    workers = []
    try:
        deadline = time.monotonic() + 240
        while not list((cache / "_log").glob("*.json")):  # the first commit: the run is encoding
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-2000:]
            time.sleep(0.05)
        workers = children(proc.pid)
        assert len(workers) == 2  # --workers 2, the default
        exits = [os.pidfd_open(w) for w in workers]  # readable once the worker has exited
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
        stderr = (tmp_path / "stderr").read_text()
        if sig == signal.SIGTERM:
            assert code == 143 and "error: stopped by SIGTERM" in stderr and "Traceback" not in stderr, stderr[-2000:]
        else:
            assert code == -signal.SIGKILL
        take_every_lock(cache)
        deadline = time.monotonic() + 30
        while exits:  # they die with the run, not at some later point
            exited, _, _ = select.select(exits, [], [], max(0.0, deadline - time.monotonic()))
            assert exited, f"workers {[w for w in workers if alive(w)]} outlived the run"
            for fd in exited:
                exits.remove(fd)
                os.close(fd)
    finally:
        for pid in [proc.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    done = len(Cache(cache))
    assert 0 < done < 12
    s = run(folder, cache)
    assert s["unchanged"] == done and s["new"] == 12 - done and verify(cache).ok


HOLDER = """
import os, sys
sys.path.insert(0, {root!r})
from shards import CacheLock
from shards.lock import writers_lock
locks = [CacheLock(sys.argv[1]), CacheLock(sys.argv[1], ".lock-r00000"), writers_lock(sys.argv[1])]
if os.fork() == 0:  # a child that outlives its parent, as a loader worker can
    sys.stdin.read()
    os._exit(0)
print("ready", flush=True)
sys.stdin.read()
"""


def test_forked_children_do_not_hold_the_locks(tmp_path):
    """The locks belong to the process that took them: a forked child that outlives it holds none of them."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT)), str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.kill()
        proc.wait()
        take_every_lock(tmp_path)
    finally:
        proc.stdin.close()  # the child reads to the end and exits
        proc.kill()
        proc.wait()


def test_repair_names_the_inputs_that_are_gone(folder, tmp_path):
    """A damaged shard whose input is gone is named with that file, the others are repaired, nothing is deleted,
    and the run exits 2."""
    data, cache = tmp_path / "data", tmp_path / "cache"
    make_folder(data, count=8)
    run(data, cache, max_shard_mb=0, batch_size=4)
    manifest = Cache(cache).manifest
    shards = [entry.path for entry in manifest.shards]
    assert len(shards) >= 2
    for path in shards:
        (cache / path).unlink()
    gone = next(src for _, src, _, shard, _ in manifest.samples() if shard == 0)
    (data / gone).unlink()
    out = cli(data, *TINY, "--cache", cache, "--workers", "0", "--repair")
    assert out.exit_code == 2, out.output
    assert f"{data}/{gone}" in out.output and f"not repaired: {shards[0]}" in out.output
    assert "error: --repair left 1 shard(s) unrepaired" in out.output and "Traceback" not in out.output
    after = Cache(cache).manifest
    assert [e.path for e in after.shards][0] == shards[0]  # still listed, as it was
    assert sorted(k for k, *_ in after.samples()) == sorted(k for k, *_ in manifest.samples())
    assert [Path(p).name for p in verify(cache).bad_files] == [Path(shards[0]).name]


def test_an_empty_data_into_a_new_cache_is_refused_without_a_trace(tmp_path):
    """An empty (or unmounted) DATA builds no cache: exit 4, and the directories the run made are gone again."""
    empty = tmp_path / "mnt"
    empty.mkdir()
    cache = tmp_path / "new" / "deeper" / "cache"
    out = cli(empty, *TINY, "--cache", cache, "--workers", "0")
    assert out.exit_code == 4 and "lists no input" in out.output and "DATA lists nothing" in out.output, out.output
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"  # a directory the user made is theirs: kept
    mine.mkdir()
    assert cli(empty, *TINY, "--cache", mine, "--workers", "0").exit_code == 4 and mine.is_dir()


def test_a_refused_run_leaves_no_trace(folder, tmp_path):
    """A run refused after it made the cache directory (here: an input that is not a dataset) removes it again;
    a cache that was there keeps every file."""
    cache = tmp_path / "cache"
    out = cli(tmp_path / "nothing-here", *TINY, "--cache", cache, "--workers", "0")
    assert out.exit_code == 2 and out.output.startswith("error: ") and "Traceback" not in out.output, out.output
    assert not cache.exists()
    run(folder, cache)
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    out = cli(folder, "--model", "tiny-pixart", "--no-progress", "--cache", cache, "--workers", "0")
    assert out.exit_code == 2 and "error: " in out.output, out.output
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before


def test_every_input_failing_exits_1(tmp_path):
    data = tmp_path / "bad"
    data.mkdir()
    for i in range(3):
        (data / f"{i}.png").write_bytes(b"not an image")
        (data / f"{i}.txt").write_text("a caption")
    assert run(data, tmp_path / "api")["failure_fraction"] == 1.0  # the API reports; the command decides
    out = cli(data, *TINY, "--cache", tmp_path / "cli", "--workers", "0")
    assert out.exit_code == 1, out.output
    assert "skipped 3 (100.0%)" in out.output and "error: 100.0% of inputs were skipped" in out.output


@pytest.mark.parametrize("raised, code, message", [
    (KeyboardInterrupt(), 130, "error: interrupted; what was committed is kept"),
    (RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed."), 2, "error: RuntimeError: DataLoader worker"),
    (OSError(28, "No space left on device", "/cache/r00000-000001.safetensors"), 2, "error: "),
])
def test_every_stop_has_its_exit_code(monkeypatch, tmp_path, raised, code, message):
    def stop(config):
        raise raised

    monkeypatch.setattr("precompute.run.run", stop)
    out = cli(tmp_path, *TINY, "--cache", tmp_path / "cache")
    assert out.exit_code == code and out.output.startswith(message) and len(out.output.splitlines()) == 1, out.output
    if isinstance(raised, OSError):  # disk full, permission denied: the path and what happened
        assert "/cache/r00000-000001.safetensors" in out.output and "No space left on device" in out.output


def test_a_damaged_cache_exits_2(tmp_path):
    """A cache file that fails its checks is a bad cache for stage one and for `prompts`: exit 2, naming the file."""
    from conftest import write_cache

    from precompute.__main__ import prompts_app

    write_cache(tmp_path / "cache", range(4))
    newest = sorted((tmp_path / "cache" / "_log").glob("*.json"))[-1]
    newest.write_text('{"broken')
    data = make_folder(tmp_path / "data", count=1)
    out = cli(data, *TINY, "--cache", tmp_path / "cache", "--workers", "0")
    assert out.exit_code == 2 and out.output.startswith("error: ") and newest.name in out.output, out.output
    out = CliRunner().invoke(prompts_app, [str(tmp_path / "cache"), "--prompt", "a prompt"])
    assert out.exit_code == 2 and out.output.startswith("error: ") and newest.name in out.output, out.output
