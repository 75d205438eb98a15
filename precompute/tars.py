"""Webdataset tars as inputs (img2dataset's layout): which DATA names tars, the tars it names, their samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from precompute.folders import IMAGE_EXTENSIONS, METADATA_FILES, metadata_captions
from precompute.images import ImagePolicy, Record, prepare

REMOTE_PREFIXES = ("http://", "https://", "pipe:", "gs://", "s3://")


def is_tar_source(data: str) -> bool:
    """Whether DATA names webdataset tars: a .tar path, a brace pattern, a URL, or a folder holding tars
    and no images or metadata. An existing folder is never a pattern, whatever its name."""
    path = Path(data)
    if path.is_dir():
        return any(path.glob("*.tar")) and not any(
            p.suffix.lower() in IMAGE_EXTENSIONS for p in path.iterdir()
        ) and not any((path / name).exists() for name in METADATA_FILES)
    return data.startswith(REMOTE_PREFIXES) or "{" in data or data.endswith(".tar")


def expand_tar_urls(data: str, allow_pipe: bool = False) -> list[str]:
    """The list of tar shards DATA names, in order.

    Raises:
        ValueError: DATA names no shard, or a shard is a `pipe:` command and `allow_pipe` is False.
        FileNotFoundError: a local shard does not exist.
    """
    import braceexpand

    path = Path(data)
    if path.is_dir():
        urls = sorted(str(p) for p in path.glob("*.tar"))
    else:
        urls = [u for u in braceexpand.braceexpand(data) if u]
    if not urls:
        raise ValueError(f"DATA={data} names no tar shards")
    piped = [u for u in urls if u.startswith("pipe:")]
    if piped and not allow_pipe:  # checked per shard: a brace pattern can expand to commands
        raise ValueError(f"DATA={data} runs shell commands ({piped[0]!r}, ...); pass --allow-pipe if you trust them")
    for u in urls:
        if not u.startswith(REMOTE_PREFIXES) and not Path(u).exists():
            raise FileNotFoundError(f"tar shard {u} does not exist (from DATA={data})")
    return urls


def tar_name(url: str) -> str:
    """The name a tar's samples carry as the prefix of their source: `{tar_name(url)}/{key}`."""
    return Path(url).name


def tar_records(sample: dict, caption_keys: tuple[str, ...]) -> Record:
    """A webdataset sample dict (raw bytes per extension) as a Record."""
    source = f"{tar_name(sample.get('__url__', ''))}/{sample['__key__']}"
    image = next((sample[ext] for ext in ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif") if ext in sample), None)
    if image is None:
        return Record(source, None, missing="not_an_image")
    captions: list[bytes | str] = []
    if "txt" in sample:
        captions.append(sample["txt"])
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            meta = {}
        for k in caption_keys:
            found = metadata_captions(meta.get(k) if isinstance(meta, dict) else None, from_csv=False)
            if found is None:
                return Record(source, None, missing="caption_not_string", detail=f"json {k!r} is {meta[k]!r}")
            captions += found
    return Record(source, image, captions)


def tar_ends_properly(url: str) -> bool:
    """Whether a local tar ends with the end-of-archive marker (two zero blocks, padded to 512-byte blocks). A tar
    cut at a member boundary reads without an error in tarfile, its last members silently missing; only the
    marker tells. Remote tars cannot be checked without reading them again and pass."""
    path = Path(url)
    if url.startswith(REMOTE_PREFIXES) or not path.is_file():
        return True
    size = path.stat().st_size
    if size < 1024 or size % 512:
        return False
    with open(path, "rb") as f:
        f.seek(size - 1024)
        return f.read(1024) == bytes(1024)


class TarDataset(torch.utils.data.IterableDataset):
    """This rank's tar shards, split further over DataLoader workers; yields `prepare`'s output with
    `stamp` 0 (unknown: a tar's samples are always read).

    A tar that cannot be read is reported once as a `corrupt_tar` failure whose source is the tar's URL,
    after the samples read before the error, and the run goes on; a local tar that lacks its end-of-archive
    marker (cut short) is reported without reading any of it.
    """

    def __init__(self, urls: list[str], policy: ImagePolicy, skip_keys: frozenset[str], caption_keys: tuple[str, ...]):
        self.urls, self.policy, self.skip_keys, self.caption_keys = urls, policy, skip_keys, caption_keys

    def __iter__(self) -> Iterator[dict]:
        import webdataset as wds

        info = torch.utils.data.get_worker_info()
        urls = self.urls[info.id :: info.num_workers] if info else self.urls
        for url in urls:
            if not tar_ends_properly(url):  # read nothing of it: its last sample may have lost members too
                yield {"status": "failed", "source": url, "reason": "corrupt_tar", "stamp": 0,
                       "detail": "ends without the end-of-archive blocks: a partial download or copy?"}
                continue
            stream = iter(wds.WebDataset(url, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False))
            while True:
                try:
                    sample = next(stream)
                except StopIteration:
                    break
                except Exception as e:  # tarfile / gopen errors: the shard is unreadable from here on
                    yield {"status": "failed", "source": url, "reason": "corrupt_tar", "detail": f"{type(e).__name__}: {e}",
                           "stamp": 0}
                    break
                yield {**prepare(tar_records(sample, self.caption_keys), self.policy, self.skip_keys), "stamp": 0}
