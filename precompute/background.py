"""Stage one's background threads: the encoder's calls on one, the shard writer's writes on another, so neither
waits on the pass's own work (sorting and batching inputs, splitting outputs) nor on each other.

`BackgroundCalls` runs batches of calls in order on one thread, behind a queue bounded by batches and by bytes, so
host memory stays bounded however large the samples (a 480p x 81-frame clip is ~9 MB); the submitter waits only when
it is full. A call that raises stops the thread; the submitter raises the same exception at its next `submit`,
`check`, `wait_for` or `drain`, and the batches queued after it never run (the run fails: nothing is dropped
silently). `completed` counts the batches done, in order, so the submitter knows whose results are ready.

The pass hands each encoded batch's writes (`ShardWriter.write_text`, `write`) to `BackgroundWrites`: while the pass
runs, the shard writer is written to only from that thread (the pass only looks texts up, `has_text`), and its
commits come in the order they would inline. Whatever follows the pass (restamps, removals, prompts, the final
commit) runs after `drain`, on the calling thread.
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


class BackgroundCalls:
    """Runs batches of calls in order on one thread, behind a queue bounded by batches and bytes.

    Args:
        max_batches: batches queued or in progress before `submit` waits.
        max_bytes: their bytes before `submit` waits (a batch larger than this waits for an empty queue).
        name: the thread's.

    Attributes:
        busy_s: time the thread spent running calls.
        wait_s: time `submit`, `wait_for` and `drain` waited for the thread (a full queue, a batch's results, the
            last batches).
        completed: batches done, in the order submitted.
        idle_since: when the thread ran out of batches to run (None while it has one): what it idled through.
    """

    def __init__(self, max_batches: int, max_bytes: int, name: str):
        self.max_batches, self.max_bytes = max_batches, max_bytes
        self.busy_s = self.wait_s = 0.0
        self.completed = 0
        self.idle_since: float | None = time.perf_counter()
        self._queue: deque[tuple[list[Callable[[], None]], int]] = deque()  # its head is running
        self._bytes = 0
        self._error: BaseException | None = None
        self._stopping = self._closing = False
        self._changed = threading.Condition()
        # a daemon: a second Ctrl-C while `stop` waits for the call in flight still ends the process (a shard renamed
        # but not committed is a leftover the next run removes, as after a kill)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, calls: list[Callable[[], None]], nbytes: int) -> None:
        """Queue one batch of calls, to run in order after the batches queued before; waits while the queue is full.

        Raises:
            the exception a call raised on the thread (the batch is not queued).
        """
        assert not (self._closing or self._stopping), "submit after drain or stop"
        t0 = time.perf_counter()
        with self._changed:
            while self._error is None and (len(self._queue) >= self.max_batches or self._queue and self._bytes + nbytes > self.max_bytes):
                self._changed.wait()
            self.wait_s += time.perf_counter() - t0
            self.check()
            self._queue.append((calls, nbytes))
            self._bytes += nbytes
            self.idle_since = None
            self._changed.notify_all()

    def check(self) -> None:
        """Raise the exception a call raised on the thread, if one did."""
        if self._error is not None:
            raise self._error

    def wait_for(self, batches: int) -> None:
        """Wait until `batches` batches are done (`completed`).

        Raises:
            the exception a call raised on the thread.
        """
        if self.completed >= batches:
            return
        t0 = time.perf_counter()
        with self._changed:
            while self._error is None and self.completed < batches:
                self._changed.wait()
        self.wait_s += time.perf_counter() - t0
        self.check()

    def drain(self) -> None:
        """Wait until every queued batch is done and end the thread.

        Raises:
            the exception a call raised on the thread.
        """
        t0 = time.perf_counter()
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()
        self.wait_s += time.perf_counter() - t0
        self.check()

    def stop(self) -> None:
        """The pass failed or was interrupted: drop the queued batches, wait for the call in progress (a shard being
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
                calls, nbytes = self._queue[0]
            t0 = time.perf_counter()
            try:
                for call in calls:
                    if self._stopping:  # between samples: the rest of the batch is buffered nowhere, as after a kill
                        return
                    call()
            except BaseException as e:  # noqa: BLE001 (raised on the submitter's thread, by `submit`, `check`, `wait_for` or `drain`)
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
                    self.completed += 1
                if not self._queue:
                    self.idle_since = time.perf_counter()
                self._changed.notify_all()


class BackgroundWrites(BackgroundCalls):
    """`BackgroundCalls` for the pass's writes: one batch per encoded batch, its texts, then its samples.

    Args:
        max_batches: batches queued or being written before `submit` waits.
        max_bytes: their tensors' bytes before `submit` waits.
    """

    def __init__(self, max_batches: int = QUEUE_BATCHES, max_bytes: int = QUEUE_BYTES, name: str = "shard-writer"):
        super().__init__(max_batches, max_bytes, name)
