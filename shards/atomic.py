"""Atomic file publication: write to a temp name, fsync, rename, fsync the directory.

A reader (or a crash) sees either the old file or the complete new one, never a partial write.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the device start writing bytes `offset` to `offset + nbytes` of the file open as `fd`, without waiting
    (Linux's sync_file_range with SYNC_FILE_RANGE_WRITE): a later fsync then waits for less. Not a durability
    guarantee (only fsync is); nothing where the call is not available."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


def _libc_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_sync_file_range = _libc_sync_file_range()


def temp_path(path: str | os.PathLike) -> Path:
    """The temp name a file is written under before it is renamed into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """fsync `tmp`, rename it to `path` and fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def atomic_write_bytes(path: str | os.PathLike, data) -> None:
    """Write `data` to `path` atomically: bytes, or an object that writes itself to an open file (`data.write_to(f)`, as a
    shard streamed from its samples' tensors does: `shards.encode.EncodedShard`)."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            if hasattr(data, "write_to"):
                data.write_to(f)
            else:
                f.write(data)
        publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def fsync_tree(root: str | os.PathLike, skip: str | os.PathLike | None = None) -> None:
    """Flush every file and directory under `root` (but `skip`) to stable storage (writers like `save_pretrained`
    and `torch.save` do not), deepest first, so a marker written afterwards never names data still in flight."""
    for directory, _, files in sorted(os.walk(root), key=lambda entry: -entry[0].count(os.sep)):
        if skip is not None and Path(directory).is_relative_to(skip):
            continue
        for name in files:
            fsync_dir(os.path.join(directory, name))  # an O_RDONLY fsync: files and directories alike
        fsync_dir(directory)


def publish_directory(tmp: str | os.PathLike, final: str | os.PathLike, *, flushed: bool = False) -> None:
    """Rename the finished directory `tmp` to `final`, replacing what was there: a reader (or a crash) sees the
    old directory or the complete new one. `flushed`: the caller already fsynced `tmp`'s contents.

    A directory cannot be renamed over a non-empty one, so an existing `final` is first renamed aside, then
    deleted once the new one is in place; a crash in between leaves `.old-NAME` beside it, never neither."""
    import shutil

    tmp, final = Path(tmp), Path(final)
    if not flushed:
        fsync_tree(tmp)
    aside = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
