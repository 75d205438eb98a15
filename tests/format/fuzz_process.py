"""A writer (or gc) of the format fuzz as a process of its own, which the fuzz can kill at any file-system event."""

import os


class Killed(BaseException):
    """The process died: not an Exception, so no `except Exception` or `except OSError` of the library sees it."""


class Process:
    """A writer (or gc) as a process of its own: its own pid (temp names carry it), and, with `kill_at`, killed at its
    `kill_at`-th file-system event (fsync, rename, replace, link, unlink, mkdir, rmdir): that event and every later
    one raise `Killed`, so no cleanup a dead process would not do happens. A kill at an fsync of a file may leave it
    torn (half written), as a kill mid-write does."""

    EVENTS = ("fsync", "rename", "replace", "link", "unlink", "mkdir", "rmdir")
    pids = iter(range(1_000_000, 4_000_000))

    def __init__(self, kill_at: int | None = None, tear: bool = False):
        self.at, self.tear, self.count, self.what = kill_at, tear, 0, None

    def __enter__(self) -> "Process":
        self.real = {name: getattr(os, name) for name in (*self.EVENTS, "getpid")}
        pid = next(self.pids)
        os.getpid = lambda: pid
        if self.at is not None:
            for name in self.EVENTS:
                setattr(os, name, self._event(name, self.real[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self.real.items():
            setattr(os, name, real)

    def _event(self, name, real):
        def call(*args, **kwargs):
            if self.what is None:
                self.count += 1
                if self.count == self.at:
                    self.what = f"{name} {args[0]}"
                    path = os.readlink(f"/proc/self/fd/{args[0]}") if name == "fsync" else ""
                    if self.tear and os.path.isfile(path):
                        os.truncate(path, os.path.getsize(path) // 2)
                        self.what = f"fsync of {path}, torn"
            if self.what is not None:
                raise Killed(self.what)
            return real(*args, **kwargs)
        return call
