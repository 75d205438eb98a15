"""Ranks under torchrun: each encodes a disjoint part of DATA into its own shards; rank 0 holds the cache's lock.
And the loader's workers, which die with the process that forked them."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shards import CacheBusy, CacheLock


def setup_distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank) under torchrun; (0, 1, 0) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj, rank: int, world: int) -> list | None:
    """Every rank's `obj`, on rank 0 alone (None on the others): what only rank 0 reads is not sent to every rank."""
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def lock_cache(cache: Path, rank: int, world: int) -> CacheLock | None:
    """Rank 0 takes the cache's lock for the whole run (every rank learns whether it could): two runs on one
    cache would encode the same samples twice. Raises `CacheBusy` on every rank when another run holds it."""
    lock, busy = None, None
    if rank == 0:
        try:
            lock = CacheLock(cache)
        except CacheBusy as e:
            busy = str(e)
    busy = gather(busy, world)[0]
    if busy:
        raise CacheBusy(busy)
    return lock


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int, worker_id: int | None = None) -> None:
    """A DataLoader worker's `worker_init_fn`: the worker is killed when `parent` (the run that forked it) dies.

    A worker whose run was killed otherwise lingers, blocked on a queue no one reads; it holds nothing of the
    cache (`shards.lock` lets go of the locks in forked children), but it keeps reading DATA. Linux only; other
    systems rely on the loader's own check of its parent.
    """
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the run died before the request was in place
        os._exit(1)
