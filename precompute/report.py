"""What a run tells its user: before encoding, whether the disk has room for the cache; after, the summary."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import torch

from precompute.encode import Encoders
from precompute.images import ImagePolicy
from precompute.inputs import REASONS
from shards import Cache
from shards.cli import reference_line, reference_stats


def estimate_bytes_per_sample(enc: Encoders, policy: ImagePolicy, storage: torch.dtype, captions: int = 1,
                              control: bool = False, references: int = 0) -> int:
    """Latents (and control latents) at the largest bucket area plus, per caption, what the family keeps of it (for
    captions trimmed to their valid tokens, half the token limit), plus `references` reference latents (their mean
    alone) at that area: an estimate for the disk check."""
    latent = enc.latent_spec()
    area = max(b.height * b.width for b in policy.buckets) // latent.downsample**2
    latents = ((2 if control else 1) * len(latent.fields) + references) * latent.channels * area
    return (latents + captions * enc.caption_elements()) * storage.itemsize + 256


def check_disk_space(cache: Path, need: int) -> None:
    free = shutil.disk_usage(cache).free
    if need > free:
        raise OSError(f"the cache needs about {_size(need)} more at {cache} but {_size(free)} are free; free space, "
                      f"choose another --cache, or pass --no-check-disk")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


ENCODER_BOUND = 0.95  # the encoder busy this much of the pass: the run goes as fast as the encoding device
BOUND_ADVICE = {
    "encoder": "bound by the encoder (busy >= 95 % of the pass): decoding and writing keep up; nothing to do here "
               "(a faster device or dtype, or a larger --batch-size if the device has room, would go faster)",
    "decoding": "bound by decoding: the encoder waited for decoded inputs; raise --workers if the machine has idle cores "
                "(each worker is a process that reads, decodes and resizes images: some 25 photos a second at 1024 px "
                "on one core)",
    "writer": "bound by the writer: the encoder waited on writes to the cache; put --cache on faster storage (a local "
              "disk rather than a network mount)",
    "pass": "bound by the pass's own thread (sorting inputs, batching, checking outputs) or a CPU the loader's workers "
            "fill: fewer --workers if every core is busy, or a larger --batch-size",
}
# a video model's inputs are clips: what decoding them costs (README, "What bounds a run" of the video section)
CLIP_ADVICE = {**BOUND_ADVICE,
               "decoding": "bound by decoding: the encoder waited for decoded clips; raise --workers if the machine has "
                           "idle cores (each worker is a process that reads, seeks, decodes, resamples and resizes "
                           "videos: about two 480p x 81-frame clips a second on one core)"}
MOSTLY_REUSED = 0.5  # of the samples a run wrote, the share whose latents it copied: its encoder barely ran


def bound_by(shares: dict[str, float], reused: float = 0.0) -> str | None:
    """Which stage bounds a run, from where its passes' time went (`report`'s `shares`): `encoder` when it was busy at
    least `ENCODER_BOUND` of the pass; else what it idled for most: `decoding` (it waited for decoded inputs),
    `writer` (it waited on writes) or `pass` (the rest: the pass's own work of sorting, batching and checking).
    None when the encoder did not run for most of the run (`reused`: the share of the samples written whose cached
    latents were copied instead, at least `MOSTLY_REUSED`): its idle time then says nothing of what bounds encoding."""
    if reused >= MOSTLY_REUSED:
        return None
    busy = shares["encoder_busy_fraction"]
    if busy >= ENCODER_BOUND:
        return "encoder"
    idle = {"decoding": shares["data_wait_fraction"], "writer": shares["writer_wait_fraction"]}
    idle["pass"] = 1.0 - busy - sum(idle.values())
    return max(idle, key=idle.get)


def report(cache: Path, counts: Counter, failures: list[dict], elapsed: float, loop_s: float,
           by_source: dict[str, Counter] | None = None, shares: dict[str, float] | None = None) -> dict:
    """The run's summary, printed to stderr and returned.

    Args:
        loop_s: the pass's wall time (the longest rank's).
        shares: where the passes' time went (`encoder_s`, `encoder_busy_fraction`, `data_wait_fraction`,
            `writer_wait_fraction`, `writer_busy_fraction`), added to the summary and printed as one line; the stage
            that bounds the run (`bound_by`) is added as `bound_by` and said with its advice on the next (when the run
            encoded anything).
    """
    manifest = Cache(cache).manifest
    in_cache = manifest.datasets()
    encoded = counts["new"] + counts["changed"]
    # each input is read once per resolution of its source: the share of inputs that failed is that of the reads
    failed_reads = counts["failed"] + counts["failed_again"]
    considered = encoded + counts["unchanged"] + failed_reads
    by_reason = Counter(f["reason"] for f in failures)
    field_bytes = dict(zip(manifest.shards.fields, (int(v) for v in manifest.shards.column("field_bytes").sum(0))))
    n = max(manifest.num_samples, 1)
    captions = manifest.captions()  # per source; several per sample: caption lists or caption variants
    summary = {
        "encoded": encoded,
        "new": counts["new"],
        "changed": counts["changed"],
        "unchanged": counts["unchanged"],
        "removed": counts["removed"],
        "kept_unreadable": counts["kept_unreadable"],
        "duplicates": counts["duplicate"],
        "failed": counts["failed"],
        "failed_by_reason": dict(sorted(by_reason.items())),
        "captions_truncated": counts["captions_truncated"],
        # changed inputs whose image was cached already (a new mask or captions): latents copied, not encoded
        "latents_reused": counts["latents_reused"],
        # captions that were not UTF-8 and were read as cp1252 / latin-1 instead (their images are cached)
        "caption_fallbacks": {k.split(":", 1)[1]: n for k, n in sorted(counts.items()) if k.startswith("caption_fallback:")},
        # of the inputs (a video's clips after its first are no input; a failed video is one)
        "failure_fraction": failed_reads / max(considered - counts["later_clips"], 1),
        "cache_samples": manifest.num_samples,
        "cache_bytes": manifest.num_bytes + (manifest.text_stats() or {}).get("bytes", 0),  # text shards too
        "generation": manifest.generation,
        "buckets": {b.name: st.samples for b, st in manifest.buckets().items()},
        "sources": {name: {"samples": in_cache.get(name, {}).get("samples", 0),
                           **({"captions": captions[name]} if name in captions else {}),
                           **{k: c[k] for k in ("new", "changed", "unchanged", "removed", "duplicate", "failed")}}
                    for name, c in (by_source or {}).items()},
        "other_sources": {name: t["samples"] for name, t in in_cache.items() if name not in (by_source or {})},
        "bytes_per_sample": {k: v / n for k, v in sorted(field_bytes.items())},
        "elapsed_s": elapsed,
        "encode_s": loop_s,  # reading, encoding and writing, without loading the encoders
        "images_per_s": encoded / loop_s if loop_s else 0.0,
        **(shares or {}),
    }
    out = sys.stderr
    clips = any(b.frames for b in manifest.buckets())
    print(f"\n{cache}: {summary['cache_samples']} samples, {summary['cache_bytes'] / 2**20:.1f} MiB, generation {manifest.generation}", file=out)
    print(f"  new {summary['new']} / changed {summary['changed']} / unchanged {summary['unchanged']} / "
          f"removed {summary['removed']}; duplicates {summary['duplicates']}", file=out)
    for name, c in summary["sources"].items():
        print(f"    source {name!r}: {c['samples']} samples; new {c['new']} / changed {c['changed']} / unchanged "
              f"{c['unchanged']} / removed {c['removed']}; duplicates {c['duplicate']}, failed {c['failed']}"
              + (f"; {c['captions'] / c['samples']:.2f} captions per sample" if c.get("captions", c["samples"]) != c["samples"] else ""),
              file=out)
    for name, n in summary["other_sources"].items():
        print(f"    source {name or '(unnamed)'!r}: {n} samples, not in this run (kept)", file=out)
    if summary["kept_unreadable"]:
        print(f"  kept {summary['kept_unreadable']} cached samples whose input could not be read or listed this time", file=out)
    print(f"  encoded {encoded} in {loop_s:.1f}s ({summary['images_per_s']:.1f} {'clips' if clips else 'images'}/s; {elapsed:.1f}s with setup); "
          f"{summary['captions_truncated']} captions truncated to the token limit", file=out)
    if shares and encoded:
        pct = {k: f"{v * 100:.0f} %" for k, v in shares.items() if k.endswith("_fraction")}
        print(f"  encoder busy {pct['encoder_busy_fraction']} of the pass; waiting on inputs {pct['data_wait_fraction']}, "
              f"on the writer {pct['writer_wait_fraction']} (the writer was busy {pct['writer_busy_fraction']} of it, in the "
              f"background)", file=out)
        summary["bound_by"] = bound_by(shares, counts["latents_reused"] / encoded)
        if summary["bound_by"] is None:
            print(f"  no bound to tell: {counts['latents_reused']} of the {encoded} samples encoded took their cached "
                  f"latents, so the encoder ran for few of them", file=out)
        else:
            print(f"  {(CLIP_ADVICE if clips else BOUND_ADVICE)[summary['bound_by']]}", file=out)
    if summary["latents_reused"]:
        print(f"  {summary['latents_reused']} of them changed only their mask or captions: their cached latents were "
              f"reused, not encoded again", file=out)
    for encoding, n in summary["caption_fallbacks"].items():
        print(f"  {n} caption file(s) were not UTF-8 and were read as {encoding}: check their text if it looks wrong", file=out)
    if failures:
        print(f"  skipped {summary['failed']} ({summary['failure_fraction']:.1%}), listed in {cache / 'failures.jsonl'}:", file=out)
        width = max([18, *map(len, by_reason)])  # the reasons' column, as wide as the longest
        for reason, k in sorted(by_reason.items()):
            print(f"    {reason:<{width}} {k:>7}  {REASONS.get(reason, '')}", file=out)
        for f in failures:
            if "samples" in f:  # a damaged tar: how many samples it stands for
                print(f"    {f['source']}: {f['detail']}", file=out)
    print(f"  buckets ({'frames x ' if clips else ''}height x width: samples):", file=out)
    for name, k in summary["buckets"].items():
        print(f"    {name:>10}: {k}", file=out)
    print("  bytes per sample: " + ", ".join(f"{k} {v:,.0f}" for k, v in summary["bytes_per_sample"].items()), file=out)
    if (refs := reference_stats(manifest)) is not None:  # an edit cache: its samples' reference images
        summary["references"] = refs
        print(f"  references: {reference_line(refs)}", file=out)
    if (texts := manifest.text_stats()) is not None:  # each distinct caption's text stored once
        summary["texts"] = texts
        saved = (f"{texts['saved']:,} bytes fewer than stored with each sample" if texts["saved"] >= 0 else
                 f"{-texts['saved']:,} bytes more than stored with each sample: its captions are all or nearly all "
                 f"distinct, --no-dedup-texts stores them with their samples")
        print(f"  texts stored once: {texts['texts']:,} for {texts['references']:,} captions, {texts['bytes']:,} bytes "
              f"({saved})", file=out)
    return summary
