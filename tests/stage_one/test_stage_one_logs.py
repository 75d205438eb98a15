"""Stage one's output in a log file or a pipe: plain progress lines instead of a bar, and one line where libraries
would warn per caption (truncation) or per class imported (a missing optional backend)."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from precompute.sample_data import make_folder
from shards.quiet import BACKEND_FALLBACK, TRUNCATION, PrintedByItsOwnHandler, collapse

pytestmark = pytest.mark.model  # encodes with tiny transformers / diffusers models

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^precompute: (\d+)/(\d+) inputs \(\d+%\)  \d+\.\d inputs/s  new (\d+), unchanged (\d+), failed (\d+)  "
                  r"ETA \d+:\d\d:\d\d$")


@pytest.mark.parametrize("ci", ["", "1"], ids=["terminal-env", "CI-env"])
def test_piped_stage_one_prints_plain_lines_and_one_line_per_repeated_warning(tmp_path, ci):
    """With CI set, transformers lets its records propagate to the root logger as well as printing them itself."""
    data = make_folder(tmp_path / "data", count=4)
    for caption in data.glob("*.txt"):  # every caption far over the tiny CLIP's 77 tokens and T5's 32
        caption.write_text(" ".join(["a large red circle on a blue background with stripes"] * 30))
    out = subprocess.run([sys.executable, "-m", "precompute", str(data), "--model", "tiny-sd3", "--cache", str(tmp_path / "cache"),
                          "--workers", "0", "--log-seconds", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CI": ci})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [m for m in map(LINE.match, out.stderr.splitlines()) if m]
    assert [(int(m[1]), int(m[2])) for m in lines] == [(1, 4), (2, 4), (3, 4), (4, 4)], out.stderr
    assert (int(lines[-1][3]), int(lines[-1][5])) == (4, 0)
    assert "\r" not in out.stderr  # no bar redrawing itself
    # the truncation is counted once in the summary, not warned per caption by the tokenizers and the pipeline
    assert "truncated because" not in out.stderr and "Token indices sequence length" not in out.stderr, out.stderr
    assert out.stderr.count("4 captions truncated to the token limit") == 1
    # a missing optional backend: one line at most (none where it is installed), not one per class imported
    assert "falling back to" not in out.stderr
    said = [line for line in out.stderr.splitlines() if "is not installed, so transformers falls back" in line]
    assert len(said) <= 1, said


def test_collapsed_warnings_say_one_line_per_backend_and_nothing_per_caption(caplog):
    """The filters themselves, on loggers of their own: a backend's first fallback becomes the summary, the rest of
    its fallbacks and every truncation warning are dropped (and counted)."""
    backends = collapse("cachedit-test.import_utils", BACKEND_FALLBACK, "{0} missing")
    captions = collapse("cachedit-test.pipeline", TRUNCATION)
    assert collapse("cachedit-test.pipeline", TRUNCATION) is captions  # installed once
    imports, pipeline = logging.getLogger("cachedit-test.import_utils"), logging.getLogger("cachedit-test.pipeline")
    with caplog.at_level(logging.WARNING):
        for name in ("CLIPImageProcessor", "SiglipImageProcessor"):
            imports.warning("`%s` requires torchvision (not installed); falling back to `%sPil` ...", name, name)
        imports.warning("`Other` requires otherlib (not installed); falling back to `OtherPil` ...")
        for _ in range(3):
            pipeline.warning("The following part of your input was truncated because CLIP can only handle 77 tokens: [...]")
        pipeline.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["torchvision missing", "otherlib missing", "something else"]
    assert backends.seen == {"torchvision": 2, "otherlib": 1} and captions.seen == {"": 3}


def test_a_backend_is_said_once_when_two_threads_warn_at_once(caplog):
    """Libraries warn from their loading threads. Two threads' first records of a backend meet inside the count (each
    waits there for the other, as an unlucky interleaving would have them): still one line."""
    import threading
    from collections import Counter

    class Meeting(Counter):
        def __missing__(self, key):  # a first count: wait here for the other thread (at most 0.3 s), then go on
            try:
                meeting.wait()
            except threading.BrokenBarrierError:
                pass
            return 0

    meeting = threading.Barrier(2, timeout=0.3)
    f = collapse("cachedit-test.threads", BACKEND_FALLBACK, "{0} missing")
    f.seen = Meeting()
    logger = logging.getLogger("cachedit-test.threads")
    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=logger.warning, args=(f"`C{i}` requires torchvision (not installed); falling "
                                                                  "back to `P` ...",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.getMessage() for r in caplog.records] == ["torchvision missing"]
    assert f.seen == {"torchvision": 2}


def test_the_root_handler_leaves_a_librarys_own_records_to_its_own_handler():
    """A library that prints its records with a handler of its own and still lets them propagate (transformers does
    with CI set) is printed once: the root handler's filter drops them; other loggers' records pass."""
    library = logging.getLogger("cachedit-test.library")
    library.addHandler(logging.NullHandler())
    try:
        root_handler = logging.StreamHandler()
        root_handler.addFilter(PrintedByItsOwnHandler())
        record = logging.LogRecord("cachedit-test.library.module", logging.WARNING, __file__, 1, "said", (), None)
        other = logging.LogRecord("cachedit-test.plain.module", logging.WARNING, __file__, 1, "said", (), None)
        assert not root_handler.filter(record)
        assert root_handler.filter(other)
    finally:
        library.handlers.clear()


def test_a_forked_worker_leaves_the_once_said_lines_to_its_parent():
    """A data loader's workers fork from the run and import what it imported: their first fallback record of a backend
    is dropped (the parent says it), the parent's own first is said."""
    import multiprocessing

    f = collapse("cachedit-test.forked", BACKEND_FALLBACK, "{0} missing")
    record = logging.LogRecord("cachedit-test.forked", logging.WARNING, __file__, 1,
                               "`C` requires torchvision (not installed); falling back to `P` ...", (), None)
    ctx = multiprocessing.get_context("fork")
    said = ctx.Queue()
    child = ctx.Process(target=lambda: said.put(f.filter(record)))
    child.start()
    assert said.get(timeout=60) is False
    child.join(timeout=60)
    assert f.filter(record) is True
