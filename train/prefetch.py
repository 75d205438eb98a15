"""The step's batches on the device ahead of time: batch k+1 is copied while step k runs; and the next optimizer step's
batches taken from the data stream (in host memory) before the current step ends, so that whether one of them is
damaged is known in time to ride the step's one read (`StepAhead`)."""

from __future__ import annotations

import time
from collections import deque

import torch

from shards import DamagedCache
from train.data import batch_tensors, to_device


class StepAhead:
    """The stream's batches in order, with a whole optimizer step's taken ahead of need (`take_step`).

    Under torchrun a rank whose batch is damaged must stop where the others do, before any collective it would not
    join: the micro-batches of a step each run collectives (DDP's buffers and gradients, FSDP's gathers). So every
    step's `size` batches are taken from the stream before the step before it ends, and whether one of them is damaged
    rides that step's one read of the device (`TrainStep.report`), instead of an all-reduce and a read per
    micro-batch. The batches wait in host memory (the prefetcher copies one at a time to the device), in the order
    taken. A failure to take one is kept and raised when its batch is due; nothing is taken after it.
    """

    def __init__(self, batches, size: int):
        self.batches, self.size = batches, size
        self.ahead: deque = deque()  # taken, not yet handed on: batches, or the error taking one raised
        self.taken = 0  # batches taken from the stream (a failed take included)
        self.planned = 0  # batches that `take_step` calls asked for in all
        self.failed: BaseException | None = None
        self.wait_s = 0.0  # time spent taking batches ahead (the training loop waits for it)

    def take_step(self) -> bool:
        """Take the next step's batches from the stream now; returns whether one of them is damaged (a damaged cache
        file or sample: the caller stops before that step)."""
        self.planned += self.size
        t0 = time.perf_counter()
        while self.taken < self.planned and self.failed is None:
            self.ahead.append(self._take())
        self.wait_s += time.perf_counter() - t0
        return isinstance(self.failed, DamagedCache)

    def _take(self):
        self.taken += 1
        try:
            return next(self.batches)
        except Exception as e:  # noqa: BLE001 (raised when its batch is due)
            self.failed = e
            return e

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.ahead:
            item = self.ahead.popleft()
        elif self.failed is not None:
            raise StopIteration
        else:
            item = self._take()
        if isinstance(item, BaseException):
            raise item
        return item


class Prefetcher:
    """Copies batch k+1 to the device on a side CUDA stream while step k runs; a plain iterator on CPU.

    Also measures the time the training loop waits for data (the stream's wait included)."""

    def __init__(self, batches, device: torch.device):
        self.batches, self.device = batches, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.wait_s = 0.0
        self._next = None  # batch k+1 on its way to the device, or the error taking it raised

    def _to_device(self, batch: dict) -> dict:
        return to_device(batch, self.device)

    def _load(self):
        t0 = time.perf_counter()
        try:
            batch = next(self.batches)
        except Exception as e:  # noqa: BLE001 (raised when this batch is due, not a step early)
            return e
        finally:
            self.wait_s += time.perf_counter() - t0
        with torch.cuda.stream(self.stream):
            return self._to_device(batch)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.stream is None:
            t0 = time.perf_counter()
            try:
                return self._to_device(next(self.batches))
            finally:
                self.wait_s += time.perf_counter() - t0
        batch = self._next if self._next is not None else self._load()
        if isinstance(batch, BaseException):
            raise batch
        t0 = time.perf_counter()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for v in batch_tensors(batch):  # an edit batch's references too
            v.record_stream(torch.cuda.current_stream(self.device))
        self.wait_s += time.perf_counter() - t0
        self._next = self._load()
        return batch
