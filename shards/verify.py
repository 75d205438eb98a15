"""verify: check a cache end to end and name every bad file."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards.atomic import TMP_SUFFIX
from shards.gc import registration
from shards.generations import load
from shards.layout import LOG_DIR, LOG_NAME, READERS_DIR, SHARD_FILE, SNAPSHOT_DIR, cache_files, parse_shard_name
from shards.log import commit_numbers, exists, gap_message, gaps, missing_manifest, read_commit, snapshots
from shards.manifest import Manifest
from shards.reader import ShardReader
from shards.schema import DIGEST, KEY, OFFSETS_SUFFIX, DamagedCache, DamagedLog, FormatError, sample_digest
from shards.texts import TEXT_KEYS, TEXTS_KIND, keys_of


@dataclass
class Report:
    """What `verify` found. `ok` is False when any problem was found or the directory is not a cache yet;
    warnings do not count."""

    problems: list[tuple[str, str]] = field(default_factory=list)  # (file, what is wrong)
    not_a_cache: str | None = None  # set when no manifest was ever committed: nothing to check, nothing lost
    warnings: list[tuple[str, str]] = field(default_factory=list)
    shards: int = 0
    samples: int = 0
    texts: int = 0  # text rows (a cache that stores texts once)
    bytes: int = 0
    generation: int = -1
    retired: int = 0  # files of earlier generations, kept for their readers
    in_progress: int = 0  # files a running writer is writing or has not committed yet

    @property
    def ok(self) -> bool:
        return not self.problems and self.not_a_cache is None

    @property
    def bad_files(self) -> list[str]:
        return sorted({path for path, _ in self.problems})


def file_sha256(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(root: str | os.PathLike, *, checksums: bool = True, deep: bool = True) -> Report:
    """Check a cache: manifest, every listed shard, and files nobody lists.

    Args:
        root: the cache directory.
        checksums: compare every shard's sha256 with the manifest (reads every byte).
        deep: also check offsets, per-sample digests, shapes and dtypes against the manifest,
            duplicate keys, and scan floating fields for NaN/Inf.

    Returns:
        A `Report`; the cache is sound when `report.ok`.
    """
    root = Path(root)
    report = Report()
    try:
        if not exists(root):
            never, message = missing_manifest(root)
            if never:
                report.not_a_cache = message
            else:
                report.problems.append((str(root / LOG_DIR), message))
            return report
        log_problems = _check_log(root)
        manifest = load(root)
    except DamagedLog as e:  # the file to restore, not the shards it lists
        report.problems += log_problems
        if e.path not in report.bad_files:
            report.problems.append((e.path, str(e)))
        return report
    except (FileNotFoundError, FormatError) as e:
        report.problems.append((str(root / LOG_DIR), str(e)))
        return report
    report.problems += log_problems  # older generations' commits: the newest one loads without them
    report.generation = manifest.generation

    index_ok = True
    try:
        manifest.shards.check_sample_index()  # before a shard's keys are compared with it: a damaged one blames no shard
        if manifest.texts is not None:
            manifest.texts.check_sample_index()
    except DamagedLog as e:
        index_ok = False
        if e.path not in report.bad_files:  # named already when _check_log read it
            report.problems.append((e.path, str(e)))
    _check_shards(root, manifest, report, checksums, deep, index_ok)
    return report


def _check_shards(root: Path, manifest: Manifest, report: Report, checksums: bool, deep: bool, keys: bool = True) -> None:
    """Every listed file against the manifest (its keys against the sample index with `keys`: the index is
    sound), then the files nobody lists, into `report`."""
    listed = set()
    seen_keys: dict[str, str] = {}
    _check_table(root, manifest, manifest.shards, "shard", report, checksums, deep, keys, listed, seen_keys)
    if manifest.texts is not None:
        text_keys: dict[str, str] = {}
        _check_table(root, manifest, manifest.texts, TEXTS_KIND, report, checksums, deep, keys, listed, text_keys)
        if keys:  # every text a sample refers to is stored
            missing = manifest.shards.referenced_texts() - set(manifest.texts.key_index())
            if missing:
                report.problems.append((str(root / LOG_DIR), f"{len(missing)} texts the samples refer to (e.g. "
                                        f"{sorted(missing)[0]}) are in no text shard: the log was edited or damaged"))

    for role, entry in manifest.files.items():
        path = root / entry["path"]
        listed.add(path.resolve())
        if not path.is_file():
            report.problems.append((str(path), f"{role} file listed in the manifest but missing"))
        elif path.stat().st_size != entry["bytes"] or (checksums and file_sha256(path) != entry["sha256"]):
            report.problems.append((str(path), f"{role} file differs from the manifest (size or sha256)"))

    links: list[Path] = []
    live = _live_ranks(root)
    for path in cache_files(root, links=links):
        if path.parent == root or path.resolve() in listed or path.parent.name in (LOG_DIR, SNAPSHOT_DIR, READERS_DIR):
            continue
        parsed = parse_shard_name(path.name)
        temp = SHARD_FILE.fullmatch(path.name)
        rank = int(temp.group(1)[1:]) if temp else None
        if parsed and parsed[1] < manifest.next_seq.get(f"r{parsed[0]:05d}/{path.parent.name}", 0):
            report.retired += 1  # listed by an earlier generation: kept for its readers until `shards gc`
        elif path.name.startswith(".gc-") and path.name.endswith(TMP_SUFFIX):  # made by an earlier gc to test writing
            report.warnings.append((str(path), "left by an interrupted gc: harmless; the next `python -m shards gc` "
                                               "deletes it"))
        elif (path.name.endswith(TMP_SUFFIX) or parsed) and (rank in live or (rank is None and live)):
            report.in_progress += 1  # a running writer's work: its temp file, or a shard it is about to commit
        elif path.suffix == ".safetensors" or path.name.endswith(TMP_SUFFIX):
            report.problems.append((str(path), "orphan: never committed (left by an interrupted run; the next run of its "
                                               "rank deletes it)"))
    for link in links:
        report.warnings.append((str(link), "a symbolic link: not checked, and gc and writers delete nothing behind it"))
    for path in sorted((root / READERS_DIR).glob("*.json")):
        try:
            registration(path)
        except DamagedCache as e:  # gc refuses to run until it is dealt with
            report.problems.append((str(path), str(e)))


def _check_table(root: Path, manifest: Manifest, table, kind: str, report: Report, checksums: bool, deep: bool, keys: bool,
                 listed: set, seen_keys: dict[str, str]) -> None:
    """Every listed shard (or text shard, `kind`) of `table` against the manifest, into `report`. A key in two shards
    is damage; a text in two text shards is not (ranks may store one text at once)."""
    texts = kind == TEXTS_KIND
    for j, entry in zip(table.rows, table):
        path = root / entry.path
        listed.add(path.resolve())
        name = str(path)
        if not path.is_file():
            report.problems.append((name, "listed in the manifest but missing"))
            continue
        size = path.stat().st_size
        if size != entry.bytes:
            report.problems.append((name, f"size {size} bytes, the manifest says {entry.bytes} (truncated or replaced)"))
            continue
        if checksums and file_sha256(path) != entry.sha256:
            report.problems.append((name, "sha256 differs from the manifest (the file was modified or damaged)"))
            continue
        try:
            reader = ShardReader(path, kind)
        except FormatError as e:
            report.problems.append((name, str(e)))
            continue
        report.shards += not texts
        report.samples += 0 if texts else reader.num_samples
        report.texts += reader.num_samples if texts else 0
        report.bytes += size
        # a file whose sha256 matched is byte for byte what the writer digested: its samples are not hashed again
        problems = _check_shard(reader, manifest, entry, deep, sample_digests=not checksums,
                                schema=manifest.text_schema if texts else manifest.schema)
        if keys and not problems and reader.keys != table.samples_of(int(j))[0]:
            problems.append("its keys differ from the manifest's sample index")
        if keys and deep and not problems and not texts and manifest.texts is not None:
            refs = set(keys_of(reader.tensor(TEXT_KEYS)))
            if refs != set(table.texts_of(int(j))):
                problems.append("the texts its samples refer to differ from the manifest's list of them")
        report.problems += [(name, p) for p in problems]
        if not problems and not texts:
            for key in reader.keys:
                if key in seen_keys:
                    report.problems.append((name, f"key {key} also in {seen_keys[key]}"))
                seen_keys[key] = name


def _check_log(root: Path) -> list[tuple[str, str]]:
    """Every commit file of the log read and checked, and every gap: (file, problem). Generations before the
    newest snapshot need them too (a run resuming an earlier epoch, gc keeping what it needs)."""
    problems = [(str(root / LOG_DIR / LOG_NAME.format(g)), gap_message(root, g, later)) for g, later in gaps(root)]
    for g in commit_numbers(root):
        try:
            read_commit(root / LOG_DIR / LOG_NAME.format(g))
        except DamagedLog as e:
            problems.append((e.path, str(e)))
    for g in snapshots(root):
        path = root / SNAPSHOT_DIR / f"{g:012d}.safetensors"
        try:
            snapshot = Manifest.from_snapshot(path)
            snapshot.shards.check_sample_index()  # the index too: a run may resume from it
            if snapshot.texts is not None:
                snapshot.texts.check_sample_index()
        except FileNotFoundError:
            continue  # pruned by a writer meanwhile
        except DamagedLog as e:
            problems.append((e.path, str(e)))
    return problems


def _live_ranks(root: Path) -> set[int]:
    """Ranks whose writer is running now, from their locks (`.lock-rRRRRR`) without taking them, which would make
    a writer starting that instant fail: the kernel's table of locks held, or the holder the file names when it
    is a live process of this machine."""
    live = set()
    held = _held_locks()
    for path in root.glob(".lock-r[0-9][0-9][0-9][0-9][0-9]"):
        try:
            st = path.stat()
            holder = path.read_text().split()
        except OSError:
            continue
        mine = len(holder) == 4 and holder[0] == "pid" and holder[3] == os.uname().nodename and holder[1].isdigit()
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held or (mine and _alive(int(holder[1]))):
            live.add(int(path.name[-5:]))
    return live


def _held_locks() -> set[tuple[int, int, int]]:
    """(device major, minor, inode) of every file an flock is held on (Linux: /proc/locks), empty elsewhere."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK":
            try:
                major, minor, inode = parts[5].split(":")
                out.add((int(major, 16), int(minor, 16), int(inode)))
            except ValueError:
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_shard(reader: ShardReader, manifest: Manifest, entry, deep: bool, sample_digests: bool = True,
                 schema=None) -> list[str]:
    schema = manifest.schema if schema is None else schema
    problems = []
    if reader.fingerprint_sha256 != manifest.fingerprint_sha256:
        problems.append("written for another fingerprint than the manifest's")
    if reader.bucket != entry.bucket or reader.num_samples != entry.samples:
        problems.append(f"holds {reader.num_samples} samples of {reader.bucket}, the manifest says {entry.samples} of {entry.bucket}")
    if reader.schema != schema:
        problems.append("field schema differs from the manifest's")
    shapes = manifest.shapes.get(entry.bucket)
    if reader.shapes != shapes:
        problems.append(f"field shapes {reader.shapes} differ from the manifest's {shapes}")
    if problems or not deep:
        return problems
    n = reader.num_samples
    for name, spec in schema.items():
        t = reader.tensor(name)
        if t.dtype != spec.dtype:
            problems.append(f"field {name} is {t.dtype}, the schema says {spec.dtype}")
        trailing = shapes[name][1:] if spec.ragged else shapes[name]
        if list(t.shape[1:]) != list(trailing):
            problems.append(f"field {name} has shape {list(t.shape)}, expected (*, {trailing})")
    for name in [*reader.ragged_fields, KEY]:
        offs = reader.tensor(name + OFFSETS_SUFFIX)
        total = reader.tensor(name).shape[0]
        if offs.shape != (n + 1,) or offs[0] != 0 or offs[-1] != total or bool((offs[1:] < offs[:-1]).any()):
            problems.append(f"offsets of {name} are inconsistent with its {total} rows")
    if reader.tensor(DIGEST).shape[0] != n:
        problems.append("digest table has the wrong length")
    if problems:
        return problems
    for name in schema:
        t = reader.tensor(name)
        if t.is_floating_point():
            if not bool(torch.isfinite(t).all()):
                problems.append(f"field {name} holds NaN or Inf")
    for i in range(n if sample_digests else 0):
        if sample_digest(reader.keys[i], reader.fields(i)) != reader.digest(i):
            problems.append(f"sample {reader.keys[i]} (row {i}) does not match its stored digest")
    return problems
