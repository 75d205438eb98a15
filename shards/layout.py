"""What the files of a cache are called, and the check that a path a manifest lists stays inside the cache.

A cache directory holds `index.json` (a pointer to the newest snapshot), the commit log `_log/`, the
snapshots `_snapshots/`, the registered readers `_readers/`, and one directory of shards per bucket, each
shard named after the rank that wrote it and its sequence number. See FORMAT.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from shards.schema import FormatError

MANIFEST = "index.json"  # points at the newest snapshot; the log is the truth
LOG_DIR = "_log"
SNAPSHOT_DIR = "_snapshots"
READERS_DIR = "_readers"
LOG_NAME = "{:012d}.json"
SNAPSHOT_NAME = "{:012d}.safetensors"
# A shard file name, or the temp name it is written under (a leading dot, a `.PID.tmp` tail); the groups are
# `rRRRRR`, the sequence number and the temp tail.
SHARD_FILE = re.compile(r"\.?(r\d{5})-(\d{6,})\.safetensors(\.\d+\.tmp)?")


def shard_name(rank: int, seq: int) -> str:
    return f"r{rank:05d}-{seq:06d}.safetensors"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(rank, seq) of a shard file name, None for other files."""
    m = SHARD_FILE.fullmatch(name)
    return (int(m.group(1)[1:]), int(m.group(2))) if m and not m.group(3) and not name.startswith(".") else None


def confined(path: str, where: str = "manifest") -> str:
    """A manifest path, checked to stay inside the cache: relative, POSIX, without `..`.

    Raises:
        FormatError: the path is absolute, climbs out of the cache or is not a plain POSIX path.
    """
    parts = PurePosixPath(path).parts if isinstance(path, str) else ()
    if not parts or parts[0] == "/" or ".." in parts or "\\" in path or "\0" in path or path.startswith("~"):
        raise FormatError(f"{where} lists {path!r}, a path outside the cache; the manifest was edited or damaged")
    return path


def cache_files(root: Path, depth: int = 2, links: list[Path] | None = None) -> list[Path]:
    """The regular files in `root` (depth 1) or also one folder down (depth 2: bucket folders, `_log/`...), sorted,
    never through a symbolic link: whoever deletes what this lists deletes nothing outside the cache. The
    links met (to folders or files) are appended to `links`."""
    out: list[Path] = []
    _scan(root, 1, depth, out, links)
    return sorted(out)


def _scan(directory: Path, level: int, depth: int, out: list[Path], links: list[Path] | None) -> None:
    """Append the regular files of `directory` (at `level`) and of its folders down to `depth` to `out`, and the
    symbolic links met to `links`."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_symlink():
                if links is not None:
                    links.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                out.append(Path(entry.path))
            elif level < depth and entry.is_dir(follow_symlinks=False):
                _scan(Path(entry.path), level + 1, depth, out, links)
