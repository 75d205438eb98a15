"""Caption files that are not UTF-8 (cp1252, latin-1: common in scraped sets) are read as such and reported in the
prepared item; UTF-8 reads as before; text that cannot be UTF-8 at all (a JSON lone surrogate) is still refused."""

import io
import json

from PIL import Image

from precompute.config import PrecomputeConfig
from precompute.folders import FolderDataset, list_folder
from precompute.images import Record, content_key, prepare
from precompute.inputs import REASONS

POLICY = PrecomputeConfig("unused").policy()
TEXT = "café — naïve"


def image_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (200, 20, 20)).save(buf, format="PNG")
    return buf.getvalue()


def prepared(tmp_path, caption: bytes) -> dict:
    """A folder of one image with `caption` as its sidecar file, read the way stage one reads it."""
    (tmp_path / "x.png").write_bytes(image_bytes())
    (tmp_path / "x.txt").write_bytes(caption)
    return FolderDataset(list_folder(tmp_path).entries, POLICY, frozenset())[0]


def test_a_cp1252_caption_is_read_and_reported(tmp_path):
    raw = TEXT.encode("cp1252")
    assert b"\x97" in raw  # the em dash: not UTF-8, and not latin-1 text either
    item = prepared(tmp_path, raw + b"\r\n")
    assert item["status"] == "ok" and item["captions"] == [TEXT]
    assert item["caption_fallback"] == "cp1252"
    assert item["key"] == content_key(image_bytes(), [TEXT])  # keyed by the text, as the same caption in UTF-8
    assert item["key"] == prepare(Record("y", image_bytes(), [TEXT.encode("utf-8")]), POLICY)["key"]


def test_bytes_cp1252_leaves_undefined_are_read_as_latin1(tmp_path):
    raw = "naïve".encode("latin-1") + b" \x81\x8d"  # 0x81 and 0x8D: C1 controls in latin-1, undefined in cp1252
    item = prepared(tmp_path, raw)
    assert item["status"] == "ok" and item["captions"] == ["naïve \x81\x8d"]
    assert item["caption_fallback"] == "latin-1"


def test_utf8_with_a_byte_order_mark_is_unchanged(tmp_path):
    item = prepared(tmp_path, b"\xef\xbb\xbf" + TEXT.encode("utf-8"))
    assert item["status"] == "ok" and item["captions"] == [TEXT]
    assert "caption_fallback" not in item


def test_a_lone_surrogate_in_metadata_is_still_refused(tmp_path):
    (tmp_path / "x.png").write_bytes(image_bytes())
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "x.png", "text": "a \ud800 circle"}) + "\n")
    listing = list_folder(tmp_path)
    items = [FolderDataset(listing.entries, POLICY, frozenset())[i] for i in range(len(listing.entries))]
    failures = [(f["source"], f["reason"]) for f in listing.failures + [i for i in items if i["status"] == "failed"]]
    assert failures == [("x.png", "caption_not_utf8")] and "caption_not_utf8" in REASONS
