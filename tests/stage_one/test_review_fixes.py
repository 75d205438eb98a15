"""Stage one's messages and checks: a suggested value is itself valid; contradictory options are refused."""

import re

import pytest

from precompute.config import PrecomputeConfig
from precompute.families import family
from precompute.presets import get_preset


@pytest.mark.parametrize("model, given", [("tiny-sd3", "1600"), ("tiny-sd3", "100"), ("tiny-wan", "1600"),
                                          ("sd3-medium", "4000"), ("tiny-flux", "abc"), ("wan2.2-ti2v-5b", "500")])
def test_the_resolutions_suggested_for_a_refused_one_are_valid(model, given):
    with pytest.raises(ValueError, match=rf"^--resolution {given}: ") as e:
        PrecomputeConfig("data", model=model, resolution=given)
    one, several = re.search(r"e\.g\. --resolution (\d+) or --resolution ([\d,]+)$", str(e.value)).groups()
    problem_of, preset = family(get_preset(model).family).resolution_problem, get_preset(model)
    suggested = [int(one), *map(int, several.split(","))]
    assert len(several.split(",")) == 2 and all(problem_of(preset, r) is None for r in suggested), str(e.value)
    PrecomputeConfig("data", model=model, resolution=one)
    PrecomputeConfig("data", model=model, resolution=several)


def test_masks_and_alpha_mask_on_one_source_are_refused_naming_the_file_line_source_and_keys(tmp_path):
    (tmp_path / "d").mkdir()
    file = tmp_path / "data.toml"
    file.write_text('[[source]]\nname = "faces"\npath = "d"\nmasks = true\nalpha_mask = true\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(file))}:5: source 'faces': alpha_mask and masks: masks come "
                                         r"from one place"):
        PrecomputeConfig(str(file))
    file.write_text('[[source]]\nname = "faces"\npath = "d"\nalpha_mask = true\nmasks = false\n')
    assert PrecomputeConfig(str(file)).sources()[0].mask_mode == "alpha"  # masks = false contradicts nothing


def test_masks_and_alpha_mask_on_the_command_line_are_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"^--masks and --alpha-mask: masks come from one place"):
        PrecomputeConfig(str(tmp_path / "d"), masks=True, alpha_mask=True)
    file = tmp_path / "data.toml"
    file.write_text('[[source]]\nname = "faces"\npath = "d"\nmasks = true\n')
    with pytest.raises(ValueError, match=r"^--alpha-mask: source 'faces' of .*data.toml sets masks = true; masks come "
                                         r"from one place"):
        PrecomputeConfig(str(file), alpha_mask=True)
    file.write_text('[[source]]\nname = "faces"\npath = "d"\nalpha_mask = true\n')
    with pytest.raises(ValueError, match=r"^--masks: source 'faces' of .*data.toml sets alpha_mask = true"):
        PrecomputeConfig(str(file), masks=True)


def test_options_not_given_are_none_so_a_rerun_can_keep_what_the_cache_records(tmp_path, monkeypatch):
    """The command line tells a flag not given (None) from --no-masks (False) and --caption-variants 1; --help says
    what a re-run keeps."""
    from typer.testing import CliRunner

    import precompute.run
    from precompute.__main__ import app

    runs = []
    monkeypatch.setattr(precompute.run, "run", lambda config: runs.append(config) or {})
    for args, masks, variants in (([], None, None), (["--no-masks"], False, None), (["--masks"], True, None),
                                  (["--caption-variants", "1"], None, 1)):
        result = CliRunner().invoke(app, [str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        assert (runs[-1].masks, runs[-1].caption_variants) == (masks, variants)
        assert runs[-1].sources()[0].caption_variants == 1 and bool(runs[-1].sources()[0].mask_mode) is bool(masks)
    # the help's table may wrap at any width the suite's terminal settings leave it: read it without its borders
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
    out = " ".join(out.replace("│", " ").split())
    assert "--masks --no-masks" in out.replace("/ ", "") and "a re-run keeps its masks; --no-masks drops them" in out
    assert "a re-run keeps its variants and their tag options unless one of these options is given" in out


def test_no_masks_does_not_override_a_dataset_file_silently(tmp_path):
    (tmp_path / "d").mkdir()
    file = tmp_path / "data.toml"
    file.write_text('[[source]]\nname = "faces"\npath = "d"\nmasks = true\n')
    with pytest.raises(ValueError, match=r"^--no-masks: source 'faces' of .*data.toml asks for loss masks, and a dataset "
                                         r"file states its sources in full"):
        PrecomputeConfig(str(file), masks=False)
    assert PrecomputeConfig(str(file), alpha_mask=False).sources()[0].mask_mode == "file"  # nothing to contradict
    file.write_text('[[source]]\nname = "faces"\npath = "d"\n')
    assert PrecomputeConfig(str(file), masks=False).sources()[0].mask_mode == ""
