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


def module_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports, at the top or inside a function."""
    graph = {}
    for package in ("shards", "precompute", "train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            targets = set()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    targets |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from train import checkpoint` imports the module train.checkpoint
                    targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            graph[name] = targets
    return {name: {t for t in targets if t in graph and t != name} for name, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules that import each other (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = module_graph()
    assert {"train.loop", "train.plan", "shards.reader"} <= set(graph)
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
