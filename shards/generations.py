"""Generations of a cache: loading one from the newest snapshot at or before it and the commits after it,
following repaired shards across generations, and compacting the log into snapshots.

Shard files are immutable. Removing samples retires whole shards (their kept samples are copied into new ones);
retired files stay on disk until `python -m shards gc`, so a reader of an earlier generation (a training run
mid-epoch) keeps working. `index.json` points at the newest snapshot; the log is the truth. See FORMAT.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from shards.layout import LOG_DIR, LOG_NAME, MANIFEST, SNAPSHOT_DIR, SNAPSHOT_NAME, confined
from shards.log import (
    check_log_end,
    committed,
    damaged_commit,
    first_generation,
    lost_snapshot,
    missing_manifest,
    prune_snapshots,
    read_commit,
    read_pointer,
    snapshots,
    write_pointer,
    write_snapshot,
)
from shards.manifest import Manifest, snapshot_replacements
from shards.schema import DamagedLog, FingerprintMismatch, FormatError, open_file

# The bounds on the commits between two snapshots (`compaction_due`): readers replay at most COMPACT_MAX small
# files, and a commit pays for a snapshot once in COMPACT_MIN commits at most.
COMPACT_MIN, COMPACT_MAX = 256, 4096


def load(root: str | os.PathLike, generation: int | None = None) -> Manifest:
    """The manifest at `generation` (default: the newest): the newest snapshot at or before it, plus the
    commits after that snapshot.

    Raises:
        FileNotFoundError: nothing was ever committed here; the message says what the directory is.
        DamagedLog: a damaged commit or snapshot, or a commit missing before later ones; the message names it.
        FormatError: another format version, or a generation gc collected.
    """
    root = Path(root)
    pointer = read_pointer(root)
    if not committed(root):
        raise FileNotFoundError(missing_manifest(root)[1])
    if generation is not None and generation < 0:
        raise ValueError(f"generation {generation} is negative; the first generation is 0")
    for attempt in range(3):
        listed = snapshots(root)
        try:
            manifest = _start(root, generation)
            replay(root, manifest, generation)
            break
        except DamagedLog:
            # gc deletes the log before the snapshot it keeps, oldest first: a load that started from an older
            # snapshot meanwhile finds a gap, and loads again from the new oldest one
            if attempt == 2 or snapshots(root) == listed:
                raise
    if generation is not None and manifest.generation != generation:
        raise FormatError(f"{root} has no generation {generation} (the newest is {manifest.generation}); the run that "
                          f"recorded it belongs to another cache")
    if generation is None and pointer is not None and pointer > manifest.generation:
        # the pointer only ever names a snapshot of a committed generation: the end of the log was lost, and a
        # writer would take the shards of the lost commits for uncommitted ones
        missing = root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(pointer)
        raise DamagedLog(missing, f"{root / MANIFEST} names snapshot {missing}, but the log and snapshots end at generation "
                                  f"{manifest.generation}: the last commits (and that snapshot) were lost, and the shards "
                                  f"they list are not at fault (--repair cannot help). Restore {LOG_DIR}/ and "
                                  f"{SNAPSHOT_DIR}/ from a backup of the cache; without one, build the cache again into a "
                                  f"new directory (`make precompute DATA=... CACHE=NEW`). Nothing was deleted.")
    return manifest


def _start(root: Path, generation: int | None) -> Manifest:
    """The manifest a load of `generation` starts from: the newest snapshot at or before it, or commit 0's init."""
    first = root / LOG_DIR / LOG_NAME.format(0)
    manifest = _snapshot_at_or_before(root, generation)
    if manifest is None and (commit := read_commit(first)) is not None:
        manifest = Manifest.from_init(commit, str(first))
    if manifest is None:
        if not snapshots(root):  # gc always keeps a snapshot where it collected the log
            check_log_end(root, 0)
        if generation is not None and (lost := lost_snapshot(root, generation)) is not None:
            raise lost
        raise FormatError(f"{root} has no generation {generation} any more (the oldest kept is "
                          f"{first_generation(root)}): `python -m shards gc` collected it, since no registered run "
                          f"needed it")
    return manifest


def _snapshot_at_or_before(root: Path, generation: int | None) -> Manifest | None:
    """The newest snapshot at or before `generation`, loaded; a writer may prune the one listed a moment ago
    (`prune_snapshots`), so the listing is read again then."""
    for _ in range(3):
        base = [g for g in snapshots(root) if generation is None or g <= generation]
        if not base:
            return None
        try:
            return Manifest.from_snapshot(root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(base[-1]))
        except FileNotFoundError:
            continue
    raise FormatError(f"{root}: the snapshots under {SNAPSHOT_DIR}/ kept disappearing while loading; retry")


def replay(root: Path, manifest: Manifest, upto: int | None = None, check_end: bool = True) -> int:
    """Apply the commits after `manifest.generation` up to `upto` (default: every one there is); returns how many
    (each is let go once applied: a log tail of millions of samples is not held as JSON at once).

    The log ends at the first missing commit only when no later one exists (`check_end`: one listing of the log;
    a writer that checked it at its start passes False, since writers never leave a gap).

    Raises:
        DamagedLog: a commit fails its checks or cannot follow the one before, or one is missing before later ones.
    """
    applied = 0
    while upto is None or manifest.generation < upto:
        path = root / LOG_DIR / LOG_NAME.format(manifest.generation + 1)
        commit = read_commit(path)
        if commit is None:
            if check_end and not check_log_end(root, manifest.generation + 1):
                continue  # committed while the log was listed
            break
        try:
            manifest.apply(commit, str(path))
        except DamagedLog:
            raise
        except (FormatError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, FingerprintMismatch):  # another cache's commit: not damage, said as it is
                raise
            raise damaged_commit(path, str(e)) from None
        applied += 1
    return applied


def replacements(root: Path, manifest: Manifest) -> dict[str, str]:
    """Repaired shard path -> its copy, as of the newest generation: a reader of `manifest`'s (older) generation
    follows them. Reads the newest snapshot's metadata and the commits after it, not the whole state."""
    replaced = dict(manifest.replaced)
    generation = manifest.generation
    later = [g for g in snapshots(root) if g > generation]
    if later:
        path = root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(later[-1])
        replaced.update(snapshot_replacements(open_file(path, kind="snapshot", tensors=False)[0], path))
        generation = later[-1]
    while True:
        while (commit := read_commit(path := root / LOG_DIR / LOG_NAME.format(generation + 1))) is not None:
            for old, new in commit.get("replace", []):
                replaced[confined(old, str(path))] = confined(new["path"], str(path))
            generation += 1
        if check_log_end(root, generation + 1):
            return replaced


def newest_copy(path: str, replaced: dict[str, str]) -> list[str]:
    """`path` and its repaired copies, oldest first: the last one is what a reader opens."""
    chain = [path]
    while chain[-1] in replaced:
        chain.append(replaced[chain[-1]])
        if chain[-1] in chain[:-1]:
            raise FormatError(f"the repairs of {path} form a cycle; the manifest was edited or damaged")
    return chain


# ---- compacting the log ------------------------------------------------------------------------------

def compact(root: Path, manifest: Manifest, rank: int = 0, prune: bool = True) -> None:
    """Write `manifest` as the snapshot of its generation (unless another writer did), point `index.json` at the
    newest snapshot and, with `prune`, delete the snapshots no reader needs (`prune_snapshots`). `gc` compacts
    without pruning: its snapshot becomes the oldest once it has deleted the ones before it."""
    write_snapshot(root, manifest.generation, manifest.encode_snapshot(), rank)
    write_pointer(root, manifest)
    if prune:
        prune_snapshots(root)


def compaction_due(root: Path, generation: int) -> bool:
    """Whether to snapshot after committing `generation`: every COMPACT_MIN commits while the cache is young,
    then every generation/64 commits, at most every COMPACT_MAX (see FORMAT.md)."""
    last = snapshots(root)
    since = generation - (last[-1] if last else -1)
    return since >= COMPACT_MIN and (since >= COMPACT_MAX or since * 64 >= generation)
