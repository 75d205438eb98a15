"""Stage two for someone who is not watching a terminal: plain progress lines in logs and pipes, the planner saying
what it traces, `--gpu-memory` as the README's per-card table means it, help that keeps install commands whole, and
`train sample` from a run alone."""

import json
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


@pytest.mark.slow
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


def test_the_planner_says_what_it_traces_on_stderr_and_prints_the_plan_alone():
    out = subprocess.run([sys.executable, "-m", "train", "plan", "tiny-flux", "--resolution", "256", "--grad-checkpointing", "all",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["config"]["bucket"] == "256x256"  # stdout: the JSON alone
    assert "planning tiny-flux: building it on the meta device" in out.stderr
    assert "tracing tiny-flux forward/backward at 256x256, batch 8 and 9, bf16 ..." in out.stderr
    assert re.search(r"traced in \d+\.\d s", out.stderr)
    # a missing optional backend (torchvision) is one line at most, not one per class FluxPipeline's import touches
    assert "falling back to" not in out.stderr
    assert len(re.findall(r"is not installed, so transformers falls back", out.stderr)) <= 1


def test_gpu_memory_means_the_card_of_the_readme_table():
    """`--gpu-memory 16GB` plans what `largest_batch_by_card["16GB"]` (the README's per-card table) plans: the card's
    memory less the CUDA context's reserve; 16GB, 16GiB, 16G and 16 are the same card."""
    from train.plan import plan
    from train.plan_config import CARD_RESERVED, GiB, PlanConfig, card_memory

    assert {card_memory(t) for t in ("16GB", "16GiB", "16G", "16", " 16gb ")} == {16 * GiB - CARD_RESERVED}
    for bad in ("0.5GB", "sixteen", "nan", "17179869184"):  # the last: bytes, as --gpu-memory once took
        with pytest.raises(ValueError, match="--gpu-memory"):
            card_memory(bad)
    setup = dict(batch_size=2, grad_checkpointing="all", bucket=(256, 256))
    for card in ("16GB", "24GB"):
        result = plan(PlanConfig("tiny-sd3", gpu_memory=card_memory(card), **setup))
        assert result["largest_batch"] == result["largest_batch_by_card"][card]
    # the reserve matters: the same card without it would plan a larger batch
    assert plan(PlanConfig("tiny-sd3", gpu_memory=16 * GiB, **setup))["largest_batch"] > result["largest_batch_by_card"]["16GB"]


def test_sample_reads_the_runs_own_cache_says_what_it_does_and_writes_beside_the_checkpoints(tiny_caches, tmp_path):
    from typer.testing import CliRunner

    from train.__main__ import tools
    from train.checkpoint import complete_checkpoints
    from train.config import TrainConfig
    from train.loop import train

    def run_to(steps: int) -> None:
        train(TrainConfig(model="tiny-sana", cache=[tiny_caches["tiny-sana"]], run=tmp_path / "run", steps=steps, batch_size=2,
                          checkpoint_every=1, keep_checkpoints=1, validate=False, workers=0))

    run_to(2)
    result = CliRunner().invoke(tools, ["sample", str(tmp_path / "run"), "--validation-steps", "1", "--validation-bucket", "256x256"])
    assert result.exit_code == 0, result.output
    written = [Path(line) for line in result.stdout.splitlines()]  # stdout: the images alone
    assert len(written) == 2 and all(p.parent == tmp_path / "run" / "samples" / "00000002" / "sample" and p.stat().st_size for p in written)
    assert "sampling 1/2: 'a large red circle on a blue background' at 256x256, 1 steps ..." in result.stderr
    assert "sampling 2/2:" in result.stderr and "decoding 2 image(s) on cpu" in result.stderr
    run_to(3)  # the run goes on: step 2's checkpoint is rotated away, its samples stay
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == ["step-00000003"]
    assert all(p.exists() for p in written)


def test_sample_without_the_runs_cache_says_to_pass_one(tmp_path, monkeypatch):
    from train.export import open_prompt_cache

    monkeypatch.chdir(tmp_path)  # the run was given a relative --cache, from elsewhere
    with pytest.raises(FileNotFoundError, match="the run's cache cache/tiny-sana .its --cache. is not there from .*--prompt-cache"):
        open_prompt_cache(None, {"cache": ["cache/tiny-sana"]})


def rendered_help(app, *args: str) -> str:
    """`--help` in an 80-column terminal (typer reads TERMINAL_WIDTH once, when it is imported: set where it looks)."""
    import typer.rich_utils
    from typer.testing import CliRunner

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(typer.rich_utils, "MAX_WIDTH", 80)
        result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def extras() -> set[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"dev"}


def test_help_shows_the_extras_install_commands_whole_at_80_columns():
    """Each extra's install command on one line of --help in an 80-column terminal, and every `pip install` whole:
    not cut by the options table's narrow column, its `[extra]` not taken for rich markup."""
    from precompute.__main__ import app as precompute_app
    from train.__main__ import app as train_app
    from train.__main__ import tools

    pages = {"train": rendered_help(train_app), "plan": rendered_help(tools, "plan"), "precompute": rendered_help(precompute_app)}
    listed = {name: set(re.findall(r"pip install -e '\.\[([\w-]+)\]'", page)) for name, page in pages.items()}
    assert listed["train"] >= {"quant", "bf16", "8bit", "tensorboard", "wandb", "remote"}
    assert listed["plan"] >= {"quant", "bf16", "8bit"} and listed["precompute"] >= {"remote", "hf"}
    assert set().union(*listed.values()) == extras()  # every extra of pyproject.toml, in one stage's help or both
    for page in pages.values():
        assert all(len(line) <= 80 for line in page.splitlines())
        for line in page.splitlines():
            if "pip install" in line:  # the whole command on its line
                assert re.search(r"pip install -e '\.\[[\w-]+\]'(\s|$)", line), line
    # an option's help names its extra (the command is above it), in the options table's wrapped column
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", pages["plan"]).split())
    assert "both from the quant extra" in flat and "bitsandbytes: the 8bit extra" in flat
    # square brackets in an option's help are printed, not taken for markup (--caption-variants: "per [[source]]")
    assert " ".join(re.sub(r"[│╭╮╰╯─]", " ", pages["precompute"]).split()).count("[[source]]") == 2
