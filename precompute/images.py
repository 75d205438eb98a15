"""How an input becomes a sample: captions decoded, the image decoded, bucketed, resized and cropped
deterministically (its control image, for ControlNet caches, and its loss mask, for masked training, given the same
resize and crop; an edit sample's reference images prepared as the model family's pipeline prepares them), and the
sample's content key.

`prepare` turns a `Record` (an input's bytes, from a folder or a tar) into a prepared sample or a failure
with a named reason (`precompute.inputs.REASONS`); nothing raises for bad data.
"""

from __future__ import annotations

import hashlib
import io
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from precompute.captions import TagOptions, caption_variants
from shards import Bucket, aspect_error, nearest_bucket
from shards.references import references_digest

PREPROCESSING_VERSION = 1  # bump when anything below changes the pixels or captions produced


@dataclass(frozen=True)
class ImagePolicy:
    """How images become bucket-sized pixels (`PrecomputeConfig.policy()` builds it from the run's options, which
    say what each means). Everything here but a source's caption options is part of the cache fingerprint;
    those change the captions, hence the keys, of the samples they apply to.

    Args:
        buckets: the bucket table.
        resolution: the resolution `buckets` is the table of, when the cache holds the preset's base resolution not
            alone or not at all (0: the base resolution; its samples keep the keys they always had); mixed into
            the key, so an image cached at several resolutions is a sample at each.
        max_upscale: skip images that would need more than this upscaling to cover their bucket.
        allow_upscale: never skip for size (tiny images are upscaled).
        extreme_aspect: "skip" or "clamp" images whose aspect ratio is beyond the table's range
            by more than `aspect_tolerance`.
        max_pixels: refuse images with more pixels (decompression bombs).
        aspect_tolerance: factor by which an aspect ratio may exceed the table's extremes.
        caption_prefix: put before every caption of the source (a trigger word).
        default_caption: the caption of an image that has none (otherwise skipped as missing or empty).
        flip: the source's samples also cache the latent of the horizontally flipped image.
        tags: how the source's captions become variants (`precompute.captions`); None: each as written.
        control: every image pairs with a control image (`Record.control`), resized and cropped as the image is;
            an image without one is skipped.
        clip: a video family's cache: how the source's videos become clips (a `precompute.video.ClipPolicy`: the
            frame rate, the source's frame buckets and extraction); every sample is a clip, an image a one-frame one.
            None: an image family's cache, where a video is a `video_input` failure.
        mask: the source's samples carry a loss mask, resized and cropped as the image is: "file", a grayscale image
            of the image's size (`Record.mask`; an image without one is skipped), or "alpha", the image's own alpha
            channel (an image without one is skipped); "" for none. Its bytes (or the alpha marker) join the key.
        references: the source's samples pair with reference images (`Record.references`, an edit model's inputs); a
            sample without them is skipped. Their bytes join the key.
        max_references: the preset's most reference images per sample (`Preset.references`); 0: not an edit preset.
            In an edit preset's cache every prepared sample has `reference_pixels` (empty for a source without
            references).
        prepare_reference: the family's `prepare_reference` bound to the preset: (PIL RGB image, index, count) ->
            the dict of a prepared reference (`pixels`, and `text_pixels` where the text encoder sees references).
            Runs in the loader's workers (they fork: nothing is pickled).
    """

    buckets: tuple[Bucket, ...]
    max_upscale: float
    allow_upscale: bool
    extreme_aspect: str
    max_pixels: int
    aspect_tolerance: float = 1.25
    caption_prefix: str = ""
    default_caption: str | None = None
    flip: bool = False
    tags: TagOptions | None = None
    control: bool = False
    mask: str = ""
    resolution: int = 0
    clip: object | None = None
    references: bool = False
    max_references: int = 0
    prepare_reference: Callable[..., dict] | None = None

    def fingerprint(self) -> dict:
        """The fingerprint's `buckets` part; a video family's cache adds its clips' (`clips_fingerprint`)."""
        clips = {"clips": clips_fingerprint(self.clip)} if self.clip is not None else {}
        return {
            "table": [b.name for b in self.buckets],
            "resize": "cover, bicubic, antialiased",
            "crop": "center",
            "max_upscale": None if self.allow_upscale else self.max_upscale,
            "extreme_aspect": self.extreme_aspect,
            "aspect_tolerance": self.aspect_tolerance,
            "alpha": "composited on white",
            "exif_orientation": "applied",
            "preprocessing_version": PREPROCESSING_VERSION,
            **clips,
        }


def clips_fingerprint(policy) -> dict:
    """What determines every clip's frames in a video cache, from its `ClipPolicy`: the frame rate, the frame buckets
    and how frames are extracted at them. Which clips of a video are taken (the extraction mode, the number of
    clips, a source's own frame buckets) is not here but in each clip's key, so a source may change it: its videos
    are cut again."""
    return {k: v for k, v in policy.fingerprint().items() if k not in ("extraction", "clips", "stride", "lengths")}


@dataclass
class Record:
    """One source's input: where it came from, its image bytes and raw caption candidates."""

    source: str
    image: bytes | None
    captions: list[bytes | str] = field(default_factory=list)
    missing: str | None = None  # a failure reason known before decoding
    detail: str = ""  # what went wrong, with `missing`
    control: bytes | None = None  # the control image's bytes (ControlNet caches); None: none was found or read
    control_missing: str = "missing_control"  # why `control` is None: missing_control or unreadable_control
    control_detail: str = ""  # what went wrong, or where the control image was looked for
    mask: bytes | None = None  # the loss mask image's bytes (masked training); None: none was found or read
    mask_missing: str = "missing_mask"  # why `mask` is None: missing_mask or unreadable_mask
    mask_detail: str = ""  # what went wrong, or where the mask was looked for
    video: bool = False  # named as a video (its file's or tar member's suffix): `image` holds the video's bytes
    references: list[bytes] | None = None  # an edit sample's reference images' bytes, in order; None: none found or read
    references_missing: str = "missing_reference"  # why `references` is None: missing_, unreadable_ or ambiguous_reference
    references_detail: str = ""  # what went wrong, or where the references were looked for
    reference_names: list[str] = field(default_factory=list)  # where each reference came from, for messages
    path: str | None = None  # a video file read where it lies (`precompute.clips`), `image` None: never held whole


# Marks the references' part of a key (content and latent keys); a sample without references has none.
REFERENCES_MARKER = b"\x00\x00references\x00"


# A control image may differ in size from its image, not in shape: their aspect ratios agree within this fraction.
CONTROL_ASPECT_TOLERANCE = 0.01


# Marks the loss mask's part of a key; a change of how masks are processed changes it, so every masked sample is
# processed again while the keys of samples without masks stay as they were.
MASK_MARKER = b"\x00\x00mask1\x00"


# How the containers a video comes in begin (an MP4 / MOV box `ftyp` after its size, Matroska / WebM's EBML, AVI,
# Ogg, FLV, MPEG-PS): bytes no image decoder reads, which an image model's run names a video rather than a bad image.
def looks_like_video(data: bytes) -> bool:
    """Whether bytes are a video container by their first bytes (an animated GIF or WebP is an image here)."""
    head = bytes(data[:12])
    return (head[4:8] == b"ftyp" or head.startswith((b"\x1a\x45\xdf\xa3", b"OggS", b"FLV", b"\x00\x00\x01\xba"))
            or head[:4] == b"RIFF" and head[8:12] == b"AVI ")


def video_presets() -> list[str]:
    """The presets whose family caches clips, as messages list them."""
    from precompute import families
    from precompute.presets import get_preset, preset_names

    return [name for name in preset_names() if families.family(get_preset(name).family).video]


def video_refused() -> str:
    """Why a video input is skipped by a run whose model takes images: the presets that take video."""
    return (f"a video, and this model takes images; cache it with a video model's preset ({', '.join(video_presets())}), "
            f"into a cache of its own")


def content_key(image, captions: list[str], flip: bool = False, control: bytes | None = None,
                mask: bytes | None = None, alpha_mask: bool = False, resolution: int = 0,
                references: list[bytes] | None = None) -> str:
    """A sample's key: sha256 of the image bytes and every caption, whether its flipped view is cached too, the
    control image's bytes when it has one, its loss mask: the mask image's bytes, or that it is the image's alpha
    channel, and the resolution it is cached at unless that is the base one (0) (a caption never holds NUL, so the
    markers cannot be a caption) and, for an edit sample, its reference images' bytes in order. A sample without
    control image, mask or references at the base resolution has the key it had before any of them existed. `image`:
    the bytes, or a sha256 object that has hashed them (not changed here)."""
    h = hashlib.sha256(image) if isinstance(image, (bytes, bytearray, memoryview)) else image.copy()
    for c in captions:
        h.update(b"\x00" + c.encode("utf-8"))
    if flip:
        h.update(b"\x00\x00flip")
    if control is not None:
        h.update(b"\x00\x00control\x00" + hashlib.sha256(control).digest())
    if mask is not None:
        h.update(MASK_MARKER + hashlib.sha256(mask).digest())
    elif alpha_mask:
        h.update(MASK_MARKER + b"alpha")
    if resolution:
        h.update(b"\x00\x00resolution\x00%d" % resolution)
    if references:
        h.update(REFERENCES_MARKER + references_digest(references))
    return h.hexdigest()


def latent_key(image: bytes, flip: bool = False, control: bytes | None = None, resolution: int = 0,
               references: list[bytes] | None = None) -> bytes:
    """What a sample's latent fields are computed from besides the cache's fingerprint: blake2b-128 of the image's
    bytes, whether its flipped view is cached, its control image's bytes, the resolution whose table buckets it
    unless that is the base one, and an edit sample's reference images' bytes (`shards.LATENT_KEY`)."""
    h = hashlib.blake2b(image, digest_size=16)
    h.update(b"\x00flip" if flip else b"\x00")
    if control is not None:
        h.update(b"\x00control\x00" + hashlib.sha256(control).digest())
    if resolution:
        h.update(b"\x00resolution\x00%d" % resolution)
    if references:
        h.update(REFERENCES_MARKER + references_digest(references))
    return h.digest()


def decode_caption(c: bytes | str) -> tuple[str, str | None]:
    """One caption candidate as text, and the fallback encoding it was read in (None: UTF-8, or already text).

    Caption files of scraped sets are often cp1252 (Windows) or latin-1: they are read as such rather than
    skipped. UTF-8 is tried first and reads as before, so no cached sample changes its key.

    Raises:
        UnicodeError: a str holding lone surrogates (from JSON), which `content_key` could not encode.
    """
    if isinstance(c, str):
        c.encode("utf-8")
        return c, None
    try:
        return c.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    try:
        return c.decode("cp1252"), "cp1252"
    except UnicodeDecodeError:  # cp1252 leaves 0x81, 0x8D, 0x8F, 0x90 and 0x9D undefined
        return c.decode("latin-1"), "latin-1"  # which maps every byte


def read_captions(raw: list[bytes | str]) -> tuple[list[str] | None, str | None, str | None]:
    """Caption candidates as stripped text, empty ones dropped.

    Returns:
        (captions, None, fallback) where `fallback` names the encoding the first caption that is not UTF-8 was
        read in ("cp1252", else "latin-1"; None when all are UTF-8), or (None, reason, None) when there is no usable
        caption or one is malformed.
    """
    if not raw:
        return None, "missing_caption", None
    out, fallback = [], None
    for c in raw:
        try:
            c, encoding = decode_caption(c)
        except UnicodeError:
            return None, "caption_not_utf8", None
        if "\x00" in c:  # content_key separates captions with NUL: ["a\0b"] and ["a", "b"] would share a key
            return None, "caption_nul", None
        c = c.removeprefix("\ufeff").strip()  # a byte order mark from a Windows editor is not text
        if c:
            out.append(c)
            fallback = fallback or encoding
    return (out, None, fallback) if out else (None, "empty_caption", None)


def decode_captions(raw: list[bytes | str]) -> tuple[list[str] | None, str | None]:
    """`read_captions` without the fallback encoding: (captions, None) or (None, reason)."""
    captions, reason, _ = read_captions(raw)
    return captions, reason


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode to 8-bit RGB: EXIF rotation applied, alpha composited on white, 16-bit scaled."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        return Image.fromarray(np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def allow_pixels(max_pixels: int) -> None:
    """Let Pillow open images of up to `max_pixels`, so that the run's limit is the one that decides.

    Pillow's decompression-bomb guard (`Image.MAX_IMAGE_PIXELS`: a warning above it, an error above twice it)
    would otherwise refuse a 100-megapixel photo that --max-pixels allows. The guard is one value per process,
    so it is only ever raised, under a lock: a thread deciding with a lower limit keeps its own check in
    `decode_image`, and Pillow's warning (an error there) still stops anything above every limit in use.
    """
    with _PILLOW_GUARD:
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
            Image.MAX_IMAGE_PIXELS = max_pixels


_PILLOW_GUARD = threading.Lock()


def to_gray(img: Image.Image) -> Image.Image:
    """A mask image as 8-bit grayscale: as `to_rgb` reads it (EXIF rotation, transparency on white, 16-bit scaled),
    then its luminance."""
    return to_rgb(img).convert("L")


def alpha_channel(img: Image.Image) -> Image.Image | None:
    """An image's alpha channel as 8-bit grayscale, EXIF rotation applied (a palette's or tRNS transparency too);
    None when it has none."""
    img = ImageOps.exif_transpose(img)
    if "transparency" in img.info or img.mode in ("PA", "La", "RGBa"):
        img = img.convert("RGBA")
    return img.getchannel("A") if "A" in img.getbands() else None


def decode_image(data: bytes, max_pixels: int, convert=None):
    """Image bytes as 8-bit RGB (`to_rgb`; another `convert` of the loaded image: what it returns), or (None,
    reason, detail): not_an_image, too_many_pixels or corrupt_image. Images of more than `max_pixels` are refused
    from their header, before any pixel is decoded."""
    allow_pixels(max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the header's size is checked below
            img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:
            return None, "too_many_pixels", f"{w}x{h} = {w * h} pixels, over the limit of {max_pixels} (--max-pixels)"
        with warnings.catch_warnings():
            # Pillow's guard is at or above max_pixels now: its warning (a frame or tile over it) refuses the image
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
            return (convert or to_rgb)(img), None, ""
    except UnidentifiedImageError:  # its message names the buffer object, whose address changes from run to run
        return None, "not_an_image", "UnidentifiedImageError: the bytes are in no image format Pillow reads"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return None, "too_many_pixels", f"{e} (--max-pixels {max_pixels})"
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        return None, "corrupt_image", f"{type(e).__name__}: {OBJECT_REPR.sub('the image', str(e))}"


# an object's default repr (`<_io.BytesIO object at 0x7f...>`): a failure's detail is the same from run to run without it
OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def prepare(record: Record, policy: ImagePolicy, skip_keys: frozenset[str] | set[str] = frozenset()) -> dict:
    """Turn a record into a prepared sample, an `unchanged` marker, or a failure.

    Returns:
        A dict with `status` ("ok", "unchanged" or "failed") and `source`; "ok" adds `key`, `bucket`,
        `pixels` (3, H, W) uint8, `captions` (after the prefix; with `policy.tags`, every caption's variants),
        `original_size` (h, w), `crop` (top, left, h, w), with
        `policy.control` `control_pixels` (3, H, W) uint8 (the control image resized and cropped as the image),
        with `policy.mask` `mask_pixels` (1, H, W) uint8 (the loss mask, resized and cropped as the image), `latent_key`
        (`latent_key`'s bytes) and, when a caption was not UTF-8, `caption_fallback` (the encoding it was read in, "cp1252" or
        "latin-1"); with `policy.max_references` (an edit preset's cache) `reference_pixels`, the list (in reference
        order) of what `policy.prepare_reference` made of each reference (empty for a source without references),
        and for a sample with references `reference_digest` (`shards.references.references_digest` of their bytes);
        "unchanged" adds `key`; "failed" adds `reason` and `detail`.
    """
    def failed(reason: str, detail: str = "") -> dict:
        return {"status": "failed", "source": record.source, "reason": reason, "detail": detail}

    if record.missing:
        return failed(record.missing, record.detail)
    if not record.image and record.path is None:
        return failed("empty_file")
    if record.video or looks_like_video(record.image):
        return failed("video_input", video_refused())
    captions, reason, fallback = read_captions(record.captions)
    if reason in ("missing_caption", "empty_caption") and policy.default_caption:
        captions, reason = [policy.default_caption], None
    if reason:
        return failed(reason)
    if policy.control and record.control is None:
        return failed(record.control_missing, record.control_detail)
    if policy.control and not record.control:
        return failed("corrupt_control", "zero-byte control image")
    if policy.mask == "file" and record.mask is None:
        return failed(record.mask_missing, record.mask_detail)
    if policy.mask == "file" and not record.mask:
        return failed("corrupt_mask", "zero-byte mask")
    references = record.references if policy.references else None
    if policy.references:
        if not references:  # none found (an empty list of them too)
            return failed(record.references_missing, record.references_detail)
        if len(references) > policy.max_references:
            names = ", ".join(record.reference_names)
            return failed("too_many_references", f"{len(references)} reference images ({names}), more than the "
                                                 f"{policy.max_references} the model takes")
        if not all(references):
            i = next(i for i, r in enumerate(references) if not r)
            return failed("corrupt_reference", f"{reference_name(record, i)}: zero-byte file")
    # the image's bytes seed the variants: the same input gives the same captions, hence the same key, on every run
    image_hash = hashlib.sha256(record.image)
    captions = caption_variants(captions, policy.tags, policy.caption_prefix, image_hash.digest())
    key = content_key(image_hash, captions, policy.flip, record.control if policy.control else None,
                      record.mask if policy.mask == "file" else None, alpha_mask=policy.mask == "alpha",
                      resolution=policy.resolution, references=references)
    if key in skip_keys:
        return {"status": "unchanged", "source": record.source, "key": key}
    mask = None
    if policy.mask == "alpha":  # the alpha channel, read before it is composited on white
        decoded, reason, detail = decode_image(record.image, policy.max_pixels, lambda im: (to_rgb(im), alpha_channel(im)))
        img, mask = decoded if decoded is not None else (None, None)
        if img is not None and mask is None:
            return failed("missing_mask", f"the image ({img.mode}) has no alpha channel to take the loss mask from (--alpha-mask)")
    else:
        img, reason, detail = decode_image(record.image, policy.max_pixels)
    if img is None:
        return failed(reason, detail)
    if policy.mask == "file":
        mask, reason, detail = decode_image(record.mask, policy.max_pixels, to_gray)
        if mask is None:
            return failed("corrupt_mask", f"mask: {reason}: {detail}")
        if mask.size != img.size:  # a mask marks the image's own pixels: one of another size marks something else
            return failed("mask_size", f"mask {mask.width}x{mask.height}, image {img.width}x{img.height} (width x height, "
                                       f"after EXIF rotation): a mask must have its image's size")
    control = None
    if policy.control:
        control, reason, detail = decode_image(record.control, policy.max_pixels)
        if control is None:
            return failed("corrupt_control", f"control image: {reason}: {detail}")
    prepared = []  # each reference as the family's pipeline prepares an image it is given
    for i, data in enumerate(references or ()):
        ref, reason, detail = decode_image(data, policy.max_pixels)
        if ref is None:
            return failed("corrupt_reference", f"{reference_name(record, i)}: {reason}: {detail}")
        try:
            prepared.append(policy.prepare_reference(ref, i, len(references)))
        except ValueError as e:  # the family's pipeline cannot take it (a reference smaller than a token, say)
            return failed("unusable_reference", f"{reference_name(record, i)}: {e}")

    h, w = img.height, img.width
    bucket, reason, detail = choose_bucket(h, w, policy)
    if bucket is None:
        return failed(reason, detail)
    if control is not None and control.size != img.size:
        # another size of the same picture (a depth map at half resolution): the same shape within 1 %
        ratio = (control.width / control.height) / (w / h)
        if max(ratio, 1 / ratio) - 1 > CONTROL_ASPECT_TOLERANCE:
            return failed("control_aspect", f"control image {control.width}x{control.height}, image {w}x{h} (width x height)")
    # cover the bucket, then center-crop; a control image is resized to the same size and cropped with the same box
    rw, rh, top, left = crop_box(h, w, bucket)
    box = (left, top, left + bucket.width, top + bucket.height)
    pixels = as_pixels(img.resize((rw, rh), Image.BICUBIC).crop(box))
    if control is not None:
        control = as_pixels(control.resize((rw, rh), Image.BICUBIC).crop(box))
    if mask is not None:
        mask = torch.from_numpy(np.asarray(mask.resize((rw, rh), Image.BICUBIC).crop(box), dtype=np.uint8).copy())[None]
    return {
        "status": "ok",
        "source": record.source,
        "key": key,
        "bucket": bucket,
        "pixels": pixels,
        "captions": captions,
        "original_size": (h, w),
        "crop": (top, left, bucket.height, bucket.width),
        **({"control_pixels": control} if control is not None else {}),
        **({"mask_pixels": mask} if mask is not None else {}),
        "latent_key": latent_key(record.image, policy.flip, record.control if policy.control else None, policy.resolution,
                                 references),
        **({"reference_pixels": prepared} if policy.max_references else {}),
        **({"reference_digest": references_digest(references)} if references else {}),
        **({"caption_fallback": fallback} if fallback else {}),
    }


def reference_name(record: Record, index: int) -> str:
    """How a message names reference `index` of a record: its file or member when known."""
    count = len(record.references or ())
    where = f" ({record.reference_names[index]})" if index < len(record.reference_names) else ""
    return f"reference {index + 1} of {count}{where}"


def choose_bucket(h: int, w: int, policy: ImagePolicy) -> tuple[Bucket | None, str | None, str]:
    """The bucket of a picture of h x w pixels (an image, or a video's frames), or (None, reason, detail) when it is
    beyond the table's aspect ratios (`extreme_aspect`, unless clamped) or would need more upscaling than allowed
    (`too_small`)."""
    bucket = nearest_bucket(h, w, policy.buckets)
    extremes = (policy.buckets[0], policy.buckets[-1]) if len(policy.buckets) > 1 else (bucket,)
    if bucket in extremes and aspect_error(h, w, bucket) > policy.aspect_tolerance and policy.extreme_aspect == "skip":
        return None, "extreme_aspect", f"{w}x{h} (width x height)"
    scale = max(bucket.height / h, bucket.width / w)
    if scale > policy.max_upscale and not policy.allow_upscale:
        return None, "too_small", f"{w}x{h} needs {scale:.2f}x upscaling for bucket {bucket}"
    return bucket, None, ""


def crop_box(h: int, w: int, bucket: Bucket) -> tuple[int, int, int, int]:
    """(resized width, resized height, top, left): a picture of h x w resized to cover `bucket`, then center-cropped
    to it from (top, left)."""
    scale = max(bucket.height / h, bucket.width / w)
    rw, rh = max(bucket.width, round(w * scale)), max(bucket.height, round(h * scale))
    return rw, rh, (rh - bucket.height) // 2, (rw - bucket.width) // 2


def as_pixels(img: Image.Image) -> torch.Tensor:
    """An RGB image as (3, H, W) uint8."""
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
