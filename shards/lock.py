"""`CacheLock`: a process's claim on a cache, an exclusive or shared `flock` on a file inside it.

A run holds `.lock`, each writer its rank's lock, and every writer shares `WRITERS_LOCK`, which `gc` and
`upgrade` take exclusively so that they never work beside a writer.

A lock lives exactly as long as the process that took it. An `flock` belongs to the open file, which a forked
child shares: a DataLoader worker that outlived a killed run would hold the cache's lock forever. So every
forked child closes its copy of each lock's file at once, and only the taker's own descriptor keeps the lock.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path

from shards.schema import CacheBusy

WRITERS_LOCK = ".lock-writers"  # every writer holds it shared; gc and upgrade exclusively
_HELD: weakref.WeakSet[CacheLock] = weakref.WeakSet()  # this process's locks, which its forked children let go


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
        _HELD.add(self)

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()


def _let_go_in_child() -> None:
    # closing the child's descriptor drops its share of the open file; the parent's lock stays held
    for lock in list(_HELD):
        lock.release()
    _HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


def writers_lock(root: Path) -> CacheLock:
    """The writers' lock, shared with the other writers of the cache."""
    try:
        return CacheLock(root, WRITERS_LOCK, shared=True)
    except CacheBusy:
        raise CacheBusy(f"`python -m shards gc` (or `upgrade`) is working on the cache at {root}; write when it has "
                        f"finished") from None
