"""The registry: every family stage one knows (`precompute.presets` looks presets and text encoders up in it).

Adding a family: its module in this folder (see `base.Family`) and its one line in `FAMILIES` below.
"""

from __future__ import annotations

from importlib import import_module

from precompute.families.base import Family


def load(module: str) -> Family:
    """The `FAMILY` of `precompute/families/<module>.py`."""
    return import_module(f"{__name__}.{module}").FAMILY


# In the order --help lists their presets and text encoders.
FAMILIES: tuple[Family, ...] = (
    load("pixart"),
    load("sana"),
    load("sd3"),
    load("flux"),
    load("flux2"),
    load("qwen_image"),
    load("z_image"),
    load("wan"),
)

DEFAULT_PRESET = "tiny-sana"  # what `python -m precompute` encodes with when --model is not given


def family(name: str) -> Family:
    """The family called `name` (`Preset.family`, `TextEncoderSpec.family`)."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"unknown model family {name!r}; stage one knows {', '.join(f.name for f in FAMILIES)}")
