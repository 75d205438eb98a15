"""Stage one's writes on one background thread, so the encoders never wait on a shard's serialisation and fsync.

The pass hands each encoded batch's writes (`ShardWriter.write_text`, `write`) to `BackgroundWrites`, which runs
them in order on one thread: while the pass runs, the shard writer is written to only from that thread (the pass
only looks texts up, `has_text`), and its commits come in the order they would inline. The queue is bounded by
batches and by bytes, so host memory stays bounded however large the samples (a 480p x 81-frame clip is ~9 MB); the
pass waits only when it is full. A write that raises (disk full, a sample refused) stops the thread; the pass raises
the same exception at its next batch, and the batches queued after it are never written (the run fails: nothing is
dropped silently). Whatever follows the pass (restamps, removals, prompts, the final commit) runs after `drain`, on
the calling thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

QUEUE_BATCHES = 4  # batches queued or being written; the encoder runs ahead of the writer by as many
QUEUE_BYTES = 512 << 20  # their tensors' bytes; a larger batch waits for an empty queue


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """The host memory `tensors` keep alive: the bytes of their distinct storages (a sample's latent may be a row of
    its batch's tensor, a trimmed caption a slice of its padded batch)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class BackgroundWrites:
    """Runs batches of writes in order on one thread, behind a queue bounded by batches and bytes.

    Args:
        max_batches: batches queued or in progress before `submit` waits.
        max_bytes: their bytes before `submit` waits (a batch larger than this waits for an empty queue).

    Attributes:
        busy_s: time the thread spent writing.
        wait_s: time `submit` and `drain` waited for the thread (a full queue, the last batches).
    """

    def __init__(self, max_batches: int = QUEUE_BATCHES, max_bytes: int = QUEUE_BYTES, name: str = "shard-writer"):
        self.max_batches, self.max_bytes = max_batches, max_bytes
        self.busy_s = self.wait_s = 0.0
        self._queue: deque[tuple[list[Callable[[], None]], int]] = deque()  # its head is being written
        self._bytes = 0
        self._error: BaseException | None = None
        self._stopping = self._closing = False
        self._changed = threading.Condition()
        # a daemon: a second Ctrl-C while `stop` waits for a shard in flight still ends the process (a shard renamed
        # but not committed is a leftover the next run removes, as after a kill)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, writes: list[Callable[[], None]], nbytes: int) -> None:
        """Queue one batch's writes, to run in order after the batches queued before; waits while the queue is full.

        Raises:
            the exception a write raised on the thread (the batch is not queued).
        """
        assert not (self._closing or self._stopping), "submit after drain or stop"
        t0 = time.perf_counter()
        with self._changed:
            while self._error is None and (len(self._queue) >= self.max_batches or self._queue and self._bytes + nbytes > self.max_bytes):
                self._changed.wait()
            self.wait_s += time.perf_counter() - t0
            self.check()
            self._queue.append((writes, nbytes))
            self._bytes += nbytes
            self._changed.notify_all()

    def check(self) -> None:
        """Raise the exception a write raised on the thread, if one did."""
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until every queued batch is written and end the thread.

        Raises:
            the exception a write raised on the thread.
        """
        t0 = time.perf_counter()
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        self.wait_s += time.perf_counter() - t0
        self.check()

    def stop(self) -> None:
        """The pass failed or was interrupted: drop the queued batches, wait for the write in progress (a shard being
        published is published and committed) and end the thread. What was committed stays; the writer's buffered
        samples are the caller's to drop (`ShardWriter.close`)."""
        with self._changed:
            self._stopping = True
            self._queue.clear()
            self._bytes = 0
            self._changed.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not (self._closing or self._stopping):
                    self._changed.wait()
                if self._stopping or not self._queue:
                    return
                writes, nbytes = self._queue[0]
            t0 = time.perf_counter()
            try:
                for write in writes:
                    if self._stopping:  # between samples: the rest of the batch is buffered nowhere, as after a kill
                        return
                    write()
            except BaseException as e:  # noqa: BLE001 (raised on the pass's thread, by `submit`, `check` or `drain`)
                with self._changed:
                    self._error = e
                    self._queue.clear()
                    self._bytes = 0
                    self._changed.notify_all()
                return
            finally:
                self.busy_s += time.perf_counter() - t0
            with self._changed:
                if self._queue:  # `stop` may have emptied it meanwhile
                    self._queue.popleft()
                    self._bytes -= nbytes
                self._changed.notify_all()
