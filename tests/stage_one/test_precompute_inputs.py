"""Reading DATA: bad inputs become counted failures, nothing outside DATA is read, and an unchanged input is
recognised by its stamp without being read."""

import contextlib
import json
import os
import signal
import tarfile
from pathlib import Path

import pytest

from precompute.config import PrecomputeConfig
from precompute.folders import FolderDataset, FolderEntry, entry_stamp, list_folder, read_folder_entry
from precompute.images import Record, decode_captions, prepare
from precompute.inputs import REASONS
from precompute.sample_data import make_folder, make_tars
from precompute.tars import TarDataset, expand_tar_urls, is_tar_source

POLICY = PrecomputeConfig("unused").policy()
as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")


@contextlib.contextmanager
def deadline(seconds: int = 10):
    """Fail instead of hanging: opening a FIFO for reading blocks until a writer appears."""
    def expire(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s: a FIFO was opened")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def reasons(failures: list[dict]) -> dict[str, str]:
    return {f["source"]: f["reason"] for f in failures}


# ---- folder listing ----------------------------------------------------------------------------

def test_symlink_loop_and_dangling_symlink_are_counted_failures(tmp_path):
    root = make_folder(tmp_path / "data", count=2)
    os.symlink("loop.png", root / "loop.png")
    os.symlink("gone.png", root / "dangling.png")
    os.symlink("00000.png", root / "alias.png")  # a symlink to a file is followed
    listing = list_folder(root)
    assert [e.source for e in listing.entries] == ["00000.png", "00001.png", "alias.png"]
    assert reasons(listing.failures) == {"loop.png": "unreadable", "dangling.png": "missing_file"}
    assert listing.complete  # every name was seen; the failures name their sources
    assert all(f["reason"] in REASONS for f in listing.failures)


def test_a_file_turned_into_a_loop_after_listing_fails_without_raising(tmp_path):
    root = make_folder(tmp_path / "data", count=2)
    entries = list_folder(root).entries
    (root / "00000.png").unlink()
    os.symlink("00000.png", root / "00000.png")
    (root / "00001.txt").unlink()
    os.symlink(root / "00001.txt", root / "00001.txt")
    items = [FolderDataset(entries, POLICY, frozenset())[i] for i in range(2)]
    assert [(it["status"], it["reason"]) for it in items] == [("failed", "unreadable")] * 2
    assert read_folder_entry(entries[0]).missing == "unreadable"


def test_fifo_named_like_an_image_is_counted_and_never_opened(tmp_path):
    root = make_folder(tmp_path / "data", count=1)
    os.mkfifo(root / "x.png")
    os.mkfifo(root / "00000.caption")  # a FIFO beside an image, named like a caption
    with deadline():
        listing = list_folder(root)
        assert [e.source for e in listing.entries] == ["00000.png"]
        assert reasons(listing.failures) == {"x.png": "special_file"}
        item = FolderDataset(listing.entries, POLICY, frozenset())[0]
        assert (item["status"], item["reason"]) == ("failed", "special_file")
        # a metadata row may name a FIFO too: the dataset refuses it instead of opening it
        fifo = FolderEntry("x.png", str(root / "x.png"), captions=("a caption",))
        item = FolderDataset([fifo], POLICY, frozenset())[0]
        assert (item["status"], item["reason"], item["stamp"]) == ("failed", "special_file", 0)


def test_a_directory_named_like_an_image_is_a_failure(tmp_path):
    (tmp_path / "d.png").mkdir()
    entry = FolderEntry("d.png", str(tmp_path / "d.png"), captions=("a caption",))
    assert read_folder_entry(entry).missing == "special_file"
    assert FolderDataset([entry], POLICY, frozenset())[0]["reason"] == "special_file"


def test_unlistable_directory_makes_the_listing_incomplete(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data", count=2)
    make_folder(root / "sub", count=1)
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path) == root / "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)  # os.walk lists directories with os.scandir
    listing = list_folder(root)
    assert [e.source for e in listing.entries] == ["00000.png", "00001.png"]
    assert reasons(listing.failures) == {"sub": "unlisted_directory"}
    assert not listing.complete


@as_root
def test_unreadable_directory_makes_the_listing_incomplete(tmp_path):
    root = make_folder(tmp_path / "data", count=2)
    make_folder(root / "sub", count=1)
    (root / "sub").chmod(0)
    try:
        listing = list_folder(root)
    finally:
        (root / "sub").chmod(0o755)
    assert [e.source for e in listing.entries] == ["00000.png", "00001.png"]
    assert reasons(listing.failures) == {"sub": "unlisted_directory"}
    assert not listing.complete


@as_root
def test_unreadable_file_is_a_per_file_failure(tmp_path):
    root = make_folder(tmp_path / "data", count=2)
    (root / "00001.png").chmod(0)
    listing = list_folder(root)
    items = [FolderDataset(listing.entries, POLICY, frozenset())[i] for i in range(2)]
    assert [it["status"] for it in items] == ["ok", "failed"]
    assert items[1]["reason"] == "permission_denied"


# ---- metadata files ----------------------------------------------------------------------------

GOOD_ROW = {"file_name": "00000.png", "text": "a caption"}
BAD_ROWS = {
    "non_string_file_name": ({"file_name": 5, "text": "x"}, "metadata.jsonl:2", "bad_metadata_row"),
    "empty_file_name": ({"file_name": "", "text": "x"}, "metadata.jsonl:2", "bad_metadata_row"),
    "no_file_name": ({"text": "x"}, "metadata.jsonl:2", "bad_metadata_row"),
    "not_an_object": ([1, 2], "metadata.jsonl:2", "bad_metadata_row"),
    "invalid_json": ('{"file_name": "00001.png", "text": ', "metadata.jsonl:2", "bad_metadata_row"),
    "parent": ({"file_name": "../x.png", "text": "x"}, "../x.png", "outside_root"),
    "inner_parent": ({"file_name": "a/../../x.png", "text": "x"}, "a/../../x.png", "outside_root"),
    "absolute": ({"file_name": "/etc/hostname", "text": "x"}, "/etc/hostname", "outside_root"),
    "symlinked_directory": ({"file_name": "out/secret.png", "text": "x"}, "out/secret.png", "outside_root"),
    "number_caption": ({"file_name": "00001.png", "text": 3}, "00001.png", "caption_not_string"),
    "bool_caption": ({"file_name": "00001.png", "text": True}, "00001.png", "caption_not_string"),
    "dict_caption": ({"file_name": "00001.png", "text": {"en": "x"}}, "00001.png", "caption_not_string"),
    "mixed_list_caption": ({"file_name": "00001.png", "text": ["x", 2]}, "00001.png", "caption_not_string"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_metadata_row_is_a_failure_and_the_listing_goes_on(tmp_path, case):
    row, source, reason = BAD_ROWS[case]
    root = make_folder(tmp_path / "data", count=3)
    outside = make_folder(tmp_path / "outside", count=1)
    (outside / "00000.png").rename(outside / "secret.png")
    os.symlink(outside, root / "out")
    bad = row if isinstance(row, str) else json.dumps(row)
    lines = [json.dumps(GOOD_ROW), bad, json.dumps(GOOD_ROW | {"file_name": "00002.png"})]
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    listing = list_folder(root)
    assert [e.source for e in listing.entries] == ["00000.png", "00002.png"]
    assert [(f["source"], f["reason"]) for f in listing.failures] == [(source, reason)]
    assert "line 2" in listing.failures[0]["detail"] and reason in REASONS
    # a row naming no file might be a cached sample's: the listing cannot be used to remove anything
    assert listing.complete == (source != "metadata.jsonl:2")


def test_metadata_file_symlink_is_followed_like_a_folder_listing(tmp_path):
    """The Hugging Face hub cache stores a snapshot's files as symlinks into ../../blobs."""
    blobs = make_folder(tmp_path / "blobs", count=1)
    root = tmp_path / "snapshot"
    root.mkdir()
    os.symlink(blobs / "00000.png", root / "00000.png")
    (root / "metadata.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    listing = list_folder(root)
    assert [e.source for e in listing.entries] == ["00000.png"] and not listing.failures
    assert FolderDataset(listing.entries, POLICY, frozenset())[0]["status"] == "ok"


def test_metadata_captions_keep_their_text(tmp_path):
    root = make_folder(tmp_path / "data", count=2)
    rows = [{"file_name": "00000.png", "text": ["one", None, "two"]}, {"file_name": "00001.png", "text": "a\u2028b"}]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    listing = list_folder(root)
    assert [e.captions for e in listing.entries] == [("one", "two"), ("a\u2028b",)]  # U+2028 is no line break
    assert listing.complete and not listing.failures


def test_metadata_csv_rows(tmp_path):
    root = make_folder(tmp_path / "data", count=3)
    text = 'file_name,text\n00000.png,plain\n,no file\n00001.png,"[1, 2]"\n00002.png,"[""a"", ""b""]"\n'
    (root / "metadata.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())  # as Excel saves it
    listing = list_folder(root)
    assert [(e.source, e.captions) for e in listing.entries] == [("00000.png", ("plain",)), ("00002.png", ("a", "b"))]
    assert [(f["source"], f["reason"]) for f in listing.failures] == [
        ("metadata.csv:3", "bad_metadata_row"), ("00001.png", "caption_not_string")]


def test_metadata_that_is_not_utf8_names_file_and_line(tmp_path):
    root = make_folder(tmp_path / "data", count=2)
    (root / "metadata.jsonl").write_bytes(json.dumps(GOOD_ROW).encode() + b'\n{"file_name": "00001.png", "text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"metadata\.jsonl:2: not valid UTF-8"):
        list_folder(root)


# ---- captions ----------------------------------------------------------------------------------

def test_caption_byte_order_mark_is_stripped():
    assert decode_captions([b"\xef\xbb\xbfa red circle\n"]) == (["a red circle"], None)
    assert decode_captions(["\ufeffa red circle"]) == (["a red circle"], None)
    image = make_image_bytes()
    assert prepare(Record("a", image, [b"\xef\xbb\xbfcap"]), POLICY)["key"] == prepare(Record("b", image, ["cap"]), POLICY)["key"]


def test_caption_with_nul_is_refused():
    # content_key joins captions with NUL: ["a\0b"] would share the key of ["a", "b"]
    assert decode_captions(["a\x00b"]) == (None, "caption_nul")
    assert decode_captions([b"ok", b"a\x00b"]) == (None, "caption_nul")
    item = prepare(Record("x", make_image_bytes(), ["a\x00b"]), POLICY)
    assert (item["status"], item["reason"]) == ("failed", "caption_nul") and "caption_nul" in REASONS


def test_caption_with_lone_surrogate_is_a_failure():
    item = prepare(Record("x", make_image_bytes(), [json.loads('"\\ud800"')]), POLICY)
    assert (item["status"], item["reason"]) == ("failed", "caption_not_utf8")


def make_image_bytes() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (200, 20, 20)).save(buf, format="PNG")
    return buf.getvalue()


# ---- stamps ------------------------------------------------------------------------------------

def test_unchanged_stamp_is_not_read(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "data", count=2)
    entries = list_folder(root).entries
    stamps = [entry_stamp(e) for e in entries]
    assert all(0 < s < 2**63 for s in stamps) and stamps[0] != stamps[1]
    known = {e.source: (f"key{i}", s) for i, (e, s) in enumerate(zip(entries, stamps))}

    def refuse(*args, **kwargs):
        raise AssertionError("an unchanged input was opened")

    with monkeypatch.context() as m:
        m.setattr(os, "open", refuse)
        m.setattr("builtins.open", refuse)
        m.setattr(Path, "read_bytes", refuse)
        assert [entry_stamp(e) for e in entries] == stamps
        items = [FolderDataset(entries, POLICY, frozenset(), known)[i] for i in range(2)]
    assert items == [{"status": "unchanged", "source": e.source, "key": f"key{i}", "stamp": s}
                     for i, (e, s) in enumerate(zip(entries, stamps))]


def test_stamp_changes_with_mtime_size_and_captions(tmp_path):
    root = make_folder(tmp_path / "data", count=1)
    entry = list_folder(root).entries[0]
    before = entry_stamp(entry)
    st = os.stat(entry.image)
    os.utime(entry.image, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    touched = entry_stamp(entry)
    assert touched != before
    item = FolderDataset([entry], POLICY, frozenset(), {entry.source: ("old", before)})[0]
    assert (item["status"], item["stamp"]) == ("ok", touched)  # read again, with the new stamp
    (root / "00000.txt").write_text("another caption")
    assert entry_stamp(entry) != touched
    meta = FolderEntry("00000.png", entry.image, captions=("one",))
    assert entry_stamp(meta) != entry_stamp(FolderEntry("00000.png", entry.image, captions=("two",)))


def test_content_unchanged_and_failures_carry_the_stamp(tmp_path):
    root = make_folder(tmp_path / "data", count=1)
    entry = list_folder(root).entries[0]
    first = FolderDataset([entry], POLICY, frozenset())[0]
    again = FolderDataset([entry], POLICY, frozenset({first["key"]}), {entry.source: (first["key"], 0)})[0]
    assert again == {"status": "unchanged", "source": entry.source, "key": first["key"], "stamp": first["stamp"]}
    (root / "00000.txt").write_text("   ")
    failed = FolderDataset([entry], POLICY, frozenset())[0]
    assert (failed["reason"], failed["stamp"]) == ("empty_caption", entry_stamp(entry))
    os.unlink(entry.image)
    gone = FolderDataset([entry], POLICY, frozenset())[0]
    assert (gone["status"], gone["reason"], gone["stamp"]) == ("failed", "missing_file", 0)


# ---- tars --------------------------------------------------------------------------------------

def test_pipe_commands_in_a_brace_pattern_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    data = f"{{pipe:touch {a},pipe:touch {b}}}"
    with pytest.raises(ValueError, match="--allow-pipe"):
        expand_tar_urls(data)
    assert not a.exists() and not b.exists()
    assert expand_tar_urls(data, allow_pipe=True) == [f"pipe:touch {a}", f"pipe:touch {b}"]
    with pytest.raises(ValueError, match="--allow-pipe"):
        expand_tar_urls(f"{{{tmp_path}/x.tar,pipe:touch {a}}}")
    assert not a.exists()


def test_expansion_to_no_shards_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    for data in (str(tmp_path / "empty"), "", "{,}"):
        with pytest.raises(ValueError, match="names no tar shards"):
            expand_tar_urls(data)


@pytest.mark.parametrize("name", ["data{1}", "x.tar", "data{1..2}.tar"])
def test_existing_folder_is_never_a_tar_pattern(tmp_path, name):
    root = make_folder(tmp_path / name, count=2)
    assert not is_tar_source(str(root))
    assert [e.source for e in list_folder(str(root)).entries] == ["00000.png", "00001.png"]
    tars = tmp_path / "tars.tar"
    make_tars(tars, count=2, per_tar=1)
    assert is_tar_source(str(tars)) and expand_tar_urls(str(tars)) == sorted(str(p) for p in tars.glob("*.tar"))


def test_tar_samples_carry_their_tar_and_stamp_zero(tmp_path):
    paths = make_tars(tmp_path / "tars", count=4, per_tar=2)
    data = paths[1].read_bytes()
    with tarfile.open(paths[1]) as tar:
        cut = tar.getmembers()[3].offset_data + 100  # inside the second sample's image
    paths[1].write_bytes(data[:cut])
    items = list(TarDataset([str(p) for p in paths], POLICY, frozenset(), ("caption",)))
    assert {it["stamp"] for it in items} == {0}
    ok = [it["source"] for it in items if it["status"] == "ok"]
    assert ok == ["data-0000.tar/00000000", "data-0000.tar/00000001"]  # webdataset drops the sample it was grouping
    assert [(it["source"], it["reason"]) for it in items if it["status"] == "failed"] == [(str(paths[1]), "corrupt_tar")]


def test_tar_json_caption_must_be_a_string(tmp_path):
    import io

    path = tmp_path / "t.tar"
    with tarfile.open(path, "w") as tar:
        for ext, data in (("jpg", make_image_bytes()), ("json", json.dumps({"caption": 42}).encode())):
            info = tarfile.TarInfo(f"k.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (item,) = TarDataset([str(path)], POLICY, frozenset(), ("caption",))
    assert (item["source"], item["reason"], item["stamp"]) == ("t.tar/k", "caption_not_string", 0)
