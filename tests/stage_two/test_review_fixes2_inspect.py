"""`shards inspect` shows every setting stage one recorded of a source in plain text as its `--json` holds it: a
held-out source (`eval = true`) beside the class sources' `is_reg`."""

import json

from conftest import FINGERPRINT, SCHEMA, make_sample
from typer.testing import CliRunner

from shards import ShardWriter
from shards.cli import app


def test_inspect_shows_a_held_out_source_in_plain_text(tmp_path):
    with ShardWriter(tmp_path / "cache", FINGERPRINT, SCHEMA) as w:
        for i, dataset in enumerate(["dogs", "dogs", "held", "class"]):
            w.write(*make_sample(i), dataset=dataset)
        w.set_extra("sources", {"dogs": {"path": "/data/dogs", "repeats": 2}, "held": {"path": "/data/held", "repeats": 1, "eval": True},
                                "class": {"path": "/data/class", "repeats": 1, "is_reg": True, "prior_loss_weight": 0.5}})
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "cache")]).output
    lines = {line.split()[0]: line for line in shown.split("\nsources:\n")[1].splitlines() if line.strip()}
    assert "eval (held out of training)" in lines["held"] and "/data/held" in lines["held"]
    assert "eval" not in lines["dogs"] and "eval" not in lines["class"]
    assert "class (is_reg), prior_loss_weight 0.5" in lines["class"]  # as before
    info = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "cache"), "--json"]).output)
    assert info["sources"]["held"]["eval"] is True and "eval" not in info["sources"]["dogs"]
