"""A video that hangs the decoder inside one call, or crashes it, is a named failure and the run goes on: videos are
decoded in a helper process that is killed at the time limit (`precompute.video_helper`). The hangs here are real:
the helper blocks inside the call that converts a decoded frame (where the old check between packets and frames
never looks) on an event nothing sets, after telling the test through a pipe that it got there."""

import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from precompute import video, video_helper
from precompute.sample_video import make_video
from precompute.video import ClipPolicy, read_clips, read_clips_here
from precompute.video_readers import AVReader, VideoFile

WAN = (1, 17, 33)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the helper is forked and watched through Linux's /proc")


@pytest.fixture
def helpers(monkeypatch):
    """A fresh forked helper for this test (so that what the test patches is in it), killed after it."""
    monkeypatch.setattr(video_helper, "_single_threaded", lambda: True)
    video_helper.stop()
    yield
    video_helper.stop()


@pytest.fixture
def clip_video(tmp_path) -> Path:
    path = tmp_path / "v.mp4"
    make_video(path, "index", 96, 24.0)  # 4 s: 64 frames at 16 fps
    return path


class Hang:
    """`AVReader.to_rgb` that writes "<pid>\\n" to a pipe and then blocks on an event that is never set in the helper
    (the test sets it to free a thread of its own)."""

    def __init__(self, monkeypatch):
        self.r, self.w = os.pipe()
        self.release = threading.Event()
        release, w = self.release, self.w

        def to_rgb(reader, frame):
            os.write(w, b"%d\n" % os.getpid())
            release.wait()
            raise OSError("released by the test")  # a failure of the video: the freed thread ends quietly

        monkeypatch.setattr(AVReader, "to_rgb", to_rgb)

    def started(self, timeout: float = 60.0) -> int:
        """The pid that reached the blocking call (waits for it, at most `timeout`)."""
        ready, _, _ = select.select([self.r], [], [], timeout)
        assert ready, "nothing reached the blocking call"
        return int(os.read(self.r, 64).split()[0])

    def close(self):
        self.release.set()
        os.close(self.r)
        os.close(self.w)


def shared_memory() -> list[str]:
    """Shared memory this process maps or holds open: named (/dev/shm) or the helper's memfds (other processes'
    /dev/shm entries come and go on a shared machine, so this process's own are what is checked)."""
    def shared(name: str) -> bool:
        # a POSIX semaphore (/dev/shm/sem.*) is a multiprocessing lock an earlier test of the process made, never
        # the helper's (its memory is memfds)
        return ("/dev/shm/" in name and "/dev/shm/sem." not in name) or "memfd:" in name

    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if shared(line)]
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return maps + [f for f in fds if shared(f)]


def zombies() -> list[int]:
    """This process's children that have exited and are not reaped."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state == "Z":
            out.append(int(pid))
    return out


def test_a_hang_inside_a_decoder_call_is_stopped_at_the_limit(helpers, clip_video, monkeypatch):
    data = clip_video.read_bytes()
    assert not shared_memory()
    with monkeypatch.context() as m:
        hang = Hang(m)
        # the old path, in this process: the limit passes and the call never returns
        got = []
        old = threading.Thread(target=lambda: got.append(read_clips_here(data, ClipPolicy(16.0, WAN, timeout_s=0.2), 10**8)),
                               daemon=True)
        old.start()
        assert hang.started() == os.getpid()
        old.join(timeout=2.0)  # ten times the limit
        assert old.is_alive() and not got, "the check between frames saw the hang: this test would prove nothing"
        # the helper: the same call blocks there, and the limit stops it
        t0 = time.monotonic()
        clips, reason, detail = read_clips(data, ClipPolicy(16.0, WAN, timeout_s=0.5), 10**8)
        took = time.monotonic() - t0
        pid = hang.started(timeout=0)
        hang.close()
    old.join(timeout=60)
    assert (clips, reason) == ([], "decode_timeout") and "over 0.5 s" in detail and "killed" in detail
    assert pid != os.getpid()
    assert 0.5 <= took < 0.5 + video_helper.GRACE_S + 10
    assert not Path(f"/proc/{pid}").exists() and not zombies()  # killed and reaped
    assert not shared_memory()
    # the run goes on: the next video gets a new helper
    clips, reason, _ = read_clips(data, ClipPolicy(16.0, WAN), 10**8)
    assert reason is None and clips[0].frames.shape == (33, 64, 96, 3)
    assert video_helper._local.helper.pid != pid


def test_a_crash_of_the_decoder_is_a_named_failure(helpers, clip_video, monkeypatch):
    data = clip_video.read_bytes()
    assert not shared_memory()
    with monkeypatch.context() as m:
        m.setattr(AVReader, "to_rgb", lambda reader, frame: ctypes.string_at(0))  # a real segfault
        clips, reason, detail = read_clips(data, ClipPolicy(16.0, WAN), 10**8)
    assert (clips, reason) == ([], "corrupt_video") and "SIGSEGV" in detail, detail
    assert not zombies() and not shared_memory()
    clips, reason, _ = read_clips(data, ClipPolicy(16.0, WAN), 10**8)
    assert reason is None and len(clips[0].frames) == 33


def test_the_helper_dies_with_the_process_that_started_it(helpers, clip_video, monkeypatch):
    """A loader's worker killed while its helper hangs: the helper goes too (the kernel's parent-death signal)."""
    data = clip_video.read_bytes()
    hang = Hang(monkeypatch)
    worker = os.fork()
    if worker == 0:  # a worker: decodes with a long limit, and is killed while its helper hangs
        try:
            read_clips(data, ClipPolicy(16.0, WAN, timeout_s=600), 10**8)
        finally:
            os._exit(0)
    try:
        helper = hang.started()
        assert helper not in (worker, os.getpid())
        watch = os.pidfd_open(helper)
        os.kill(worker, signal.SIGKILL)
        assert os.waitpid(worker, 0)[0] == worker
        ready, _, _ = select.select([watch], [], [], 30)  # readable when the helper has exited
        assert ready, "the helper outlived the process that started it"
        os.close(watch)
    finally:
        hang.close()


def test_a_thread_among_others_gets_a_fresh_interpreter_that_decodes_the_same(clip_video, monkeypatch):
    """In a process with other threads (the main process with --workers 0: the encoder's, the writer's), the helper
    is a new interpreter, not a fork; it decodes the same frames, from bytes and from the file where it lies."""
    monkeypatch.setattr(video_helper, "_single_threaded", lambda: False)
    stopped = []

    def decode():
        try:
            policy = ClipPolicy(16.0, (1, 9, 17), "chunk")
            stats, here_stats = {}, {}
            got = read_clips(clip_video.read_bytes(), policy, 10**8, stats)
            fd = os.open(clip_video, os.O_RDONLY)
            try:
                from_file = read_clips(VideoFile(str(clip_video), fd, os.fstat(fd).st_size), policy, 10**8)
            finally:
                os.close(fd)
            here = read_clips_here(clip_video.read_bytes(), policy, 10**8, here_stats)
            stopped.append((got, from_file, here, stats, here_stats, video_helper._local.helper.proc))
        finally:
            video_helper.stop()

    t = threading.Thread(target=decode)
    t.start()
    t.join()
    (got, from_file, here, stats, here_stats, proc) = stopped[0]
    assert not isinstance(proc, video_helper._Forked) and proc.returncode is not None  # spawned, and reaped
    assert got[1:] == here[1:] == (None, "") and from_file[1:] == (None, "") and stats == here_stats
    assert len(got[0]) == len(here[0]) == 3
    for a, b, c in zip(got[0], from_file[0], here[0]):
        assert (a.index, a.start, a.size) == (c.index, c.start, c.size)
        assert np.array_equal(a.frames, c.frames) and np.array_equal(b.frames, c.frames)


def test_a_long_lived_helper_keeps_no_descriptor_or_memory_per_video(helpers, clip_video):
    policy = ClipPolicy(16.0, (1, 9, 17), "chunk")
    data = clip_video.read_bytes()
    fd = os.open(clip_video, os.O_RDONLY)
    try:
        file = VideoFile(str(clip_video), fd, os.fstat(fd).st_size)
        for source in (data, file):  # what is opened once for good is opened by now
            read_clips(source, policy, 10**8)
        pid = video_helper._local.helper.pid
        theirs, ours = sorted(os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")), len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            for source in (data, file):
                clips, reason, _ = read_clips(source, policy, 10**8)
                assert reason is None
                del clips
        assert video_helper._local.helper.pid == pid  # one helper served them all, in the memory it used first
        now = sorted(os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd"))
        assert now == theirs and len(os.listdir("/proc/self/fd")) == ours
    finally:
        os.close(fd)
    video_helper.stop()
    assert not shared_memory()  # the helper's memory went with it


def test_fit_is_asked_in_the_caller(helpers, clip_video):
    asked = []

    def fit(h, w):
        asked.append((h, w, os.getpid()))
        return 32, 48

    clips, reason, _ = read_clips(clip_video.read_bytes(), ClipPolicy(16.0, WAN), 10**8, fit=fit)
    assert reason is None and clips[0].frames.shape == (33, 32, 48, 3) and clips[0].size == (64, 96)
    assert asked == [(64, 96, os.getpid())]


def test_clips_held_by_the_caller_are_never_written_over(helpers, tmp_path):
    """The helper decodes into memory the caller maps and uses it again only once the caller's clips of it are gone."""
    paths = [tmp_path / f"{i}.mp4" for i in range(3)]
    for i, path in enumerate(paths):
        make_video(path, "shapes", 48, 24.0, seed=i)
    policy = ClipPolicy(16.0, WAN)
    expected = [read_clips_here(p.read_bytes(), policy, 10**8)[0][0].frames for p in paths]
    held = [read_clips(p.read_bytes(), policy, 10**8)[0] for p in paths]  # all three held at once
    again = [read_clips(p.read_bytes(), policy, 10**8)[0] for p in reversed(paths)]
    for clips, want in zip([*held, *reversed(again)], [*expected, *expected]):
        assert np.array_equal(clips[0].frames, want)
    pid = video_helper._local.helper.pid
    del held, again, clips
    for p in paths:  # let go of at once: the slabs are used again, a few kept
        read_clips(p.read_bytes(), policy, 10**8)
    slabs = {os.stat(f"/proc/{pid}/fd/{fd}").st_ino for fd in os.listdir(f"/proc/{pid}/fd")
             if "memfd:clips" in os.readlink(f"/proc/{pid}/fd/{fd}")}
    assert len(slabs) <= video_helper.Slabs.KEEP_FREE + 1  # the one in use and the free ones kept


def test_a_bug_raises_in_the_caller_and_ctrl_c_ends_the_helper(helpers, clip_video, monkeypatch):
    """Not a bad video: an exception of the decoding code is raised by `read_clips`, with the helper's traceback,
    as it was in-process; Ctrl-C while a video is being read kills the helper (a new one reads the next)."""
    data = clip_video.read_bytes()

    with monkeypatch.context() as m:
        m.setattr(video, "_extract", lambda *a: 1 / 0)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            read_clips(data, ClipPolicy(16.0, WAN), 10**8)
    assert not zombies()

    def interrupted(h, w):
        raise KeyboardInterrupt

    read_clips(data, ClipPolicy(16.0, WAN), 10**8)
    pid = video_helper._local.helper.pid
    with pytest.raises(KeyboardInterrupt):
        read_clips(data, ClipPolicy(16.0, WAN), 10**8, fit=interrupted)  # asked while the helper waits for the answer
    assert not Path(f"/proc/{pid}").exists() and not zombies()
    clips, reason, _ = read_clips(data, ClipPolicy(16.0, WAN), 10**8)
    assert reason is None and video_helper._local.helper.pid != pid


def test_a_helper_slow_to_start_costs_no_video_its_time_limit(helpers, clip_video, monkeypatch):
    """A helper's start (a fresh interpreter importing torch and PyAV: seconds, more on a cold network file system)
    is not decoding: the limit counts from when the helper says it is ready."""
    real, limit = video_helper.serve, 0.3

    def slow_to_start(*args):  # in the helper: a start that takes far longer than the limit and its grace
        time.sleep(3 * (limit + video_helper.GRACE_S))
        real(*args)

    monkeypatch.setattr(video_helper, "serve", slow_to_start)
    start = time.monotonic()
    clips, reason, detail = read_clips(clip_video.read_bytes(), ClipPolicy(16.0, (1, 9, 17), timeout_s=limit), 10**8)
    assert time.monotonic() - start > 3 * (limit + video_helper.GRACE_S)
    assert (reason, detail) == (None, "") and len(clips) == 1
