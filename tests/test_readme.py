"""The README's commands run as written.

Every shell block the README marks with `<!-- runs as written -->` is run whole, in order, by bash, in a scratch
directory that looks like a checkout (the Makefile, the packages and the installed `.venv` linked in), so
`make precompute ...` and `.venv/bin/python -m train ...` behave as they do for a user. Those are the blocks that use
tiny presets; a command naming a tiny preset outside a marked block is an error, so none goes untested. Commands for
the released models need their weights and are not run here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- runs as written -->"
LINKED = ("Makefile", "pyproject.toml", "precompute", "train", "shards", "bench", ".venv")


def shell_blocks(text: str) -> list[tuple[int, bool, str]]:
    """The README's ```bash blocks: (line number, marked to run, body)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() in ("```bash", "```sh"):
            start = i
            marked = any(lines[j].strip() == MARKER for j in range(max(0, i - 2), i))
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start + 1, marked, "\n".join(body)))
        i += 1
    return blocks


def test_every_tiny_command_is_run():
    blocks = shell_blocks((REPO / "README.md").read_text(encoding="utf-8"))
    marked = [b for b in blocks if b[1]]
    assert len(marked) >= 3, "the README marks its quick paths' tiny commands to run"
    untested = [(line, body) for line, run, body in blocks if not run and re.search(r"\btiny-", body)]
    assert not untested, f"README.md:{untested[0][0]}: a block naming a tiny preset is not marked {MARKER!r}"


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv (make install)")
def test_marked_blocks_run_as_written(tmp_path):
    for name in LINKED:
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("MAKEFLAGS", None)
    for line, run, body in shell_blocks((REPO / "README.md").read_text(encoding="utf-8")):
        if not run:
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, (f"README.md:{line}: the block exited {done.returncode}\n{body}\n"
                                      f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
