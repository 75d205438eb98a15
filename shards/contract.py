"""What a cache means to the model that trains from it: a typed view of the fingerprint and of stage one's record.

Stage one builds these specs and writes them into the manifest (`LatentSpec.fingerprint()` and
`TextSpec.fingerprint()` are parts of the fingerprint; `CacheSpec.record()` is the manifest's
`extra["precompute"]`); stage two reads them back with `CacheSpec.of(manifest)` and never looks up a
fingerprint key itself. The JSON these produce is exactly what caches of format version 2 hold, so a
cache written before these classes existed reads the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from shards.buckets import Bucket
from shards.schema import FormatError

TextLayoutKind = Literal["masked", "sd3_joint", "flux", "padded"]
# The horizontally flipped image's latent fields are the latent fields' names with this prefix, ragged: one row
# for a sample of a source cached with `flip = true`, none for the others (8 bytes of offsets each).
FLIP_PREFIX = "flip_"
# The control image's latent fields (ControlNet training) are the latent fields' names with this prefix, stacked
# like the latent: every sample of a cache built with control images has one. Their presence is in the fingerprint
# (`control`), so a cache with control latents never extends one without, nor the other way round.
CONTROL_PREFIX = "control_"
# A sample's loss mask (masked training): a single channel at latent resolution, uint8 (255: the latent cell's pixels
# all kept, 0: none), ragged with one row (1, h, w) for a sample of a source cached with masks and none for the others.
# Each cell is the area average of the mask resized and cropped as the image was.
MASK = "mask"
# blake2b-128 of what a sample's latent fields are computed from besides the fingerprint (the image's bytes, whether
# its flipped view is cached, its control image's bytes), (16,) uint8: a re-run finds a changed input whose image did
# not change (a new mask, new captions) and copies the latent fields instead of running the VAE again.
LATENT_KEY = "latent_key"


@dataclass(frozen=True)
class DecoderRecipe:
    """How stage two rebuilds the VAE's decoder: its class, where its weights are, and the latent scaling.

    `in_cache`: the weights exist nowhere else (tiny presets) and were stored in the cache under `source`.
    `latents_mean` / `latents_std`: the per-channel normalisation the latents were stored with (see `LatentSpec`),
    undone before decoding instead of the scaling and shift. `frame_axis`: the VAE takes and returns video,
    (B, C, T, H, W); the cache holds one frame without that axis. `patch`: the stored latent holds the VAE latent's
    `patch` x `patch` patches folded into its channels, channel-major ((c, i, j) -> c * patch^2 + i * patch + j, as
    Flux2-style pipelines patchify), unfolded after the normalisation is undone; 1: the VAE's latent as it is."""

    vae_class: str
    source: str
    scaling_factor: float
    shift_factor: float
    subfolder: str | None = None
    revision: str | None = None
    in_cache: bool = False
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    frame_axis: bool = False
    patch: int = 1

    def __post_init__(self) -> None:
        _check_channel_stats(self.latents_mean, self.latents_std, "decoder recipe")
        if self.patch < 1:
            raise FormatError(f"the decoder recipe's patch must be 1 or more; got {self.patch!r}")

    def to_json(self) -> dict:
        out = {"class": self.vae_class, "scaling_factor": self.scaling_factor, "shift_factor": self.shift_factor,
               "source": self.source, "subfolder": self.subfolder, "revision": self.revision}
        if self.in_cache:
            out["in_cache"] = True
        # keys written only when set: the recipes of caches without them read and write back byte for byte
        if self.latents_mean is not None:
            out.update(latents_mean=list(self.latents_mean), latents_std=list(self.latents_std))
        if self.frame_axis:
            out["frame_axis"] = True
        if self.patch > 1:
            out["patch"] = self.patch
        return out

    @classmethod
    def from_json(cls, data: dict) -> DecoderRecipe:
        mean, std = data.get("latents_mean"), data.get("latents_std")
        return cls(data["class"], data["source"], data["scaling_factor"], data["shift_factor"], data.get("subfolder"),
                   data.get("revision"), bool(data.get("in_cache")), None if mean is None else tuple(mean),
                   None if std is None else tuple(std), bool(data.get("frame_axis")), int(data.get("patch", 1)))

    def located(self, root: Path) -> DecoderRecipe:
        """The recipe with weights stored in the cache at `root` given by their full path."""
        if not self.in_cache:
            return self
        return replace(self, source=str(Path(root) / self.source))


@dataclass(frozen=True)
class LatentSpec:
    """The cached latents: `channels` x (H / `downsample`) x (W / `downsample`), stored as
    (z - shift_factor) * scaling_factor, or, for a VAE normalised per channel (`latents_mean` and `latents_std`,
    one value per channel, as its pipeline applies them), as (z - latents_mean[c]) * (1 / latents_std[c]). A KL
    VAE's posterior is stored as `latent_mean` + `latent_std` (training samples a fresh latent every draw); a
    deterministic one's (DC-AE) as `latent`.

    `temporal_downsample`: 0 for a cache of images (latents (C, h, w)); for a video VAE's cache of clips, pixel frames
    per latent frame after the first: a clip of F frames is stored (C, (F - 1) // temporal_downsample + 1, h, w)."""

    channels: int
    downsample: int
    scaling_factor: float
    shift_factor: float
    posterior: Literal["mean_std", "deterministic"]
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    temporal_downsample: int = 0

    def __post_init__(self) -> None:
        _check_channel_stats(self.latents_mean, self.latents_std, "latent spec", self.channels)

    @property
    def stored(self) -> str:
        """How the cached latent derives from the VAE's latent z, as the fingerprint says it."""
        if self.latents_mean is not None:
            return "(z - latents_mean[c]) * (1 / latents_std[c])"
        return "(z - shift_factor) * scaling_factor"

    @property
    def fields(self) -> tuple[str, ...]:
        return ("latent_mean", "latent_std") if self.posterior == "mean_std" else ("latent",)

    @property
    def flipped_fields(self) -> tuple[str, ...]:
        """The fields of the flipped image's latent (`FLIP_PREFIX`), present in caches written since they exist."""
        return tuple(FLIP_PREFIX + name for name in self.fields)

    @property
    def control_fields(self) -> tuple[str, ...]:
        """The fields of the control image's latent (`CONTROL_PREFIX`), encoded like the image's: same VAE, same
        resize and crop, the posterior's mean and std for a KL VAE (a fresh draw each step, as the stock SD3
        ControlNet pipeline samples `latent_dist`), the latent itself for DC-AE."""
        return tuple(CONTROL_PREFIX + name for name in self.fields)

    def control_fingerprint(self) -> dict:
        """The fingerprint's `control` part, written by stage one into a cache that holds control latents."""
        return {"fields": list(self.control_fields), "image": "the training image's bucket, resize and crop",
                "encoder": "the cache's VAE", "stored": self.stored}

    def shape(self, height: int, width: int, frames: int = 0) -> tuple[int, ...]:
        """The latent's shape for a bucket of `height` x `width` pixels (and `frames` frames, for a clip)."""
        spatial = (height // self.downsample, width // self.downsample)
        return (self.channels, self.latent_frames(frames), *spatial) if frames else (self.channels, *spatial)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of `frames` pixel frames (the first alone, then one per `temporal_downsample`)."""
        if not self.temporal_downsample:
            raise ValueError("this cache holds images: its latents have no frame axis")
        return (frames - 1) // self.temporal_downsample + 1

    def fingerprint(self) -> dict:
        """The fingerprint's `vae` entries this spec owns (stage one adds the VAE's identity beside them)."""
        out = {"scaling_factor": self.scaling_factor, "shift_factor": self.shift_factor, "latent_channels": self.channels,
               "downsample": self.downsample, "posterior": self.posterior, "stored": self.stored}
        if self.latents_mean is not None:  # absent otherwise: the fingerprints of caches without them do not change
            out.update(latents_mean=list(self.latents_mean), latents_std=list(self.latents_std))
        if self.temporal_downsample:  # likewise: written by caches of clips only
            out["temporal_downsample"] = self.temporal_downsample
        return out

    @classmethod
    def from_fingerprint(cls, vae: dict) -> LatentSpec:
        mean, std = vae.get("latents_mean"), vae.get("latents_std")
        return cls(vae["latent_channels"], vae["downsample"], vae.get("scaling_factor", 1.0), vae.get("shift_factor", 0.0),
                   vae.get("posterior", "deterministic"), None if mean is None else tuple(mean),
                   None if std is None else tuple(std), int(vae.get("temporal_downsample", 0)))


def _check_channel_stats(mean, std, what: str, channels: int | None = None) -> None:
    """Per-channel mean and std come together, one finite value per channel, the std above 0."""
    if mean is None and std is None:
        return
    if mean is None or std is None or len(mean) != len(std) or (channels is not None and len(mean) != channels):
        raise FormatError(f"the {what}'s latents_mean and latents_std must both hold one value per latent channel "
                          f"({channels if channels is not None else 'as many'}); got {mean!r} and {std!r}")
    if not all(math.isfinite(m) for m in mean) or not all(math.isfinite(s) and s > 0 for s in std):
        raise FormatError(f"the {what}'s latents_mean must be finite and its latents_std finite and above 0; got {mean!r} "
                          f"and {std!r}")


@dataclass(frozen=True)
class TextSpec:
    """The cached text and how it becomes the transformer's text input.

    "masked" (PixArt, Sana): one `text` field of valid tokens per caption (up to `max_tokens`, `width` wide),
    padded per batch with a mask. "sd3_joint": per caption `clip` (`clip_tokens`, `clip_width`), `pooled`
    (`pooled_width`,) and, unless T5 was dropped, `text` (`t5_tokens`, `t5_width`); the model input is
    cat(pad(clip, to the joint width), T5 tokens) as StableDiffusion3Pipeline builds it, with `t5_tokens`
    zero tokens in T5's place when it was dropped. "flux" (Flux.1): per caption `text`, every one of the `t5_tokens`
    T5 tokens padding included (`t5_width` wide; Flux attends to the padding without a mask, so it is part of the
    input), and `pooled` (`pooled_width`,), CLIP-L's pooled output; the text ids are zeros, as FluxPipeline builds them.
    "padded" (Wan): one `text` field of valid tokens per caption, as "masked" stores it; the transformer's input is each
    caption zero-filled to `max_tokens`, without a mask, as the pipeline's `encode_prompt` zero-fills past a caption's
    length (so the rebuild is exact)."""

    layout: TextLayoutKind
    width: int | None
    max_tokens: int
    clip_tokens: int = 0
    t5_tokens: int = 0
    t5_stored: bool = True
    clip_width: int | None = None
    pooled_width: int | None = None
    t5_width: int | None = None

    @property
    def tokens(self) -> int:
        """The most text tokens one sample feeds the transformer."""
        return self.clip_tokens + self.t5_tokens if self.layout == "sd3_joint" else self.max_tokens

    @property
    def t5_zeros(self) -> int:
        """Zero tokens standing in for a dropped T5 (0 when T5 is stored or the layout has none)."""
        return self.t5_tokens if self.layout == "sd3_joint" and not self.t5_stored else 0

    def fingerprint(self) -> dict:
        """The fingerprint's `text_encoder` entries this spec owns."""
        out: dict = {"hidden_size": self.width, "max_length": self.max_tokens}
        if self.layout == "sd3_joint":
            out["layout"] = {"kind": "sd3_joint", "clip_tokens": self.clip_tokens, "t5_tokens": self.t5_tokens,
                             "t5": "stored" if self.t5_stored else "dropped", "clip_width": self.clip_width,
                             "pooled_width": self.pooled_width, "t5_width": self.t5_width}
        elif self.layout == "flux":
            out["layout"] = {"kind": "flux", "t5_tokens": self.t5_tokens, "pooled_width": self.pooled_width,
                             "t5_width": self.t5_width}
        elif self.layout == "padded":
            out["layout"] = {"kind": "padded"}
        return out

    @classmethod
    def from_fingerprint(cls, text: dict) -> TextSpec:
        layout = text.get("layout") or {"kind": "masked"}
        if layout["kind"] == "masked":
            return cls("masked", text.get("hidden_size"), text["max_length"])
        if layout["kind"] == "padded":
            return cls("padded", text.get("hidden_size"), text["max_length"])
        if layout["kind"] == "flux":
            return cls("flux", text.get("hidden_size"), text["max_length"], t5_tokens=layout["t5_tokens"],
                       pooled_width=layout["pooled_width"], t5_width=layout["t5_width"])
        if layout["kind"] != "sd3_joint":
            raise FormatError(f"unknown text layout {layout['kind']!r}: this cache was written by a newer version; update")
        return cls("sd3_joint", text.get("hidden_size"), text["max_length"], layout["clip_tokens"], layout["t5_tokens"],
                   layout.get("t5") != "dropped", layout["clip_width"], layout["pooled_width"], layout.get("t5_width"))


@dataclass(frozen=True)
class CacheSpec:
    """Everything stage two needs to know about a cache's values, read from its manifest."""

    latent: LatentSpec
    text: TextSpec
    family: str | None = None  # "sana", "pixart", "sd3"; None in caches written without stage one's record
    preset: str | None = None
    base_resolution: int | None = None
    decoder: DecoderRecipe | None = None
    extra: dict = field(default_factory=dict, compare=False)  # the rest of stage one's record, untyped
    control: dict | None = None  # the fingerprint's `control` part: the cache holds control latents (ControlNet)
    # the bucket table of every resolution the cache was built at, when one is not `base_resolution` (None: the cache
    # holds that one alone, on the fingerprint's table)
    tables: dict[int, tuple[Bucket, ...]] | None = None

    def record(self) -> dict:
        """Stage one's record in the manifest's `extra["precompute"]` (keys in the order caches have held them)."""
        tables = {"resolutions": {str(r): [b.name for b in t] for r, t in sorted(self.tables.items())}} if self.tables else {}
        return {"preset": self.preset, "family": self.family, **self.extra, "base_resolution": self.base_resolution,
                **tables, **({"decoder": self.decoder.to_json()} if self.decoder else {})}

    def resolution(self, tag: int) -> int | None:
        """The resolution of a shard (`ShardEntry.resolution`; 0: the base resolution, None if unknown)."""
        return tag or self.base_resolution

    def resolutions(self) -> list[int]:
        """The resolutions the cache was built at (its base resolution alone unless stage one recorded others)."""
        if self.tables:
            return sorted(self.tables)
        return [self.base_resolution] if self.base_resolution else []

    @classmethod
    def of(cls, manifest, root: Path | str = "") -> CacheSpec:
        """The spec of a manifest (`shards.Manifest`); a cache not written by this product's stage one is refused,
        naming the missing fields."""
        fp = manifest.fingerprint
        absent = [part for part in ("vae", "text_encoder") if not isinstance(fp.get(part), dict)]
        absent += [f"vae.{key}" for key in ("latent_channels", "downsample") if "vae" not in absent and key not in fp["vae"]]
        absent += [f"text_encoder.{key}" for key in ("max_length",) if "text_encoder" not in absent and key not in fp["text_encoder"]]
        if absent:
            raise FormatError(f"the cache {root} was not built by this product's stage one (its fingerprint has no "
                              f"{', '.join(absent)}); build one with make precompute DATA=...")
        record = dict(manifest.extra.get("precompute") or {})
        decoder = record.pop("decoder", None)
        try:
            tables = {int(r): tuple(Bucket.parse(b) for b in names) for r, names in record.pop("resolutions", {}).items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise FormatError(f"the cache {root}: stage one's record of its resolutions cannot be read ({e}); re-run stage "
                              f"one on it") from None
        return cls(LatentSpec.from_fingerprint(fp["vae"]), TextSpec.from_fingerprint(fp["text_encoder"]), record.pop("family", None),
                   record.pop("preset", None), record.pop("base_resolution", None),
                   DecoderRecipe.from_json(decoder) if decoder else None, record, fp.get("control") or None, tables or None)
