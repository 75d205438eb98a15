"""Videos decoded in a helper process that is killed when it overruns the time limit (`precompute.video.read_clips`).

The limit checked between packets and frames (`Reader.check`) cannot stop a decoder stuck inside one FFmpeg call,
and a crash of FFmpeg (a segfault on hostile data) would take the process with it: the loader's worker, or with
`--workers 0` the run. So every video is decoded by a helper process, and the caller waits for it with the limit:

- **One long-lived helper per decoding thread**, replaced when it is killed. Forking a process per video costs the
  copy of a worker's page tables (a worker that imported torch maps hundreds of MB) on every video; a helper serves
  every video of its thread, and its start is paid once a worker, and again only after a video that was killed.
  Per thread, because the kernel's parent-death signal follows the thread that started the helper, and so that
  threads never wait for each other's videos.
- **Forked when this process runs one Python thread, else started fresh.** A loader's worker runs one: the fork is
  cheap (a few ms), starts decoding at once with every module imported, and no lock another thread held is copied
  half-taken. The main process (`--workers 0`) runs the encoder's and the writer's threads: there the helper is a
  new interpreter (`subprocess`, fork + exec: safe with threads), whose start costs its imports (~2 s, once).
- **Frames come back without a copy.** The helper decodes each clip straight into a memfd (anonymous shared memory,
  `os.memfd_create`) and passes its descriptor over the socket; the caller maps it, and its arrays are the helper's
  frames (an 81x480x832 clip is 97 MB: a pipe would copy it twice). The memfd and both mappings of it are used again
  for later videos once the caller's arrays of it are gone (it says which with its next request): fresh shared pages
  would cost more than the copy (`Slab`). A memfd has no name: a helper killed at any point leaves nothing in /dev/shm,
  and the kernel frees the memory with its last descriptor or mapping. The request (the policy, a file's bytes or
  its descriptor), the fit's question and the answer go through the same socket.
- **Deaths are named failures.** Killed at the limit: `decode_timeout`. Died of a signal (FFmpeg's segfault) or
  exited: `corrupt_video`, naming the signal. Either way it is reaped (no zombie) and the next video gets a new
  helper. A bug in the decoding code raises in the caller, as it did in-process.
- **The helper dies with its parent**: `PR_SET_PDEATHSIG` (SIGKILL, sent by the kernel, so a helper stuck in a C call
  dies too; `precompute.distributed.die_with_parent`, as the loader's workers do), and when the socket reaches its
  end. It ignores SIGINT: Ctrl-C is the run's to handle, not a failure of the video being decoded.

The helper checks the limit itself too (`Reader.check`, the same deadline, the system's monotonic clock): a video
that is merely slow is answered by the helper at the limit, without a new helper; the caller kills it only after
`GRACE_S` more.
"""

from __future__ import annotations

import faulthandler
import gc
import mmap
import multiprocessing.util
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path

import numpy as np

from precompute.video_readers import Clip, VideoFile

# How long after the limit the caller waits for the helper's own answer before it kills it.
GRACE_S = 0.5
# How long a new helper may take to be ready (a fresh interpreter imports torch and PyAV first: seconds, more on a
# cold network file system); its start never counts against a video's time limit.
START_S = 300.0
_PAGE = mmap.ALLOCATIONGRANULARITY


class Slab:
    """Memory a helper decodes a video's clips into: a memfd, one page-aligned block per clip, mapped once by the helper
    and once by the caller and used again for later videos once the caller has let go of the clips it holds. Fresh
    shared memory would cost a page fault, a zeroed page and its freeing per 4 KiB in both processes (1.3 ms a MB:
    more than the copy it saves); pages used again through the same mappings cost nothing."""

    def __init__(self, ident: int):
        self.ident = ident
        self.fd = os.memfd_create("clips", os.MFD_CLOEXEC) if hasattr(os, "memfd_create") else _unnamed_file()
        self.capacity = self.used = 0
        self.memory: mmap.mmap | None = None  # the whole memfd; a video's arrays keep the mapping they were made in
        self.blocks: list[tuple[int, int, int]] = []  # (address, bytes, offset) of each block of this video's

    def start(self):
        self.used, self.blocks = 0, []

    def alloc(self, shape, dtype=np.uint8) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not nbytes:
            return np.empty(shape, dtype)
        offset = self.used
        self.used += -(-nbytes // _PAGE) * _PAGE
        if self.used > self.capacity:
            self.resize(max(self.used, -(-self.capacity * 3 // 2 // _PAGE) * _PAGE))
        block = np.ndarray(shape, dtype, buffer=self.memory, offset=offset)
        self.blocks.append((block.ctypes.data, nbytes, offset))
        return block

    def resize(self, capacity: int):
        os.ftruncate(self.fd, capacity)
        self.capacity = capacity
        self.memory = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED) if capacity else None

    def offset(self, a: np.ndarray) -> int | None:
        """Where a contiguous array lies in the memfd; None when it is not in it."""
        address = a.ctypes.data
        for start, nbytes, offset in self.blocks:
            if start <= address and address + a.nbytes <= start + nbytes:
                return offset + address - start
        return None

    def close(self):
        os.close(self.fd)


class Slabs:
    """A helper's slabs: one per video whose clips the caller still holds, and a few free ones kept for the next."""

    KEEP_FREE = 2
    KEEP_BYTES = 256 << 20  # a free slab's memory kept beyond this is given back (a 720p x 81-frame clip is 224 MB)

    def __init__(self):
        self.slabs: dict[int, Slab] = {}
        self.free: list[int] = []
        self.made = 0

    def take(self, released: list[int]) -> Slab:
        for ident in released:
            self.put(ident)
        if self.free:
            slab = self.slabs[self.free.pop()]
        else:
            self.made += 1
            slab = self.slabs[self.made] = Slab(self.made)
        slab.start()
        return slab

    def put(self, ident: int):
        slab = self.slabs[ident]
        if slab.capacity > self.KEEP_BYTES:  # (the caller maps it anew: the slab's capacity changed)
            slab.resize(self.KEEP_BYTES)
        self.free.append(ident)
        while len(self.free) > self.KEEP_FREE:
            self.slabs.pop(self.free.pop(0)).close()


class _Frames:
    """A clip's frames in the caller's mapping of a slab, as numpy takes them (`__array_interface__`): the arrays made
    of it keep it alive, and with it the mapping and its video's token, whose end frees the slab."""

    def __init__(self, memory: mmap.mmap, address: int, shape: tuple, token: object):
        self.memory, self.token = memory, token
        self.__array_interface__ = {"version": 3, "shape": tuple(shape), "typestr": "|u1", "data": (address, False)}


class _Token:
    pass


def _unnamed_file() -> int:
    """A file with no name, where there is no memfd (macOS)."""
    import tempfile

    with tempfile.TemporaryFile() as f:
        return os.dup(f.fileno())


def read_clips(data: bytes | VideoFile, policy, max_pixels: int, stats: dict, fit=None, *, decode):
    """`decode` (`precompute.video.read_clips_here`, passed in: this module is below `precompute.video`) in this
    thread's helper, killed `GRACE_S` after `policy.timeout_s`."""
    for attempt in range(2):
        helper = _helper(decode)
        deadline = time.monotonic() + policy.timeout_s  # from when the helper is ready: its start is not decoding
        try:
            return helper.read(data, policy, max_pixels, stats, fit, deadline)
        except _Gone:  # it had died before it was asked (killed while idle): a new one reads the video
            helper.close()
            if attempt:
                raise RuntimeError("the video decoding helper process died twice before it read a request") from None
        except BaseException:  # a bug, Ctrl-C: the helper's state is unknown
            helper.close()
            raise


class _Gone(Exception):
    pass


class Helper:
    """A decoding process and the socket to it (`read` one video at a time)."""

    def __init__(self, decode):
        self.owner = os.getpid()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = _fork(theirs, self.sock, decode) if _single_threaded() else _spawn(theirs, decode)
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self.dead = False
        self.released: list[int] = []  # slabs whose clips the caller let go of, told with the next request
        self.maps: dict[int, tuple[int, mmap.mmap, int]] = {}  # slab -> (capacity, this process's mapping, address)
        self._end = weakref.finalize(self, _end, self.proc, self.sock, self.owner)  # also when its thread's helper is dropped
        self.ready()
        _HELPERS.add(self)
        _stop_at_exit()

    def ready(self):
        """Wait for the helper to say it is ready to decode; a helper that does not is ended, and its start raises."""
        try:
            if not _readable(self.sock, time.monotonic() + START_S):
                raise RuntimeError(f"the video decoding helper process did not start within {START_S:g} s")
            try:
                _recv(self.sock)
            except (EOFError, ConnectionError):
                raise RuntimeError(f"the video decoding helper process ended as it started: {self.death()}") from None
        except BaseException:
            self._end()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self.dead and self.owner == os.getpid() and self.proc.poll() is None

    def read(self, data, policy, max_pixels: int, stats: dict, fit, deadline: float):
        released = []
        while self.released:  # (appended to by the collector, from any thread)
            released.append(self.released.pop())
        try:
            if isinstance(data, VideoFile):
                _send(self.sock, (policy, max_pixels, deadline, fit is not None, released, "file", data.path, data.size))
                socket.send_fds(self.sock, [b"F"], [data.fd])
            else:
                _send(self.sock, (policy, max_pixels, deadline, fit is not None, released, "bytes", "", len(data)))
                self.sock.sendall(data)
        except OSError:
            if self.proc.poll() is not None:
                raise _Gone() from None
            raise
        while True:
            if not _readable(self.sock, deadline + GRACE_S):
                self.close()
                return [], "decode_timeout", (f"over {policy.timeout_s:g} s: the decoder did not return (stopped, "
                                              f"its process killed)")
            try:
                message = _recv(self.sock)
            except (EOFError, ConnectionError):
                return [], "corrupt_video", self.death()
            if message[0] == "fit":
                _send(self.sock, fit(*message[1:]))
                continue
            if message[0] == "raised":
                raise RuntimeError(f"decoding a video failed in the helper process:\n{message[1]}")
            _, reason, detail, their_stats, parts, slab, capacity, slabs = message
            stats.update(their_stats)
            for ident in set(self.maps) - set(slabs):  # closed by the helper: let go of its memory
                del self.maps[ident]
            if not parts:
                return [], reason, detail
            _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
            try:
                if self.maps.get(slab, (None,))[0] != capacity:  # new, or resized: mapped anew (the old mapping lives
                    memory = mmap.mmap(fds[0], capacity, flags=mmap.MAP_SHARED)  # on with the arrays made of it)
                    self.maps[slab] = (capacity, memory, np.frombuffer(memory, np.uint8).ctypes.data)
            finally:
                os.close(fds[0])
            _, memory, address = self.maps[slab]
            token = _Token()
            weakref.finalize(token, self.released.append, slab)  # the clips' last array gone: the slab is free
            return [Clip(index, start, np.asarray(_Frames(memory, address + offset, shape, token)), size)
                    for index, start, offset, shape, size in parts], reason, detail

    def death(self) -> str:
        """Why the helper ended (it is reaped)."""
        code = self.proc.wait()
        self.close()
        if code < 0:
            name = signal.Signals(-code).name
            if -code == signal.SIGKILL:
                return f"the decoding process was killed ({name}; out of memory?)"
            return f"the decoder crashed on this file's data: its process died of {name}"
        return f"the decoding process exited with status {code}"

    def close(self):
        """Kill and reap the helper (an idle one holds nothing)."""
        self.dead = True
        self.maps.clear()  # clips still held keep their mappings
        self._end()


def _end(proc, sock: socket.socket, owner: int):
    sock.close()
    if owner == os.getpid():  # a forked child's copy of its parent's helper is not its own to end
        proc.kill()
        proc.wait()


class _Forked:
    """A forked child, with `subprocess.Popen`'s poll / wait / kill."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self) -> int:
        return self._wait(0)

    def _wait(self, options: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, options)
            except ChildProcessError:  # reaped by someone else's waitpid(-1): its status is lost
                pid, status = self.pid, 255 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _fork(theirs: socket.socket, ours: socket.socket, decode) -> _Forked:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            gc.freeze()  # the parent's objects are never scanned (or copied) by the helper's collections
            serve(theirs.fileno(), parent, decode)
        finally:
            os._exit(70)
    return _Forked(pid)


def _spawn(theirs: socket.socket, decode) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[1])  # the repository: `precompute` imports as it does here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # the fresh interpreter imports `decode` by its module and name, as pickle would
    code = ("import importlib, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "from precompute.video_helper import serve; "
            "serve(int(sys.argv[1]), int(sys.argv[2]), getattr(importlib.import_module(sys.argv[3]), sys.argv[4]))")
    return subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), str(os.getpid()), decode.__module__,
                             decode.__qualname__],
                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)


def serve(fd: int, parent: int, decode):
    """The helper's loop: a request, the video decoded (`decode`: `precompute.video.read_clips_here`), its answer;
    until the socket ends."""
    from precompute.distributed import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.disable()  # a crash is the caller's named failure, not a traceback on the run's terminal
    die_with_parent(parent)
    sock = socket.socket(fileno=fd)
    slabs = Slabs()
    _send(sock, ("ready",))  # everything it needs is imported: from here on, its time is decoding's
    while True:
        try:
            policy, max_pixels, deadline, asks, released, kind, path, size = _recv(sock)
        except (EOFError, ConnectionError):
            os._exit(0)
        if kind == "file":
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            data = VideoFile(path, fds[0], size)
        else:
            data = bytearray(size)
            view = memoryview(data)
            got = 0
            while got < size:
                n = sock.recv_into(view[got:])
                if not n:
                    os._exit(0)
                got += n
        slab = slabs.take(released)
        parts = []
        try:
            stats: dict = {}
            fit = (lambda h, w: _ask(sock, h, w)) if asks else None
            try:
                clips, reason, detail = decode(data, policy, max_pixels, stats, fit, deadline, slab.alloc)
                parts = [(c.index, c.start, _place(slab, c), c.frames.shape, c.size) for c in clips]
            except Exception:
                _send(sock, ("raised", traceback.format_exc()))
                continue
            finally:
                if isinstance(data, VideoFile):  # closed before the answer: the caller may close or change the file then
                    os.close(data.fd)
            _send(sock, ("done", reason, detail, stats, parts, slab.ident, slab.capacity, list(slabs.slabs)))
            if parts:
                socket.send_fds(sock, [b"F"], [slab.fd])
        finally:
            clips = None  # the arrays of this process's mapping (the slab's memory stays, for the next video)
            slab.start()
            if not parts:
                slabs.put(slab.ident)


def _place(slab: Slab, clip) -> int:
    """The clip's frames' offset in the slab (copied into it when they are not there)."""
    offset = slab.offset(clip.frames) if clip.frames.flags.c_contiguous else None
    if offset is None:
        frames = slab.alloc(clip.frames.shape)
        frames[...] = clip.frames
        clip.frames = frames
        offset = slab.offset(frames)
    return offset


def _ask(sock: socket.socket, h: int, w: int):
    _send(sock, ("fit", h, w))
    return _recv(sock)


def _send(sock: socket.socket, obj):
    data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _recv(sock: socket.socket):
    return pickle.loads(_exactly(sock, int.from_bytes(_exactly(sock, 8), "little")))


def _exactly(sock: socket.socket, n: int) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the socket ended")
        got += k
    return out


def _readable(sock: socket.socket, until: float) -> bool:
    """Whether the helper has answered (or ended) before `until` (monotonic)."""
    with selectors.DefaultSelector() as selector:  # epoll / kqueue: no limit on the descriptor's number
        selector.register(sock, selectors.EVENT_READ)
        while True:
            if selector.select(min(max(0.0, until - time.monotonic()), 60.0)):
                return True
            if time.monotonic() >= until:
                return False


def _single_threaded() -> bool:
    """Whether this process runs one Python thread (Linux; elsewhere the helper is never forked). Native pools
    (OpenBLAS's, OpenMP's) are not counted: the helper never calls into them, and nothing else it uses (malloc, the
    interpreter's own locks) is left half-taken by a fork."""
    return sys.platform == "linux" and threading.active_count() == 1


_local = threading.local()
_HELPERS: weakref.WeakSet[Helper] = weakref.WeakSet()  # this process's helpers


def _helper(decode) -> Helper:
    helper = getattr(_local, "helper", None)
    if helper is None or not helper.alive():
        if helper is not None:
            helper.close()
        helper = _local.helper = Helper(decode)
    return helper


def stop():
    """Kill this thread's helper (the next video starts another)."""
    helper = getattr(_local, "helper", None)
    if helper is not None:
        helper.close()
        _local.helper = None


def _forget_in_child():
    """A forked child (a loader's worker, a helper) neither uses nor keeps its parent's helpers: it closes its copies of
    their sockets, so that only the parent's end keeps a helper's socket open."""
    global _local
    for helper in list(_HELPERS):
        helper.dead = True
        helper._end.detach()
        helper.sock.close()
    _HELPERS.clear()
    _local = threading.local()


_exit_registered: int | None = None


def _stop_at_exit():
    """Kill and reap this process's helpers when it exits: `weakref.finalize` does at the interpreter's exit, and a
    loader's worker (a multiprocessing child, which leaves by `os._exit`) runs multiprocessing's finalizers instead."""
    global _exit_registered
    if _exit_registered != os.getpid():
        _exit_registered = os.getpid()
        multiprocessing.util.Finalize(None, _stop_all, exitpriority=0)


def _stop_all():
    for helper in list(_HELPERS):
        helper.close()


os.register_at_fork(after_in_child=_forget_in_child)
