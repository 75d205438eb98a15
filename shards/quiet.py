"""Library warnings that would repeat without telling anything new, collapsed: one line per missing optional backend
instead of one per class imported, and none per truncated caption (stage one counts those in its summary).

Each filter sits on the logger that creates the records (`logging.getLogger(name)` is the library's own logger, so it
can be installed before the library is imported), and installing one twice installs it once.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter

# Set in a forked child (a data loader's worker): its parent says what is said once, so the child says none of it.
_forked = False


def _in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_in_child)

# transformers, per class it imports whose preferred backend is missing: "`CLIPImageProcessor` requires torchvision (not
# installed); falling back to `CLIPImageProcessorPil` ..."
BACKEND_FALLBACK = r"`\w+` requires ([\w.-]+) \(not installed\); falling back"
# what tokenizers and pipelines' encode_prompt say of each caption over the token limit
TRUNCATION = r"truncated because|Token indices sequence length is longer than"


class Collapsed(logging.Filter):
    """Records whose message matches `pattern`: the first of each key (the pattern's first group) is rewritten as
    `summary` (formatted with the groups) and let through, the others are dropped; with `summary` None all are
    dropped. `seen` counts them by key.

    Loggers call their filters without a lock, and libraries log from their loading threads (transformers and
    diffusers load weights in thread pools), so counting and deciding is one locked step: two threads' first records
    of a key must not both be let through. A forked process (a data loader's worker, which imports what its parent
    imported) lets none through: the parent says it, once for all of them."""

    def __init__(self, pattern: str, summary: str | None = None):
        super().__init__(pattern)
        self.pattern, self.summary = re.compile(pattern), summary
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        match = self.pattern.search(record.getMessage())
        if match is None:
            return True
        key = match.group(1) if match.groups() else ""
        with self._lock:
            self.seen[key] += 1
            first = self.seen[key] == 1
        if self.summary is None or not first or _forked:
            return False
        record.msg, record.args = self.summary.format(*match.groups()), ()
        return True


def collapse(logger: str, pattern: str, summary: str | None = None) -> Collapsed:
    """The `Collapsed` filter of `pattern` on logger `logger`, installed once."""
    target = logging.getLogger(logger)
    for f in target.filters:
        if isinstance(f, Collapsed) and f.pattern.pattern == pattern:
            return f
    f = Collapsed(pattern, summary)
    target.addFilter(f)
    return f


def one_line_per_missing_backend() -> None:
    """transformers warns once per class whose optional backend (torchvision) is missing: say it once per backend."""
    collapse("transformers.utils.import_utils", BACKEND_FALLBACK,
             "{0} is not installed, so transformers falls back to other implementations of the classes that want it "
             "(e.g. PIL image processors); said once for all of them")


def no_truncation_warnings(*loggers: str) -> None:
    """Drop the per-caption truncation warnings of `loggers` (the modules of a pipeline's encode_prompt) and of the
    tokenizers: the caller counts truncated captions itself and reports the number once."""
    for name in (*loggers, "transformers.tokenization_utils_base"):
        collapse(name, TRUNCATION)


class PrintedByItsOwnHandler(logging.Filter):
    """On the root logger's handlers: drop the records a library's own handler has already printed. transformers
    prints its records itself and, when the environment variable CI is set, also lets them propagate to the root
    logger, which would print each a second time."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None and logger is not logging.root:
            if logger.handlers:
                return False
            if not logger.propagate:
                return True
            logger = logger.parent
        return True


def log_warnings(fmt: str = logging.BASIC_FORMAT) -> None:
    """`logging.basicConfig` at WARNING for a command line, printing each record once."""
    logging.basicConfig(level=logging.WARNING, format=fmt)
    for handler in logging.root.handlers:
        if not any(isinstance(f, PrintedByItsOwnHandler) for f in handler.filters):
            handler.addFilter(PrintedByItsOwnHandler())
