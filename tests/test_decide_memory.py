"""Stage one's "nothing changed" decision holds no Python object per sample: over a cache of 200 k samples (part
snapshot, part log), its peak memory growth in a fresh process stays a small number of bytes per input (the
dict-based decision took about 1,400 bytes per input at this size)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.scale_build import key, source, stamp
from shards import Field, ShardWriter

REPO = Path(__file__).resolve().parents[1]
SAMPLES = 200_000
BYTES_PER_INPUT = 250  # the arrays' ~100 bytes, the log tail's packed rows and the run's fixed costs at this size


@pytest.mark.slow
def test_the_decision_grows_by_arrays_not_objects(tmp_path):
    root = tmp_path / "cache"
    x = {"x": torch.zeros(1, dtype=torch.int32)}
    with ShardWriter(root, {"lean": 1}, {"x": Field(torch.int32)}, max_shard_samples=500) as w:  # a snapshot at 256 commits
        for i in range(SAMPLES):
            w.write(key(i), (8, 8), x, source=source(i), stamp=stamp(i))
    code = (f"import sys, json; sys.path.insert(0, {str(REPO)!r}); import bench.scale_measure as m; "
            f"print(json.dumps(m.measure_decide({str(root)!r}, {SAMPLES})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.splitlines()[-1])
    assert row["unchanged"] == SAMPLES
    assert row["decide_peak_bytes"] / SAMPLES < BYTES_PER_INPUT, row
