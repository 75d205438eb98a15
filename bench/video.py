"""Stage one on video: decode, encode and write throughput and the encoder's busy fraction on tiny-wan, measured side
by side in one run; and the cache's bytes per clip for Wan 2.1 at 480p x 81 frames, exactly from shapes.

The goal is that decoding never bounds the encoder: workers decode while the encoder runs, clips are encoded in
batches, and writing takes a small share of the pass. The rows:

(a) decode: stage one's own loader alone (`precompute.run.open_all_inputs`: its worker processes read each video,
    seek, resample to the family's 16 fps, resize and crop the clip to its bucket), clips/s and clip frames/s.
    Goal: faster than (b) with the same workers, i.e. the encoder never waits for clips.
(b) encode: the bare encoders (`Encoders.encode_videos`, the VAE, and `encode_text`, umT5) on the clips (a) decoded,
    in the run's batches (one bucket per batch, in arrival order), clips/s: the limit of (d).
(c) write: samples of stage one's fields through `shards.ShardWriter` (shards published and fsynced, NaN checks on),
    MB/s of field bytes: the tiny clips of (a), and clips of Wan 2.1 480p x 81 frames (latent mean and std
    (16, 21, 60, 104) and an 80-token umT5 caption (80, 4096), bf16, random values) in 128 MiB shards.
(d) the run: a real stage-one run over the same videos (`precompute.run.main`, new cache each round). The encoder's
    busy fraction is what stage one's summary reports (`encoder_busy_fraction`: the time inside the encode calls over
    the pass's wall time, `encode_s`: reading, encoding and writing, without loading the encoders); the VAE's and
    umT5's shares of it are timed by wrapping `Encoders.encode_videos` / `encode_text` (the same code runs; two clock
    reads per call); beside it the pass's wait on the loader (`data_wait_fraction`), on the background writer
    (`writer_wait_fraction`) and the writer thread's own busy share, and clips/s over (b) (with
    the encode calls' time in the run over their time in (b): on a shared CPU the run's worker and other processes
    slow the encoder itself, which busy leaves out and (d) / (b) counts). Goals: busy >= 0.90 and (d) / (b) >= 0.90.
(e) bytes per clip of a Wan 2.1 cache at 480p x 81 frames: the latent fields from the real preset's `LatentSpec`
    (AutoencoderKLWan's published configuration built on the meta device: 16 channels, 8x spatial, 4x temporal),
    umT5-XXL's 4096 wide text (the published transformer's `text_dim`) for 60, 80 and 100 valid tokens, both in the
    storage dtype; the other fields as the tiny cache of (d) stores them. Cross-checked: the tiny cache's stored
    bytes per latent and text element, which must be the storage dtype's width (2.00 for bf16) plus its overhead.
(f) decode at the real size: stage one's loader for the real preset (no weights needed) over generated 480x832
    videos of 5.5 s at 24 fps, one 81-frame clip each, clips/s with the same workers; beside it the Wan 2.1 VAE
    encoder's cost per such clip, its FLOPs counted on the meta device, and the clips/s that cost allows at
    989 TFLOP/s (an H100 SXM's dense bf16 peak): an upper bound on the rate the loader must keep up with on one GPU.
    On the CPU the loader's workers send frames through a pipe as arrays (the clip's 97 MB of pixels copied); a CUDA
    run passes them as shared-memory tensors.

Threads are pinned (`bench.common.pin_threads`, 1 by default: on 2 cores one encodes while the loader's worker
decodes on the other). The videos are generated before the first round and read warm (in the page cache). Default
run: 64 clips of 33 frames at --resolution 64, 3 rounds, about 2 minutes on 2 cores. The tiny VAE's encoder has
~580 times fewer parameters than the Wan 2.1 VAE's and costs ~330 times fewer FLOPs a clip (2.1 vs 683 GFLOP at
33x64x64): (a)-(d) show the machinery at a small size; (f) compares decoding with the real encoder's cost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import SHARD_BYTES, pin_threads  # noqa: E402
from precompute.config import PrecomputeConfig  # noqa: E402
from precompute.encode import Encoders  # noqa: E402
from precompute.encoding import EncodingPass  # noqa: E402
from precompute.families import family  # noqa: E402
from precompute.presets import get_preset  # noqa: E402
from precompute.run import main as precompute  # noqa: E402
from precompute.run import open_all_inputs  # noqa: E402
from precompute.sample_video import make_video, make_video_folder  # noqa: E402
from shards import Field, ShardWriter, load  # noqa: E402
from shards.options import torch_dtype  # noqa: E402

REAL_PRESET = "wan2.1-t2v-1.3b"  # the Wan 2.1 VAE and umT5-XXL, as every Wan 2.1 preset has them
REAL_CLIP = (81, 480, 832)  # frames, height, width
REAL_TOKENS = (60, 80, 100)  # a typical caption's valid umT5 tokens (the pipelines zero-fill to 512)
WRITE_TOKENS = 80


def decode(config: PrecomputeConfig) -> tuple[list[dict], float]:
    """Stage one's loader over `config.data` with `config.workers` worker processes, nothing encoded: the clips it
    yields (pixels as tensors) and the seconds from opening the inputs to the last clip."""
    t0 = time.perf_counter()
    inputs = open_all_inputs(config, None, torch.device("cpu"), 0, 1)
    items = []
    for item in inputs.batches:
        if item["status"] != "ok":
            raise RuntimeError(f"{item['source']}: {item['status']} {item.get('reason', '')} {item.get('detail', '')}")
        if isinstance(item["pixels"], np.ndarray):
            item["pixels"] = torch.from_numpy(item["pixels"])
        items.append(item)
    return items, time.perf_counter() - t0


def batches_of(items: list[dict], batch_size: int) -> list[list[dict]]:
    """The encoder's batches as stage one forms them: per bucket in arrival order, the rest of each bucket at the end."""
    pending, out = defaultdict(list), []
    for it in items:
        pending[it["bucket"]].append(it)
        if len(pending[it["bucket"]]) == batch_size:
            out.append(pending.pop(it["bucket"]))
    return out + [pending[b] for b in sorted(pending)]


def bare_encoders(enc: Encoders, items: list[dict], batch_size: int) -> float:
    """Seconds to encode decoded clips and their captions in stage one's batches."""
    batches = batches_of(items, batch_size)
    t0 = time.perf_counter()
    for batch in batches:
        enc.encode_videos(torch.stack([it["pixels"] for it in batch]))  # (B, 3, F, H, W) uint8
        enc.encode_text([c for it in batch for c in it["captions"]])
    return time.perf_counter() - t0


@contextlib.contextmanager
def stopwatch(*methods: tuple[type, str]):
    """Seconds spent inside each `(class, method)` while the block runs, by method name (`spent`), and what they
    were when `EncodingPass.run` returned (`spent["pass:<name>"]`): the pass, not the prompts and commits after it.
    The methods run unchanged; each call also reads the clock twice."""
    spent: Counter = Counter()
    originals = [(owner, name, owner.__dict__[name]) for owner, name in [*methods, (EncodingPass, "run")]]

    def timed(name, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
                if name == "run":
                    for k in [k for k in spent if not k.startswith("pass:")]:
                        spent[f"pass:{k}"] = spent[k]
        return wrapper

    for owner, name, original in originals:
        setattr(owner, name, timed(name, original))
    try:
        yield spent
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def clip_schema(storage: torch.dtype) -> dict:
    """Stage one's fields of a text-to-video clip, with its caption's text stored in the sample."""
    return {"latent_mean": Field(storage), "latent_std": Field(storage), "text": Field(storage, ragged=True),
            "text_lengths": Field(torch.int32, ragged=True), "original_size": Field(torch.int32),
            "crop": Field(torch.int32), "clip": Field(torch.int32), "source": Field(torch.uint8, ragged=True)}


def write_clips(root: Path, samples: list[tuple[tuple[int, int, int], dict[str, torch.Tensor]]], storage: torch.dtype,
                shard_bytes: int = SHARD_BYTES) -> tuple[int, float]:
    """Write `(bucket, latent and text fields)` samples with `ShardWriter` into a new cache, as stage one's writer
    is set up (NaN checks on, `shard_bytes` shards, published and fsynced); returns (field bytes, seconds)."""
    fingerprint = {"bench": "video write", "storage_dtype": str(storage).removeprefix("torch.")}
    nbytes, t0 = 0, time.perf_counter()
    with ShardWriter(root, fingerprint, clip_schema(storage), max_shard_bytes=shard_bytes) as writer:
        for i, ((frames, h, w), fields) in enumerate(samples):
            source = f"videos/{i:06d}.mp4"
            sample = {**fields, "text_lengths": torch.tensor([fields["text"].shape[0]], dtype=torch.int32),
                      "original_size": torch.tensor([h, w], dtype=torch.int32),
                      "crop": torch.tensor([0, 0, h, w], dtype=torch.int32),
                      "clip": torch.tensor([0, 0, frames], dtype=torch.int32),
                      "source": torch.frombuffer(bytearray(source.encode()), dtype=torch.uint8)}
            nbytes += sum(t.numel() * t.element_size() for t in sample.values())
            writer.write(f"{i:016x}", (h, w, frames), sample, source=source)
    return nbytes, time.perf_counter() - t0


def tiny_samples(enc: Encoders, items: list[dict], storage: torch.dtype) -> list:
    """The decoded clips' latent and text fields as the encoders make them, in the storage dtype."""
    out = []
    for batch in batches_of(items, 8):
        latents = enc.encode_videos(torch.stack([it["pixels"] for it in batch]))
        texts = enc.encode_text([it["captions"][0] for it in batch]).fields
        for j, it in enumerate(batch):
            b = it["bucket"]
            fields = {"latent_mean": latents["latent_mean"][j], "latent_std": latents["latent_std"][j], "text": texts[j]["text"]}
            out.append(((b.frames, b.height, b.width), {k: v.to(storage) for k, v in fields.items()}))
    return out


def real_latent_spec():
    """The Wan 2.1 VAE's `LatentSpec` as stage one records it: AutoencoderKLWan's published configuration (the
    class defaults) built on the meta device, asked of the preset's family."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan()
    return family(get_preset(REAL_PRESET).family).latent_spec(vae)


def real_text_width() -> int:
    """umT5-XXL's width: what the published transformer takes (`text_dim`)."""
    from train.families import get_preset as transformer_preset

    return int(transformer_preset(REAL_PRESET).transformer_config()["text_dim"])


def real_samples(count: int, storage: torch.dtype) -> list:
    """`count` clips of Wan 2.1 480p x 81 frames with an 80-token caption, random values."""
    frames, h, w = REAL_CLIP
    shape = real_latent_spec().shape(h, w, frames)  # (16, 21, 60, 104)
    g = torch.Generator().manual_seed(0)
    mean, std = torch.randn(shape, generator=g).to(storage), torch.rand(shape, generator=g).to(storage)
    text = torch.randn(WRITE_TOKENS, real_text_width(), generator=g).to(storage)
    # the same values under other keys: the writer's work (checks, digests, copies, fsync) is per byte all the same
    return [(REAL_CLIP, {"latent_mean": mean, "latent_std": std, "text": text}) for _ in range(count)]


def cache_bytes(cache: Path, latent_fields: tuple[str, ...], tokens: int, width: int, itemsize: int) -> dict:
    """What a stage-one cache stores per clip: bytes per stored latent element (the latent fields' bytes over their
    elements from the manifest's shapes); per text element (its text shards' bytes over `tokens` x `width`); each
    other field's bytes per sample; the shard files' bytes beyond their fields per sample, and the text shards'
    beyond their `itemsize`-wide elements per caption row."""
    m = load(cache)
    n = m.num_samples
    field_bytes = dict(zip(m.shards.fields, (int(v) for v in m.shards.column("field_bytes").sum(0))))
    elements = {name: sum(st.samples * int(np.prod(m.shapes[b][name])) for b, st in m.buckets().items())
                for name in latent_fields}
    texts = m.text_stats()
    return {"latent_bytes_per_element": sum(field_bytes[k] for k in latent_fields) / sum(elements.values()),
            "text_bytes_per_element": texts["bytes"] / (tokens * width), "text_rows": texts["texts"],
            "text_row_overhead": (texts["bytes"] - tokens * width * itemsize) / texts["texts"],
            "other_per_sample": {k: v / n for k, v in field_bytes.items() if k not in latent_fields},
            "container_per_sample": (m.num_bytes - sum(field_bytes.values())) / n, "samples": n, "shards": len(m.shards)}


def real_videos(root: Path, count: int) -> Path:
    """`count` generated videos of 480x832 pixels, 5.5 s at 24 fps (an 81-frame clip at 16 fps each), with captions."""
    root.mkdir(parents=True)
    for i in range(count):
        caption = make_video(root / f"{i:05d}.mp4", "shapes", 132, 24.0, REAL_CLIP[1:], seed=i)
        (root / f"{i:05d}.txt").write_text(caption + "\n", encoding="utf-8")
    return root


def real_encoder_flops() -> float:
    """FLOPs of the Wan 2.1 VAE's encode of one 480p x 81-frame clip, counted on the meta device (no weights)."""
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    frames, h, w = REAL_CLIP
    with torch.device("meta"):
        vae = AutoencoderKLWan()
        with FlopCounterMode(display=False) as counter:
            vae.encode(torch.zeros(1, 3, frames, h, w))
    return float(counter.get_total_flops())


def main(
    model: str = typer.Option("tiny-wan", help="Video preset to encode with."),
    count: int = typer.Option(64, help="Generated videos (one clip each: --clip-extraction head)."),
    frames: int = typer.Option(33, help="Frames of each clip at the family's frame rate (4k+1); every video is long enough."),
    resolution: int = typer.Option(64, help="Stage one's --resolution: the clips' area (64: 64x64, 48x80, 80x48)."),
    batch_size: int = typer.Option(4, help="Clips per VAE batch (stage one's --batch-size; its default is 1)."),
    workers: int = typer.Option(1, help="Stage one's loader worker processes, in (a) and (d)."),
    repeats: int = typer.Option(3, help="Rounds; each runs (a) to (d) back to back."),
    real_clips: int = typer.Option(16, help="480p x 81-frame clips written in each round of (c) (9.0 MB each)."),
    real_videos_count: int = typer.Option(6, "--real-videos", help="480x832 videos decoded in each round of (f) (0: no (f))."),
    threads: int = typer.Option(1, help="torch threads of the encoders (the loader's workers use 1 each)."),
    dtype: str = typer.Option("bf16", help="Storage dtype: bf16, fp16 or fp32."),
) -> None:
    threads_line = pin_threads(threads)
    storage = torch_dtype(dtype)
    work = Path(tempfile.mkdtemp(prefix="video-bench-"))
    try:
        # 16 fps clips of `frames` need (frames - 1) / 16 s of video; the videos run 24 fps, a little longer
        span = (frames - 1) / 16 + 0.25
        data = make_video_folder(work / "data", count, seconds=(span, span + 0.75))
        config = PrecomputeConfig(str(data), model, work / "cache", workers=workers, frames=frames,
                                  resolution=str(resolution), batch_size=batch_size, storage_dtype=dtype, progress=False)
        enc = Encoders(get_preset(model), torch.device("cpu"))
        items, _ = decode(config)  # warm-up: the loader's imports, the files' pages
        bare_encoders(enc, items[:batch_size], batch_size)
        tiny = tiny_samples(enc, items, storage)
        real = real_samples(real_clips, storage)
        real_config = None
        if real_videos_count:
            real_config = PrecomputeConfig(str(real_videos(work / "real-videos", real_videos_count)), REAL_PRESET,
                                           work / "real-cache", workers=workers, frames=REAL_CLIP[0], resolution=str(REAL_CLIP[1]))
            decode(real_config)  # warm-up
        rounds = []
        for r in range(repeats):
            items, decode_s = decode(config)
            encode_s = bare_encoders(enc, items, batch_size)
            tiny_bytes, tiny_s = write_clips(work / f"tiny-{r}", tiny, storage)
            real_bytes, real_s = write_clips(work / f"real-{r}", real, storage)
            shutil.rmtree(work / f"tiny-{r}")
            shutil.rmtree(work / f"real-{r}")
            shutil.rmtree(config.cache, ignore_errors=True)
            with stopwatch((Encoders, "encode_videos"), (Encoders, "encode_text")) as spent:
                summary = precompute(str(data), model, config.cache, workers=workers, frames=frames, resolution=str(resolution),
                                     batch_size=batch_size, storage_dtype=dtype, progress=False, log_seconds=3600)
            if summary["encoded"] != len(items):
                raise RuntimeError(f"the run encoded {summary['encoded']} clips of {len(items)}: {json.dumps(summary)[:400]}")
            loop = summary["encode_s"]
            rounds.append({
                "decode": len(items) / decode_s, "frames": sum(it["pixels"].shape[1] for it in items) / decode_s,
                "encode": len(items) / encode_s, "tiny_write": tiny_bytes / tiny_s / 1e6, "real_write": real_bytes / real_s / 1e6,
                "real_clip_s": real_s / len(real), "run": summary["images_per_s"], "loop_s": loop,
                "busy": summary["encoder_busy_fraction"],
                "vae": spent["pass:encode_videos"] / loop, "text": spent["pass:encode_text"] / loop,
                "wait": summary["data_wait_fraction"], "writing": summary["writer_wait_fraction"],
                "writer_busy": summary["writer_busy_fraction"],
            })
            if real_config is not None:
                real_items, real_s = decode(real_config)
                rounds[-1]["real_decode"] = len(real_items) / real_s
                del real_items
            rounds[-1]["run_over_bare"] = rounds[-1]["run"] / rounds[-1]["encode"]
            # the encode calls' own time in the run over the same calls bare: above 1 when the run's loader worker (or
            # another process) takes CPU time from the encoder
            rounds[-1]["slowdown"] = (spent["pass:encode_videos"] + spent["pass:encode_text"]) / encode_s
        best = {k: max(r[k] for r in rounds) for k in rounds[0]}
        med = {k: statistics.median([r[k] for r in rounds]) for k in rounds[0]}

        n_frames = {it["bucket"].frames for it in items}
        buckets = Counter(it["bucket"].name for it in items)
        print(f"{model}: {len(items)} generated videos (24 fps, {'/'.join(map(str, sorted(n_frames)))}-frame clips at 16 fps, "
              f"buckets {', '.join(f'{b} x{n}' for b, n in sorted(buckets.items()))}), batch {batch_size} clips, {workers} loader "
              f"worker(s); {threads_line}; warm (videos just written); storage {dtype}; {repeats} rounds: median (best)")
        print(f"{'row':58s} {'measured':>26s}   goal")
        print(f"{'(a) decode, stage one loader alone':58s} {med['decode']:7.1f} clips/s ({best['decode']:5.1f})   > (b): decoding "
              f"never bounds the encoder")
        print(f"{'    clip frames decoded, resampled, resized, cropped':58s} {med['frames']:7.0f} frames/s ({best['frames']:4.0f})")
        print(f"{'(b) encode, bare VAE + umT5 on decoded clips':58s} {med['encode']:7.1f} clips/s ({best['encode']:5.1f})   the "
              f"limit of (d)")
        print(f"{'    (a) / (b): decode headroom with ' + str(workers) + ' worker(s)':58s} {statistics.median([r['decode'] / r['encode'] for r in rounds]):7.1f} x"
              f"{'':16s}   > 1")
        print(f"{'(c) write, ShardWriter, tiny clips (fsynced)':58s} {med['tiny_write']:7.1f} MB/s ({best['tiny_write']:5.1f})   "
              f"measured")
        print(f"{'    Wan 2.1 480p x 81 clips + 80-token captions, 128 MiB shards':58s} {med['real_write']:7.1f} MB/s "
              f"({best['real_write']:5.1f})   measured; {med['real_clip_s'] * 1e3:.0f} ms a clip")
        print(f"{'(d) run: encoder busy (time in encode calls / pass wall)':58s} {med['busy']:7.1%}{'':9s} "
              f"({best['busy']:.1%})   >= 90 %; VAE {med['vae']:.1%}, umT5 {med['text']:.1%}")
        print(f"{'    run: waiting on the loader / on the writer':58s} {med['wait']:7.1%} / {med['writing']:.1%}{'':8s}   small")
        print(f"{'    run: the background writer busy (beside the encoder)':58s} {med['writer_busy']:7.1%}")
        print(f"{'    run / bare encoders':58s} {med['run_over_bare']:7.2f} ({med['run']:.1f} clips/s){'':7s}   >= 0.90; the "
              f"encode calls took {med['slowdown']:.2f} x their bare time in the run")

        # (e) bytes per clip at Wan 2.1 480p x 81 frames, from the tiny cache of the last run and the real shapes
        latent = real_latent_spec()
        width = real_text_width()
        captions = sorted({it["captions"][0] for it in items})
        tokens = sum(enc.text_family.token_counts(enc.text, captions, enc.preset.text.max_length))
        tiny_width = enc.text_spec().width
        stored = cache_bytes(config.cache, tuple(latent.fields), tokens, tiny_width, storage.itemsize)
        f, h, w = REAL_CLIP
        shape = latent.shape(h, w, f)
        size = storage.itemsize
        latents = len(latent.fields) * int(np.prod(shape)) * size
        # the fields besides latents and text, and the shard files' own bytes, as the tiny cache stores them
        other = sum(stored["other_per_sample"].values()) + stored["container_per_sample"] + stored["text_row_overhead"]
        print(f"\n(e) cache bytes per clip, Wan 2.1 at {h}p x {f} frames ({REAL_PRESET}'s VAE: latent fields "
              f"{' + '.join(latent.fields)}, each {tuple(shape)}; umT5-XXL text {width} wide; {dtype}; one caption a clip):")
        print(f"    latents {len(latent.fields)} x {' x '.join(map(str, shape))} x {size} B = {latents:,} B")
        for n in REAL_TOKENS:
            text = n * width * size
            total = latents + text + other
            print(f"    + {n}-token caption {n} x {width} x {size} B = {text:,} B + other fields and shard overhead "
                  f"{other:,.0f} B = {total:,.0f} B ({total / 2**20:.2f} MiB) per clip")
        print(f"    (the pipelines' zero-filled caption would be 512 x {width} x {size} B = {512 * width * size:,} B: the cache "
              f"keeps the valid tokens and training zero-fills them)")
        print(f"    cross-check on the tiny cache of (d) ({stored['samples']} clips, {stored['shards']} shards): "
              f"{stored['latent_bytes_per_element']:.4f} B per latent element; text shards {stored['text_bytes_per_element']:.4f} B "
              f"per text element ({stored['text_rows']} caption rows, {tokens:,} tokens x {tiny_width}), i.e. "
              f"{stored['text_row_overhead']:,.0f} B a row beyond its elements")
        print("    other fields and overhead per clip: " + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(stored["other_per_sample"].items()))
              + f"; shard file beyond the fields {stored['container_per_sample']:,.0f}; text row {stored['text_row_overhead']:,.0f}")
        if real_config is not None:
            flops = real_encoder_flops()
            peak = 989e12 / flops
            print(f"\n(f) decode at {h}p x {f} frames: stage one's loader for {REAL_PRESET} ({workers} worker(s)), "
                  f"{real_videos_count} generated {h}x{w} videos: {med['real_decode']:.2f} clips/s (best {best['real_decode']:.2f}), "
                  f"{med['real_decode'] * f:.0f} frames/s")
            print(f"    the Wan 2.1 VAE encoder: {flops / 1e12:.1f} TFLOP a clip (counted on the meta device): at most "
                  f"{peak:.1f} clips/s at 989 TFLOP/s, an H100's dense bf16 peak; decode / that bound "
                  f"{med['real_decode'] / peak:.2f} per worker")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
