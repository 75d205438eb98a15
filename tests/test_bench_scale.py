"""bench/scale.py's decide row runs at a tiny size: stage one's real decision over a cache the writer built, every
input found unchanged, each figure printed beside its goal."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_scale_bench_decides_at_a_tiny_size(tmp_path):
    args = ["--decide-only", "--sizes", "3000", "--samples-per-shard", "100", "--out", str(tmp_path), "--keep"]
    for built in (False, True):  # built, then kept and measured again
        run = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), *args], capture_output=True, text=True,
                             timeout=300, cwd=REPO)
        assert run.returncode == 0, run.stderr[-3000:]
        assert ("kept from an earlier run" in run.stdout) == built
        row = re.search(r"^\s+3,000\s+30 \|.*GOAL <= 2\.6.*$|^\s+3,000\s+30 \|.*$", run.stdout, re.M)
        assert row and re.search(r"(PASS|MISS) \(cpu (PASS|MISS)\) \|\s+\d+\s+\d+ (PASS|MISS)", row.group(0)), run.stdout
