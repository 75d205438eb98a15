"""What decoding a video in a killable helper process costs, side by side with decoding it in the calling process.

`precompute.video.read_clips` decodes in a helper process (`precompute.video_helper`: frames written into shared
memory, nothing copied back); `read_clips_here` is the same decode in the caller, as stage one did before. Each round
decodes every video both ways, alternating which goes first, from the same bytes in the page cache, in one process
with pinned threads (`bench.common.pin_threads`): a loader's worker, which forks its helper.

Rows: the wall-time ratio isolated / in-process (the median over the pairs, with its quartiles) and the ratio of
the CPU seconds both ways took in all (this process's and the helper's: steadier than wall time on a shared machine):
- decode: `read_clips` against `read_clips_here`.
- decode + fit: and then `fit_frames` to the clip's own size, as stage one's `prepare_clips` does (the frames read
  once more: in the isolated case, from the shared memory).
Every video is read both ways back to back (alternating which goes first), so that a busy machine slows both alike;
the ratio is the median over those pairs. Sizes: the real one (generated 480x832 videos at 30 fps with a camera's
worth of detail, ~1 Mbit/s; one 81-frame clip each at 16 fps: 152 source frames decoded, a 97 MB clip), and
tiny-wan's (`make_video`'s 64x96 shapes, 33 frames), where the helper's fixed cost per video weighs most.
Beside them, once: what starting a helper costs (a fork from this process; a fresh interpreter, as the main process
of a `--workers 0` run starts it).

Default run: 4 real-size videos and 16 tiny ones, 5 rounds, about 2 minutes on 2 cores.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import pin_threads  # noqa: E402
from precompute import video_helper  # noqa: E402
from precompute.sample_video import make_video, video_codec  # noqa: E402
from precompute.video import ClipPolicy, fit_frames, read_clips, read_clips_here  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process and of this thread's decode helper (its threads that ended included)."""
    helper = getattr(video_helper._local, "helper", None)
    theirs = 0.0
    if helper is not None and not helper.dead:
        fields = Path(f"/proc/{helper.pid}/stat").read_text().rsplit(")", 1)[1].split()
        theirs = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return time.process_time() + theirs


def one_read(data: bytes, policy: ClipPolicy, isolated: bool, fit: bool) -> tuple[float, float]:
    """(wall, CPU) seconds to read a video's clips (and fit them, as stage one does) and let go of them."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    clips, reason, detail = (read_clips if isolated else read_clips_here)(data, policy, 10**9)
    if reason:
        raise RuntimeError(f"{reason}: {detail}")
    if fit:
        for c in clips:
            fit_frames(c.frames, *c.frames.shape[1:3])
    del clips
    return time.perf_counter() - t0, cpu_seconds() - c0


def compare(datas: list[bytes], policy: ClipPolicy, rounds: int, fit: bool) -> dict:
    """Each video read both ways back to back (alternating which goes first), `rounds` times: the median ratio
    isolated / in-process of wall time over the pairs with its quartiles, the ratio of the total CPU seconds (both
    processes'; what a busy machine does not move), and the median wall seconds of each way."""
    one_read(datas[0], policy, True, fit)  # warm: the helper started, the decoder's code paged in
    one_read(datas[0], policy, False, fit)
    ratios, wall, cpu = [], {True: [], False: []}, {True: 0.0, False: 0.0}
    for r in range(rounds):
        for i, data in enumerate(datas):
            order = (True, False) if (r + i) % 2 else (False, True)
            took = {isolated: one_read(data, policy, isolated, fit) for isolated in order}
            ratios.append(took[True][0] / took[False][0])
            for isolated, (w, c) in took.items():
                wall[isolated].append(w)
                cpu[isolated] += c
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "q1": q1, "q3": q3, "cpu": cpu[True] / cpu[False],
            "here": statistics.median(wall[False]), "there": statistics.median(wall[True])}


def textured_video(path: Path, frames: int, fps: float, size: tuple[int, int], seed: int):
    """A video with a camera's worth of detail (a window panning over smoothed noise, H.264 at crf 23: ~1 Mbit/s at
    480p), so that decoding costs what real footage costs; `make_video`'s flat shapes compress to almost nothing."""
    import av
    from PIL import Image, ImageFilter

    h, w = size
    rng = np.random.default_rng(seed)
    noise = Image.fromarray(rng.integers(0, 256, (h + frames * 2, w + frames * 3, 3), np.uint8)).filter(ImageFilter.GaussianBlur(2))
    texture = np.asarray(noise)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(video_codec(".mp4"), rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width, stream.pix_fmt = h, w, "yuv420p"
        if stream.codec_context.name == "libx264":
            stream.options = {"crf": "23"}
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(texture[2 * k : 2 * k + h, 3 * k : 3 * k + w]), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())


def start_cost(fresh: bool) -> float:
    """Seconds from no helper to the first answer of a new one, on a one-frame request that fails at once."""
    video_helper.stop()
    real = video_helper._single_threaded
    video_helper._single_threaded = lambda: not fresh
    try:
        t0 = time.perf_counter()
        read_clips(b"not a video", ClipPolicy(16.0, (1,)), 10**9)
        return time.perf_counter() - t0
    finally:
        video_helper._single_threaded = real
        video_helper.stop()


def main(
    real_videos: int = typer.Option(4, help="Generated 480x832 videos at 30 fps (one 81-frame clip each at 16 fps)."),
    tiny_videos: int = typer.Option(16, help="Generated 64x96 videos (one 33-frame clip each at 16 fps)."),
    rounds: int = typer.Option(5, help="Rounds; each reads every video both ways, back to back."),
    threads: int = typer.Option(1, help="torch / OpenMP threads (pinned)."),
):
    """Print the isolated / in-process time ratios of decoding real-size and tiny clips."""
    print(pin_threads(threads))
    with tempfile.TemporaryDirectory() as tmp:
        real, tiny = [], []
        for i in range(real_videos):
            path = Path(tmp) / f"real{i}.mp4"
            textured_video(path, 180, 30.0, (480, 832), seed=i)  # 6 s
            real.append(path.read_bytes())
        for i in range(tiny_videos):
            path = Path(tmp) / f"tiny{i}.mp4"
            make_video(path, "shapes", 72, 30.0, (64, 96), seed=i)
            tiny.append(path.read_bytes())
        print(f"{real_videos} videos 480x832 at 30 fps ({statistics.mean(map(len, real)) / 1e6:.2f} MB each), "
              f"{tiny_videos} videos 64x96; {rounds} rounds; ratios isolated / in-process")
        print(f"{'row':40s} {'wall ratio (quartiles)':>22s} {'CPU ratio':>9s} {'in-process':>11s} {'isolated':>11s}")
        for name, datas, policy in (("81x480x832 clip", real, ClipPolicy(16.0, (1, 81))),
                                    ("33x64x96 clip", tiny, ClipPolicy(16.0, (1, 33)))):
            for fit in (False, True):
                m = compare(datas, policy, rounds, fit)
                row = f"{name}: decode{' + fit' if fit else ''}"
                print(f"{row:40s} {m['ratio']:6.3f} ({m['q1']:.3f}-{m['q3']:.3f}) {m['cpu']:6.3f}   "
                      f"{m['here'] * 1000:8.1f} ms {m['there'] * 1000:8.1f} ms")
        print(f"{'starting a helper: fork':44s} {'':7s} {start_cost(False) * 1000:9.1f} ms   (a loader's worker)")
        print(f"{'starting a helper: fresh interpreter':44s} {'':7s} {start_cost(True) * 1000:9.1f} ms   (--workers 0)")


if __name__ == "__main__":
    typer.run(main)
