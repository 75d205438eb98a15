"""A writer's shard files on disk: one written durably under its fresh name, rows copied out of one (a removal
keeps the other samples of a shard), and the files a killed writer of the same rank left behind removed before a
new one starts.

Shard names carry the writer's rank and a sequence number per rank and bucket (`shards.layout`), so the
processes of a multi-process run never write the same name, and a file whose sequence number is past the last
committed one is a leftover: its commit never happened.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch

from shards.atomic import TMP_SUFFIX, atomic_write_bytes, fsync_dir
from shards.buckets import Bucket
from shards.layout import LOG_DIR, SNAPSHOT_DIR, cache_files, parse_shard_name, shard_name
from shards.reader import REPAIR, ShardReader
from shards.schema import CorruptSample, sample_digest


def write_shard_file(root: Path, bucket: Bucket, rank: int, seq: int, data: bytes, folder: str | None = None) -> Path:
    """Write shard `seq` of `rank` in `bucket`'s folder of the cache (or in `folder`) durably; returns its path.

    Raises:
        OSError: the device is full (the message names the path and that what was committed is kept), or
            another failure to write.
    """
    directory = root / (folder or bucket.name)
    if not directory.is_dir():
        directory.mkdir(exist_ok=True)  # other ranks create bucket directories concurrently
        fsync_dir(root)
    path = directory / shard_name(rank, seq)
    try:
        atomic_write_bytes(path, data)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(e.errno, f"no space left on the device of {path} ({len(data) / 2**20:.1f} MiB to write); "
                                   f"free space and re-run: everything committed so far is kept") from None
        raise
    return path


def intact_rows(root: Path, path: str, rows: list[int], kind: str = "shard") -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Copies of rows of shard `path` (relative to the cache `root`), each checked against its stored digest: a
    removal never turns a damaged sample into one with a fresh, valid digest.

    Raises:
        CorruptSample: the shard is missing, or a row does not match its digest; the message names the repair.
    """
    try:
        reader = ShardReader(root / path, kind)
    except FileNotFoundError:
        raise CorruptSample(f"{root / path} is listed but missing, and samples it holds are kept: "
                            f"{REPAIR.format(root=root)}") from None
    out = []
    for i in rows:
        fields = {n: t.clone() for n, t in reader.fields(i).items()}
        if sample_digest(reader.keys[i], fields) != reader.digest(i):
            raise CorruptSample(f"sample {reader.keys[i]} (row {i} of {reader.path}) does not match its stored digest; "
                                f"nothing was removed. {REPAIR.format(root=root)}")
        out.append((i, fields))
    return out


def remove_leftovers(root: Path, rank: int, next_seq: dict[str, int]) -> None:
    """Delete `rank`'s temp files and the shards a crash left uncommitted (sequence numbers at or past
    `next_seq`, the manifest's next unused number per rank and bucket); retired shards of earlier generations
    are kept. Only the holder of the rank's lock may call this."""
    prefix = f"r{rank:05d}-"
    for path in cache_files(root):  # a symbolic link to a folder outside the cache is not entered
        name = path.name
        if path.parent == root:
            continue
        if path.parent.name in (LOG_DIR, SNAPSHOT_DIR):
            if name.endswith(TMP_SUFFIX) and f".r{rank:05d}." in name:
                path.unlink()
            continue
        if name.startswith(f".{prefix}") and name.endswith(TMP_SUFFIX):
            path.unlink()
            continue
        parsed = parse_shard_name(name)
        if parsed and parsed[0] == rank and parsed[1] >= next_seq.get(f"r{rank:05d}/{path.parent.name}", 0):
            path.unlink()
