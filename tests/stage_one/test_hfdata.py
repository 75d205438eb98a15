"""A Hugging Face dataset on disk as a source: `save_to_disk` folders and parquet files written by `datasets`
itself, read incrementally like a folder."""

import io
import json
import os

import pytest
import torch
from PIL import Image

from precompute.config import PrecomputeConfig
from precompute.hfdata import HFDataset, is_hf_dataset, list_hf
from precompute.hffiles import PartReader
from precompute.run import main as precompute
from precompute.sample_data import make_folder
from shards import Cache, load

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

datasets = pytest.importorskip("datasets")

RUN = dict(workers=0, progress=False, batch_size=4, max_shard_mb=0)


def folder_rows(folder) -> tuple[list[bytes], list[str], list[str]]:
    """(image bytes, caption, name) of a sample folder's files, as a dataset holds them."""
    images = sorted(folder.glob("*.png"))
    return ([p.read_bytes() for p in images], [p.with_suffix(".txt").read_text(encoding="utf-8").strip() for p in images],
            [p.name for p in images])


def as_dataset(images: list, captions: list, image_column="image", caption_column="text"):
    """A `datasets.Dataset` with an Image column holding the given bytes (None: a row without an image)."""
    cells = [None if b is None else {"bytes": b, "path": None} for b in images]
    ds = datasets.Dataset.from_dict({image_column: cells, caption_column: captions})
    return ds.cast_column(image_column, datasets.Image())


def cached(cache) -> dict[str, dict[str, torch.Tensor]]:
    return {sample.key: sample.fields for sample in (Cache(cache)[i] for i in range(len(Cache(cache))))}


def test_a_saved_dataset_caches_what_the_same_images_in_a_folder_cache(tmp_path):
    folder = make_folder(tmp_path / "folder", count=6, seed=3)
    images, captions, _ = folder_rows(folder)
    as_dataset(images, captions).save_to_disk(str(tmp_path / "saved"), num_shards=3)  # several Arrow files
    assert is_hf_dataset(str(tmp_path / "saved")) and not is_hf_dataset(str(folder))
    listing = list_hf(str(tmp_path / "saved"))
    assert len(listing.files) > 1 and listing.rows == 6

    summary = precompute(str(tmp_path / "saved"), "tiny-sana", tmp_path / "from-hf", **RUN)
    assert summary["new"] == 6 and summary["failed"] == 0
    precompute(str(folder), "tiny-sana", tmp_path / "from-folder", **RUN)
    hf, plain = cached(tmp_path / "from-hf"), cached(tmp_path / "from-folder")
    assert hf.keys() == plain.keys()  # content keys: the same image bytes and captions
    for key in hf:
        assert torch.equal(hf[key]["latent"], plain[key]["latent"]) and torch.equal(hf[key]["text"], plain[key]["text"])
    inputs = {src for _, src, *_ in load(tmp_path / "from-hf").samples()}
    assert all(":" in s and s.split(":")[0].endswith(".arrow") for s in inputs)

    # a second run reads nothing: every part's rows are known with their stamps
    def never(*args):
        raise AssertionError("an unchanged part was read")

    original = PartReader.read
    PartReader.read = never
    try:
        summary = precompute(str(tmp_path / "saved"), "tiny-sana", tmp_path / "from-hf", **RUN)
    finally:
        PartReader.read = original
    assert (summary["unchanged"], summary["new"], summary["removed"]) == (6, 0, 0)


def test_parquet_files_of_a_hub_layout_with_their_split_and_columns(tmp_path):
    images, captions, _ = folder_rows(make_folder(tmp_path / "folder", count=7, seed=4))
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    train = as_dataset(images[:5], [[c, c.upper()] for c in captions[:5]], "jpg", "prompts")
    train.select(range(3)).to_parquet(str(hub / "data" / "train-00000-of-00002.parquet"))
    train.select(range(3, 5)).to_parquet(str(hub / "data" / "train-00001-of-00002.parquet"))
    as_dataset(images[5:], [[c] for c in captions[5:]], "jpg", "prompts").to_parquet(str(hub / "data" / "test-00000-of-00001.parquet"))
    assert is_hf_dataset(str(hub)) and is_hf_dataset(str(hub / "data" / "train-*.parquet"))

    with pytest.raises(ValueError, match=r"no image column 'image'.*jpg.*image_column"):
        list_hf(str(hub))
    with pytest.raises(ValueError, match=r"no caption column 'prompt' \(did you mean 'prompts'\?\)"):
        list_hf(str(hub), image_column="jpg", caption_column="prompt")
    with pytest.raises(ValueError, match=r"no parquet file of split 'validation'.*test, train"):
        list_hf(str(hub), split="validation")
    assert list_hf(str(hub), "test", "jpg", "prompts").rows == 2

    file = tmp_path / "data.toml"
    file.write_text(f'[[source]]\nname = "hub"\npath = "{hub}"\nimage_column = "jpg"\ncaption_column = "prompts"\n', encoding="utf-8")
    cache = tmp_path / "cache"
    summary = precompute(str(file), "tiny-sana", cache, **RUN)
    assert summary["sources"]["hub"]["new"] == 5  # the train split alone
    assert [int(s["text_lengths"].numel()) for s in cached(cache).values()] == [2] * 5  # both captions of each row
    assert {src.split(":")[0] for _, src, *_ in load(cache).samples()} == {
        "data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"}

    # a rewritten file is read again: its rows are unchanged by content, one row less is one removal
    train.select(range(3, 4)).to_parquet(str(hub / "data" / "train-00001-of-00002.parquet"))
    summary = precompute(str(file), "tiny-sana", cache, **RUN)
    assert {k: summary["sources"]["hub"][k] for k in ("unchanged", "new", "removed")} == {"unchanged": 4, "new": 0, "removed": 1}


def test_a_dataset_dict_split_and_rows_without_image_or_caption(tmp_path):
    images, captions, _ = folder_rows(make_folder(tmp_path / "folder", count=4, seed=5))
    broken = b"\x89PNG\r\n\x1a\n not really"
    train = as_dataset([images[0], None, broken, images[1], images[2]], [captions[0], "a caption", "x", None, captions[2]])
    datasets.DatasetDict(train=train, validation=as_dataset(images[3:], captions[3:])).save_to_disk(str(tmp_path / "dd"))

    with pytest.raises(ValueError, match=r"without a split 'test'; its splits are train, validation"):
        list_hf(str(tmp_path / "dd"), split="test")
    summary = precompute(str(tmp_path / "dd"), "tiny-sana", tmp_path / "cache", **RUN)
    failures = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    reasons = {f["source"]: f["reason"] for f in failures}
    assert reasons == {"train/data-00000-of-00001.arrow:1": "no_image", "train/data-00000-of-00001.arrow:2": "not_an_image",
                       "train/data-00000-of-00001.arrow:3": "missing_caption"}
    assert summary["new"] == 2

    # a default caption takes the captionless row; the validation split is its own source
    file = tmp_path / "data.toml"
    file.write_text(f'[[source]]\nname = "train"\npath = "{tmp_path / "dd"}"\ndefault_caption = "a shape"\n\n'
                    f'[[source]]\nname = "val"\npath = "{tmp_path / "dd"}"\nsplit = "validation"\n', encoding="utf-8")
    summary = precompute(str(file), "tiny-sana", tmp_path / "cache2", **RUN)
    assert summary["sources"]["train"]["new"] == 3 and summary["sources"]["val"]["new"] == 1


def test_rows_are_split_over_ranks_and_loader_workers_once_each(tmp_path):
    images, captions, _ = folder_rows(make_folder(tmp_path / "folder", count=9, seed=6))
    path = tmp_path / "one.parquet"
    as_dataset(images, captions).to_parquet(str(path), batch_size=2)  # row groups of 2
    listing = list_hf(str(path))
    assert [p.rows for p in listing.parts] == [2, 2, 2, 2, 1] and listing.files[0][0] == "one.parquet"
    policy = PrecomputeConfig("unused").policy()
    seen = []
    for rank in range(2):
        dataset = HFDataset(listing, listing.parts[rank::2], policy, frozenset())
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
        seen += [item["source"] for item in loader]
    assert sorted(seen) == sorted(f"one.parquet:{i}" for i in range(9))


def test_a_row_naming_its_image_by_path_is_read_and_stamped_by_that_file(tmp_path):
    folder = make_folder(tmp_path / "images", count=2, seed=7)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"image": [{"bytes": None, "path": "images/00000.png"}, {"bytes": None, "path": str(folder / "00001.png")}],
                      "text": ["first", "second"]})
    pq.write_table(table, tmp_path / "paths.parquet")
    cache = tmp_path / "cache"
    assert precompute(str(tmp_path / "paths.parquet"), "tiny-sana", cache, **RUN)["new"] == 2
    img = Image.open(folder / "00000.png")
    img.transpose(Image.FLIP_LEFT_RIGHT).save(folder / "00000.png")  # the file named, not the parquet, changes
    os.utime(folder / "00000.png", ns=(1, 1))
    summary = precompute(str(tmp_path / "paths.parquet"), "tiny-sana", cache, **RUN)
    assert (summary["changed"], summary["unchanged"]) == (1, 1)


def test_a_folder_with_a_metadata_file_stays_a_folder(tmp_path):
    folder = make_folder(tmp_path / "f", count=1)
    (folder / "metadata.jsonl").write_text('{"file_name": "00000.png", "text": "x"}\n', encoding="utf-8")
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    as_dataset([buf.getvalue()], ["x"]).to_parquet(str(folder / "extra.parquet"))
    assert not is_hf_dataset(str(folder))
