"""Inputs of a video family's cache: every sample is a clip. A video becomes the clips its source's `ClipPolicy` takes
(`precompute.video.read_clips`), each resized and cropped to its bucket as an image is; an image is a one-frame clip.

An input of N clips is N samples that share the input's name (`source`) and stamp, so they are kept, skipped or
encoded again together:
- a clip's key is the input's content key, the source's clip choices (extraction, number of clips, frame buckets),
  the clip's index and the input's number of clips N: the keys of an unchanged input's clips can be named without
  decoding it, and a run killed after writing some of an input's clips finds the set incomplete and decodes it;
- every clip is stamped `clip_stamp(input stamp, N)`: an input is unchanged without being read when each of its
  cached clips has the stamp its count gives (`cached_unchanged`).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator

from PIL import Image

from precompute import video
from precompute.captions import caption_variants
from precompute.images import ImagePolicy, Record, choose_bucket, content_key, crop_box, prepare, read_captions
from precompute.paths import os_reason, stat_regular
from precompute.video_readers import VideoFile, open_source

# Marks the clip part of a key or latent key; a change of how clips are cut changes it.
CLIP_MARKER = b"\x00\x00clip1\x00"

HASH_CHUNK = 1 << 20  # a video file is hashed in reads of this many bytes, never held whole

CLIP = "clip"  # a clip sample's field: (index, first frame, frames), frames counted at the family's frame rate

# An input's cached clips as a dataset compares them: ((key, stamp), ...), stamps without the source's salt.
Cached = tuple[tuple[str, int], ...]


def clip_choice(policy) -> bytes:
    """What of a `ClipPolicy` chooses a video's clips (and is no part of the fingerprint): the extraction, the number
    of clips of "uniform", the stride of "slide", the lengths when "each", and the frame buckets, with the frame rate
    they count frames at (a choice without stride or lengths is written as before they existed)."""
    clips = f"\0{policy.clips}" if policy.extraction == "uniform" else ""
    stride = f"\0stride {policy.stride}" if policy.extraction == "slide" else ""
    lengths = f"\0{policy.lengths}" if policy.lengths != "longest" else ""
    buckets = ",".join(str(b) for b in policy.frame_buckets)
    return f"{policy.extraction}{clips}{stride}{lengths}\0{buckets}\0{policy.frame_rate!r}".encode()


def clip_key(base: str, choice: bytes, index: int, count: int) -> str:
    """The key of clip `index` of an input cut into `count` clips by `choice` (`clip_choice`), whose content key
    (bytes, captions, resolution) is `base`."""
    h = hashlib.sha256(bytes.fromhex(base))
    h.update(CLIP_MARKER + choice + b"\0%d\0%d" % (index, count))
    return h.hexdigest()


def clip_latent_key(data, choice: bytes, index: int, count: int, resolution: int = 0) -> bytes:
    """What a clip's latent fields are computed from besides the fingerprint (`shards.LATENT_KEY`): the video's bytes
    (or a 16-byte blake2b that has hashed them, not changed here), the clip choice, which clip, and the resolution
    unless it is the base one."""
    h = hashlib.blake2b(data, digest_size=16) if isinstance(data, (bytes, bytearray, memoryview)) else data.copy()
    h.update(CLIP_MARKER + choice + b"\0%d\0%d" % (index, count))
    if resolution:
        h.update(b"\x00resolution\x00%d" % resolution)
    return h.digest()


def clip_stamp(stamp: int, count: int) -> int:
    """The stamp each of an input's `count` clips is cached with: the input's own for one clip (an image, a head
    clip), else a digest of both, so a count that differs from the cached clips' is a change. 0 (unknown) stays 0."""
    if count == 1 or not stamp:
        return stamp
    h = hashlib.blake2b(stamp.to_bytes(8, "big") + count.to_bytes(8, "big"), digest_size=8)
    return int.from_bytes(h.digest(), "big") >> 1 or 1


def cached_clips(manifest, dataset: str, resolution: int) -> dict[str, Cached]:
    """input -> its cached clips ((key, stamp), ...) of one source at one resolution, from the sample index alone."""
    out: dict[str, list] = {}
    for key, source, stamp, _, _ in manifest.samples(dataset, resolution):
        if source:
            out.setdefault(source, []).append((key, stamp))
    return {source: tuple(pairs) for source, pairs in out.items()}


def unsalted_clips(known: dict[str, Cached], salt: int) -> dict[str, Cached]:
    """`cached_clips` with the source's salt taken out of every stamp (as `precompute.inputs.unsalted`)."""
    if not salt:
        return known
    return {source: tuple((key, stamp ^ salt) for key, stamp in pairs) for source, pairs in known.items()}


def cached_unchanged(source: str, stamp: int, cached: Cached | None) -> list[dict] | None:
    """The `unchanged` items of an input whose cached clips all carry the stamp their count gives with `stamp` (its
    files' stamp now), so nothing needs reading; None otherwise (a stamp of 0 is unknown: never unchanged)."""
    if not stamp or not cached:
        return None
    expected = clip_stamp(stamp, len(cached))
    if any(s != expected for _, s in cached):
        return None
    return list(one_input(unchanged(source, key, expected) for key, _ in cached))


def one_input(items) -> Iterator[dict]:
    """An input's items, each after the first marked `inputs` 0: progress counts inputs, not clips."""
    for n, item in enumerate(items):
        yield item if n == 0 else {**item, "inputs": 0}


def unchanged(source: str, key: str, stamp: int, touched: bool = False) -> dict:
    """An input's clip that is cached already; `touched`: its cached stamp is another (the file was touched, not
    changed), so the run restamps it."""
    return {"status": "unchanged", "source": source, "key": key, "stamp": stamp, **({"touched": True} if touched else {})}


def is_still_image(data: bytes) -> bool:
    """Whether bytes are an image of one frame (a photo, a still GIF / WebP / PNG), read with Pillow from its header;
    an animated GIF, WebP or APNG is a video here, and so is anything Pillow does not read."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return getattr(img, "n_frames", 1) == 1 or img.format not in ("GIF", "WEBP", "PNG")
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
        return False  # not an image (a video container), or one Pillow refuses: the video reader says which


def prepare_clips(record: Record, policy: ImagePolicy, skip_keys: frozenset[str] | set[str], stamp: int = 0,
                  cached: Cached | None = None) -> Iterator[dict]:
    """`_prepare_clips`, each item after an input's first marked (`one_input`)."""
    return one_input(_prepare_clips(record, policy, skip_keys, stamp, cached))


def _prepare_clips(record: Record, policy: ImagePolicy, skip_keys: frozenset[str] | set[str], stamp: int = 0,
                   cached: Cached | None = None) -> Iterator[dict]:
    """An input of a video family's cache as its items: a failure, or one item per clip, each "ok" (`prepare`'s fields,
    `bucket` (h, w, frames), `pixels` (3, F, H, W) uint8, `clip` (index, start, frames) at the policy's frame rate) or
    "unchanged"; each with the stamp its clips are cached with (`clip_stamp`).

    Args:
        record: the input's bytes and captions.
        policy: the source's; `policy.clip` cuts its videos.
        skip_keys: keys already cached: such a clip is "unchanged" and not prepared.
        stamp: the input's stamp (0: unknown, a tar's).
        cached: the input's cached clips: when the keys its bytes and captions give are exactly those, nothing is
            decoded (a touched file, a tar read again).
    """
    def failed(reason: str, detail: str = "") -> dict:
        return {"status": "failed", "source": record.source, "reason": reason, "detail": detail, "stamp": stamp}

    old = dict(cached or ())
    if record.missing:
        yield failed(record.missing, record.detail)
        return
    if record.path is not None:  # a video file, read where it lies
        try:
            file, before = open_video(record.path)
        except OSError as e:
            yield failed(os_reason(e), f"{type(e).__name__}: {e}")
            return
        try:
            yield from _video_clips(record, file, policy, skip_keys, stamp, old, before)
        finally:
            os.close(file.fd)
        return
    if not record.image:
        yield failed("empty_file")
        return
    if not record.video and is_still_image(record.image):  # a one-frame clip, read as images are
        item = prepare(record, policy, skip_keys)
        if item["status"] == "ok":
            item = {**item, "bucket": item["bucket"].with_frames(1), "pixels": item["pixels"][:, None], "clip": (0, 0, 1)}
        elif item["status"] == "unchanged" and old.get(item["key"], stamp) != stamp:
            item["touched"] = True
        yield {**item, "stamp": stamp}
        return
    yield from _video_clips(record, record.image, policy, skip_keys, stamp, old)


def open_video(path: str) -> tuple[VideoFile, os.stat_result]:
    """A regular file opened for `read_clips` (and its stat then); anything else raises SpecialFileError unopened."""
    stat_regular(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = stat_regular(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return VideoFile(path, fd, st.st_size), st


def hash_file(file: VideoFile) -> tuple:
    """(sha256, 16-byte blake2b) of a file's bytes, read once in chunks: what `content_key` and `clip_latent_key`
    compute from the bytes held whole."""
    sha, blake = hashlib.sha256(), hashlib.blake2b(digest_size=16)
    chunk = bytearray(HASH_CHUNK)
    view = memoryview(chunk)
    with open_source(file) as f:
        while n := f.readinto(chunk):
            sha.update(view[:n])
            blake.update(view[:n])
    return sha, blake


def _video_clips(record: Record, data, policy: ImagePolicy, skip_keys, stamp: int, old: dict,
                 before: os.stat_result | None = None) -> Iterator[dict]:
    """A video's items (`_prepare_clips`); `data` its bytes, or its file (`VideoFile`, stat'ed `before`)."""
    def failed(reason: str, detail: str = "") -> dict:
        return {"status": "failed", "source": record.source, "reason": reason, "detail": detail, "stamp": stamp}

    if not len(data):
        yield failed("empty_file")
        return
    captions, reason, fallback = read_captions(record.captions)
    if reason in ("missing_caption", "empty_caption") and policy.default_caption:
        captions, reason = [policy.default_caption], None
    if reason:
        yield failed(reason)
        return
    if isinstance(data, VideoFile):
        digest, content = hash_file(data)
    else:
        digest, content = hashlib.sha256(data), data
    captions = caption_variants(captions, policy.tags, policy.caption_prefix, digest.digest())
    base, choice = content_key(digest, captions, resolution=policy.resolution), clip_choice(policy.clip)
    if old and set(old) == {clip_key(base, choice, i, len(old)) for i in range(len(old))}:
        new = clip_stamp(stamp, len(old))  # the same bytes, captions and choice: the same clips, not decoded again
        yield from (unchanged(record.source, key, new, touched=s != new) for key, s in old.items())
        return
    clips, reason, detail = video.read_clips(data, policy.clip, policy.max_pixels)
    if before is not None:
        after = os.fstat(data.fd)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            # its key and its frames may be of different bytes: none of it is cached, and the next run reads it again
            yield failed("unreadable", f"the file changed while it was read (size {before.st_size} -> {after.st_size})")
            return
    if reason:
        yield failed(reason, detail)
        return
    _, h, w, _ = clips[0].frames.shape
    bucket, reason, detail = choose_bucket(h, w, policy)  # every clip of a video has its frames' size
    if bucket is None:
        yield failed(reason, detail)
        return
    _, _, top, left = crop_box(h, w, bucket)
    count, new = len(clips), clip_stamp(stamp, len(clips))
    for clip in clips:
        key = clip_key(base, choice, clip.index, count)
        frames, clip.frames = clip.frames, None  # each clip's frames are released once fitted
        if key in skip_keys:
            yield unchanged(record.source, key, new, touched=key in old and old[key] != new)
            continue
        yield {
            "status": "ok",
            "source": record.source,
            "key": key,
            "bucket": bucket.with_frames(len(frames)),
            "pixels": video.fit_frames(frames, bucket.height, bucket.width),  # (3, F, H, W) uint8
            "captions": captions,
            "original_size": (h, w),
            "crop": (top, left, bucket.height, bucket.width),
            "clip": (clip.index, clip.start, len(frames)),
            "latent_key": clip_latent_key(content, choice, clip.index, count, policy.resolution),
            **({"replaces": tuple(old)} if old else {}),  # the input's cached clips: one may hold this clip's latents
            "stamp": new,
            **({"caption_fallback": fallback} if fallback else {}),
        }
