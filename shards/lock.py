"""`CacheLock`: a process's claim on a cache, an exclusive or shared `flock` on a file inside it.

A run holds `.lock`, each writer its rank's lock, and every writer shares `WRITERS_LOCK`, which `gc` and
`upgrade` take exclusively so that they never work beside a writer.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from shards.schema import CacheBusy

WRITERS_LOCK = ".lock-writers"  # every writer holds it shared; gc and upgrade exclusively


class CacheLock:
    """Exclusive use of a cache by one run (all ranks of a multi-process run share the holder's).

    Raises `CacheBusy` at once when another process holds it; released on `release()` or exit. A shared
    lock (`shared=True`) coexists with other shared holders and excludes an exclusive one.
    """

    def __init__(self, root: str | os.PathLike, name: str = ".lock", what: str = "the cache", *, shared: bool = False):
        self.path = Path(root) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")
        try:
            fcntl.flock(self._file, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise CacheBusy(f"{what} at {Path(root)} is being written by {holder}; wait for it to finish (two writers would "
                            f"encode the same samples twice)") from None
        if not shared:  # shared holders leave the name of the last exclusive one
            self._file.truncate(0)
            self._file.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
            self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def writers_lock(root: Path) -> CacheLock:
    """The writers' lock, shared with the other writers of the cache."""
    try:
        return CacheLock(root, WRITERS_LOCK, shared=True)
    except CacheBusy:
        raise CacheBusy(f"`python -m shards gc` (or `upgrade`) is working on the cache at {root}; write when it has "
                        f"finished") from None
