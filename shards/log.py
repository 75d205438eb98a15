"""The commit log and the snapshots as files: whether a directory holds a cache (and if not, why not), which
snapshots there are, the check of the `index.json` pointer, and reading and creating commits. A commit or a
snapshot file is created once ("create if absent"), so writers never overwrite each other.

`shards.manifest` builds on this: it loads and compacts the `Manifest` these files describe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shards.atomic import TMP_SUFFIX, fsync_dir
from shards.layout import LOG_DIR, LOG_NAME, MANIFEST, SHARD_FILE, SNAPSHOT_DIR
from shards.schema import FORMAT_NAME, FORMAT_VERSION, FormatError, check_version


def committed(root: Path) -> bool:
    """Whether the log or a snapshot holds a generation (gc may have collected the first commits)."""
    return (root / LOG_DIR / LOG_NAME.format(0)).exists() or bool(snapshots(root))


def exists(root: str | os.PathLike) -> bool:
    """Whether `root` holds a cache: something was committed there, or it has an `index.json` (a cache of
    another version, or one whose log was lost; either way no directory to start afresh in)."""
    root = Path(root)
    return (root / MANIFEST).exists() or committed(root)


def missing_manifest(root: str | os.PathLike) -> tuple[bool, str]:
    """Why a directory holds no committed cache: (never committed, what to tell the user).

    A writer commits after every shard it publishes, so a run killed before its first commit leaves at
    most one shard file (and one temp file) per rank. More shard files than that, or an `index.json`, mean
    commits happened and the log was lost afterwards.
    """
    root = Path(root)
    build = f"build it with `make precompute DATA=... CACHE={root}`"
    if not root.is_dir():
        return True, f"{root} does not exist; {build}"
    shards: dict[str, int] = {}
    leftovers = 0
    for path in root.glob("*/*"):
        m = SHARD_FILE.fullmatch(path.name)
        if m and path.parent.name not in (LOG_DIR, SNAPSHOT_DIR):
            leftovers += 1
            if not m.group(3):
                shards[m.group(1)] = shards.get(m.group(1), 0) + 1
    pointer = (root / MANIFEST).exists()
    if any(n > 1 for n in shards.values()) or pointer:
        return False, (f"{root} holds {sum(shards.values())} shard files and {'an' if pointer else 'no'} {MANIFEST} "
                       f"but no commit log ({LOG_DIR}/ and {SNAPSHOT_DIR}/): it was removed or lost after shards were "
                       f"committed. Restore {LOG_DIR}/ and {SNAPSHOT_DIR}/ from a backup, or rebuild the cache with "
                       f"`make precompute`")
    left = (f" ({leftovers} file(s) left by a run interrupted before its first commit; the next `make precompute` into it "
            f"clears them)") if leftovers else ""
    return True, f"{root} is not a cache yet: no manifest was ever committed{left}; {build}"


def snapshots(root: Path) -> list[int]:
    """Generations with a snapshot, oldest first (temp files of a snapshot being written are not listed)."""
    return sorted(int(p.stem) for p in (root / SNAPSHOT_DIR).glob("*.safetensors") if p.stem.isdigit())


def first_generation(root: Path) -> int | None:
    """The oldest generation that can still be loaded (gc collects the log before the oldest one needed)."""
    if (root / LOG_DIR / LOG_NAME.format(0)).exists():
        return 0
    return next(iter(snapshots(root)), None)


def read_pointer(root: Path) -> int | None:
    """The snapshot generation `index.json` names, after checking it is a cache of this format version."""
    path = root / MANIFEST
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON ({e}); delete it (the log under {LOG_DIR}/ is the truth) and retry") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a {FORMAT_NAME} manifest (its 'format' field is missing or wrong)")
    if obj.get("format_version") == 1:
        raise FormatError(f"{root} is a version 1 cache (a single index.json); this library reads version {FORMAT_VERSION}. "
                          f"Convert it in place, keeping every shard: python -m shards upgrade {root}")
    check_version(obj.get("format_version"), str(path))
    return obj.get("snapshot_generation")


def read_commit(path: Path) -> dict | None:
    """The commit at `path`, None when that generation was not committed (yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        commit = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON ({e}): the commit log is damaged; run `python -m shards verify`") from e
    if not isinstance(commit, dict) or commit.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a {FORMAT_NAME} commit")
    check_version(commit.get("format_version"), str(path))
    return commit


def create_if_absent(final: Path, data: bytes, rank: int) -> bool:
    """Create `final` holding `data` if it does not exist yet (False if it does): the bytes go to a temp file
    first, fsynced, then are hard-linked to `final`, so `final` is never seen partial or overwritten."""
    tmp = final.with_name(f".{final.name}.r{rank:05d}.{os.getpid()}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    fsync_dir(final.parent)
    return True


def write_commit(root: Path, commit: dict, rank: int = 0) -> bool:
    """Create `_log/GENERATION.json` if it does not exist yet: False when another writer took the number."""
    log = root / LOG_DIR
    if not log.is_dir():
        log.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
    body = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **commit}
    return create_if_absent(log / LOG_NAME.format(commit["generation"]), json.dumps(body, separators=(",", ":")).encode(), rank)
