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

from shards import Cache, ShardWriter, verify

HERE = Path(__file__).resolve().parent

# A child that writes shards until killed. KILL_AT picks a deterministic instant to SIGKILL
# itself: mid-way through a shard's bytes, after the shard's rename but before the manifest.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path[:0] = [{here!r}, {root!r}]
    from conftest import FINGERPRINT, SCHEMA, make_sample
    import shards.atomic, shards.writer
    from shards import ShardWriter

    kill_at, start = os.environ.get("KILL_AT"), int(os.environ["START"])
    published = 0
    real_publish = shards.atomic.publish

    def publish(tmp, path):
        global published
        if str(path).endswith(".safetensors"):
            published += 1
            if kill_at == "mid-shard" and published == 3:
                os.truncate(tmp, os.path.getsize(tmp) // 2)
                os.kill(os.getpid(), signal.SIGKILL)
            real_publish(tmp, path)
            if kill_at == "before-manifest" and published == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            real_publish(tmp, path)

    shards.atomic.publish = publish
    w = ShardWriter(sys.argv[1], FINGERPRINT, SCHEMA, max_shard_samples=3)
    i = start
    while True:
        w.write(*make_sample(i))
        i += 1
    """
)


def run_child(root, start, kill_at=None, delay=None):
    code = CHILD.format(here=str(HERE), root=str(HERE.parent))
    env = {**os.environ, "START": str(start), "KILL_AT": kill_at or ""}
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], env=env)
    if delay is None:
        assert proc.wait(timeout=120) == -signal.SIGKILL
    else:
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=60)


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


@pytest.mark.parametrize("kill_at", ["mid-shard", "before-manifest"])
def test_sigkill_at_the_worst_instants(tmp_path, kill_at):
    run_child(tmp_path, start=0, kill_at=kill_at)
    cache = assert_consistent(tmp_path)
    assert cache.manifest.num_samples == 6  # two complete shards listed, the third not
    orphans = [p for p, m in verify(tmp_path).problems if "orphan" in m]
    assert len(orphans) == 1  # the temp file or the renamed, unlisted shard
    # the next writer of that rank clears the orphan and carries on after the listed shards
    done = {k for k, _ in cache.keys()}
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        for i in range(12):
            if f"key{i:05d}" not in done:
                w.write(*make_sample(i))
    cache = assert_consistent(tmp_path, orphans_allowed=False)
    assert sorted(k for k, _ in cache.keys()) == [f"key{i:05d}" for i in range(12)]


@pytest.mark.slow
def test_sigkill_at_random_instants(tmp_path):
    rng = random.Random(0)
    start = 0
    for _ in range(6):
        run_child(tmp_path, start=start, delay=rng.uniform(1.5, 3.0))
        cache = assert_consistent(tmp_path)
        start = 1_000_000 + len(cache) * 10  # fresh keys each round
    assert len(cache) > 0
