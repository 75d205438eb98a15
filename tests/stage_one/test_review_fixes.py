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
