"""The commit log and the snapshots as files: whether a directory holds a cache (and if not, why not), which
snapshots there are, the check of the `index.json` pointer, and reading and creating commits. A commit or a
snapshot file is created once ("create if absent"), so writers never overwrite each other.

Writers claim generation numbers in order, so the log never has a gap: a commit missing while later ones are
there was lost, and the log must not be taken to end before it (a writer would delete the shards the later
commits list as uncommitted, and publish others under their names).

`shards.generations` builds on this: it loads and compacts the `Manifest` (`shards.manifest`) these files describe.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from shards.atomic import TMP_SUFFIX, atomic_write_json, fsync_dir
from shards.layout import LOG_DIR, LOG_NAME, MANIFEST, SHARD_FILE, SNAPSHOT_DIR, SNAPSHOT_NAME
from shards.schema import BASE_VERSION, FORMAT_NAME, FORMAT_VERSION, DamagedLog, FormatError, check_version


def committed(root: Path) -> bool:
    """Whether the log or a snapshot holds a generation (gc may have collected the first commits)."""
    return (root / LOG_DIR / LOG_NAME.format(0)).exists() or bool(snapshots(root)) or bool(commit_numbers(root))


def exists(root: str | os.PathLike) -> bool:
    """Whether `root` holds a cache: something was committed there, or it has an `index.json` (a cache of
    another version, or one whose log was lost; either way no directory to start afresh in)."""
    root = Path(root)
    return (root / MANIFEST).exists() or committed(root)


def missing_manifest(root: str | os.PathLike) -> tuple[bool, str]:
    """Why a directory holds no committed cache: (never committed, what to tell the user).

    A writer commits after every shard it publishes, so a run killed before its first commit leaves at
    most one shard file (and one temp file) per rank, and one text shard (`texts/`) where texts are stored once.
    More shard files than that, or an `index.json`, mean commits happened and the log was lost afterwards.
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
            if not m.group(3):  # a text shard is written just before the first commit too
                kind = f"{m.group(1)}/{'texts' if path.parent.name == 'texts' else 'shards'}"
                shards[kind] = shards.get(kind, 0) + 1
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


def commit_numbers(root: Path) -> list[int]:
    """Generations with a commit file, in order (temp files of commits being written are not listed)."""
    try:
        names = os.listdir(root / LOG_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(name[:-5]) for name in names if name.endswith(".json") and name[:-5].isdigit())


def check_log_end(root: Path, generation: int) -> bool:
    """Called when commit `generation` was missing: whether the log ends there (no later commit exists). False:
    the commit is there now, written while the log was listed (writers create commits in order, so a later one
    means this one was there first): read it.

    Raises:
        DamagedLog: later commits exist and this one is still missing; the message names it and the later ones.
    """
    later = [g for g in commit_numbers(root) if g > generation]
    if not later:
        return True
    path = root / LOG_DIR / LOG_NAME.format(generation)
    if path.exists():
        return False
    raise DamagedLog(path, gap_message(root, generation, later))


def gaps(root: Path) -> list[tuple[int, list[int]]]:
    """Every commit missing from the log while later ones exist, with those later ones. The log starts at commit 0,
    or after the oldest snapshot once gc collected its beginning (gc deletes the log oldest first, so an
    interrupted gc leaves no gap above the snapshot it kept)."""
    numbers = commit_numbers(root)
    if not numbers:
        return []
    have, kept = set(numbers), snapshots(root)
    start = kept[0] + 1 if kept and 0 not in have else 0
    return [(g, [n for n in numbers if n > g]) for g in range(start, numbers[-1])
            if g not in have and not (root / LOG_DIR / LOG_NAME.format(g)).exists()]  # not one committed while listing


def gap_message(root: Path | str, generation: int, later: list[int]) -> str:
    """What to say of commit `generation` missing before `later` ones; `root` is a directory or a cache's URL."""
    name = LOG_NAME.format(generation)
    names = ", ".join(LOG_NAME.format(g) for g in later[:3]) + (f" ... {LOG_NAME.format(later[-1])}" if len(later) > 3 else "")
    return (f"{root}/{LOG_DIR}/{name} is missing, but {len(later)} later commit(s) are there ({names}): the file was "
            f"lost, so generation {generation} and every later one cannot be read, and the shards those commits list "
            f"are not at fault (--repair cannot help). Restore {name} into {root}/{LOG_DIR}/ from a backup of the "
            f"cache; without one, build the cache again into a new directory (`make precompute DATA=... CACHE=NEW`). "
            f"Nothing was deleted: stage one and `python -m shards gc` refuse to work on the cache until it is restored.")


def damaged_commit(path: Path, why: str) -> DamagedLog:
    """The error of a commit file that is there but fails its checks."""
    return DamagedLog(path, f"{path} is damaged ({why}): the commit log of the cache cannot be read past it, and the "
                            f"shards it lists are not at fault (--repair cannot help). Restore {path.name} from a "
                            f"backup of the cache; without one, build the cache again into a new directory "
                            f"(`make precompute DATA=... CACHE=NEW`).")


def commit_digest(commit: dict) -> str:
    """sha256 of a commit's canonical JSON without its own `sha256`: a flipped bit in a listed digest or size would
    otherwise blame a healthy shard."""
    body = {k: v for k, v in commit.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def first_generation(root: Path) -> int | None:
    """The oldest generation that can still be loaded (gc collects the log before the oldest one needed)."""
    if (root / LOG_DIR / LOG_NAME.format(0)).exists():
        return 0
    return next(iter(snapshots(root)), None)


def lost_snapshot(root: Path, generation: int) -> DamagedLog | None:
    """The error of `generation` when its snapshot was lost, not collected (None otherwise): neither a snapshot nor
    commit 0 loads it, yet commits from it on, older than the oldest loadable generation, are still there. gc deletes
    the log only before the snapshot it keeps, so such commits mean that snapshot was there and is gone."""
    first = first_generation(root)
    if first is not None and generation >= first:
        return None
    kept = [g for g in commit_numbers(root) if g >= generation and (first is None or g < first)]
    if not kept:
        return None
    path = root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(generation)
    return DamagedLog(path, f"{path} is missing, but the commits from generation {kept[0]} on are there: gc kept that "
                            f"snapshot for a run that needs generation {generation} and deleted the commits before it, "
                            f"so the snapshot was lost, not collected, and generation {generation} cannot be read; the "
                            f"shards are not at fault (--repair cannot help). Restore {path.name} into "
                            f"{root}/{SNAPSHOT_DIR}/ from a backup of the cache; without one, build the cache again into "
                            f"a new directory (`make precompute DATA=... CACHE=NEW`). Nothing was deleted: "
                            f"`python -m shards gc` refuses to work on the cache until it is restored.")


def read_pointer(root: Path) -> int | None:
    """The snapshot generation `index.json` names, after checking it is a cache of this format version."""
    path = root / MANIFEST
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path} is not valid JSON ({e}); delete it (the log under {LOG_DIR}/ is the truth) and retry") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a {FORMAT_NAME} manifest (its 'format' field is missing or wrong)")
    if obj.get("format_version") == 1:
        raise FormatError(f"{root} is a version 1 cache (a single index.json); this library reads version {FORMAT_VERSION}. "
                          f"Convert it in place, keeping every shard: python -m shards upgrade {root}")
    check_version(obj.get("format_version"), str(path))
    return obj.get("snapshot_generation")


def read_commit(path: Path) -> dict | None:
    """The commit at `path`, None when that generation was not committed (yet).

    Raises:
        DamagedLog: the file is there but is not a whole commit of this format, or fails its digest.
        FormatError: a commit of another format version.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        commit = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise damaged_commit(path, f"not valid JSON: {e}") from None
    if not isinstance(commit, dict) or commit.get("format") != FORMAT_NAME:
        raise damaged_commit(path, f"not a {FORMAT_NAME} commit")
    check_version(commit.get("format_version"), str(path))
    if "sha256" in commit and commit["sha256"] != commit_digest(commit):
        raise damaged_commit(path, "its content does not match the sha256 written with it")
    if not isinstance(commit.get("generation"), int) or LOG_NAME.format(commit["generation"]) != path.name:
        raise damaged_commit(path, f"it names generation {commit.get('generation')!r}")
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
    """Create `_log/GENERATION.json` if it does not exist yet: False when another writer took the number. The
    commit's `format_version` is its cache's (`Manifest.version`), 2 when it names none."""
    log = root / LOG_DIR
    if not log.is_dir():
        log.mkdir(parents=True, exist_ok=True)
        fsync_dir(root)
    body = {"format": FORMAT_NAME, "format_version": BASE_VERSION, **commit}
    body["sha256"] = commit_digest(body)
    return create_if_absent(log / LOG_NAME.format(commit["generation"]), json.dumps(body, separators=(",", ":")).encode(), rank)


SAMPLE_INDEX = "samples."  # the tensors of a snapshot's sample index start so
TEXT_INDEX = "text_index."  # ... and those of its text rows' index (a cache that stores texts once), digested apart


def snapshot_digest(metadata: dict[str, str], tensors: dict[str, torch.Tensor], sample_index: bool = False) -> str:
    """sha256 of a snapshot's metadata (but this digest) and its tensors, the sample index only with `sample_index`:
    a flipped bit in its table of shard sizes and digests would otherwise blame healthy shards. Without the sample
    index it costs O(shards), so every load checks it; the sample index has its own digest (`sample_index_digest`)
    in the metadata, checked where it is read (a cache is opened at 10M samples without reading them)."""
    h = hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode())
    _hash_tensors(h, {n: t for n, t in tensors.items() if sample_index or not n.startswith((SAMPLE_INDEX, TEXT_INDEX))})
    return h.hexdigest()


def sample_index_digest(tensors: dict[str, torch.Tensor], prefix: str = SAMPLE_INDEX) -> str:
    """sha256 of a snapshot's sample index (the `samples.*` tensors): metadata `samples_sha256`; with `prefix`
    `TEXT_INDEX`, of its text rows' index (`text_index.*`, named as `samples.*` are): metadata `texts_sha256`."""
    h = hashlib.sha256()
    _hash_tensors(h, {SAMPLE_INDEX + n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})
    return h.hexdigest()


def _hash_tensors(h, tensors: dict[str, torch.Tensor]) -> None:
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8))  # empty tables too


def check_snapshot(path: Path, metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    """Check a snapshot's `sha256` (its sample index aside: see `snapshot_digest`). A snapshot written before
    snapshots carried digests has none and is read unchecked; one whose `sha256` covers every tensor (no
    `samples_sha256` beside it) is checked whole.

    Raises:
        DamagedLog: the snapshot fails it.
    """
    if "sha256" not in metadata:
        if "samples_sha256" in metadata:  # written with both: the other one's name was damaged
            raise damaged_snapshot(path, "its metadata has a samples_sha256 but no sha256")
        return
    if metadata["sha256"] != snapshot_digest(metadata, tensors, sample_index="samples_sha256" not in metadata):
        raise damaged_snapshot(path, "its content does not match the sha256 written with it")


def damaged_snapshot(path: Path, why: str) -> DamagedLog:
    """The error of a snapshot file that is there but fails its checks, with the way back: a backup, or the log
    it compacts when that is all there."""
    root, generation = path.parent.parent, int(path.stem)
    have = set(commit_numbers(root))
    older = [g for g in snapshots(root) if g < generation]
    base = older[-1] if older else (-1 if 0 in have else None)
    if base is not None and all(g in have for g in range(base + 1, generation + 1)):
        start = f"snapshot {base}" if base >= 0 else "commit 0"
        other = (f"or move it out of the cache: generation {generation} is then replayed from {start} and the commits "
                 f"after it, which are all there")
    else:
        other = ("without one, build the cache again into a new directory (`make precompute DATA=... CACHE=NEW`): gc "
                 "collected the commits it compacts")
    return DamagedLog(path, f"{path} is damaged ({why}): the cache's state at generation {generation} cannot be read "
                            f"from it, and the shards it lists are not at fault (--repair cannot help). Restore it from "
                            f"a backup of the cache, {other}.")


def write_snapshot(root: Path, generation: int, data: bytes, rank: int = 0) -> None:
    """Create the snapshot file of `generation` (`Manifest.encode_snapshot`) unless another writer did."""
    directory = root / SNAPSHOT_DIR
    if not directory.is_dir():
        directory.mkdir(exist_ok=True)
        fsync_dir(root)
    create_if_absent(directory / SNAPSHOT_NAME.format(generation), data, rank)


def prune_snapshots(root: Path) -> None:
    """Delete the snapshots between the oldest and the two newest. Every generation stays loadable: the log is
    kept until `gc`, and the oldest snapshot is where it starts once `gc` collected its beginning; the
    previous newest is kept for a reader that listed it a moment ago. Without this a million-shard cache
    would keep a hundred snapshots of growing size."""
    if (root / SNAPSHOT_DIR).is_symlink():  # nothing outside the cache is deleted
        return
    for generation in snapshots(root)[1:-2]:
        (root / SNAPSHOT_DIR / SNAPSHOT_NAME.format(generation)).unlink(missing_ok=True)


def write_pointer(root: Path, manifest) -> None:
    """Point `index.json` at the newest snapshot (none yet: null). Concurrent writers may leave it one snapshot
    behind; readers list `_snapshots/` and never depend on it."""
    newest = snapshots(root)
    atomic_write_json(root / MANIFEST, {
        "format": FORMAT_NAME, "format_version": manifest.version, "fingerprint_sha256": manifest.fingerprint_sha256,
        "snapshot_generation": newest[-1] if newest else None,
        "note": f"the cache's state is {SNAPSHOT_DIR}/<snapshot_generation>.safetensors plus the commits after it in {LOG_DIR}/",
    })
