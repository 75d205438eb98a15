"""bench/writer.py runs at a tiny size: every row measured, the goal's ratio printed with PASS or MISS, one shard's
parts timed before and after."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_writer_bench_runs_at_a_tiny_size(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "writer.py"), "--gib", "0.01", "--rounds", "2", "--shard-mib", "2",
                          "--mds-path", str(tmp_path / "no-streaming"), "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for row, fsync in (("(i) MDS-style write, no fsync", "no"), ("(i') MDS-style write + fsync", "yes"),
                       ("(ii) ShardWriter, all guarantees", "yes")):
        assert re.search(re.escape(row) + rf"\s+{fsync}\s+\d+", out), f"no figure in row {row!r}:\n{out}"
    assert re.search(r"\(ii\) / \(i\) += \d+\.\d\d \(rounds \d+\.\d\d-\d+\.\d\d\) +GOAL writer >= MDS-style sequential write "
                     r"\(ratio >= 1\.00\): (PASS|MISS|INCONCLUSIVE \((machine loaded: load average \d+\.\d on \d+ cores|"
                     r"the rounds' ratios \d+\.\d\d-\d+\.\d\d straddle 1\.00)\))$", out, re.M), out
    assert re.search(r"load average \(1 min\): \d+\.\d before, \d+\.\d after", out), out
    assert "row (iii) left out: no mosaicml-streaming" in out
    for part in ("finite check", "stack / cat", "safetensors save", "lay out the file", "blake2b per sample", "write + fsync", "end to end"):
        assert re.search(re.escape(part) + r".*\d\.\d{3}", out), f"no time for {part!r}:\n{out}"
    assert list(tmp_path.iterdir()) == []  # its files removed


def test_a_goal_is_inconclusive_on_a_loaded_machine_or_when_the_rounds_disagree():
    from bench.common import Stats
    from bench.writer import verdict

    assert verdict(Stats.of([1.05, 1.10, 1.20]), 1.0, 1.5, 2) == "PASS"
    assert verdict(Stats.of([0.80, 0.90, 0.99]), 1.0, 1.5, 2) == "MISS"
    assert verdict(Stats.of([0.95, 1.10, 1.20]), 1.0, 1.5, 2) == "INCONCLUSIVE (the rounds' ratios 0.95-1.20 straddle 1.00)"
    assert verdict(Stats.of([1.05, 1.10, 1.20]), 1.0, 4.4, 2) == "INCONCLUSIVE (machine loaded: load average 4.4 on 2 cores)"
