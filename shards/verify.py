"""verify: check a cache end to end and name every bad file."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shards.atomic import TMP_SUFFIX
from shards.manifest import LOG_DIR, READERS_DIR, SNAPSHOT_DIR, Manifest, exists, load, missing_manifest, parse_shard_name
from shards.reader import ShardReader
from shards.schema import DIGEST, KEY, OFFSETS_SUFFIX, FormatError, sample_digest


@dataclass
class Report:
    """What `verify` found. `ok` is False when any problem was found or the directory is not a cache yet;
    warnings do not count."""

    problems: list[tuple[str, str]] = field(default_factory=list)  # (file, what is wrong)
    not_a_cache: str | None = None  # set when no manifest was ever committed: nothing to check, nothing lost
    warnings: list[tuple[str, str]] = field(default_factory=list)
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    generation: int = -1
    retired: int = 0  # files of earlier generations, kept for their readers

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
        manifest = load(root)
    except (FileNotFoundError, FormatError) as e:
        report.problems.append((str(root / LOG_DIR), str(e)))
        return report
    report.generation = manifest.generation

    listed = set()
    seen_keys: dict[str, str] = {}
    rows = manifest.shards.rows
    for j, entry in zip(rows, manifest.shards):
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
            reader = ShardReader(path)
        except FormatError as e:
            report.problems.append((name, str(e)))
            continue
        report.shards += 1
        report.samples += reader.num_samples
        report.bytes += size
        # a file whose sha256 matched is byte for byte what the writer digested: its samples are not hashed again
        problems = _check_shard(reader, manifest, entry, deep, sample_digests=not checksums)
        if not problems and reader.keys != manifest.shards.samples_of(int(j))[0]:
            problems.append("its keys differ from the manifest's sample index")
        report.problems += [(name, p) for p in problems]
        if not problems:
            for key in reader.keys:
                if key in seen_keys:
                    report.problems.append((name, f"key {key} also in {seen_keys[key]}"))
                seen_keys[key] = name

    for role, entry in manifest.files.items():
        path = root / entry["path"]
        listed.add(path.resolve())
        if not path.is_file():
            report.problems.append((str(path), f"{role} file listed in the manifest but missing"))
        elif path.stat().st_size != entry["bytes"] or (checksums and file_sha256(path) != entry["sha256"]):
            report.problems.append((str(path), f"{role} file differs from the manifest (size or sha256)"))

    for path in sorted(root.glob("*/*")):
        if not path.is_file() or path.resolve() in listed or path.parent.name in (LOG_DIR, SNAPSHOT_DIR, READERS_DIR):
            continue
        parsed = parse_shard_name(path.name)
        if parsed and parsed[1] < manifest.next_seq.get(f"r{parsed[0]:05d}/{path.parent.name}", 0):
            report.retired += 1  # listed by an earlier generation: kept for its readers until `shards gc`
        elif path.suffix == ".safetensors" or path.name.endswith(TMP_SUFFIX):
            report.problems.append((str(path), "orphan: never committed (left by an interrupted run; the next run of its "
                                               "rank deletes it)"))
    return report


def _check_shard(reader: ShardReader, manifest: Manifest, entry, deep: bool, sample_digests: bool = True) -> list[str]:
    problems = []
    if reader.fingerprint_sha256 != manifest.fingerprint_sha256:
        problems.append("written for another fingerprint than the manifest's")
    if reader.bucket != entry.bucket or reader.num_samples != entry.samples:
        problems.append(f"holds {reader.num_samples} samples of {reader.bucket}, the manifest says {entry.samples} of {entry.bucket}")
    if reader.schema != manifest.schema:
        problems.append("field schema differs from the manifest's")
    shapes = manifest.shapes.get(entry.bucket)
    if reader.shapes != shapes:
        problems.append(f"field shapes {reader.shapes} differ from the manifest's {shapes}")
    if problems or not deep:
        return problems
    n = reader.num_samples
    for name, spec in manifest.schema.items():
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
    for name, spec in manifest.schema.items():
        t = reader.tensor(name)
        if t.is_floating_point():
            if not bool(torch.isfinite(t).all()):
                problems.append(f"field {name} holds NaN or Inf")
    for i in range(n if sample_digests else 0):
        if sample_digest(reader.keys[i], reader.fields(i)) != reader.digest(i):
            problems.append(f"sample {reader.keys[i]} (row {i}) does not match its stored digest")
    return problems
