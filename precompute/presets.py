"""Presets: which VAE and text encoder a cache is built with, looked up by name in the families' registry.

Stage two has presets of the same names for the transformer it trains. Real presets load
published weights with `from_pretrained` (a Hub id or a local directory in the diffusers layout);
`tiny-*` presets build the same classes from small configs with seeded random weights, so the
whole path runs offline on a CPU in seconds.
"""

from __future__ import annotations

import hashlib

import torch

from precompute import families
from precompute.families.base import Preset, TextEncoderSpec


def real_first(names: list[str]) -> list[str]:
    """Published models before the tiny ones, each group in the registry's order."""
    return [n for n in names if not n.startswith("tiny-")] + [n for n in names if n.startswith("tiny-")]


def preset_names() -> list[str]:
    """Every preset's name, as --help and the errors list them."""
    return real_first([name for f in families.FAMILIES for name in f.presets()])


def text_encoder_names() -> list[str]:
    """Every text encoder `--text-encoder` may name."""
    return real_first([name for f in families.FAMILIES for name in f.text_encoders()])


def get_preset(name: str) -> Preset:
    for f in families.FAMILIES:
        if name in (presets := f.presets()):
            return presets[name]
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())}")


def get_text_encoder(name: str) -> TextEncoderSpec:
    for f in families.FAMILIES:
        if name in (encoders := f.text_encoders()):
            return encoders[name]
    raise ValueError(f"unknown text encoder {name!r}; choose one of {', '.join(text_encoder_names())}")


def save_tiny(preset: Preset, directory) -> None:
    """Write a tiny preset's components in the diffusers layout, to load back with `from_pretrained` (--pretrained)."""
    families.family(preset.family).save_tiny_vae(preset.vae, str(directory))
    families.family(preset.text.family).save_tiny_text(preset.text, str(directory))


def weights_digest(module: torch.nn.Module, samples: int = 4096) -> str:
    """A cheap digest of a module's weights: names, shapes, dtypes and evenly spaced values.

    Hashing every byte of a large text encoder would cost tens of seconds per run; any two distinct checkpoints
    differ at sampled positions, which is what the fingerprint needs.
    """
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        picked = flat[::step][:samples].to("cpu", torch.float64)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(picked.numpy().tobytes())
    return h.hexdigest()
