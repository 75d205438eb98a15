"""The step's batches on the device ahead of time: batch k+1 is copied while step k runs."""

from __future__ import annotations

import time

import torch

from train.data import batch_tensors, to_device


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
