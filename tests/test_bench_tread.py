"""bench/tread.py runs at a tiny size: every row measured with a figure and a PASS or MISS, the FLOPs of a routed step
below the unrouted one's."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tread_bench_runs_at_a_tiny_size():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "tread.py"), "--flux-size", "128", "--wan-size", "64",
                          "--rounds", "1", "--steps", "1", "--run-steps", "4", "--images", "8", "--run-batch-size", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for name in ("(a) flux step time", "(b) flux FLOPs", "(a) wan step time", "(b) wan FLOPs", "(c) flux held-out loss"):
        assert re.search(re.escape(name) + r".*\d\.\d{3}.*GOAL .*(PASS|MISS)$", out, re.M), f"no row {name!r}:\n{out}"
    for name in ("flux", "wan"):
        ratio = float(re.search(rf"\(b\) {name} FLOPs routed / unrouted\s+(\d\.\d+)", out).group(1))
        assert 0.5 < ratio < 1
    assert re.search(r"unrouted: smoothed loss \d+\.\d+, held-out loss \d+\.\d+", out)
