"""Damaged tars and Hugging Face datasets as stage one meets them: a tar that does not end as a whole tar does is a
named failure counted by the samples it lost, and its cached samples stay; a dataset's bad file or cell is a named
failure of its own, the rest is read."""

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import fsspec
import pytest

from precompute.config import PrecomputeConfig
from precompute.run import main as precompute
from precompute.sample_data import make_tars
from precompute.tars import TarDataset
from shards import Cache

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

POLICY = PrecomputeConfig("unused").policy()


def run(data, cache, **kw):
    return precompute(str(data), "tiny-sana", Path(cache), workers=0, progress=False, **kw)


def keys(cache) -> list[str]:
    return sorted(k for k, _ in Cache(cache).keys())


def read(urls, known=None) -> list[dict]:
    return list(TarDataset([str(u) for u in urls], POLICY, frozenset(), ("caption",), **({"known": known} if known else {})))


def failures(items) -> list[tuple[str, str]]:
    return [(Path(it["source"]).name, it["reason"]) for it in items if it["status"] == "failed"]


def zero_from(path: Path, cut: int) -> None:
    """Zeros from byte `cut` to the end, the file's size unchanged: a preallocated file whose download stopped."""
    data = path.read_bytes()
    path.write_bytes(data[:cut] + bytes(len(data) - cut))


def members_end(path: Path) -> int:
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + -(-last.size // 512) * 512


# ---- the end of a tar ------------------------------------------------------------------------------

def test_a_tar_whose_second_half_is_zeros_is_a_failure_and_its_samples_stay(tmp_path):
    tars = make_tars(tmp_path / "tars", count=12, per_tar=4)
    run(tmp_path / "tars", tmp_path / "cache")
    before = keys(tmp_path / "cache")
    zero_from(tars[1], tars[1].stat().st_size // 2)
    s = run(tmp_path / "tars", tmp_path / "cache")
    assert s["failed_by_reason"] == {"corrupt_tar": 1}
    assert s["removed"] == 0 and s["unchanged"] + s["kept_unreadable"] == 12  # read before the zeros, or kept
    assert keys(tmp_path / "cache") == before
    (failure,) = map(json.loads, (tmp_path / "cache" / "failures.jsonl").read_text().splitlines())
    assert failure["source"] == str(tars[1]) and "zeros" in failure["detail"] and "preallocated" in failure["detail"]


def test_zeros_where_members_should_be_fail_the_tar_and_count_what_is_missing(tmp_path):
    (path,) = make_tars(tmp_path, count=8, per_tar=8)
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[12].offset  # the fifth sample's header: members end here, zeros follow
    zero_from(path, cut)
    items = read([path])
    assert [it["source"] for it in items if it["status"] == "ok"] == [f"data-0000.tar/{i:08d}" for i in range(3)]
    (failed,) = [it for it in items if it["status"] == "failed"]
    assert failed["reason"] == "corrupt_tar" and "zeros" in failed["detail"]
    assert "truncated after 3 samples" in failed["detail"]  # the fourth is held back: its members may be cut
    assert 4 <= failed["samples"] <= 7  # estimated from the unread bytes at the mean sample size
    cached = {f"data-0000.tar/{i:08d}": (f"k{i}", 0) for i in range(8)}
    assert read([path], known=cached)[-1]["samples"] == 5  # a tar cached whole before: exactly what was not read


@pytest.mark.parametrize("tail", ["one zero block", "a record and a block of zeros", "data after the marker"])
def test_a_tar_must_end_at_its_end_of_archive_blocks(tmp_path, tail):
    (path,) = make_tars(tmp_path, count=2, per_tar=2)
    end = members_end(path)
    data = path.read_bytes()
    assert len(data) % tarfile.RECORDSIZE == 0 and not any(data[end:])
    if tail == "one zero block":
        path.write_bytes(data[: end + 512])
    elif tail == "a record and a block of zeros":
        path.write_bytes(data + bytes(512))
    else:
        path.write_bytes(data + data)  # two tars joined: tarfile would stop at the first marker
    assert failures(read([path])) == [("data-0000.tar", "corrupt_tar")]


def test_whole_tars_of_every_common_writer_read_whole(tmp_path):
    (path,) = make_tars(tmp_path / "tarfile", count=3, per_tar=3)  # padded to a record of 10240 bytes
    end = members_end(path)
    bare = tmp_path / "bare" / "data-0000.tar"  # the two zero blocks alone (Go's archive/tar, tar-stream)
    bare.parent.mkdir()
    bare.write_bytes(path.read_bytes()[: end + 1024])
    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()
    paths = [path, bare, empty]
    if shutil.which("tar"):
        gnu = tmp_path / "gnu" / "data-0000.tar"
        gnu.parent.mkdir()
        with tarfile.open(path) as tar:
            tar.extractall(tmp_path / "members", filter="data")
        subprocess.run(["tar", "-cf", str(gnu), "-C", str(tmp_path / "members"), *sorted(p.name for p in (tmp_path / "members").iterdir())],
                       check=True)
        paths.append(gnu)
    items = read(paths)
    assert failures(items) == []
    assert len(items) == 3 * (len(paths) - 1)


def test_a_tar_in_object_storage_with_zeros_for_members_fails(tmp_path):
    (path,) = make_tars(tmp_path, count=4, per_tar=4)
    zero_from(path, path.stat().st_size // 2)
    fs, url = fsspec.filesystem("memory"), f"memory://tars-{tmp_path.name}/data-0000.tar"
    fs.pipe_file(url, path.read_bytes())
    try:
        items = read([url])
    finally:
        fs.rm(url)
    assert failures(items) == [("data-0000.tar", "corrupt_tar")]
    assert "zeros" in items[-1]["detail"]


# ---- Hugging Face datasets --------------------------------------------------------------------------

def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (256, 256), (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


def hf_items(data, **kw) -> list[dict]:
    from precompute.hfdata import HFDataset, list_hf

    listing = list_hf(str(data), **kw)
    return list(HFDataset(listing, listing.parts, POLICY, frozenset()))


def test_image_paths_outside_the_dataset_folder_are_failures_of_their_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    (tmp_path / "secret.png").write_bytes(png())
    root = tmp_path / "ds"
    (root / "images").mkdir(parents=True)
    (root / "images" / "a.png").write_bytes(png())
    (root / "linked").symlink_to(tmp_path, target_is_directory=True)
    paths = ["images/a.png", str(root / "images" / "a.png"), str(tmp_path / "secret.png"), "../secret.png",
             "images/../../secret.png", "linked/secret.png", "images/a.png\x00.txt"]
    pq.write_table(pa.table({"image": [{"bytes": None, "path": p} for p in paths], "text": ["x"] * len(paths)}),
                   root / "train.parquet")
    items = hf_items(root / "train.parquet")
    assert [it["status"] for it in items[:2]] == ["ok", "ok"]  # inside the folder, relative or absolute
    for it, path in zip(items[2:-1], paths[2:-1]):
        assert (it["status"], it["reason"]) == ("failed", "outside_root"), path
        assert repr(path) in it["detail"] and "outside the dataset's folder" in it["detail"]
    assert (items[-1]["status"], items[-1]["reason"]) == ("failed", "unreadable")  # no file has a NUL in its name


def test_a_corrupt_or_empty_parquet_file_is_a_named_failure_and_the_others_are_read(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    root = tmp_path / "ds"
    root.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"image": [png()], "text": [f"row {i}"]}), root / f"part-{i}.parquet")
    (root / "part-1.parquet").write_bytes(b"PAR1 not a parquet file at all")
    (root / "part-3.parquet").write_bytes(b"")
    items = hf_items(root)
    assert sorted(it["source"] for it in items if it["status"] == "ok") == ["part-0.parquet:0", "part-2.parquet:0"]
    bad = {it["source"]: it for it in items if it["status"] == "failed"}
    assert sorted(bad) == ["part-1.parquet", "part-3.parquet"]
    assert all(it["reason"] == "unreadable" and str(root / it["source"]) in it["detail"] for it in bad.values())


def test_a_corrupt_parquet_file_keeps_its_cached_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    from precompute.sample_data import make_folder

    folder = make_folder(tmp_path / "images", count=4)
    images = sorted(folder.glob("*.png"))
    root = tmp_path / "ds"
    root.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"image": [p.read_bytes() for p in images[2 * i: 2 * i + 2]], "text": ["a", "b"]}),
                       root / f"part-{i}.parquet")
    assert run(root, tmp_path / "cache")["new"] == 4
    before = keys(tmp_path / "cache")
    (root / "part-1.parquet").write_bytes(b"")
    s = run(root, tmp_path / "cache", max_removal_fraction=1.0)
    assert (s["unchanged"], s["failed"], s["removed"], s["kept_unreadable"]) == (2, 2, 0, 2)
    assert keys(tmp_path / "cache") == before
    lines = [json.loads(line) for line in (tmp_path / "cache" / "failures.jsonl").read_text().splitlines()]
    assert sorted(f["source"] for f in lines) == ["part-1.parquet:0", "part-1.parquet:1"]


@pytest.mark.parametrize("cells", ["int", "struct"])
def test_an_image_column_of_the_wrong_type_is_named_with_its_type(tmp_path, cells):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    image = [7] if cells == "int" else [{"width": 7, "height": 9}]
    pq.write_table(pa.table({"image": image, "text": ["x"]}), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"train.parquet: the image column 'image' is of type (int64|struct<width: int64, "
                                         r"height: int64>); an image column holds .*bytes.*path.*image_column"):
        hf_items(tmp_path / "train.parquet")


def test_a_tar_cut_short_counts_the_samples_it_lost_toward_the_failure_fraction(tmp_path):
    tars = make_tars(tmp_path / "tars", count=12, per_tar=4)
    run(tmp_path / "tars", tmp_path / "cache")
    with tarfile.open(tars[1]) as tar:
        cut = tar.getmembers()[6].offset
    tars[1].write_bytes(tars[1].read_bytes()[:cut])
    s = run(tmp_path / "tars", tmp_path / "cache")
    assert (s["unchanged"], s["failed"], s["failed_by_reason"], s["removed"]) == (9, 3, {"corrupt_tar": 1}, 0)
    assert s["failure_fraction"] == 3 / 12 > 0.1  # over the default --max-failure-fraction: the command exits 1
    (failure,) = map(json.loads, (tmp_path / "cache" / "failures.jsonl").read_text().splitlines())
    assert failure["samples"] == 3 and "truncated after 1 samples, about 3 sample(s) missing" in failure["detail"]


def test_zeros_for_the_rest_of_a_new_tar_count_its_unread_bytes(tmp_path):
    tars = make_tars(tmp_path / "tars", count=12, per_tar=4)
    data = tars[1].read_bytes()
    tars[1].write_bytes(data[: len(data) // 4] + bytes(len(data) - len(data) // 4))
    s = run(tmp_path / "tars", tmp_path / "cache")
    assert s["failed_by_reason"] == {"corrupt_tar": 1} and s["failed"] >= 3 and s["failure_fraction"] > 0.1


def test_absolute_image_paths_inside_a_dataset_reached_through_a_symlink_are_read(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    real = tmp_path / "gpfs" / "ds"
    (real / "images").mkdir(parents=True)
    (real / "images" / "a.png").write_bytes(png())
    alias = tmp_path / "home-ds"
    alias.symlink_to(real, target_is_directory=True)  # DATA given by another name of the same folder
    paths = [str(real / "images" / "a.png"), str(alias / "images" / "a.png")]
    pq.write_table(pa.table({"image": [{"bytes": None, "path": p} for p in paths], "text": ["x"] * 2}),
                   real / "train.parquet")
    assert [it["status"] for it in hf_items(alias / "train.parquet")] == ["ok", "ok"]
    assert [it["status"] for it in hf_items(real / "train.parquet")] == ["ok", "ok"]
