"""Readers of earlier generations, and `gc`: deleting what neither the cache nor a resumable run needs.

A training run registers the generation it reads in `_readers/` and records it in each checkpoint; `gc`
keeps every file that the newest generation or any generation a complete checkpoint records still lists,
and deletes the rest: retired shards, leftovers of interrupted writers, superseded prompt files, and the
log and snapshots before the oldest generation still needed. It runs alone: no writer may hold the cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from shards.atomic import TMP_SUFFIX, atomic_write_json, fsync_dir
from shards.generations import load, newest_copy, replay
from shards.layout import LOG_DIR, READERS_DIR, SNAPSHOT_DIR, cache_files, parse_shard_name
from shards.lock import WRITERS_LOCK, CacheLock
from shards.log import first_generation, lost_snapshot, snapshots, write_pointer, write_snapshot
from shards.manifest import Manifest
from shards.schema import CacheBusy, DamagedCache

CHECKPOINTS_GLOB = "checkpoints/step-*/state.json"  # where a run's checkpoints record their cache generation
COMPLETE = "COMPLETE"
_PROMPTS_FILE = re.compile(r"prompts(-[0-9a-f]+)?\.safetensors")


def register_reader(root: str | os.PathLike, run: str | os.PathLike, generation: int) -> bool:
    """Record that the run in directory `run` reads `generation` of the cache (until its checkpoints say
    otherwise). False when the cache is read-only: the run goes on, but `gc` cannot know it."""
    root, run = Path(root), Path(run).resolve()
    name = hashlib.sha256(str(run).encode()).hexdigest()[:16] + ".json"
    try:
        (root / READERS_DIR).mkdir(exist_ok=True)
        atomic_write_json(root / READERS_DIR / name, {"run": str(run), "generation": generation, "time": time.time()})
    except OSError:
        return False
    return True


@dataclass
class GcReport:
    generations: list[int] = field(default_factory=list)  # kept for readers
    deleted: list[str] = field(default_factory=list)
    bytes: int = 0
    stale_readers: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # symbolic links in the cache: never entered, nothing behind them deleted


def needed_generations(root: Path) -> tuple[set[int], list[Path]]:
    """Generations a registered run can still resume from, and the registrations of runs that are gone."""
    needed, stale = set(), []
    for path in sorted((root / READERS_DIR).glob("*.json")):
        reg = registration(path)
        run = Path(reg["run"])
        if not run.is_dir():
            stale.append(path)
            continue
        recorded = []
        for state in run.glob(CHECKPOINTS_GLOB):
            if (state.parent / COMPLETE).exists():
                obj = _checkpoint_state(state, path)
                # a run of several caches lists each under "caches"; the first one's fields are at the top too
                for entry in obj.get("caches") or [obj]:
                    if entry.get("cache_root") in (None, str(root.resolve())) and entry.get("cache_generation") is not None:
                        recorded.append(entry["cache_generation"])
        needed |= set(recorded)
        if not recorded or reg["generation"] > max(recorded):
            needed.add(reg["generation"])  # the epoch in progress, not checkpointed yet
    return needed, stale


def registration(path: Path) -> dict:
    """A run's registration (`register_reader`), checked: gc cannot tell what a registration it cannot read protects.

    Raises:
        DamagedCache: not JSON, or without a `run` path and an integer `generation`; the message names the file.
    """
    try:
        reg = json.loads(path.read_bytes())
        why = None if isinstance(reg, dict) else "not a JSON object"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reg, why = None, f"not valid JSON: {e}"
    except OSError as e:  # e.g. a directory by that name
        reg, why = None, f"unreadable: {e.strerror}"
    if why is None and not isinstance(reg.get("run"), str):
        why = "no `run` directory"
    elif why is None and (not isinstance(reg.get("generation"), int) or isinstance(reg["generation"], bool)):
        why = "no integer `generation`"
    if why is not None:
        raise DamagedCache(f"{path} is a damaged registration of a training run ({why}): gc cannot tell which "
                           f"generations that run still needs, and deletes nothing while it is there. If that run is "
                           f"gone (or will never resume), delete {path}; otherwise start or resume the run, which "
                           f"registers it anew. Then run gc again.")
    return reg


def _checkpoint_state(state: Path, reg: Path) -> dict:
    """A complete checkpoint's state.json as gc reads it (the generations it records).

    Raises:
        DamagedCache: not a JSON object; the message names it and the registration that led there.
    """
    try:
        obj = json.loads(state.read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        obj = e
    if not isinstance(obj, dict) or not all(isinstance(entry, dict) for entry in obj.get("caches") or []):
        raise DamagedCache(f"{state}, a complete checkpoint of the run registered in {reg}, is damaged (not the JSON "
                           f"object a checkpoint writes): gc cannot tell which generation it needs, and deletes nothing "
                           f"while it is there. Restore that checkpoint or delete its directory, then run gc again.")
    return obj


def exclusive(root: Path) -> list[CacheLock]:
    """The cache for this process alone: no run (`.lock`) and no writer (`.lock-writers`) holds it.

    Raises:
        CacheBusy: a run or a writer uses the cache.
    """
    try:
        run = CacheLock(root)
    except PermissionError as e:
        raise read_only(root, e) from None
    try:
        return [run, CacheLock(root, WRITERS_LOCK)]
    except CacheBusy:
        run.release()
        raise CacheBusy(f"a writer is writing the cache at {root}; run this when it has finished") from None
    except PermissionError as e:
        run.release()
        raise read_only(root, e) from None


def read_only(path: Path, e: OSError) -> PermissionError:
    return PermissionError(e.errno, f"cannot change {path} ({e.strerror}: {e.filename or path}); nothing was deleted. "
                                    f"Run this as a user who may write the cache, on a writable mount")


def gc(root: str | os.PathLike, dry_run: bool = False) -> GcReport:
    """Delete the files no reader needs (see the module's doc). Holds the cache alone: no writer runs meanwhile.

    Args:
        root: the cache directory.
        dry_run: report what would be deleted, delete nothing.

    Raises:
        CacheBusy: a run or a writer uses the cache; nothing was deleted.
        DamagedCache: a commit or snapshot is damaged, or missing before later ones, or a run's registration
            (`_readers/`) or complete checkpoint cannot be read; nothing was deleted.
        PermissionError: the cache (or a folder of it) cannot be changed; nothing was deleted.
    """
    root = Path(root)
    locks = exclusive(root)
    try:
        current = load(root)
        needed, stale = needed_generations(root)
        for g in sorted(needed):  # a generation older than the log that still has commits after it lost its snapshot
            if (lost := lost_snapshot(root, g)) is not None:
                raise lost
        first = first_generation(root)
        needed = {g for g in needed if first <= g <= current.generation}  # older ones were collected already
        report = GcReport(generations=sorted(needed), stale_readers=[str(p) for p in stale])
        oldest = min(needed | {current.generation})
        base = current if oldest == current.generation else load(root, oldest)
        # the log before `oldest` goes: its snapshot becomes the only copy of the sample index, so it must be sound
        base.shards.check_sample_index()
        if base.texts is not None:
            base.texts.check_sample_index()
        # the snapshot of `oldest` makes the log and snapshots before it redundant; encoded before the replay below
        snapshot = base.encode_snapshot() if oldest not in snapshots(root) else None
        compacting = snapshot is not None
        keep = _files_needed(root, base, sorted(needed | {current.generation}), current.replaced)
        links: list[Path] = []
        doomed = [p for p in cache_files(root, links=links) if _collectable(root, p, keep, oldest, stale)]
        # snapshots first, then the log oldest first: an interrupted gc never leaves a gap in the log
        doomed.sort(key=lambda p: (p.parent.name != SNAPSHOT_DIR, p.parent.name != LOG_DIR, p.as_posix()))
        report.links = sorted(p.relative_to(root).as_posix() for p in links)
        for path in doomed:
            report.deleted.append(path.relative_to(root).as_posix())
            report.bytes += path.stat().st_size
        if dry_run:
            return report
        for directory in sorted({p.parent for p in doomed} | ({root, root / SNAPSHOT_DIR} if compacting else set())):
            _check_writable(directory)
        if compacting:
            write_snapshot(root, oldest, snapshot)
            write_pointer(root, current)
        for path in doomed:
            path.unlink()
        for directory in {root} | {p.parent for p in doomed}:
            fsync_dir(directory)
        return report
    finally:
        for lock in reversed(locks):
            lock.release()


def _check_writable(directory: Path) -> None:
    """Fail before anything is deleted when `directory` cannot be changed (a read-only cache or mount). Asked of
    the file system, not tried with a file: a gc killed meanwhile would leave it behind."""
    if not directory.is_dir():
        return  # `_snapshots/` not there yet: compacting creates it in the root, checked too
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        raise read_only(directory, OSError(errno.EROFS, os.strerror(errno.EROFS), str(directory)))
    if not os.access(directory, os.W_OK | os.X_OK):
        raise read_only(directory, PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory)))


def _files_needed(root: Path, manifest: Manifest, generations: list[int], replaced: dict[str, str]) -> set[str]:
    """Every file the given generations list (shards, their repaired copies, auxiliary files), relative to
    `root`, in one replay of the log from `manifest` (the oldest of them)."""
    keep: set[str] = set()
    for g in generations:
        replay(root, manifest, g)
        texts = manifest.texts.paths() if manifest.texts is not None else []
        for path in [*manifest.shards.paths(), *texts, *(e["path"] for e in manifest.files.values())]:
            keep.update(newest_copy(path, replaced))  # a reader resolved its copies when it opened the cache
    return keep


def _collectable(root: Path, path: Path, keep: set[str], oldest: int, stale: list[Path]) -> bool:
    """Whether gc deletes `path`; never a file this library did not write, nor one outside the cache."""
    name, parent = path.name, path.parent.name
    if path.parent != root and parent == READERS_DIR:
        return path in stale  # runs register without a lock: their temp files may be in use
    if name.startswith(".") and name.endswith(TMP_SUFFIX):
        return True  # no writer runs, so a temp file was left by one that was killed
    if path.parent != root and parent in (LOG_DIR, SNAPSHOT_DIR):
        stem = name.split(".")[0]
        return stem.isdigit() and int(stem) < oldest
    if path.relative_to(root).as_posix() in keep:
        return False
    # a shard no kept generation lists (retired, or never committed), or a superseded prompts file
    return parse_shard_name(name) is not None or (path.parent == root and _PROMPTS_FILE.fullmatch(name) is not None)
