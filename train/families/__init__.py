"""The model families stage two trains, in ONE list: adding a family is its module here and one line in `MODULES`.

Presets, the family of a cache (`CacheSpec.family`) and the reader of a cache's text layout are all looked up here."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

from train.families.base import Family, ModelPreset, TextInput

# one line per family: its module in train/families/, which defines FAMILY
MODULES = (
    "pixart",
    "sana",
    "sd3",
    "flux",
    "flux2",
    "qwen_image",
    "z_image",
    "wan",
)

FAMILIES: list[Family] = [import_module(f"{__name__}.{module}").FAMILY for module in MODULES]
# every family's presets by name (a dict, so a test may replace one): the released ones first, then the CPU-sized ones
PRESETS: dict[str, Callable[[], ModelPreset]] = dict(sorted(
    ((name, make) for f in FAMILIES for name, make in f.presets().items()), key=lambda item: item[0].startswith("tiny-")))
# the preset a run trains when none is named: CPU-sized, for a first run
DEFAULT_PRESET = "tiny-sana"


def get_preset(name: str, expert: str | None = None) -> ModelPreset:
    """The preset of this name; of a two-expert model, the preset of `expert` ("high" or "low": `ModelPreset.expert`)."""
    try:
        preset = PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return preset.expert(expert)


def get_family(name: str) -> Family:
    """The family of this name (a preset's `family`, a cache's `CacheSpec.family`)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; stage two trains {', '.join(f.name for f in FAMILIES)}")


def family_of_module(module) -> Family:
    """The family whose transformer or ControlNet class `module` is (adapted, quantized or sharded: FSDP's class
    derives from it)."""
    experts = getattr(module, "experts", None)  # two experts of one architecture (`train.experts.Experts`)
    if isinstance(experts, tuple):
        module = experts[0]
    names = {cls.__name__ for cls in type(module).__mro__}
    for family in FAMILIES:
        if family.transformer in names or (family.controlnet is not None and family.controlnet.model in names):
            return family
    raise ValueError(f"{type(module).__name__} is no transformer or ControlNet of the families stage two trains "
                     f"({', '.join(f.name for f in FAMILIES)})")


def text_input(layout: str) -> TextInput:
    """The reader of a cache's text layout (`TextSpec.layout`)."""
    for family in FAMILIES:
        if family.text.layout == layout:
            return family.text
    known = sorted({f.text.layout for f in FAMILIES})
    raise ValueError(f"text layout {layout!r} is not one stage two reads ({', '.join(known)}); the cache was written by "
                     f"another version of stage one: rebuild it with this one")


def layout_description(layout: str) -> str:
    """What a text layout holds and which families take it, for messages."""
    users = [f.title for f in FAMILIES if f.text.layout == layout]
    if not users:
        return "unknown"
    return f"{text_input(layout).description} ({', '.join(users)})"
