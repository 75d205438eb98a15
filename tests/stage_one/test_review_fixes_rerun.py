"""A re-run of DATA as one source that does not say keeps the loss masks and caption variants the cache records for
it, and says so; an explicit value changes them, loudly; a dataset file states its sources in full, and a source that
drops its masks or variants is warned about before anything is cached again."""

import json
from pathlib import Path

import pytest
from PIL import Image

from precompute.run import main as precompute
from shards import MASK, Cache, load

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models

RUN = dict(workers=0, progress=False, check_disk=False)


def folder(root: Path) -> Path:
    root.mkdir()
    for i in range(3):
        Image.new("RGB", (256, 256), (60 * i, 90, 30)).save(root / f"{i}.png")
        Image.new("L", (256, 256), 255).save(root / f"{i}.mask.png")
        (root / f"{i}.txt").write_text(f"red, blue, green, shape {i}", encoding="utf-8")
    return root


def state(cache: Path, name: str) -> tuple[bool, int, dict]:
    """(every sample has a mask, captions cached, the source's record)."""
    c = Cache(cache)
    masked = all(len(c[i][MASK]) > 0 for i in range(len(c)))
    manifest = load(cache)
    return masked, manifest.captions()[name], manifest.extra["sources"][name]


def test_a_plain_rerun_keeps_masks_and_caption_variants_and_an_explicit_value_drops_them(tmp_path, capsys):
    data, cache = folder(tmp_path / "data"), tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, masks=True, caption_variants=3, shuffle_tags=True, **RUN)
    assert state(cache, "data")[:2] == (True, 9)
    capsys.readouterr()

    summary = precompute(str(data), "tiny-sana", cache, **RUN)  # "I added nothing": nothing changes
    err = capsys.readouterr().err
    assert (summary["unchanged"], summary["changed"]) == (3, 0)
    assert ("source 'data' keeps the settings the cache records for it, which this run does not give: --masks "
            "--caption-variants 3 --shuffle-tags (to change them, give them; to drop them, --no-masks, "
            "--caption-variants 1)") in err
    masked, captions, record = state(cache, "data")
    assert masked and captions == 9 and record["masks"] and record["caption_variants"] == 3

    summary = precompute(str(data), "tiny-sana", cache, masks=False, **RUN)  # --no-masks: the variants stay
    err = capsys.readouterr().err
    assert "warning: source 'data': its 3 cached samples lose their loss masks (masks)" in err
    assert (summary["changed"], summary["latents_reused"]) == (3, 3)
    assert state(cache, "data")[:2] == (False, 9)

    summary = precompute(str(data), "tiny-sana", cache, caption_variants=1, **RUN)
    err = capsys.readouterr().err
    assert "warning: source 'data': its 3 cached samples lose 2 of their 3 caption variants" in err
    assert state(cache, "data")[:2] == (False, 3) and "keeps the settings" not in err


def test_a_plain_rerun_keeps_alpha_masks(tmp_path, capsys):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    for i in range(2):
        Image.new("RGBA", (256, 256), (90, 60 * i, 30, 200)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text("a picture", encoding="utf-8")
    precompute(str(data), "tiny-sana", cache, alpha_mask=True, **RUN)
    capsys.readouterr()
    summary = precompute(str(data), "tiny-sana", cache, **RUN)
    assert summary["unchanged"] == 2 and "--alpha-mask (to change them, give them; to drop them, --no-alpha-mask)" in \
        capsys.readouterr().err
    assert state(cache, "data")[0] and state(cache, "data")[2]["alpha_mask"]


def test_a_dataset_file_that_drops_masks_and_variants_changes_them_with_a_warning(tmp_path, capsys):
    folder(tmp_path / "photos")
    toml, cache = tmp_path / "data.toml", tmp_path / "cache"
    toml.write_text('[[source]]\npath = "photos"\nmasks = true\ncaption_variants = 3\nshuffle_tags = true\n')
    precompute(str(toml), "tiny-sana", cache, **RUN)
    capsys.readouterr()
    toml.write_text('[[source]]\npath = "photos"\n')
    summary = precompute(str(toml), "tiny-sana", cache, **RUN)
    err = capsys.readouterr().err
    assert (f"warning: source 'photos': its 3 cached samples lose their loss masks (masks) and 2 of their 3 caption "
            f"variants: its [[source]] in {toml} no longer asks for them") in err
    assert err.index("warning: source 'photos'") < err.index("new 0 / changed 3")  # said before the run's report
    assert summary["changed"] == 3 and state(cache, "photos")[:2] == (False, 3)


def test_a_run_whose_latents_were_all_reused_gives_no_advice_on_what_bounds_it(tmp_path, capsys):
    data, cache = folder(tmp_path / "data"), tmp_path / "cache"
    precompute(str(data), "tiny-sana", cache, masks=True, **RUN)
    capsys.readouterr()
    summary = precompute(str(data), "tiny-sana", cache, masks=False, **RUN)  # every sample changes its mask alone
    err = capsys.readouterr().err
    assert summary["latents_reused"] == 3 and summary["bound_by"] is None
    assert "bound by" not in err and "raise --workers" not in err and "no bound to tell: 3 of the 3 samples" in err


def test_a_bad_mask_read_at_two_resolutions_is_one_failed_input(tmp_path):
    data, cache = folder(tmp_path / "data"), tmp_path / "cache"
    Image.new("L", (128, 256), 255).save(data / "1.mask.png")  # another size than its image's
    summary = precompute(str(data), "tiny-sana", cache, masks=True, resolution="256,320", max_failure_fraction=1.0, **RUN)
    (failure,) = [json.loads(line) for line in (cache / "failures.jsonl").read_text().splitlines()]
    assert failure["source"] == "1.png" and failure["reason"] == "mask_size"
    assert failure["detail"].endswith("(at each of the source's 2 resolutions (256, 320))"), failure["detail"]
    assert summary["failed"] == 1 and summary["failed_by_reason"] == {"mask_size": 1}
    assert summary["sources"]["data"]["failed"] == 1 and summary["new"] == 4
    assert summary["failure_fraction"] == pytest.approx(1 / 3)  # one input of three


def test_a_new_cache_whose_every_input_failed_is_not_left_behind(tmp_path, capsys):
    from shards import exists

    data, cache = folder(tmp_path / "data"), tmp_path / "new" / "cache"
    summary = precompute(str(data), "tiny-sana", cache, alpha_mask=True, max_failure_fraction=1.0, **RUN)  # no alpha
    assert summary["failed_by_reason"] == {"missing_mask": 3} and summary["cache_samples"] == 0
    assert not exists(cache) and not (cache / "_log").exists() and not (cache / "vae").exists()
    assert {p.name for p in cache.iterdir() if not p.name.startswith(".lock")} == {"failures.jsonl"}
    assert len((cache / "failures.jsonl").read_text().splitlines()) == 3
    assert f"{cache}: no sample was cached, so no cache is kept; {cache / 'failures.jsonl'} lists why" in capsys.readouterr().err
    summary = precompute(str(data), "tiny-sana", cache, **RUN)  # the same directory takes the cache once inputs are good
    assert summary["new"] == 3 and exists(cache)
    summary = precompute(str(data), "tiny-sana", cache, alpha_mask=True, max_failure_fraction=1.0, **RUN)
    assert summary["failed"] == 3 and exists(cache)  # a cache that was there stays
