"""Reading what users' files name, safely: regular files only (never a FIFO or a device), paths written in a
user's file confined to their root, and the failure reason of a file that cannot be read. Shared by the folder,
tar and Hugging Face dataset readers."""

from __future__ import annotations

import bisect
import os
import stat
from pathlib import Path, PurePosixPath


class SpecialFileError(OSError):
    """A path that is not a regular file (FIFO, socket, device, directory). It is never opened: opening a
    FIFO blocks until a writer appears, and opening a device can have side effects."""


def os_reason(e: OSError) -> str:
    """The failure reason of a per-file OSError."""
    if isinstance(e, SpecialFileError):
        return "special_file"
    if isinstance(e, PermissionError):
        return "permission_denied"
    if isinstance(e, FileNotFoundError):  # deleted since listing, or a dangling symlink
        return "missing_file"
    return "unreadable"  # ELOOP, EIO, ...


def stat_regular(path: str | os.PathLike, st: os.stat_result | None = None) -> os.stat_result:
    """`os.stat` of a regular file, following symlinks (or check `st`); anything else raises SpecialFileError."""
    st = st or os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                 (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "directory"))
        kind = next((name for is_kind, name in kinds if is_kind(st.st_mode)), "special file")
        raise SpecialFileError(f"{path} is a {kind}, not a regular file")
    return st


def read_regular(path: str | os.PathLike) -> bytes:
    """A regular file's bytes; anything else raises SpecialFileError without being opened."""
    stat_regular(path)
    # O_NONBLOCK: should the path become a FIFO after the check, the open still returns at once
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        stat_regular(path, os.fstat(fd))
        return f.read()


class OutsideRoot(ValueError):
    """A path read from a user's file (a metadata row, a dataset cell) that names something outside its root."""


def confined(root: str | os.PathLike, name: str, what: str = "file_name", inside: dict[str, bool] | None = None) -> str:
    """The path that `name`, a relative path written in a user's file, names under `root`, refusing any other.

    The name must be relative, without `..`, and its directory must resolve inside root. The file itself may be a
    symlink, followed as in a folder listing (the Hugging Face hub cache stores a snapshot's files as symlinks into
    ../../blobs): the text of a row reaches nothing a folder listing would not. Nothing is opened.

    Args:
        root: the folder the names are relative to (DATA, or the dataset's folder).
        name: the path as written.
        what: how messages name the field (`file_name`, a column).
        inside: a cache of the answer per directory, shared by the calls of one listing.

    Raises:
        OutsideRoot: the name is absolute, holds `..`, or its directory leads out of root through a symlink.
        ValueError: the name is not a file name (empty, a NUL, text the file system cannot encode, root itself).
    """
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise ValueError(f"{what} {name!r} is not a non-empty string without NUL")
    try:
        os.fsencode(name)
    except UnicodeEncodeError:  # a lone surrogate from JSON's \ud800: no file has that name
        raise ValueError(f"{what} {name!r} is not a file name the file system can hold") from None
    if os.path.isabs(name) or ".." in PurePosixPath(name).parts:
        raise OutsideRoot(f"{what} {name!r} is not a relative path inside DATA")
    if not PurePosixPath(name).name:
        raise ValueError(f"{what} {name!r} names the folder itself, not a file in it")
    path = Path(root) / name
    parent = str(path.parent)
    inside = {} if inside is None else inside
    if parent not in inside:
        real_root, real_parent = os.path.realpath(root), os.path.realpath(parent)
        inside[parent] = os.path.commonpath([real_root, real_parent]) == real_root
    if not inside[parent]:
        raise OutsideRoot(f"{what} {name!r} leads outside DATA through a symlinked directory")
    return str(path)


def names_under(names: list[str], prefix: str) -> list[str]:
    """The names of sorted `names` that start with `prefix`, found by bisection (a damaged tar or data file asks
    which cached samples were its own: a slice of the source's names, not a pass over all of them)."""
    return names[bisect.bisect_left(names, prefix) : bisect.bisect_left(names, prefix + "\U0010ffff")]
