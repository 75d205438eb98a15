"""Data flows one way: precompute -> shards <- train. Walks the imports of every module with ast."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY_BANNED_IN_SHARDS = {"diffusers", "transformers", "webdataset"}


def imported_modules(package: str) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in `package`, per file."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def wrong_arrows(package: str, banned: set[str]) -> list[str]:
    return [f"{path} imports {sorted(names & banned)}" for path, names in imported_modules(package).items() if names & banned]


def test_shards_imports_neither_stage_nor_model_libraries():
    assert imported_modules("shards"), "no modules found"
    assert wrong_arrows("shards", {"precompute", "train"} | THIRD_PARTY_BANNED_IN_SHARDS) == []


def test_stages_do_not_import_each_other():
    assert wrong_arrows("precompute", {"train"}) == []
    assert wrong_arrows("train", {"precompute"}) == []


def test_the_walker_sees_a_wrong_arrow(tmp_path, monkeypatch):
    pkg = tmp_path / "shards"
    pkg.mkdir()
    (pkg / "bad.py").write_text("import os\nfrom train.loop import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert wrong_arrows("shards", {"train"}) == ["shards/bad.py imports ['train']"]
