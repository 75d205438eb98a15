"""bench/encoder_busy.py runs at a tiny size: every row has its figures, the goal row says PASS or MISS, and each
row names the stage that bounds it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_encoder_busy_bench_runs_at_a_tiny_size():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "encoder_busy.py"), "--count", "48", "--repeats", "1",
                          "--rate", "200", "--high-rate", "2000", "--batch-size", "8", "--workers", "1", "--gil-share", "0.1"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "10% of each encoder call holding the GIL" in out, out
    figures = r"\s+(\d+\.\d)%\s+(\d+) of\s+(\d+)\s+(\d+\.\d)%\s+(\d+\.\d)%\s+(encoder|decoding|writer|pass)\s"
    rows = {}
    for label in ("encoder on its own thread, 200/s", "serial pass (before), 200/s", "inputs decoded before: own thread, 200/s",
                  "inputs decoded before: serial, 200/s", "encoder on its own thread, 2000/s"):
        m = re.search(re.escape(label) + figures, out)
        assert m, f"no figures in row {label!r}:\n{out}"
        rows[label] = m
        assert 0 < float(m[1]) <= 100 and int(m[3]) == int(label.split(", ")[1].removesuffix("/s"))
    assert re.search(r">= 95 % busy at 200 samples/s on \d+ cores \(and >= 95 % of the rate\): (PASS|MISS)", out), out
    assert re.search(r"overlapped / serial samples/s\s+\d+\.\d\d x", out), out
    assert re.search(r"loader alone, 1 worker\(s\), nothing encoded\s+\d+ samples/s", out), out
