"""A crash at any instant leaves every committed generation valid and no partial file listed; the next run resumes
and ends with the samples an uninterrupted run writes."""

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FINGERPRINT, SCHEMA, make_sample
from typer.testing import CliRunner

from shards import Cache, ShardWriter, gc, verify
from shards.cli import app

HERE = Path(__file__).resolve().parents[1]  # tests/, where conftest is; its parent the project

# A child that writes samples 0..UPTO-1 not in the cache yet, three per shard (one shard per commit), and prints
# "committed" once its first commit is durable and "done" at the end. KILL_AT makes it SIGKILL itself at the
# KILL_N-th event of a kind, through the real code path: "mid-" leaves that event's temp file torn (half its
# bytes) and dies before the rename or link that would publish it; "after-" dies right after it. The kinds:
# shard (a shard's rename), commit (the link of _log/GENERATION.json), snapshot (the link of
# _snapshots/GENERATION.safetensors) and pointer (the rename of index.json). COMPACT_MIN sets how often the
# child snapshots (2: after generations 1, 3, 5, ...).
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from conftest import FINGERPRINT, SCHEMA, make_sample
    import shards.atomic, shards.generations
    from shards import ShardWriter

    kill_at, kill_n = os.environ["KILL_AT"], int(os.environ["KILL_N"])
    shards.generations.COMPACT_MIN = int(os.environ["COMPACT_MIN"])
    counts = dict.fromkeys(["shard", "commit", "snapshot", "pointer"], 0)
    real_publish, real_link = shards.atomic.publish, os.link

    def maybe_die(moment, kind, tmp=None):
        if kill_at == moment + "-" + kind and counts[kind] == kill_n:
            if tmp is not None:
                os.truncate(tmp, os.path.getsize(tmp) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    def publish(tmp, path):
        kind = "pointer" if Path(path).name == "index.json" else "shard"
        counts[kind] += 1
        maybe_die("mid", kind, tmp)
        real_publish(tmp, path)
        maybe_die("after", kind)

    def link(tmp, path, **kwargs):
        kind = "commit" if Path(path).parent.name == "_log" else "snapshot"
        counts[kind] += 1
        maybe_die("mid", kind, tmp)
        real_link(tmp, path, **kwargs)
        maybe_die("after", kind)
        if counts["commit"] == 1 and kind == "commit":
            print("committed", flush=True)

    shards.atomic.publish, os.link = publish, link

    # KILL_EVENT: SIGKILL at the N-th fsync, rename, link or unlink of the run, whichever it is
    kill_event, events = int(os.environ.get("KILL_EVENT", "0")), 0

    def at_event(real):
        def call(*args, **kwargs):
            global events
            events += 1
            if events == kill_event:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call

    os.fsync, os.replace, os.link, os.unlink = (at_event(f) for f in (os.fsync, os.replace, os.link, os.unlink))
    with ShardWriter(sys.argv[1], FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        listed = {key for key, *_ in w.manifest.samples()}
        for i in range(int(os.environ["UPTO"])):
            if make_sample(i)[0] not in listed:
                w.write(*make_sample(i))
    print("done", flush=True)
    """
)
UPTO = 30  # ten shards of three, in three buckets


def child(root, upto=UPTO, kill_at="", kill_n=0, compact_min=2, kill_event=0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}", "KILL_AT": kill_at, "KILL_N": str(kill_n),
           "UPTO": str(upto), "COMPACT_MIN": str(compact_min), "KILL_EVENT": str(kill_event)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_child_until_it_kills_itself(root, kill_at, kill_n):
    proc = child(root, kill_at=kill_at, kill_n=kill_n)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL and "done" not in out, err[-2000:]


def write_the_rest(root, upto=UPTO):
    """What a re-run does: open a writer (it clears what a killed writer of its rank left) and write what is missing."""
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=3) as w:
        listed = {key for key, *_ in w.manifest.samples()}
        for i in range(upto):
            if make_sample(i)[0] not in listed:
                w.write(*make_sample(i))


def assert_consistent(root, orphans_allowed=True) -> Cache:
    report = verify(root)
    assert [(p, m) for p, m in report.problems if not (orphans_allowed and "orphan" in m)] == []
    return Cache(root)


def digests(cache: Cache) -> dict[str, bytes]:
    return {key: cache.shard(j).digest(row) for key, _, _, j, row in cache.manifest.samples()}


def assert_resumes_like_an_uninterrupted_run(root, reference, upto=UPTO):
    write_the_rest(root, upto)
    cache = assert_consistent(root, orphans_allowed=False)
    keys = [key for key, _ in cache.keys()]
    assert len(keys) == len(set(keys)) == upto  # no sample listed twice, none lost
    assert [p for p in root.rglob("*.tmp") if p.parent != root] == []  # the writer cleared its rank's temp files
    write_the_rest(reference, upto)
    assert digests(cache) == digests(Cache(reference))
    gc(root)  # and gc clears the rest (a torn index.json temp file)
    assert list(root.rglob("*.tmp")) == [] and verify(root).ok
    assert digests(Cache(root)) == digests(Cache(reference))


def test_exception_mid_write_keeps_previous_generation(tmp_path):
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=4) as w:
        for i in range(8):
            w.write(*make_sample(i))
    def state():  # every file but the locks
        return {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")}

    before = state()
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, FINGERPRINT, SCHEMA, max_shard_samples=100) as w:
            for i in range(8, 12):
                w.write(*make_sample(i))
            raise RuntimeError("boom")
    # the buffered samples were not published: no commit, no shard, nothing changed
    assert state() == before
    assert len(assert_consistent(tmp_path, orphans_allowed=False)) == 8


# (kill_at, at the n-th event, samples committed when it dies, orphans verify reports then)
WORST_INSTANTS = [
    ("mid-shard", 3, 6, 1),  # the third shard's temp file, torn
    ("after-shard", 3, 6, 1),  # the third shard renamed into place, never committed
    ("mid-commit", 3, 6, 1),  # its commit's temp file torn, not linked: the shard is an orphan
    ("after-commit", 3, 9, 0),  # its commit linked, the temp file not yet removed
    ("mid-snapshot", 2, 12, 0),  # the snapshot of generation 3 torn, not linked
    ("after-snapshot", 2, 12, 0),  # ... linked, index.json not yet pointing at it
    ("mid-pointer", 1, 3, 0),  # generation 0 committed, its index.json torn: there is none
    ("mid-pointer", 2, 6, 0),  # index.json torn on its way to the first snapshot
]


@pytest.mark.parametrize("kill_at,n,committed,orphans", WORST_INSTANTS, ids=[f"{k}-{n}" for k, n, *_ in WORST_INSTANTS])
def test_sigkill_at_the_worst_instants(tmp_path, kill_at, n, committed, orphans):
    root = tmp_path / "cache"
    run_child_until_it_kills_itself(root, kill_at, n)
    cache = assert_consistent(root)  # no torn temp file is read as a commit or a snapshot
    assert len(cache) == committed and len(list((root / "_log").glob("*.json"))) == committed // 3
    assert len([p for p, m in verify(root).problems if "orphan" in m]) == orphans
    assert_resumes_like_an_uninterrupted_run(root, tmp_path / "reference")


@pytest.mark.parametrize("kill_at", ["mid-shard", "after-shard", "mid-commit"])
def test_a_writer_killed_before_its_first_commit(tmp_path, kill_at):
    """What a user sees: verify and inspect say the directory is not a cache yet (exit 2, not "damaged"),
    and the next run starts cleanly, clearing what the killed one left."""
    root = tmp_path / "cache"
    run_child_until_it_kills_itself(root, kill_at, 1)
    assert not list(root.glob("_log/*.json")) and list(root.glob("*x*/*"))  # no commit; a shard or temp file was left
    report = verify(root)
    assert report.problems == [] and not report.ok
    assert "not a cache yet: no manifest was ever committed (1 file(s) left by a run interrupted" in report.not_a_cache
    for command in ("verify", "inspect", "ls"):
        result = CliRunner().invoke(app, [command, str(root)])
        assert result.exit_code == 2 and "not a cache yet" in result.output, (command, result.output)
        assert "BAD" not in result.output
    assert_resumes_like_an_uninterrupted_run(root, tmp_path / "reference")


def test_a_lost_log_is_damage_but_a_lost_pointer_is_not(tmp_path):
    write_the_rest(tmp_path, 12)  # six shards (three buckets of 3 + 1 samples), six commits
    (tmp_path / "index.json").unlink()  # the pointer only: the log is the truth
    assert len(assert_consistent(tmp_path, orphans_allowed=False)) == 12
    for directory in ("_log", "_snapshots"):
        for p in (tmp_path / directory).glob("*"):
            p.unlink()
    report = verify(tmp_path)
    assert report.not_a_cache is None and "removed or lost after shards were committed" in report.problems[0][1]
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "BAD" in result.output
    with pytest.raises(FileNotFoundError, match="lost after shards were committed"):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)  # never starts afresh over committed shards


@pytest.mark.slow
def test_sigkill_at_random_instants(tmp_path):
    """Killed at a random one of its file-system events (an fsync, a rename, the link of a commit or a snapshot, an
    unlink) six times over, the cache stays consistent, and finishing the job gives what an uninterrupted run gives.
    The instant is counted in events, not timed, so a busy machine changes nothing."""
    rng = random.Random(0)
    root, upto = tmp_path / "cache", 240
    killed = 0
    for _ in range(6):
        proc = child(root, upto=upto, compact_min=4, kill_event=rng.randint(1, 150))
        out, err = proc.communicate(timeout=300)
        assert proc.returncode in (0, -signal.SIGKILL), err[-2000:]
        killed += proc.returncode == -signal.SIGKILL
        assert_consistent(root)
    assert killed >= 5  # the job outlasts the kills: almost every round dies somewhere inside it
    assert_resumes_like_an_uninterrupted_run(root, tmp_path / "reference", upto)
