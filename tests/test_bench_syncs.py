"""bench/syncs.py runs at a tiny size: each row states its figure beside the goal (one sync per optimizer step) and
passes, and says why the step time with and without the syncs is not measured on a CPU."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]


def test_syncs_bench_runs_at_a_tiny_size():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "syncs.py"), "--presets", "tiny-flux,tiny-qwen-image", "--steps",
                          "2", "--no-loop"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for preset in ("tiny-flux", "tiny-qwen-image"):
        assert re.search(rf"\(a\) {preset}\s+1 per step\s+GOAL 1 per optimizer step\s+PASS", out), out
    assert "not measurable on a CPU" in out and "all PASS" in out
