"""Stage one's progress for a log file or a pipe: a plain line now and then, where a terminal gets tqdm's bar."""

from __future__ import annotations

import sys
import time


class PlainProgress:
    """The progress bar's part `EncodingPass.run` uses, for a log file or a pipe: a plain line on stderr every
    `every_s` seconds (0: every input), and one at the end."""

    def __init__(self, total: int | None, every_s: float, desc: str = "precompute"):
        self.total, self.every_s, self.desc = total, every_s, desc
        self.n, self.shown, self.postfix = 0, 0, {}
        self.t0 = self.last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, refresh: bool = False, **counts) -> None:
        self.postfix = counts
        if time.perf_counter() - self.last >= self.every_s:
            self.show()

    def close(self) -> None:
        if self.n != self.shown:
            self.show()

    def show(self) -> None:
        self.last = now = time.perf_counter()
        self.shown = self.n
        rate = self.n / max(now - self.t0, 1e-9)
        done = f"{self.n:,}/{self.total:,} inputs ({self.n / max(self.total, 1):.0%})" if self.total else f"{self.n:,} inputs"
        counts = ", ".join(f"{k} {v:,}" for k, v in self.postfix.items())
        eta = ""
        if self.total:
            left = int(max(self.total - self.n, 0) / max(rate, 1e-9))
            eta = f"  ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}"
        print(f"{self.desc}: {done}  {rate:.1f} inputs/s" + (f"  {counts}" if counts else "") + eta, file=sys.stderr, flush=True)
