"""What the tests of a cache's faults share: the cache's files as they are, and the `python -m shards` command."""

from pathlib import Path

from typer.testing import CliRunner

from shards.cli import app


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (not following links) and its bytes, lock files aside."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and not p.name.startswith(".lock")}


def cli(*args):
    """`python -m shards ARGS`, in this process."""
    return CliRunner().invoke(app, [str(a) for a in args])
