"""Random and hostile brace patterns as DATA: expanding and listing them answers with the shards, or with a
ValueError / FileNotFoundError naming the pattern, never another error, and refuses an expansion too large to
hold before building it. Seeded: every run feeds the same patterns."""

import random
import re
import time

import pytest

from precompute import tars
from precompute.tars import expand_tar_urls, is_tar_source

SEED, CASES = 20240601, 400
PIECES = ("{", "}", ",", "..", "-", "0", "7", "09", "\\", "/", "*", "?", "[", "]", "a", "Z", ".tar", "é", "中", "🙂",
          "\u0663", "\x00", " ", "\n", "~", "://", "pipe:")


def number(rng: random.Random) -> str:
    n = rng.choice((0, 1, 9, 10, 99, 10**6, 10**12, 10**40, rng.randrange(1000)))
    text = str(n).zfill(rng.choice((0, 0, 3, 5)))
    return ("-" if rng.random() < 0.2 else "") + text


def term(rng: random.Random, depth: int = 0) -> str:
    """A piece of a pattern: a range, a list (possibly nested), or noise, sometimes left unbalanced."""
    kind = rng.randrange(6)
    if kind == 0:
        step = f"..{number(rng)}" if rng.random() < 0.3 else ""
        return f"{{{number(rng)}..{number(rng)}{step}}}"
    if kind == 1:
        return "{" + rng.choice("aAzZ") + ".." + rng.choice("aAzZ") + "}"
    if kind == 2 and depth < 4:
        return "{" + ",".join(term(rng, depth + 1) for _ in range(rng.randrange(0, 4))) + "}"
    if kind == 3:
        return "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 8)))
    if kind == 4:
        return "{" * rng.randrange(1, 40) + "x" + "}" * rng.randrange(0, 40)
    return rng.choice(("data", "shard-", "", "..", "/", "\\{", "\\}"))


def pattern(rng: random.Random, root: str) -> str:
    if rng.random() < 0.1:  # the shards that exist, named in a random way
        names = ",".join(rng.choice(("0", "1", "2", "{0..2}", "{2..1}", "{0..1..2}", "{0,{1,2}}")) for _ in range(rng.randrange(1, 4)))
        return f"{root}/d-{{{names}}}.tar" if "," in names or rng.random() < 0.5 else f"{root}/d-{names}.tar"
    body = "".join(term(rng) for _ in range(rng.randrange(1, 5)))
    prefix = rng.choice((root + "/", root + "/", "memory://fuzz/", "", "pipe:cat "))
    return prefix + body + rng.choice((".tar", ".tar", "", "/"))


@pytest.fixture
def root(tmp_path):
    for i in range(3):
        (tmp_path / f"d-{i}.tar").write_bytes(b"")
    return str(tmp_path)


def check(data: str, allow_pipe: bool) -> bool:
    """Whether DATA expanded (to names); otherwise it was refused naming the pattern."""
    assert isinstance(is_tar_source(data), bool)
    try:
        urls = expand_tar_urls(data, allow_pipe)
    except (ValueError, FileNotFoundError) as e:
        assert data in str(e), f"{type(e).__name__} does not name the pattern: {e}"
        return False
    assert urls and all(isinstance(u, str) and u for u in urls)
    return True


def test_random_patterns_expand_or_are_refused_naming_the_pattern(root, monkeypatch):
    monkeypatch.setattr(tars, "MAX_SHARDS", 20_000, raising=False)  # the refusal is the same at any limit; building a million names is not quick
    rng = random.Random(SEED)
    start, expanded = time.perf_counter(), 0
    for _ in range(CASES):
        data = pattern(rng, root)
        try:
            expanded += check(data, allow_pipe=rng.random() < 0.5)
        except AssertionError:
            raise
        except Exception as e:  # anything else is a traceback the user would see
            raise AssertionError(f"DATA={data!r}: {type(e).__name__}: {e}") from e
    assert time.perf_counter() - start < 5
    assert expanded > CASES // 20  # the patterns that name shards were read as such


@pytest.mark.parametrize("data", ["{0..999999999999}.tar", "{0..99999}{0..99999}.tar", "x{a,{0..9999999}{0..9999999}}.tar",
                                  "{" * 5000 + "}" * 5000, "{1..10000000..1}/{a..z}/{A..Z}.tar"])
def test_huge_expansions_are_refused_before_they_are_built(root, data):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"expands to \d+ names, more than|braces nest 5000 deep"):
        expand_tar_urls(f"{root}/{data}")
    assert time.perf_counter() - start < 1


def test_the_shards_a_pattern_names_in_order(root):
    assert expand_tar_urls(f"{root}/d-{{0..2}}.tar") == [f"{root}/d-{i}.tar" for i in range(3)]
    assert expand_tar_urls(f"{root}/d-{{2,0}}.tar") == [f"{root}/d-2.tar", f"{root}/d-0.tar"]
    with pytest.raises(ValueError, match=r"DATA=.*d-\{0\.\.2\.tar: its braces do not pair"):
        expand_tar_urls(f"{root}/d-{{0..2.tar")


def test_the_count_is_what_braceexpand_yields(root):
    import braceexpand

    rng = random.Random(SEED + 1)
    compared = 0
    for _ in range(CASES):
        data = "".join(term(rng) for _ in range(rng.randrange(1, 4)))
        if re.search(r"\d{4}", data):  # braceexpand builds every range it meets, even of a pattern it then refuses
            continue
        try:
            size = tars.expansion_size(data)
        except ValueError as e:
            if "nest" not in str(e):  # braceexpand recurses once per level: too deep for it to answer either
                with pytest.raises(braceexpand.UnbalancedBracesError):
                    list(braceexpand.braceexpand(data))
            continue
        if size <= 20_000:
            assert size == sum(1 for _ in braceexpand.braceexpand(data)), data
            compared += 1
    assert compared > CASES // 4
