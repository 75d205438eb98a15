"""Seeded random inputs to every parser of what a user writes for stage one: the dataset file, metadata.jsonl and
metadata.csv rows, sidecar caption files. Each bad input is a clear error naming its file (exit 2 at the command
line) or a counted skip with a named reason; nothing raises anything else."""

import csv
import io
import json
import random

import pytest
from PIL import Image
from typer.testing import CliRunner

from precompute.__main__ import EXIT_INPUT, app
from precompute.config import PrecomputeConfig
from precompute.folders import FolderDataset, list_folder
from precompute.inputs import REASONS
from precompute.sources import KEYS, Source, read_dataset_file

POLICY = PrecomputeConfig("unused", allow_upscale=True, extreme_aspect="clamp").policy()
IMAGES = ("a.png", "b.png", "sub/c.png")

# text a user (or a broken tool) writes into a string field
NASTY = ["", " ", "x", "dog, sks", "\x00", "a\x00b", "\ufeffcaption", "\ud800", "\udcff", "é" * 3, "\u2028", "\r\n",
         "a" * 5000, "../a.png", "/etc/passwd", "a/../../b.png", ".", "./", "sub/../a.png", "sub/", "a.png\n",
         "\\..\\x",
         "[", "[[1]]", "[\"a\", \"b\"]", "[" * 3000, "1" * 5000, "{}", "null", "😀", "\t", "a,b", "\"quoted\""]


def nasty_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind < 3:
        return rng.choice(NASTY + list(IMAGES))
    if kind == 3:
        return rng.choice([0, -1, 1, 2**64, 10**400, 1.5, float("inf"), float("nan"), True, False])
    if kind == 4:
        return None
    if kind == 5:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(1, 20)))
    if kind == 6:
        return [nasty_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {rng.choice(["file_name", "text", "bytes", "path"]): nasty_value(rng, depth + 1)}
    return [rng.choice(NASTY) for _ in range(rng.randrange(1, 4))]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A few random byte edits: flips, inserted junk (BOMs, NULs, invalid UTF-8), truncation."""
    data = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(len(data) + 1)
        edit = rng.randrange(4)
        if edit == 0 and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif edit == 1:
            junk = [b"\xef\xbb\xbf", b"\x00", b"\xff\xfe", b"\xc3", b"\n", b"\"", b"[[", b"]", b"=", b"\\"]
            data[at:at] = rng.choice(junk)
        elif edit == 2:
            del data[at:]
        else:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    return bytes(data)


def folder(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    for name in IMAGES:
        Image.new("RGB", (24, 24), (40, 90, 200)).save(root / name)
    (tmp_path / "outside.png").write_bytes((root / "a.png").read_bytes())
    return root


def check_listing(root, where: str) -> None:
    """List and read the folder: a ValueError naming the metadata file, or entries and failures with named reasons
    that read into samples or named failures, all writable to failures.jsonl."""
    try:
        listing = list_folder(root)
    except ValueError as e:
        assert any(f"{root / name}" in str(e) for name in ("metadata.jsonl", "metadata.csv")), (where, e)
        return
    items = [FolderDataset(listing.entries, POLICY, frozenset())[i] for i in range(len(listing.entries))]
    for failure in listing.failures:
        assert failure["reason"] in REASONS and failure["detail"], (where, failure)
    for failure in listing.failures + [i for i in items if i["status"] == "failed"]:
        assert failure["reason"] in REASONS, (where, failure)
        json.dumps(failure)  # failures.jsonl holds it
    for item in items:
        assert item["status"] in ("ok", "failed"), (where, item)
        if item["status"] == "ok":
            assert item["captions"] and all("\x00" not in c for c in item["captions"])
    for entry in listing.entries:  # nothing outside DATA is ever read
        assert (root / entry.source).resolve().is_relative_to(root.resolve()), (where, entry)


def test_metadata_jsonl_rows(tmp_path):
    rng, root = random.Random(1), folder(tmp_path)
    for case in range(120):
        lines = []
        for _ in range(rng.randrange(1, 6)):
            pick = rng.randrange(10)
            if pick < 5:
                row = {"file_name": rng.choice(IMAGES) if rng.random() < 0.6 else nasty_value(rng),
                       "text": nasty_value(rng) if rng.random() < 0.7 else "a blue square"}
                if rng.random() < 0.3:
                    del row[rng.choice(["file_name", "text"])]
                if rng.random() < 0.2:
                    row[rng.choice(["extra", "file_name ", "TEXT"])] = nasty_value(rng)
                try:
                    lines.append(json.dumps(row, ensure_ascii=rng.random() < 0.5))
                except ValueError:  # an integer Python will not print
                    lines.append('{"file_name": "a.png", "text": ' + "1" * 5000 + "}")
            elif pick < 7:
                lines.append(rng.choice(["[1, 2]", "null", "1" * 5000, "[" * 5000, "{", "\ufeff{}", '"x"', "{}",
                                         '{"file_name": "a.png", "text": [' + "[" * 3000 + "]}"]))
            else:
                lines.append(json.dumps({"file_name": "a.png", "text": "a blue square"}))
        data = "\n".join(lines).encode("utf-8", "surrogatepass")
        if rng.random() < 0.3:
            data = mutate(rng, data)
        (root / "metadata.jsonl").write_bytes(data)
        check_listing(root, f"case {case}: {data[:300]!r}")


@pytest.mark.parametrize("name, line, reason", [
    ("metadata.jsonl", '{"file_name": "a.png", "text": ' + "[" * 5000 + "]" * 5000 + "}", "bad_metadata_row"),
    ("metadata.jsonl", '{"file_name": "a.png", "text": ' + "7" * 5000 + "}", "bad_metadata_row"),
    ("metadata.jsonl", '{"file_name": "sub\\ud800/a.png", "text": "x"}', "bad_metadata_row"),
    ("metadata.jsonl", '{"file_name": "\\ud800.png", "text": "x"}', "bad_metadata_row"),
    ("metadata.jsonl", '{"file_name": ".", "text": "x"}', "bad_metadata_row"),
    ("metadata.csv", "file_name,text\nb.png," + "[" * 5000, None),  # not a JSON list: the text is the caption
    ("metadata.csv", "file_name,text\nb.png,[" + "7" * 5000 + "]", None),
])
def test_rows_beyond_what_json_reads_are_named_failures(tmp_path, name, line, reason):
    root = folder(tmp_path)
    (root / name).write_text(line + "\n", encoding="utf-8")
    listing = list_folder(root)
    if reason is None:
        item = FolderDataset(listing.entries, POLICY, frozenset())[0]
        assert item["status"] == "ok" and item["captions"] == [line.split(",", 2)[-1]]
        return
    assert not listing.entries and [f["reason"] for f in listing.failures] == [reason]
    assert "metadata.jsonl line 1" in listing.failures[0]["detail"]


def test_metadata_csv_rows(tmp_path):
    rng, root = random.Random(2), folder(tmp_path)
    for case in range(120):
        columns = ["file_name", "text"]
        if rng.random() < 0.15:
            columns = rng.choice([["text"], ["file", "text"], [], ["file_name"], ["file_name", "text", "text"]])
        out = io.StringIO()
        writer = csv.writer(out, quoting=rng.choice([csv.QUOTE_MINIMAL, csv.QUOTE_ALL]))
        writer.writerow(columns)
        for _ in range(rng.randrange(1, 6)):
            cells = [rng.choice(IMAGES) if rng.random() < 0.5 else rng.choice(NASTY) for _ in columns]
            if rng.random() < 0.2:
                cells = cells[: rng.randrange(len(cells) + 1)] + [rng.choice(NASTY) for _ in range(rng.randrange(3))]
            if rng.random() < 0.05:
                cells = ["a.png", "x" * 200_000]  # beyond the csv module's field size limit
            writer.writerow(cells)
        data = out.getvalue().encode("utf-8", "surrogatepass")
        if rng.random() < 0.3:
            data = mutate(rng, data)
        (root / "metadata.csv").write_bytes(data)
        check_listing(root, f"case {case}: {data[:300]!r}")


def test_sidecar_caption_files(tmp_path):
    rng, root = random.Random(3), folder(tmp_path)
    for case in range(60):
        for name in IMAGES:
            stem = root / name[: -len(".png")]
            for ext in (".txt", ".caption"):
                path = stem.with_suffix(ext)
                path.unlink(missing_ok=True)
                if rng.random() < 0.6:
                    text = rng.choice(NASTY).encode("utf-8", "surrogatepass")
                    path.write_bytes(mutate(rng, text or b"x") if rng.random() < 0.5 else text)
        check_listing(root, f"case {case}")


def toml_value(rng: random.Random) -> str:
    return rng.choice(['"photos"', '""', '" "', '"a\\u0000b"', "3", "0", "-2", "2.5", "inf", "nan", "true",
                       '["a"]', "{x = 1}", "1979-05-27", "'lit'", '"""multi\nline"""', str(2**63 - 1),
                       '"' + "a" * 3000 + '"', '"\\ud800"', "[[1], [2]]", '"photos/../photos"', '"/abs/path"'])


def toml_document(rng: random.Random) -> str:
    parts = []
    for i in range(rng.randrange(0, 4)):
        header = rng.choice(["[[source]]"] * 8 + ["[source]", "[[sources]]", "[[ source ]]", "source = [1]",
                                                  "source = ['x']", "[[source.sub]]"])
        body = [f'path = "folder{i}"'] if rng.random() < 0.8 else []
        for _ in range(rng.randrange(0, 4)):
            key = rng.choice(sorted(KEYS) + ["captoin_prefix", "weigth", "Path", '"quoted key"', "a.b"])
            body.append(f"{key} = {toml_value(rng)}")
        parts.append("\n".join([header, *body]))
    if rng.random() < 0.2:
        parts.append(rng.choice(["top = 1", "a = [" * 2000, "x = " + "9" * 5000, "[other]"]))
    return "\n\n".join(parts) + "\n"


def test_dataset_files(tmp_path):
    rng = random.Random(4)
    file = tmp_path / "data.toml"
    outcomes = set()
    for case in range(300):
        text = toml_document(rng)
        data = text.encode("utf-8")
        if rng.random() < 0.35:
            data = mutate(rng, data)
        file.write_bytes(data)
        try:
            sources = read_dataset_file(file)
        except ValueError as e:
            assert str(file) in str(e), (case, data, e)
            outcomes.add("refused")
            continue
        outcomes.add("read")
        assert sources and all(isinstance(s, Source) and s.path and s.name for s in sources), (case, data)
        assert len({s.name for s in sources}) == len(sources)
        for s in sources:
            texts = (s.name, s.path, s.caption_prefix, s.default_caption or "")
            assert all("\x00" not in text for text in texts)
            assert s.weight is None or 0 < s.weight < float("inf")
    assert outcomes == {"read", "refused"}


@pytest.mark.parametrize("data", [b"\xff\xfe[[source]]\npath = 'a'\n", b'[[source]]\npath = "a\\u0000"\n',
                                  b"source = [1]\n", b"[source]\npath = 'a'\n",
                                  b"[[source]]\npath = 'a'\nweight = inf\n[[source]]\npath = 'b'\nweight = 1\n"])
def test_a_bad_dataset_file_exits_2_naming_it(tmp_path, data):
    file = tmp_path / "data.toml"
    file.write_bytes(data)
    out = CliRunner().invoke(app, [str(file), "--cache", str(tmp_path / "cache"), "--no-progress"])
    assert out.exit_code == EXIT_INPUT, out.output
    assert f"error: {file}:" in out.output and "Traceback" not in out.output
