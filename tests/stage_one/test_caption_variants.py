"""Caption variants (tag shuffling, keep_tokens, tag dropout, N versions per caption): how captions become variants,
the options of a dataset file's source and of the command line, and what a refused value says. The cache they
build and how training draws them: test_caption_variants_cache.py."""

import io
import re
from dataclasses import replace

import pytest
from PIL import Image
from typer.testing import CliRunner

import precompute.run
from precompute.__main__ import app as precompute_app
from precompute.captions import TagOptions, caption_variants
from precompute.config import PrecomputeConfig
from precompute.images import Record, content_key, prepare
from precompute.sources import KEY_HELP, TAG_KEYS, read_dataset_file

CAPTION = "1girl, solo, red hair, smile, outdoors, sky"
TAGS = CAPTION.split(", ")
SEED = bytes(32)
WIDE = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}


def write_toml(tmp_path, body: str):
    file = tmp_path / "data.toml"
    file.write_text(body, encoding="utf-8")
    return file


def test_variants_are_the_written_caption_then_shuffled_and_thinned_ones_after_the_prefix():
    options = TagOptions(4, shuffle=True, keep_tokens=1, dropout=0.3)
    out = caption_variants([CAPTION], options, "sks, ", SEED)
    # the exact strings: a change here changes the keys of every cached sample with variants (all re-encoded)
    assert out == ["sks, 1girl, solo, red hair, smile, outdoors, sky", "sks, 1girl, sky, red hair, smile, solo",
                   "sks, 1girl, solo, smile, red hair", "sks, 1girl, smile, sky, solo, outdoors"]
    for variant in out:
        assert variant.startswith("sks, 1girl, ")  # the prefix stays first and whole, the kept tag right after it
        tags = variant.removeprefix("sks, ").split(", ")
        assert len(set(tags)) == len(tags) and set(tags) <= set(TAGS)  # only the caption's tags, none twice
    assert len(set(out)) == 4
    assert caption_variants([CAPTION], options, "sks, ", SEED) == out  # a pure function of caption and content
    assert caption_variants([CAPTION], options, "sks, ", b"another image")[1:] != out[1:]  # seeded by the content


def test_many_variants_shuffle_every_free_tag_and_drop_at_about_the_rate():
    options = TagOptions(64, shuffle=True, keep_tokens=2, dropout=0.25)
    tags = [f"tag{i}" for i in range(12)]
    out = [v.split(", ") for v in caption_variants([", ".join(tags)], options, "", SEED)]
    assert len(out) == 64 and out[0] == tags
    assert all(v[:2] == tags[:2] for v in out)  # the kept tags: in place, never dropped
    kept = sum(len(v) - 2 for v in out[1:]) / (63 * 10)
    assert 0.65 < kept < 0.85  # 1 - 0.25
    assert {v[2] for v in out[1:]} >= set(tags[2:8])  # any free tag may come first after the kept ones


def test_dropout_alone_keeps_the_order_and_shuffle_alone_keeps_every_tag():
    dropped = caption_variants([CAPTION], TagOptions(8, dropout=0.5), "", SEED)
    for v in dropped:
        tags = v.split(", ")
        assert tags == [t for t in TAGS if t in tags] and tags  # written order; never no tag at all
    shuffled = caption_variants([CAPTION], TagOptions(8, shuffle=True), "", SEED)
    assert len(shuffled) == 8 and all(sorted(v.split(", ")) == sorted(TAGS) for v in shuffled)


def test_identical_variants_are_stored_once():
    assert caption_variants(["a, b"], TagOptions(4, shuffle=True, keep_tokens=1), "", SEED) == ["a, b"]
    assert sorted(caption_variants(["a, b"], TagOptions(4, shuffle=True), "", SEED)) == ["a, b", "b, a"]
    assert caption_variants(["solo"], TagOptions(4, shuffle=True, dropout=0.5), "p ", SEED) == ["p solo"]
    # two captions of one sample: each has its variants; a text both produce is kept once
    two = caption_variants(["a, b", "b, a"], TagOptions(4, shuffle=True), "", SEED)
    assert sorted(two) == ["a, b", "b, a"]


def test_the_separators_are_kohyas():
    # keep_tokens_separator: the text before it stays in front, after a second one at the end; the separator goes
    options = TagOptions(6, shuffle=True, keep_tokens=3, keep_separator="|||", dropout=0.2)
    for v in caption_variants(["masterpiece, sks ||| red, blue, green, circle ||| best quality"], options, "", SEED):
        tags = v.split(", ")
        assert tags[:2] == ["masterpiece", "sks"] and tags[-1] == "best quality" and "|||" not in v
    assert caption_variants(["a, b, c"], options, "", SEED)[0] == "a, b, c"  # without it, keep_tokens applies
    # another tag separator; variants join tags as the caption writes them
    out = caption_variants(["x | y | z"], TagOptions(3, shuffle=True, separator="|"), "", SEED)
    assert all(re.fullmatch(r"\w \| \w \| \w", v) for v in out) and out[0] == "x | y | z"
    assert caption_variants(["a,b,  c"], TagOptions(3, shuffle=True), "", SEED)[0] == "a,b,c"


def image() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (20, 200, 20)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_prepared_input_carries_its_variants_and_its_key_covers_them():
    tags = PrecomputeConfig("unused", caption_variants=3, shuffle_tags=True).sources()[0].tags()
    base = PrecomputeConfig("unused").policy()
    item = prepare(Record("x.png", image(), [CAPTION.encode()]), replace(base, tags=tags, caption_prefix="sks, "))
    assert item["status"] == "ok" and len(item["captions"]) == 3 and item["captions"][0] == "sks, " + CAPTION
    assert item["key"] == content_key(image(), item["captions"])
    plain = prepare(Record("x.png", image(), [CAPTION.encode()]), base)
    assert plain["captions"] == [CAPTION] and plain["key"] == content_key(image(), [CAPTION])  # unchanged without


def test_a_source_records_and_salts_its_variant_options(tmp_path):
    (tmp_path / "a").mkdir()
    file = write_toml(tmp_path, '[[source]]\npath = "a"\ncaption_variants = 4\nshuffle_tags = true\nkeep_tokens = 1\n'
                                'tag_dropout = 0.1\n[[source]]\npath = "b"\n')
    tagged, plain = read_dataset_file(file)
    assert tagged.tags() == TagOptions(4, True, 1, ",", None, 0.1) and plain.tags() is None
    assert tagged.record() == {"path": str(tmp_path / "a"), "repeats": 1, "caption_variants": 4, "shuffle_tags": True,
                               "keep_tokens": 1, "tag_separator": ",", "tag_dropout": 0.1}
    assert plain.record() == {"path": str(tmp_path / "b"), "repeats": 1} and plain.salt() == 0  # old caches: as before
    edited = write_toml(tmp_path, file.read_text().replace("0.1", "0.2"))
    assert tagged.salt() not in (0, read_dataset_file(edited)[0].salt())  # an edit makes a re-run read the inputs again


@pytest.mark.parametrize("keys, key, message", [
    ("caption_variants = 0", "caption_variants", "from 1 to 64"),
    ("caption_variants = 65\nshuffle_tags = true", "caption_variants", "from 1 to 64"),
    ("caption_variants = 2.5", "caption_variants", "whole number"),
    ("caption_variants = 4\nshuffle_tags = \"yes\"", "shuffle_tags", "true or false"),
    ("caption_variants = 4\ntag_dropout = 1.0", "tag_dropout", r"up to \(not including\) 1"),
    ("caption_variants = 4\ntag_dropout = -0.1", "tag_dropout", "from 0"),
    ("caption_variants = 4\nshuffle_tags = true\nkeep_tokens = -1", "keep_tokens", "≥ 0"),
    ("caption_variants = 4\nshuffle_tags = true\ntag_separator = \"\"", "tag_separator", "must not be empty"),
    ("caption_variants = 4", "caption_variants", "nothing varies the caption: set shuffle_tags"),
    ("shuffle_tags = true", "shuffle_tags", "set caption_variants to the number of versions"),
    ("tag_dropout = 0.1", "tag_dropout", "set caption_variants"),
    ("keep_tokens = 1", "keep_tokens", "applies to caption variants only"),
    ("caption_variants = 2\nshuffle_tags = true\nkeep_tokens_separator = \",\"", "keep_tokens_separator",
     "must differ from tag_separator"),
])
def test_a_bad_variant_option_is_refused_naming_the_source_the_key_and_the_line(tmp_path, keys, key, message):
    file = write_toml(tmp_path, f'[[source]]\npath = "a"\n\n[[source]]\nname = "tags"\npath = "b"\n{keys}\n')
    line = 7 + keys.split("\n").index(next(k for k in keys.split("\n") if k.startswith(key)))
    with pytest.raises(ValueError, match=message) as e:
        read_dataset_file(file)
    assert str(e.value).startswith(f"{file}:{line}: source 'tags': {key} = "), str(e.value)


def test_the_command_line_sets_the_options_of_data_as_one_source(tmp_path):
    config = PrecomputeConfig(str(tmp_path), caption_variants=3, tag_dropout=0.2, keep_tokens=2, tag_separator=";")
    assert config.sources()[0].tags() == TagOptions(3, False, 2, ";", None, 0.2)
    with pytest.raises(ValueError, match=r"^--caption-variants 3: nothing varies the caption: set --shuffle-tags"):
        PrecomputeConfig(str(tmp_path), caption_variants=3)
    with pytest.raises(ValueError, match=r"^--shuffle-tags: .* set --caption-variants to the number"):
        PrecomputeConfig(str(tmp_path), shuffle_tags=True)
    file = write_toml(tmp_path, '[[source]]\npath = "a"\n')
    with pytest.raises(ValueError, match=r"^--shuffle-tags: DATA is a dataset file, .* write shuffle_tags = \.\.\. in "):
        PrecomputeConfig(str(file), shuffle_tags=True)


def test_the_command_refuses_bad_options_before_encoding_and_help_explains_them(monkeypatch, tmp_path):
    runs = []
    monkeypatch.setattr(precompute.run, "run", lambda config: runs.append(config) or {})
    for args, said in ((["--caption-variants", "0"], "--caption-variants 0: must be in [1, 64]"),
                       (["--tag-dropout", "1"], "--tag-dropout 1.0: must be in [0, 1)"),
                       (["--keep-tokens", "1"], "--keep-tokens 1: applies to caption variants only")):
        result = CliRunner().invoke(precompute_app, [str(tmp_path), *args], env=WIDE)
        assert result.exit_code == 2 and f"error: {said}" in result.output and not runs, result.output
    result = CliRunner().invoke(precompute_app, [str(tmp_path), "--caption-variants", "4", "--shuffle-tags",
                                                 "--keep-tokens", "1", "--keep-tokens-separator", "|||"], env=WIDE)
    assert result.exit_code == 0 and runs[0].sources()[0].tags() == TagOptions(4, True, 1, ",", "|||", 0.0)
    out = " ".join(CliRunner().invoke(precompute_app, ["--help"], env=WIDE).output.split())
    for key in TAG_KEYS:
        assert f"--{key.replace('_', '-')}" in out and f"{key}: " in out and KEY_HELP[key]
    assert "kohya's --shuffle_caption" in out and "Variant 0 is the caption's tags in written order" in out
