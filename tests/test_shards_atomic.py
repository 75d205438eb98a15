"""A crash at any instant leaves the previous manifest valid and no partial shard listed."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import FINGERPRINT, SCHEMA, make_sample
from typer.testing import CliRunner

from shards import Cache, ShardWriter, verify
from shards.cli import app

HERE = Path(__file__).resolve().parent

# A child that writes shards until killed. It prints "committed" once its first manifest is durable, so
# a kill "at a random instant" is counted from an instant the child is really writing, never from its
# start-up. KILL_AT picks a deterministic instant to SIGKILL itself instead, at the KILL_SHARD-th shard:
# mid-way through the shard's bytes, or after the shard's rename but before the manifest.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path[:0] = [{here!r}, {root!r}]
    from conftest import FINGERPRINT, SCHEMA, make_sample
    import shards.atomic, shards.writer
    from shards import ShardWriter

    kill_at, kill_shard, start = os.environ.get("KILL_AT"), int(os.environ["KILL_SHARD"]), int(os.environ["START"])
    published = 0
    real_publish = shards.atomic.publish

    def publish(tmp, path):
        global published
        if str(path).endswith(".safetensors"):
            published += 1
            if kill_at == "mid-shard" and published == kill_shard:
                os.truncate(tmp, os.path.getsize(tmp) // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            real_publish(tmp, path)
            if kill_at == "before-manifest" and published == kill_shard:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            real_publish(tmp, path)
            if published == 1:
                print("committed", flush=True)

    shards.atomic.publish = publish
    w = ShardWriter(sys.argv[1], FINGERPRINT, SCHEMA, max_shard_samples=3)
    i = start
    while True:
        w.write(*make_sample(i))
        i += 1
    """
)


def child(root, start, kill_at="", kill_shard=0) -> subprocess.Popen:
    code = CHILD.format(here=str(HERE), root=str(HERE.parent))
    env = {**os.environ, "START": str(start), "KILL_AT": kill_at, "KILL_SHARD": str(kill_shard)}
    return subprocess.Popen([sys.executable, "-c", code, str(root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_child_until_it_kills_itself(root, start, kill_at, kill_shard):
    proc = child(root, start, kill_at, kill_shard)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]


def kill_child_while_writing(root, start, delay):
    proc = child(root, start)
    line = proc.stdout.readline()  # blocks until the child has committed its first shard
    assert line == "committed\n", proc.communicate(timeout=60)[1][-2000:]
    # Sleeping here orders nothing: the child is already inside its endless write loop, and any delay
    # lands somewhere in it (a shard's bytes, a rename, a manifest write).
    time.sleep(delay)
    proc.kill()
    proc.communicate(timeout=60)


def assert_consistent(root, orphans_allowed=True):
    report = verify(root)
    bad = [(p, m) for p, m in report.problems if not (orphans_allowed and "orphan" in m)]
    assert bad == []
    return Cache(root)


def test_exception_mid_write_keeps_previous_manifest(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=4) as w:
        for i in range(8):
            w.write(*make_sample(i))
    before = (tmp_path / "index.json").read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=100) as w:
            for i in range(8, 12):
                w.write(*make_sample(i))
            raise RuntimeError("boom")
    # the buffered samples were not published, and nothing listed changed
    assert (tmp_path / "index.json").read_bytes() == before
    assert len(assert_consistent(tmp_path, orphans_allowed=False)) == 8


def write_the_rest(root, upto):
    done = {k for k, _ in Cache(root).keys()} if (Path(root) / "index.json").exists() else set()
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        for i in range(upto):
            if f"key{i:05d}" not in done:
                w.write(*make_sample(i))


@pytest.mark.parametrize("kill_at", ["mid-shard", "before-manifest"])
def test_sigkill_at_the_worst_instants(tmp_path, kill_at):
    run_child_until_it_kills_itself(tmp_path, start=0, kill_at=kill_at, kill_shard=3)
    cache = assert_consistent(tmp_path)
    assert cache.manifest.num_samples == 6  # two complete shards listed, the third not
    orphans = [p for p, m in verify(tmp_path).problems if "orphan" in m]
    assert len(orphans) == 1  # the temp file or the renamed, unlisted shard
    # the next writer of that rank clears the orphan and carries on after the listed shards
    write_the_rest(tmp_path, 12)
    cache = assert_consistent(tmp_path, orphans_allowed=False)
    assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(12)]


@pytest.mark.parametrize("kill_at", ["mid-shard", "before-manifest"])
def test_a_writer_killed_before_its_first_commit(tmp_path, kill_at):
    """What a user sees: verify and inspect say the directory is not a cache yet (exit 2, not "damaged"),
    and the next run starts cleanly, clearing what the killed one left."""
    run_child_until_it_kills_itself(tmp_path, start=0, kill_at=kill_at, kill_shard=1)
    assert not (tmp_path / "index.json").exists() and list(tmp_path.glob("*/*"))  # a shard or temp file was left
    report = verify(tmp_path)
    assert report.problems == [] and not report.ok
    assert "not a cache yet: no manifest was ever committed (1 file(s) left by a run interrupted" in report.not_a_cache
    for command in ("verify", "inspect", "ls"):
        result = CliRunner().invoke(app, [command, str(tmp_path)])
        assert result.exit_code == 2 and "not a cache yet" in result.output, (command, result.output)
        assert "BAD" not in result.output

    write_the_rest(tmp_path, 6)
    cache = assert_consistent(tmp_path, orphans_allowed=False)
    assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(6)]


def test_a_lost_manifest_is_damage_not_an_empty_cache(tmp_path):
    write_the_rest(tmp_path, 12)  # four shards of three
    (tmp_path / "index.json").unlink()
    report = verify(tmp_path)
    assert report.not_a_cache is None and "removed or lost after shards were committed" in report.problems[0][1]
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "BAD" in result.output


@pytest.mark.slow
def test_sigkill_at_random_instants(tmp_path):
    rng = random.Random(0)
    start = 0
    for _ in range(6):
        kill_child_while_writing(tmp_path, start=start, delay=rng.uniform(0.0, 0.5))
        cache = assert_consistent(tmp_path)
        start = 1_000_000 + len(cache) * 10  # fresh keys each round
    assert len(cache) > 0
