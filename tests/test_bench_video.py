"""bench/video.py runs at a tiny size: every row measured, the Wan 2.1 480p x 81-frame latents' bytes exact, and the
tiny cache stores 2 bytes per bf16 latent element."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_video_bench_runs_at_a_tiny_size():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "video.py"), "--count", "4", "--frames", "17", "--repeats", "1",
                          "--real-clips", "1", "--real-videos", "0", "--batch-size", "2"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for row in ("(a) decode", "(b) encode", "(c) write", "(d) run: encoder busy", "run / bare encoders"):
        assert re.search(re.escape(row) + r".*\d", out), f"no figure in row {row!r}:\n{out}"
    busy = float(re.search(r"encoder busy.*?\s(\d+\.\d)%", out).group(1))
    assert 0 < busy <= 100
    assert "latents 2 x 16 x 21 x 60 x 104 x 2 B = 8,386,560 B" in out
    assert "80-token caption 80 x 4096 x 2 B = 655,360 B" in out
    assert "2.0000 B per latent element" in out
