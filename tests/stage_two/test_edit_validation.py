"""Validation, sampling and export of an edit run: cached dataset items edited from their captions and references,
shown as reference(s) | generated | target; the export's card loads it into the family's edit pipeline with an image."""

import json

import pytest
import torch
from edit_testing import EDIT_PRESET, PROMPT, caption, edit_preset, sample_references, write_edit_cache
from PIL import Image

from shards import Cache
from train.config import TrainConfig
from train.decode import LABEL_WIDTH
from train.families import get_preset
from train.objectives import FlowMatching
from train.validate import Validator

pytestmark = pytest.mark.model  # builds tiny diffusers models (left out of make test-fast)

COUNTS = [1, 2, 1, 0]  # sample 3: a text-to-image sample


@pytest.fixture
def cache(tmp_path):
    return write_edit_cache(tmp_path / "edit", COUNTS, decoder=True)


def validator(cache_root, out, **kw) -> Validator:
    args = dict(prompts=[], buckets=[], steps=2, guidance=4.5, seed=0, decode_device="cpu", out=out,
                model_name=EDIT_PRESET, items=4)
    return Validator(Cache(cache_root), get_preset(EDIT_PRESET), FlowMatching(shift=3.0), **{**args, **kw})


def test_an_edit_run_validates_on_cached_items_with_their_references(cache, tmp_path, monkeypatch):
    forward = edit_preset(monkeypatch)
    v = validator(cache, tmp_path)
    assert len(v.items) == 4 and not v.prompts and not v.references  # no prompt rows, no dataset row
    by_name = {item.name: item for item in v.items}
    for i, n in enumerate(COUNTS):
        item = by_name[f"{i}.png"]
        assert item.caption == caption(i) and item.control is None
        assert len(item.references) == n and all(torch.equal(a, b) for a, b in zip(item.references, sample_references(i, n)))
    preset = get_preset(EDIT_PRESET)
    model = preset.transformer_class.from_config(preset.transformer_config())
    latents = v.sample(model, torch.float32)
    assert all(latents[i].shape == item.target.shape for i, item in enumerate(v.items))
    # the sampler's batch: the null caption and the prompt, each with the item's references
    for call, item in zip(forward.seen[:: v.steps], v.items):
        assert call == [[(tuple(r.shape), torch.float32, "cpu") for r in item.references]] * 2
    for i, item in enumerate(v.items):
        label, row = v.item_row(i, latents[i])
        assert f'"{item.caption}"' in label and ("no reference" in label) == (not item.references)
        # empty cells first where another item has more references: generated and target in the last two columns
        n = len(item.references)
        assert len(row) == max(COUNTS) + 2 and row[-2] is latents[i] and row[-1] is item.target
        assert row[: max(COUNTS) - n] == [None] * (max(COUNTS) - n)
        assert all(a is b for a, b in zip(row[max(COUNTS) - n : -2], item.references))


def test_the_grid_is_a_row_per_item_references_generated_target(cache, tmp_path, monkeypatch):
    edit_preset(monkeypatch)
    v = validator(cache, tmp_path)
    v.decode_device = torch.device("cpu")  # decoded in this process (the run's background decoder takes seconds to start)
    preset = get_preset(EDIT_PRESET)
    model = preset.transformer_class.from_config(preset.transformer_config())
    path = v.run(model, 7, torch.float32)
    assert v.finished() == [("ok", str(path))] and path.name == "samples-step00000007.png"
    grid = Image.open(path)
    widest = max(it.target.shape[-1] for it in v.items) * 8  # the widest image a cell holds (48x80: 80 pixels)
    assert grid.width == LABEL_WIDTH + (max(COUNTS) + 2) * (widest + 4)  # two references, generated, target


def test_an_edit_model_has_no_prompt_only_validation_one_that_also_generates_has(cache, tmp_path, monkeypatch):
    edit_preset(monkeypatch)
    with pytest.raises(ValueError, match=f"{EDIT_PRESET} edits an input image: it validates on cached dataset items"):
        validator(cache, tmp_path, prompts=[PROMPT])
    assert not validator(cache, tmp_path, items=0)  # nothing to validate on
    edit_preset(monkeypatch, requires_references=False)
    both = validator(cache, tmp_path, prompts=[PROMPT])
    assert len(both.items) == 4 and [p.text for p in both.prompts] == [PROMPT] and both.buckets
    only = validator(cache, tmp_path, items=0)  # text to image alone: the cached prompts
    assert not only.items and [p.text for p in only.prompts] == [PROMPT]


@pytest.mark.slow  # the background decoder starts in a process of its own
def test_an_edit_run_validates_samples_and_exports_for_the_edit_pipeline(cache, tmp_path, monkeypatch):
    from train.export import export, sample
    from train.loop import train

    edit_preset(monkeypatch)
    run = tmp_path / "run"
    summary = train(TrainConfig(model=EDIT_PRESET, cache=cache, run=run, steps=2, batch_size=2, progress=False,
                                caption_dropout=0.0, validation_items=3, validation_steps=2))
    assert summary["grids"] == [str(run / "samples-step00000002.png")]
    written = sample(run, steps=2, decode_device="device")
    names = sorted(p.name for p in written)
    assert len(names) == 2 * 3 and sum(n.endswith("-row.png") for n in names) == 3  # the run's 3 items: each edit and its row
    out = export(run, tmp_path / "export")
    card = (tmp_path / "export" / "README.md").read_text()
    assert "image-to-image" in card and "image=reference" in card and "load_image" in card
    assert "validation edits" in card
    assert json.loads((out / "training.json").read_text())["pipeline"] == "SanaPipeline"
