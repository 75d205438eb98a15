"""A model family's knowledge lives in its modules under `<stage>/families/`: no other file of a stage names one,
not in code, help texts or comments (generic code asks the family object)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each family name as code spells it: lower case, Title or UPPER case, and the camel-case class-name forms.
NAMES = ["pixart", "PixArt", "sana", "sd3", "sd35", "flux", "qwen", "z-image", "z_image", "zimage", "ZImage", "wan", "kontext"]
FORMS = sorted({form for name in NAMES for form in (name, name.lower(), name[0].upper() + name[1:], name.upper())}, key=len,
               reverse=True)
# A name starts after a non-alphanumeric character (or, capitalised, a lower-case letter: isFlux) and ends before
# anything but a letter: a digit (Qwen2, Wan2), "_" (sd3_joint), punctuation, or, capitalised, a camel hump
# (FluxPipeline). So "sanitize", "transformers", "swan" or "WANDB" are not names.
FAMILY = re.compile("|".join(rf"(?<![A-Za-z0-9]){re.escape(f)}(?![A-Za-z])" if f.isupper() or f[0].islower()
                             else rf"(?<![A-Z0-9]){re.escape(f)}(?![a-z])" for f in FORMS))


def family_names(stage: str) -> list[str]:
    """`path:line: name` for every family name in the stage's .py files outside `families/` folders."""
    found = []
    for path in sorted((ROOT / stage).rglob("*.py")):
        if "families" in path.relative_to(ROOT).parts:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {m.group(0)}" for m in FAMILY.finditer(line)]
    return found


def test_the_pattern_finds_names_and_only_names():
    hits = ["pipe = FluxPipeline()", "the sana family", "# PixArt-Σ", "layout == 'sd3_joint'", "sd35-large", "Qwen2.5-VL",
            "ZImagePipeline", "z-image", "tiny_z_image", "isFlux", "Wan2.1", "KONTEXT", "SD3", "the SANA_600M repo", "from x import flux"]
    misses = ["sanitize(text)", "import transformers", "a swan", "want", "fluxion", "the sandbox", "Sanity", "wander",
              "WANDB_MODE=offline", "Wandb"]
    assert [line for line in hits if not FAMILY.search(line)] == []
    assert [line for line in misses if FAMILY.search(line)] == []


def test_precompute_names_no_family_outside_its_families():
    assert (ROOT / "precompute" / "families").is_dir()
    found = family_names("precompute")
    assert not found, "a family named outside precompute/families/ (ask the family object):\n" + "\n".join(found)


def test_train_names_no_family_outside_its_families():
    found = family_names("train")
    assert not found, "a family named outside train/families/ (ask the family object):\n" + "\n".join(found)
