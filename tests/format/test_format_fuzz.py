"""Random sequences of writes, removals, repairs, gc, kills and damage keep the cache format's invariants
(tests/format/format_fuzz.py draws and checks them). Each block of seeds is one test, so a failure names its seeds; the
message holds the failing seed's operation trace and the command that replays it. `make fuzz` runs thousands."""

import os

import pytest

from tests.format.format_fuzz import DEFAULT_KINDS, KINDS, PENDING, Case, run_case
from tests.format.fuzz_model import read
from tests.format.fuzz_process import Process

CASES = int(os.environ.get("FUZZ_CASES", 100))
FIRST = int(os.environ.get("FUZZ_SEED", 0))
BLOCK = 20


@pytest.mark.parametrize("start", range(FIRST, FIRST + CASES, BLOCK),
                         ids=lambda s: f"seeds-{s}-{min(s + BLOCK, FIRST + CASES) - 1}")
def test_random_operations_keep_every_generation_exact(start):
    for seed in range(start, min(start + BLOCK, FIRST + CASES)):
        run_case(seed)


def test_every_kind_left_out_says_why():
    assert set(PENDING) <= set(KINDS) and set(DEFAULT_KINDS) == set(KINDS) - set(PENDING)
    assert all(PENDING.values())


def test_a_kill_at_every_event_of_a_write_keeps_the_committed_samples(tmp_path, monkeypatch):
    """Every file-system event of a writer session that writes one shard and compacts, killed in turn: the newest
    generation is what was committed before or that plus the new sample, and the next session cleans up."""
    import shards.generations
    from shards import ShardWriter, verify
    from shards.schema import sample_digest
    from tests.format.fuzz_model import FINGERPRINT, SCHEMA, State, fields_of
    from tests.format.fuzz_process import Killed

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 1)  # every commit is followed by a snapshot
    case = Case(0, tmp_path, DEFAULT_KINDS, steps=0)
    case.write(kill=False)
    before, n = case.state, 10_000
    for at in range(1, 200):
        key, fields = f"x{at:05d}", fields_of(n + at, (16, 16))
        after = State({**case.state.samples, key: (sample_digest(key, fields), "", "", 0)}, case.state.prompts)
        with Process(kill_at=at) as process:
            w = None
            try:
                w = ShardWriter(case.root, FINGERPRINT, SCHEMA)
                w.write(key, (16, 16), fields)
                w.finish()
            except Killed:
                if w is not None:
                    w.close()  # the locks die with the process
        generation, got = read(case.root)
        assert got in (case.state, after), f"killed at {process.what}"
        case.commit(generation, got)
        if process.what is None:
            break
    assert at > 10 and len(case.state.samples) > len(before.samples)
    with Process():
        ShardWriter(case.root, FINGERPRINT, SCHEMA).finish()  # deletes what the kills left
    assert verify(case.root).ok


def test_a_cache_emptied_by_removals_compacts_and_collects(tmp_path):
    """Removing every sample leaves a generation of no shard: its snapshot (gc's, or a compaction's) is written."""
    from shards import Cache, ShardWriter, gc
    from tests.format.fuzz_model import FINGERPRINT, SCHEMA, fields_of

    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.write("a", (16, 16), fields_of(0, (16, 16)))
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        w.remove({"a"})
    gc(tmp_path)
    assert len(Cache(tmp_path)) == 0 and Cache(tmp_path).generation == 1
