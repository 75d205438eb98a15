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
    assert re.search(r"\(ii\) / \(i\)  = \d+\.\d\d .*GOAL writer >= MDS-style sequential write \(ratio >= 1\.00\): (PASS|MISS)", out), out
    assert "row (iii) left out: no mosaicml-streaming" in out
    for part in ("finite check", "stack / cat", "safetensors save", "blake2b per sample", "write + fsync", "end to end"):
        assert re.search(re.escape(part) + r".*\d\.\d{3}", out), f"no time for {part!r}:\n{out}"
    assert list(tmp_path.iterdir()) == []  # its files removed
