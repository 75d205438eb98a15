"""Stage two for someone who is not watching a terminal: plain progress lines in logs and pipes, the planner saying
what it traces, `--gpu-memory` as the README's per-card table means it, help that keeps install commands whole, and
`train sample` from a run alone."""

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # trains tiny diffusers models

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d{4})  smoothed \d+\.\d{4}  lr \d\.\d\de[-+]\d\d  (\d+\.\d) samples/s  "
                  r"data wait \d+%  ETA \d+:\d\d:\d\d$")


def train_command(cache: Path, run: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "train", "--model", "tiny-sana", "--cache", str(cache), "--run-dir", str(run), "--steps", "6",
            "--batch-size", "2", "--log-every", "2", "--no-validate", "--checkpoint-every", "0", "--workers", "0", *args]


def test_piped_output_shows_loss_lines(tiny_caches, tmp_path):
    out = subprocess.run(train_command(tiny_caches["tiny-sana"], tmp_path / "run"), cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [m for m in map(LINE.match, out.stdout.splitlines()) if m]
    assert [(int(m[1]), int(m[2])) for m in lines] == [(2, 6), (4, 6), (6, 6)], out.stdout
    assert all(float(m[3]) > 0 and float(m[4]) > 0 for m in lines)
    assert lines[-1][0].endswith("ETA 0:00:00")
    assert "a line every 2 steps" in out.stdout
    assert "\r" not in out.stdout + out.stderr  # no progress bar redrawing itself in the log


def test_no_progress_prints_the_lines_at_a_terminal_too(tiny_caches, tmp_path):
    """stdout is a terminal (a pseudo-terminal here): the bar, unless --no-progress asks for the plain lines."""

    def at_terminal(*args: str) -> tuple[str, str]:
        main, sub = pty.openpty()
        proc = subprocess.Popen(train_command(tiny_caches["tiny-sana"], tmp_path / f"run{len(args)}", *args), cwd=ROOT,
                                stdout=sub, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.close(sub)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the terminal closed: the process is done
                break
            if not chunk:
                break
            shown += chunk
        os.close(main)
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=600) == 0, err[-3000:]
        return shown.decode().replace("\r\n", "\n"), err

    shown, err = at_terminal("--no-progress")
    assert len([line for line in shown.splitlines() if LINE.match(line)]) == 3, shown
    shown, err = at_terminal()
    assert not any(LINE.match(line) for line in shown.splitlines()), shown
    assert "6/6" in err  # tqdm's bar, on stderr
