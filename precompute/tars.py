"""Webdataset tars as inputs (img2dataset's layout): which DATA names tars, the tars it names, their samples.

Tars in object storage (`s3://`, `gs://`, `hf://`, any fsspec URL) are listed and read through fsspec; `pipe:`
commands and http(s) URLs through webdataset's `gopen`; both are unpacked by tarfile as a stream, their members
grouped into samples by webdataset, and must end with the end-of-archive blocks where the file ends. A sample's
control image (ControlNet caches) is its `control.png` / `control.jpg` member (`KEY.control.png` beside `KEY.jpg`), and
its loss mask (masked training) its `mask.png` member (`KEY.mask.png`), and an edit sample's reference images its
`ref.png` member, or `ref0.png`, `ref1.png`, ... in their numbers' order (`KEY.ref.png`, `KEY.ref0.png`, ...; any image
extension), which are never its image.
"""

from __future__ import annotations

import json
import posixpath
import re
import tarfile
from collections.abc import Iterator
from glob import has_magic
from pathlib import Path

import torch

from precompute.clips import prepare_clips
from precompute.folders import INPUT_EXTENSIONS, METADATA_FILES, VIDEO_EXTENSIONS, in_order, metadata_captions
from precompute.images import ImagePolicy, Record, prepare
from precompute.paths import names_under

STREAMED = ("http://", "https://", "pipe:")  # opened by webdataset's gopen, read once as a stream
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif")  # a sample's image, the first present
CONTROL_MEMBERS = tuple(f"control.{ext}" for ext in IMAGE_MEMBERS)  # its control image, the first present
MASK_MEMBERS = tuple(f"mask.{ext}" for ext in IMAGE_MEMBERS)  # its loss mask, the first present
VIDEO_MEMBERS = tuple(ext.lstrip(".") for ext in VIDEO_EXTENSIONS)  # a sample's video (mp4, webm, mov, mkv...)
REFERENCE_MEMBER = re.compile(rf"ref(\d*)\.({'|'.join(IMAGE_MEMBERS)})", re.IGNORECASE)  # ref.png, ref0.png, ref1.jpg...


def is_stored(url: str) -> bool:
    """Whether a tar URL names an object in storage fsspec reads (s3://, gs://, hf://, file://, memory://...)."""
    return "://" in url and not url.startswith(STREAMED)


def is_tar_source(data: str) -> bool:
    """Whether DATA names webdataset tars: a .tar path, a brace pattern, a URL, or a folder holding tars
    and no images or metadata. An existing folder is never a pattern, whatever its name."""
    path = Path(data)
    if _is_dir(path):
        return any(path.glob("*.tar")) and not any(
            p.suffix.lower() in INPUT_EXTENSIONS for p in path.iterdir()
        ) and not any((path / name).exists() for name in METADATA_FILES)
    return data.startswith(STREAMED) or is_stored(data) or "{" in data or data.endswith(".tar")


MAX_SHARDS = 1_000_000  # names a pattern may expand to: a few hundred MiB of strings already
MAX_NESTING = 32  # braces inside braces; braceexpand recurses once per level


def expansion_size(data: str) -> int:
    """How many names `braceexpand(data)` yields, counted without building them (it materialises every range and
    list it meets, so a pattern like {0..99999999999} would fill memory first). Follows braceexpand's grammar:
    a part that is not a range or a list stays literal, braces included.

    Raises:
        ValueError: braces that do not pair, or nest deeper than MAX_NESTING.
    """
    from braceexpand import alphabet, char_range_re, int_range_re

    depth = deepest = 0
    escaped = False
    for c in data:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c in "{}":
            depth += 1 if c == "{" else -1
            deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        raise ValueError(f"braces nest {deepest} deep, more than {MAX_NESTING}")

    def pattern(text: str) -> int:  # braceexpand.parse_pattern: the product of its parts
        count, start, pos, depth = 1, 0, 0, 0
        while pos < len(text):
            if text[pos] == "\\":
                pos += 2
                continue
            if text[pos] == "{":
                if depth == 0 and pos > start:
                    start = pos
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    count *= expression(text[start + 1 : pos])
                    start = pos + 1
            pos += 1
        if depth != 0:
            raise ValueError("its braces do not pair")
        return count

    def expression(text: str) -> int:  # braceexpand.parse_expression: a range, a list, or literal braces
        if match := int_range_re.match(text):
            first, last, step = int(match[1]), int(match[2]), int(match[3] or 1) or 1
            return abs(last - first) // step + 1  # len(range(...)), which overflows past sys.maxsize
        if match := char_range_re.match(text):
            first, last, step = alphabet.index(match[1]), alphabet.index(match[2]), int(match[3] or 1) or 1
            return len(alphabet[first : last + 1 : step] if first < last else alphabet[first : (last or -len(alphabet)) - 1 : -step])
        items, start, pos, depth = [], 0, 0, 0
        while pos < len(text):
            if text[pos] == "\\":
                pos += 2
                continue
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
            elif text[pos] == "," and depth == 0:
                items.append(text[start:pos])
                start = pos + 1
            pos += 1
        if depth != 0 or not items:
            return pattern(text)
        return sum(pattern(item) for item in items) + pattern(text[start:])

    return pattern(data)


def expand_tar_urls(data: str, allow_pipe: bool = False) -> list[str]:
    """The list of tar shards DATA names, in order. In object storage a URL may also be a glob pattern or a
    directory of tars; they are listed once per directory.

    Raises:
        ValueError: DATA names no shard, its braces do not pair, it expands to more than MAX_SHARDS names, a name is
            not a path, or a shard is a `pipe:` command and `allow_pipe` is False.
        FileNotFoundError: a shard does not exist, or a glob pattern matches none.
    """
    import braceexpand

    path = Path(data)
    if _is_dir(path):
        urls = sorted(str(p) for p in path.glob("*.tar"))
    else:
        try:
            size = expansion_size(data)
        except ValueError as e:
            raise ValueError(f"DATA={data}: {e}; a brace pattern reads like /data/{{00000..00999}}.tar, and \\{{ is a "
                             f"literal brace") from None
        if size > MAX_SHARDS:
            raise ValueError(f"DATA={data} expands to {size} names, more than the {MAX_SHARDS} a run takes: check its "
                             f"ranges ({{00000..00999}} names 1000 shards)")
        urls = [u for u in braceexpand.braceexpand(data) if u]
    if not urls:
        raise ValueError(f"DATA={data} names no tar shards")
    piped = [u for u in urls if u.startswith("pipe:")]
    if piped and not allow_pipe:  # checked per shard: a brace pattern can expand to commands
        raise ValueError(f"DATA={data} runs shell commands ({piped[0]!r}, ...); pass --allow-pipe if you trust them")
    for u in urls:
        if "\x00" in u:
            raise ValueError(f"tar shard {u!r} holds a NUL character: not a path (from DATA={data})")
        if not u.startswith(STREAMED) and not is_stored(u) and not _exists(Path(u)):
            raise FileNotFoundError(f"tar shard {u} does not exist (from DATA={data})")
    return stored_tars(urls, data)


def _is_dir(path: Path) -> bool:
    """Whether a path is a directory; a name the system refuses (too long, say) is not one."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def stored_tars(urls: list[str], data: str) -> list[str]:
    """`urls` with those in object storage checked to exist, glob patterns and directories replaced by the tars
    they hold (sorted). One listing per directory, not one request per tar."""
    from fsspec.core import url_to_fs

    out, listings = [], {}
    for url in urls:
        if not is_stored(url):
            out.append(url)
            continue
        try:
            fs, path = url_to_fs(url)
        except (ValueError, ImportError) as e:  # a protocol fsspec does not know, or whose package is missing
            raise ValueError(f"tar shard {url}: {e} (from DATA={data})") from None
        path = path.rstrip("/")
        if has_magic(path):
            found = sorted(fs.glob(path))
            if not found:
                raise FileNotFoundError(f"{url} matches no file (from DATA={data})")
            out += [fs.unstrip_protocol(p) for p in found]
            continue
        parent = posixpath.dirname(path)
        key = fs.unstrip_protocol(parent)  # the directory with its store's protocol
        if key not in listings:
            listings[key] = entry_types(fs, parent)
        kind = listings[key].get(path)
        if kind is None:
            raise FileNotFoundError(f"tar shard {url} does not exist (from DATA={data})")
        if kind == "directory":
            found = sorted(fs.glob(f"{path}/*.tar"))
            if not found:
                raise FileNotFoundError(f"{url} holds no .tar files (from DATA={data})")
            out += [fs.unstrip_protocol(p) for p in found]
        else:
            out.append(url)
    return out


def entry_types(fs, directory: str) -> dict[str, str]:
    """path -> "file" or "directory" of what a directory in storage holds (nothing if it does not exist)."""
    try:
        return {info["name"].rstrip("/"): info["type"] for info in fs.ls(directory, detail=True)}
    except FileNotFoundError:
        return {}


def tar_name(url: str) -> str:
    """The name a tar's samples carry as the prefix of their source: `{tar_name(url)}/{key}`."""
    return Path(url).name


def tar_records(sample: dict, caption_keys: tuple[str, ...], control: bool = False, mask: bool = False,
                video: bool = False, references: bool = False) -> Record:
    """A webdataset sample dict (raw bytes per extension) as a Record; with `control`, its `control.EXT` member
    is the control image; with `mask`, its `mask.EXT` member the loss mask; with `references`, its `ref.EXT` member or
    its `ref0.EXT`, `ref1.EXT`, ... members the reference images (`precompute.folders.in_order` says how numbers go).
    Its input is its image member, or its video member (`KEY.mp4`, ...) when it has no image; with `video` (a video
    model's cache), the video when it has both (a video beside its thumbnail)."""
    source = f"{tar_name(sample.get('__url__', ''))}/{sample['__key__']}"
    found = [(sample[ext], False) for ext in IMAGE_MEMBERS if ext in sample][:1]
    found += [(sample[ext], True) for ext in VIDEO_MEMBERS if ext in sample][:1]
    if not found:
        return Record(source, None, missing="not_an_image")
    image, is_video = found[-1] if video else found[0]
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
    record = Record(source, image, captions, video=is_video)
    if control:
        record.control = next((sample[ext] for ext in CONTROL_MEMBERS if ext in sample), None)
        record.control_detail = f"no member {sample['__key__']}.control.png (or another image extension) in the tar"
    if mask:
        record.mask = next((sample[ext] for ext in MASK_MEMBERS if ext in sample), None)
        record.mask_detail = f"no member {sample['__key__']}.mask.png (or another image extension) in the tar"
    if references:
        key = sample["__key__"]
        numbered = [(int(m[1] or 0), f"{key}.{ext}") for ext in sample
                    if isinstance(ext, str) and (m := REFERENCE_MEMBER.fullmatch(ext))]
        found, reason, detail = in_order(numbered, key + ".ref{n}.png")
        if not numbered:
            record.references_detail = (f"no member {key}.ref.png (or {key}.ref0.png, {key}.ref1.png, ...; any image "
                                        f"extension) in the tar")
        elif found is None:
            record.references_missing, record.references_detail = reason, f"{detail} in the tar"
        else:
            record.references = [sample[name[len(key) + 1 :]] for name in found]
            record.reference_names = found
    return record


RECORD = tarfile.RECORDSIZE  # 10240 bytes: tarfile, GNU tar and bsdtar pad an archive to a whole record of 20 blocks
META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members, never a sample's


class TarCutShort(ValueError):
    """A tar whose members do not end with the end-of-archive blocks at the end of the file: cut short, or zeros (a
    preallocated partial download) or other data where members should be. `end` is where its members end and
    `size` the file's size (None for a stream): what is missing can be estimated from them."""

    def __init__(self, message: str, end: int, size: int | None):
        super().__init__(message)
        self.end, self.size = end, size


class _Header(tarfile.TarInfo):
    """A member header that records on its archive why the archive ended: tarfile ends a stream without an error at
    a zero block, at the end of the data and at a block that is not a header, and only the first is the marker."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as e:
            tar.ended_at = e
            raise


def check_end(tar: tarfile.TarFile, size: int | None) -> None:
    """After a tar's last member: the end-of-archive marker (two zero blocks) must follow it, and nothing but the
    zeros padding the archive to a whole record after that, up to the end of the file.

    Raises:
        TarCutShort: the marker is missing, or more than one record of zeros (a preallocated file not downloaded
            whole) or other data follows the members; the message says which.
    """
    end, reason = tar.offset, getattr(tar, "ended_at", None)  # where the members end, and why tarfile stopped
    if isinstance(reason, (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError)):
        raise TarCutShort(f"ends at byte {tar.fileobj.tell()} after its members, without the "
                          f"end-of-archive blocks: a partial download or copy?", end, size)
    if not isinstance(reason, tarfile.EOFHeaderError):
        raise TarCutShort(f"the block at byte {end} after the members is not a tar header ({reason}): the tar is damaged "
                          f"from there on", end, size)
    boundary = -(-(end + 2 * tarfile.BLOCKSIZE) // RECORD) * RECORD  # the padding may reach the record's end, no further
    rest = tar.fileobj.read(boundary - tar.fileobj.tell() + 1)
    stop = tar.fileobj.tell()
    if stop < end + 2 * tarfile.BLOCKSIZE:
        raise TarCutShort(f"ends at byte {stop}, inside the end-of-archive blocks: a partial download or copy?", end, size)
    if rest.count(0) != len(rest) or stop > boundary:
        zeros = rest.count(0) == len(rest)
        what = ("zeros" if zeros else "data") + f" from byte {end} to " + (f"byte {size}" if size else "past the record's end")
        raise TarCutShort(f"its members end at byte {end} but the file holds {what}, where only the end-of-archive "
                          f"blocks padded to {RECORD} bytes belong: " + ("a preallocated file not downloaded whole?" if zeros
                          else "a damaged tar, or tars joined end to end (read each on its own)"), end, size)


def tar_samples(url: str) -> Iterator[dict]:
    """webdataset's sample dicts (`__key__`, `__url__`, raw bytes per extension) of one tar, read as a stream. The last
    sample is yielded only once the end-of-archive marker is found where the file ends (`check_end`): a tar cut
    between members reads without an error in tarfile, its last sample possibly missing members.

    Raises:
        TarCutShort: the tar does not end as a whole tar does.
        Exception: tarfile, gopen or fsspec errors of a damaged or unreachable tar.
    """
    import fsspec
    from webdataset.gopen import gopen
    from webdataset.tariterators import group_by_keys

    if url.startswith(STREAMED):
        opened, size = gopen(url), None
    else:
        opened = fsspec.open(url, "rb")
        size = opened.fs.size(opened.path)

    def members(stream) -> Iterator[dict]:  # webdataset's tar_file_iterator, with the end checked
        tar = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_Header)
        # the file's size in the archive's bytes: not of a compressed tar
        archive_size = size if getattr(tar.fileobj, "comptype", "tar") == "tar" else None
        for info in tar:
            if info.isreg() and not META.match(info.name):
                yield {"fname": info.name, "data": tar.extractfile(info).read(), "__url__": url}
            tar.members = []
        check_end(tar, archive_size)
        yield {}  # the end of the shard: group_by_keys yields its last sample

    with opened as stream:
        yield from group_by_keys(members(stream))


def missing_estimate(error: Exception, read: int, cached: int) -> int:
    """About how many samples of a tar that failed after `read` samples were not read: those cached from it before
    that were not read again or, for a tar never cached whose rest is zeros, as many as its size holds at the mean
    size of the samples its members held (those read and the one held back); at least one."""
    if cached:
        return max(cached - read, 1)
    if isinstance(error, TarCutShort) and error.size and error.end:
        return max(round(error.size * (read + 1) / error.end) - read, 1)
    return 1


class TarDataset(torch.utils.data.IterableDataset):
    """This rank's tar shards, split further over DataLoader workers; yields `prepare`'s output with
    `stamp` 0 (unknown: a tar's samples are always read), or in a video model's cache `prepare_clips`' (`known`:
    input name -> its cached clips).

    A tar that cannot be read, or does not end as a whole tar does (`check_end`), is reported once as a
    `corrupt_tar` failure whose source is the tar's URL, after the samples read before the error, and the run goes
    on. The failure's `samples` is how many of the tar's samples it stands for: those not read (`missing_estimate`),
    which `known` (input name -> (key, stamp) of the source's cached samples, as `tar_name(url)/KEY`) makes exact
    for a tar cached whole before.
    """

    def __init__(self, urls: list[str], policy: ImagePolicy, skip_keys: frozenset[str], caption_keys: tuple[str, ...],
                 known: dict[str, tuple[str, int]] | None = None):
        self.urls, self.policy, self.skip_keys, self.caption_keys = urls, policy, skip_keys, caption_keys
        self.known = known or {}
        self._sorted: list[str] | None = None

    def sorted_known(self) -> list[str]:
        if self._sorted is None:  # sorted once, when a tar first fails
            self._sorted = sorted(self.known)
        return self._sorted

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        urls = self.urls[info.id :: info.num_workers] if info else self.urls
        for url in urls:
            stream, read = tar_samples(url), 0
            while True:
                try:
                    sample = next(stream)
                except StopIteration:
                    break
                except Exception as e:  # tarfile, gopen or fsspec errors: the shard is unreadable from here on
                    prefix = tar_name(url) + "/"
                    missing = missing_estimate(e, read, len(names_under(self.sorted_known(), prefix)))
                    cut = f"truncated after {read} samples, " if read or isinstance(e, TarCutShort) else ""
                    yield {"status": "failed", "source": url, "reason": "corrupt_tar", "stamp": 0, "samples": missing,
                           "detail": f"{type(e).__name__}: {e}; {cut}about {missing} sample(s) missing"}
                    break
                read += 1
                video = self.policy.clip is not None
                record = tar_records(sample, self.caption_keys, self.policy.control, self.policy.mask == "file", video,
                                     self.policy.references)
                if video:  # a video model's: its clips, not decoded again when its cached clips' keys are its own
                    yield from prepare_clips(record, self.policy, self.skip_keys, 0, self.known.get(record.source))
                else:
                    yield {**prepare(record, self.policy, self.skip_keys), "stamp": 0}
