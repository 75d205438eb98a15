"""Stage one's inputs of an edit model: every kind of source finds a target image's reference images (sidecars,
a metadata column, reference folders, tar members, a dataset column) in order; bad or missing references are named
failures; reference files are never training images; the references' bytes join the sample's keys and their files'
stamps join the input's stamp. The family's preparation is stubbed here (the families' own tests check theirs)."""

import io
import json
import os
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import precompute.config
from precompute.config import PrecomputeConfig
from precompute.folders import FolderDataset, entry_stamp, list_folder, with_reference_folder
from precompute.hfdata import HFDataset, list_hf, row_stamp
from precompute.images import Record, content_key, latent_key, prepare
from precompute.inputs import REASONS, open_inputs, pixels_as_array
from precompute.presets import get_preset
from precompute.sample_data import make_edit_folder
from precompute.sources import KEYS, Source, read_dataset_file
from precompute.tars import TarDataset
from shards.references import references_digest

SIZES = [(40, 24), (24, 40), (32, 48), (48, 32)]  # (width, height) of references 0, 1, 2, 3: each tells which it is


def stub_prepare(image: Image.Image, index: int, count: int) -> dict:
    """What a family's prepare_reference returns, with what the stub was given: the image's size, its place."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
    return {"pixels": pixels, "seen": (image.size, index, count)}


POLICY = replace(PrecomputeConfig("unused", allow_upscale=True).policy(), references=True, max_references=3, prepare_reference=stub_prepare)
PLAIN = PrecomputeConfig("unused", allow_upscale=True).policy()  # a model that takes no references


def png(size=(64, 64), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def target(folder: Path, name: str, caption: str = "make it red") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png())
    path.with_suffix(".txt").write_text(caption)
    return path


def refs(folder: Path, names: list[str]) -> None:
    """Reference files, the i-th of size SIZES[i] (by its place in `names`)."""
    for i, name in enumerate(names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(png(SIZES[i], (10 * i, 90, 200)))


def items(root: Path, policy=POLICY, **listing) -> dict[str, dict]:
    found = list_folder(root, references=policy.references, **listing)
    dataset = FolderDataset(found.entries, policy, frozenset())
    return {it["source"]: it for i in range(len(dataset)) for it in dataset.items(i)}


def seen(item: dict) -> list:
    """The (size, index, count) each of an item's references was prepared with, in its order."""
    assert item["status"] == "ok", item
    return [ref["seen"] for ref in item["reference_pixels"]]


def test_sidecars_in_order_and_never_images_with_or_without_references(tmp_path):
    target(tmp_path, "a.png")
    refs(tmp_path, ["a.ref.png"])
    target(tmp_path, "b.png")
    refs(tmp_path, ["b.ref0.jpg", "b.ref1.png", "b.ref2.webp"])
    target(tmp_path, "sub/c.jpg")
    refs(tmp_path, ["sub/c.REF1.PNG", "sub/c.ref2.png"])  # any case; numbered from 1
    target(tmp_path, "d.png")
    refs(tmp_path, ["d.ref.png", "d.ref1.png"])  # x.ref is number 0
    got = items(tmp_path)
    assert sorted(got) == ["a.png", "b.png", "d.png", "sub/c.jpg"]
    assert seen(got["a.png"]) == [(SIZES[0], 0, 1)]
    assert seen(got["b.png"]) == [(SIZES[0], 0, 3), (SIZES[1], 1, 3), (SIZES[2], 2, 3)]
    assert seen(got["sub/c.jpg"]) == [(SIZES[0], 0, 2), (SIZES[1], 1, 2)]
    assert seen(got["d.png"]) == [(SIZES[0], 0, 2), (SIZES[1], 1, 2)]
    b = [(tmp_path / n).read_bytes() for n in ("b.ref0.jpg", "b.ref1.png", "b.ref2.webp")]
    assert got["b.png"]["reference_digest"] == references_digest(b)
    # without --references the sidecars are still no images, and a model without references gets no reference entries
    plain = items(tmp_path, PLAIN)
    assert sorted(plain) == sorted(got) and all("reference_pixels" not in it for it in plain.values())
    assert all(it["key"] == content_key((tmp_path / s).read_bytes(), ["make it red"]) for s, it in plain.items())


def test_a_reference_is_read_as_images_are_exif_orientation_applied_rgb(tmp_path):
    target(tmp_path, "a.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to view
    Image.new("RGBA", SIZES[0], (10, 20, 30, 0)).convert("RGB").save(tmp_path / "a.ref.jpg", exif=exif)
    Image.new("LA", SIZES[0], (100, 0)).save(tmp_path / "b.ref.png")  # grey with alpha: composited on white, RGB
    target(tmp_path, "b.png")
    got = items(tmp_path)
    assert seen(got["a.png"]) == [(SIZES[0][::-1], 0, 1)]
    pixels = got["b.png"]["reference_pixels"][0]["pixels"]
    assert pixels.shape[0] == 3 and torch.all(pixels == 1)  # fully transparent: white


def test_sidecars_that_make_no_sequence_are_named_failures(tmp_path):
    for name, files in {"gap.png": ["gap.ref0.png", "gap.ref2.png"], "twice.png": ["twice.ref.png", "twice.ref0.png"],
                        "ext.png": ["ext.ref1.png", "ext.ref1.jpg"], "none.png": []}.items():
        target(tmp_path, name)
        refs(tmp_path, files)
    got = items(tmp_path)
    assert {s: it["reason"] for s, it in got.items()} == {"gap.png": "missing_reference", "twice.png": "ambiguous_reference",
                                                          "ext.png": "ambiguous_reference", "none.png": "missing_reference"}
    assert "no gap.ref1.<image extension>" in got["gap.png"]["detail"]
    assert "twice.ref.png and" in got["twice.png"]["detail"] and "twice.ref0.png" in got["twice.png"]["detail"]
    assert "no none.ref.<image extension>" in got["none.png"]["detail"]
    assert all(reason in REASONS for reason in ("missing_reference", "ambiguous_reference", "unreadable_reference",
                                                "corrupt_reference", "too_many_references"))


def test_unreadable_corrupt_and_too_many_references_skip_their_sample(tmp_path):
    target(tmp_path, "fifo.png")
    os.mkfifo(tmp_path / "fifo.ref.png")  # a special file is never opened
    target(tmp_path, "bad.png")
    refs(tmp_path, ["bad.ref0.png"])
    (tmp_path / "bad.ref1.png").write_bytes(b"not an image")
    target(tmp_path, "empty.png")
    (tmp_path / "empty.ref.png").write_bytes(b"")
    target(tmp_path, "many.png")
    refs(tmp_path, [f"many.ref{i}.png" for i in range(4)])
    target(tmp_path, "big.png")
    (tmp_path / "big.ref.png").write_bytes(png((80, 80)))  # over the pixel limit, which the 64x64 target is not
    got = items(tmp_path, replace(POLICY, max_pixels=64 * 64))
    assert {s: it["reason"] for s, it in got.items() if it["status"] == "failed"} == {
        "fifo.png": "unreadable_reference", "bad.png": "corrupt_reference", "empty.png": "corrupt_reference",
        "many.png": "too_many_references", "big.png": "corrupt_reference"}
    # the reference and Pillow's error named, and nothing that changes from run to run (an object's address)
    assert got["bad.png"]["detail"] == ("reference 2 of 2 (bad.ref1.png): not_an_image: UnidentifiedImageError: the bytes "
                                        "are in no image format Pillow reads")
    assert "4 reference images" in got["many.png"]["detail"] and "the 3 the model takes" in got["many.png"]["detail"]
    assert "too_many_pixels" in got["big.png"]["detail"] and "fifo.ref.png" in got["fifo.png"]["detail"]


def test_keys_cover_the_references_bytes_and_a_plain_sample_keeps_its_key():
    image, captions = png(), ["make it red"]
    one, two = png(SIZES[0]), png(SIZES[1])
    plain = prepare(Record("x.png", image, captions), PLAIN)
    assert plain["key"] == content_key(image, captions) and plain["latent_key"] == latent_key(image)
    edit = prepare(Record("x.png", image, captions, references=[one, two]), POLICY)
    assert edit["key"] != plain["key"] and edit["latent_key"] != plain["latent_key"]
    assert edit["key"] == content_key(image, captions, references=[one, two])
    same = prepare(Record("y.png", image, captions, references=[one, two]), POLICY)
    assert (same["key"], same["latent_key"]) == (edit["key"], edit["latent_key"])
    for changed in ([one, png(SIZES[1], (1, 2, 3))], [two, one], [one]):  # one reference's bytes, their order, how many
        other = prepare(Record("x.png", image, captions, references=changed), POLICY)
        assert other["key"] != edit["key"] and other["latent_key"] != edit["latent_key"]
    assert prepare(Record("x.png", image, captions, references=[one, two]), POLICY, {edit["key"]})["status"] == "unchanged"
    # a source without references in an edit model's cache: its key as ever, and no references
    t2i = prepare(Record("x.png", image, captions), replace(POLICY, references=False))
    assert t2i["key"] == plain["key"] and t2i["reference_pixels"] == [] and "reference_digest" not in t2i
    arrays = pixels_as_array(edit)
    assert all(isinstance(ref["pixels"], np.ndarray) for ref in arrays["reference_pixels"])
    assert isinstance(edit["reference_pixels"][0]["pixels"], torch.Tensor)  # the worker's own item is left as it was


def test_stamps_notice_an_edited_reference(tmp_path):
    target(tmp_path, "a.png")
    refs(tmp_path, ["a.ref0.png", "a.ref1.png"])
    target(tmp_path, "b.png")
    refs(tmp_path, ["b.ref.png"])

    def stamps() -> dict[str, int]:
        return {e.source: entry_stamp(e) for e in list_folder(tmp_path, references=True).entries}

    before = stamps()
    plain = {e.source: entry_stamp(e) for e in list_folder(tmp_path).entries}
    assert plain["a.png"] != before["a.png"]  # the references are part of the input
    (tmp_path / "a.ref1.png").write_bytes(png(SIZES[1], (1, 2, 3)))
    os.utime(tmp_path / "a.ref1.png", ns=(1, 1))
    after = stamps()
    assert after["a.png"] != before["a.png"] and after["b.png"] == before["b.png"]
    # an unchanged stamp is not read; a changed one is read and its new key found
    known = {"a.png": ("old", before["a.png"]), "b.png": ("kept", before["b.png"])}
    dataset = FolderDataset(list_folder(tmp_path, references=True).entries, POLICY, frozenset(), known)
    got = {it["source"]: it for i in range(len(dataset)) for it in dataset.items(i)}
    assert got["b.png"]["status"] == "unchanged" and got["a.png"]["status"] == "ok"


def test_a_metadata_column_names_references_and_sidecars_work_beside_it(tmp_path):
    rows = [{"file_name": "a.png", "text": "one", "reference_file_name": "refs/a-before.png"},
            {"file_name": "b.png", "text": "two", "reference_file_name": ["refs/b0.png", "refs/b1.png"]},
            {"file_name": "c.png", "text": "three"},  # its sidecar
            {"file_name": "d.png", "text": "four", "reference_file_name": "../outside.png"},
            {"file_name": "e.png", "text": "five", "reference_file_name": "refs/gone.png"},
            {"file_name": "f.png", "text": "six", "reference_file_name": [3]},
            {"file_name": "c.ref.png", "text": "a reference is no image"}]
    for name in "abcdef":
        target(tmp_path, f"{name}.png")
    refs(tmp_path, ["refs/a-before.png"])
    refs(tmp_path, ["refs/b0.png", "refs/b1.png"])
    refs(tmp_path, ["c.ref.png"])
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    listing = list_folder(tmp_path, references=True)
    assert {f["source"]: f["reason"] for f in listing.failures} == {
        "d.png": "outside_root", "f.png": "bad_metadata_row", "c.ref.png": "bad_metadata_row"}
    got = items(tmp_path)
    assert seen(got["a.png"]) == [(SIZES[0], 0, 1)] and seen(got["c.png"]) == [(SIZES[0], 0, 1)]
    assert seen(got["b.png"]) == [(SIZES[0], 0, 2), (SIZES[1], 1, 2)]
    assert got["e.png"]["reason"] == "missing_reference" and "gone.png" in got["e.png"]["detail"]
    # a CSV cell holds one path or a JSON list of them; the column may be renamed
    (tmp_path / "metadata.jsonl").unlink()
    (tmp_path / "metadata.csv").write_text('file_name,text,before\na.png,one,refs/a-before.png\n'
                                           'b.png,two,"[""refs/b1.png"", ""refs/b0.png""]"\n')
    got = items(tmp_path, reference_column="before")
    assert seen(got["a.png"]) == [(SIZES[0], 0, 1)] and seen(got["b.png"]) == [(SIZES[1], 0, 2), (SIZES[0], 1, 2)]


def test_reference_folders_by_relative_name(tmp_path):
    images, before = tmp_path / "images", tmp_path / "before"
    for name in ("a.png", "sub/b.jpg", "c.png", "d.png", "d_0.png"):
        target(images, name)
    refs(before, ["a.webp"])
    refs(before, ["sub/b_0.png", "sub/b_1.png", "sub/b_2.png"])  # musubi-tuner's numbered names
    refs(before, ["d.png"])  # d's exact name wins; d_0.png is the image d_0's
    refs(before, ["d_0.jpg"])
    entries = with_reference_folder(list_folder(images).entries, (before,))
    dataset = FolderDataset(entries, POLICY, frozenset())
    got = {it["source"]: it for i in range(len(dataset)) for it in dataset.items(i)}
    assert seen(got["a.png"]) == [(SIZES[0], 0, 1)] and seen(got["d.png"]) == [(SIZES[0], 0, 1)]
    assert seen(got["sub/b.jpg"]) == [(SIZES[0], 0, 3), (SIZES[1], 1, 3), (SIZES[2], 2, 3)]
    assert seen(got["d_0.png"]) == [(SIZES[0], 0, 1)]
    assert got["c.png"]["reason"] == "missing_reference" and "no c.<image extension> (or c_0" in got["c.png"]["detail"]
    # one folder per reference (ai-toolkit's control_path_1, _2): reference i of a/x.png is a/x.EXT in the i-th
    second = tmp_path / "second"
    refs(second, ["x.png", "a.png"])
    entries = with_reference_folder(list_folder(images).entries, (before, second))
    dataset = FolderDataset(entries, POLICY, frozenset())
    got = {it["source"]: it for i in range(len(dataset)) for it in dataset.items(i)}
    assert seen(got["a.png"]) == [(SIZES[0], 0, 2), (SIZES[1], 1, 2)]
    assert got["d.png"]["reason"] == "missing_reference" and str(second) in got["d.png"]["detail"]
    with pytest.raises(FileNotFoundError, match="nowhere is not a folder"):
        with_reference_folder([], (tmp_path / "nowhere",))


def tar_of(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_tar_members_are_references_never_images(tmp_path):
    url = tar_of(tmp_path / "data.tar", {
        "a.png": png(), "a.txt": b"one", "a.ref.png": png(SIZES[0]),
        "b.jpg": png(), "b.txt": b"two", "b.ref1.png": png(SIZES[1]), "b.ref0.jpg": png(SIZES[0]),
        "c.png": png(), "c.txt": b"three",
        "d.png": png(), "d.txt": b"four", "d.ref0.png": png(SIZES[0]), "d.ref2.png": png(SIZES[1])})
    got = {it["source"]: it for it in TarDataset([str(url)], POLICY, frozenset(), ("caption",))}
    assert seen(got["data.tar/a"]) == [(SIZES[0], 0, 1)]
    assert seen(got["data.tar/b"]) == [(SIZES[0], 0, 2), (SIZES[1], 1, 2)]
    assert got["data.tar/c"]["reason"] == "missing_reference" and "c.ref.png" in got["data.tar/c"]["detail"]
    assert got["data.tar/d"]["reason"] == "missing_reference" and "d.ref1" in got["data.tar/d"]["detail"]
    plain = {it["source"]: it for it in TarDataset([str(url)], PLAIN, frozenset(), ("caption",))}
    assert {s: it["status"] for s, it in plain.items()} == dict.fromkeys(got, "ok")  # no member became an image


def test_a_hugging_face_dataset_reference_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    refs(tmp_path, ["files/a.png"])
    table = pa.table({
        "image": pa.array([{"bytes": png(), "path": None}] * 4, image),
        "text": ["one", "two", "three", "four"],
        "reference_image": pa.array([[{"bytes": png(SIZES[0]), "path": None}],
                                     [{"bytes": png(SIZES[0]), "path": None}, {"bytes": png(SIZES[1]), "path": None}],
                                     [], [{"bytes": None, "path": "files/a.png"}]], pa.list_(image))})
    pq.write_table(table, tmp_path / "train.parquet")
    listing = list_hf(str(tmp_path / "train.parquet"), reference_column="reference_image")
    got = {it["source"]: it for it in HFDataset(listing, listing.parts, POLICY, frozenset())}
    assert seen(got["train.parquet:0"]) == [(SIZES[0], 0, 1)]
    assert seen(got["train.parquet:1"]) == [(SIZES[0], 0, 2), (SIZES[1], 1, 2)]
    assert got["train.parquet:2"]["reason"] == "missing_reference"
    assert seen(got["train.parquet:3"]) == [(SIZES[0], 0, 1)]
    # a reference named by path stamps its row: editing it makes the row changed
    stamp = got["train.parquet:3"]["stamp"]
    (tmp_path / "files/a.png").write_bytes(png(SIZES[0], (9, 9, 9)))
    os.utime(tmp_path / "files/a.png", ns=(5, 5))
    again = {it["source"]: it for it in HFDataset(listing, listing.parts, POLICY, frozenset())}
    assert again["train.parquet:3"]["stamp"] != stamp and again["train.parquet:0"]["stamp"] == got["train.parquet:0"]["stamp"]
    assert row_stamp(b"f", 0) == row_stamp(b"f", 0, references=[])  # a row without references stamps as ever
    # one image per cell, in a renamed column; a missing column names the fix
    pq.write_table(pa.table({"image": pa.array([{"bytes": png(), "path": None}], image), "text": ["one"],
                             "before": pa.array([{"bytes": png(SIZES[1]), "path": None}], image)}), tmp_path / "train.parquet")
    listing = list_hf(str(tmp_path / "train.parquet"), reference_column="before")
    assert seen(next(iter(HFDataset(listing, listing.parts, POLICY, frozenset())))) == [(SIZES[1], 0, 1)]
    with pytest.raises(ValueError, match="no reference column 'reference_image'.*set reference_column"):
        list_hf(str(tmp_path / "train.parquet"), reference_column="reference_image")


def test_the_edit_sample_data(tmp_path):
    make_edit_folder(tmp_path / "one", 3)
    make_edit_folder(tmp_path / "three", 2, references=3)
    got = items(tmp_path / "one")
    assert len(got) == 3 and all(len(seen(it)) == 1 for it in got.values())
    assert all(open(tmp_path / "one" / s.replace(".png", ".txt")).read().startswith("make the ") for s in got)
    got = items(tmp_path / "three")
    assert len(got) == 2 and all(len(seen(it)) == 3 for it in got.values())
    for s in got:  # every reference at another size than its target
        size = Image.open(tmp_path / "three" / s).size
        assert all(Image.open(tmp_path / "three" / s.replace(".png", f".ref{k}.png")).size != size for k in range(3))


def test_source_keys_record_and_salt(tmp_path):
    assert {"references", "reference_folder", "reference_column"} <= KEYS
    (tmp_path / "d.toml").write_text('[[source]]\npath = "imgs"\nreference_folder = "before"\n'
                                     '[[source]]\npath = "more"\nreference_folder = ["r1", "/abs/r2"]\n'
                                     '[[source]]\npath = "hf"\nreference_column = "src"\n'
                                     '[[source]]\npath = "t2i"\n')
    one, two, three, plain = read_dataset_file(tmp_path / "d.toml")
    assert one.reference_folder == (str(tmp_path / "before"),) and two.reference_folder == (str(tmp_path / "r1"), "/abs/r2")
    assert all(s.takes_references for s in (one, two, three)) and not plain.takes_references
    assert one.record()["references"] is True and one.record()["reference_folder"] == [str(tmp_path / "before")]
    assert "references" not in plain.record() and plain.salt() == 0
    assert Source("x", "p", references=True).salt() != 0
    assert Source("x", "p", references=True).salt() != Source("x", "p", reference_column="c").salt()
    for bad, said in (("references = 1", "must be true or false"), ('reference_folder = ""', "must be a folder"),
                      ("reference_folder = []", "must be a folder"), ("reference_column = 3", "must be a string")):
        (tmp_path / "bad.toml").write_text(f'[[source]]\npath = "imgs"\n{bad}\n')
        with pytest.raises(ValueError, match=f"bad.toml:3: .*{said}"):
            read_dataset_file(tmp_path / "bad.toml")


def test_references_need_an_edit_preset_and_an_edit_only_preset_needs_them(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--references pairs images with reference images.*--model tiny-sana takes none"):
        PrecomputeConfig(str(tmp_path), references=True)
    (tmp_path / "d.toml").write_text('[[source]]\npath = "imgs"\nreference_folder = "before"\n')
    with pytest.raises(ValueError, match=r"source 'imgs': reference_folder pairs images .*drop reference_folder"):
        PrecomputeConfig(str(tmp_path / "d.toml"))
    edit = replace(get_preset("tiny-sana"), references=2, requires_references=True)
    monkeypatch.setattr(precompute.config, "get_preset", lambda name: edit if name == "tiny-sana" else get_preset(name))
    with pytest.raises(ValueError, match=r"tiny-sana is an edit model.*Pass --references .*or set references = true"):
        PrecomputeConfig(str(tmp_path))
    config = PrecomputeConfig(str(tmp_path), references=True)
    assert config.sources()[0].takes_references and config.policy().max_references == 2
    (tmp_path / "two.toml").write_text('[[source]]\npath = "edits"\nreferences = true\n[[source]]\npath = "plain"\n')
    with pytest.raises(ValueError, match=r"edit model: .* source 'plain' has none.*references = true"):
        PrecomputeConfig(str(tmp_path / "two.toml"))
    # a model that also takes text-to-image samples (requires_references False) takes sources without references
    mixed = replace(edit, requires_references=False)
    monkeypatch.setattr(precompute.config, "get_preset", lambda name: mixed if name == "tiny-sana" else get_preset(name))
    assert [s.takes_references for s in PrecomputeConfig(str(tmp_path / "two.toml")).sources()] == [True, False]
    with pytest.raises(ValueError, match="flip = true with reference images"):
        (tmp_path / "f.toml").write_text('[[source]]\npath = "imgs"\nreferences = true\nflip = true\n')
        PrecomputeConfig(str(tmp_path / "f.toml"))



def test_a_reference_folder_or_column_where_the_source_keeps_references_otherwise_is_refused(tmp_path):
    url = tar_of(tmp_path / "data.tar", {"a.png": png(), "a.txt": b"one"})
    config = PrecomputeConfig(str(tmp_path))

    def opened(source: Source):
        return open_inputs(config, source, POLICY, {}, frozenset(), rank=0, world=1)

    with pytest.raises(ValueError, match=r"reference_folder .*KEY\.ref\.png .*remove reference_folder"):
        opened(Source("t", str(url), reference_folder=("before",)))
    with pytest.raises(ValueError, match=r"reference_column .*KEY\.ref\.png .*remove reference_column"):
        opened(Source("t", str(url), reference_column="before"))
    target(tmp_path / "imgs", "a.png")
    with pytest.raises(FileNotFoundError, match=r"source 'i': reference_folder: .*nowhere is not a folder"):
        opened(Source("i", str(tmp_path / "imgs"), reference_folder=(str(tmp_path / "nowhere"),)))
