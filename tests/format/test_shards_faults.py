"""Faults of the cache's log and snapshots: a commit lost from the middle or the end of the log, damaged commits
and snapshots, a damaged `index.json`, and a commit that appears while a reader lists the log. Each stops with a
message naming the file and what to do; nothing is deleted on the way."""

import json
import os
import re
from pathlib import Path

import pytest
from conftest import FINGERPRINT, SCHEMA, write_cache
from shards_testing import cli, files

import shards
from shards import Cache, DamagedCache, FormatError, ShardWriter, gc, open_cache, verify
from shards.log import snapshots

REPAIR_HINT = "Re-encode the damaged samples"  # the start of the shard repair the reader recommends


def commit_path(root: Path, generation: int) -> Path:
    return root / "_log" / f"{generation:012d}.json"


def test_a_commit_missing_mid_log_is_damage_and_nothing_is_deleted(tmp_path):
    root = tmp_path / "cache"
    write_cache(root, range(12), max_shard_samples=1)  # one shard and one commit per sample: generations 0..11
    lost = commit_path(root, 5)
    backup = lost.read_bytes()
    lost.unlink()
    before = files(root)
    for open_it in (lambda: Cache(root), lambda: Cache(root, generation=2), lambda: open_cache(f"file://{root}")):
        with pytest.raises(DamagedCache, match=r"000000000005\.json is missing, but 6 later commit\(s\) are there "
                                               r"\(000000000006\.json.* 000000000011\.json\).*backup"):
            open_it()
    with pytest.raises(DamagedCache, match="000000000005.json is missing"):
        ShardWriter(root, FINGERPRINT, SCHEMA)  # would delete the shards of commits 5..11 as never committed
    with pytest.raises(DamagedCache, match="000000000005.json is missing"):
        gc(root)
    assert files(root) == before  # nothing deleted, nothing re-published under the names the later commits list
    report = verify(root)
    assert not report.ok and report.bad_files == [str(lost)]
    for command in ("verify", "ls", "inspect", "gc"):
        result = cli(command, root)
        assert result.exit_code == 1 and str(lost) in result.output, (command, result.output)
        assert isinstance(result.exception, SystemExit) and REPAIR_HINT not in result.output
    assert files(root) == before
    lost.write_bytes(backup)  # restored from a backup: the cache is whole again
    assert len(Cache(root)) == 12 and verify(root).ok


def test_a_commit_missing_before_the_newest_snapshot_is_reported(tmp_path, monkeypatch):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    assert snapshots(tmp_path)[-1] == 11
    commit_path(tmp_path, 5).unlink()
    assert len(Cache(tmp_path)) == 12  # the newest generation comes from its snapshot
    report = verify(tmp_path)  # generations 5..10 cannot be read any more
    assert report.bad_files == [str(commit_path(tmp_path, 5))] and "backup" in report.problems[0][1]


def flip_in_snapshot(path: Path, tensor: str) -> None:
    """Flip one byte of a tensor of a snapshot, as a bad disk would: the file still opens."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    raw[8 + n + begin] ^= 0x01
    path.write_bytes(bytes(raw))


SNAPSHOT_TENSOR = {"flipped digest": "shards.sha256", "flipped size": "shards.bytes",  # the shard table
                   "flipped sample index": "samples.shard", "flipped key": "samples.key"}  # the sample index


@pytest.mark.parametrize("damage", [*SNAPSHOT_TENSOR, "truncated"])
def test_a_damaged_snapshot_is_named_and_healthy_shards_are_not_blamed(tmp_path, monkeypatch, damage):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    newest = tmp_path / "_snapshots" / "000000000011.safetensors"
    expected = [k for k, _ in Cache(tmp_path).keys()]
    if damage == "truncated":
        os.truncate(newest, newest.stat().st_size - 40)
    else:
        flip_in_snapshot(newest, SNAPSHOT_TENSOR[damage])
    before = files(tmp_path)
    report = verify(tmp_path)
    assert report.bad_files == [str(newest)]
    assert "restore it from a backup" in report.problems[0][1].lower() and REPAIR_HINT not in report.problems[0][1]
    in_index = SNAPSHOT_TENSOR.get(damage, "").startswith("samples.")
    if in_index:  # opening the cache does not read the sample index: what reads it finds the damage
        assert len(Cache(tmp_path)) == 12
    uses = [lambda: list(Cache(tmp_path).keys()), lambda: Cache(tmp_path).manifest.by_source(),
            lambda: ShardWriter(tmp_path, FINGERPRINT, SCHEMA), lambda: gc(tmp_path)]
    for use in uses if in_index else [lambda: Cache(tmp_path), *uses]:
        with pytest.raises(DamagedCache, match=r"000000000011\.safetensors is damaged.*move it out of the cache"):
            use()
    assert files(tmp_path) == before  # gc and the writer deleted nothing: the log is the way back
    for command in ("verify", "ls") if in_index else ("verify", "ls", "inspect"):
        result = cli(command, tmp_path)
        assert result.exit_code == 1 and str(newest) in result.output, (command, result.output)
        assert isinstance(result.exception, SystemExit) and REPAIR_HINT not in result.output
    newest.rename(tmp_path.parent / "aside.safetensors")  # what the message offers: the log replays it exactly
    assert [k for k, _ in Cache(tmp_path).keys()] == expected and verify(tmp_path).ok


def test_opening_a_cache_does_not_read_its_sample_index(tmp_path, monkeypatch):
    """At 10M samples the sample index is most of a snapshot's gigabytes: opening hashes the shard table alone, and
    the index is checked where it is read."""
    import hashlib
    import re

    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    assert snapshots(tmp_path)[-1] == 11  # the newest generation is its snapshot alone, no commit after it
    hashed, real = [], hashlib.sha256

    class Spy:
        def __init__(self, data=b"", **kwargs):
            self.h = real(**kwargs)
            self.update(data)

        def update(self, data):
            hashed.append(bytes(data))
            self.h.update(data)

        def __getattr__(self, name):
            return getattr(self.h, name)

    monkeypatch.setattr(hashlib, "sha256", Spy)
    keys_tensor = re.compile(rb"key\d{5}key\d{5}")  # the snapshot's samples.key bytes: keys back to back
    cache = Cache(tmp_path)
    assert len(cache) == 12 and hashed  # the shard table is checked
    assert not [chunk for chunk in hashed if keys_tensor.search(chunk)]
    assert len(list(cache.keys())) == 12
    assert [chunk for chunk in hashed if keys_tensor.search(chunk)]  # checked when read


@pytest.mark.parametrize("damage", ["truncated", "flipped digest"])
def test_a_damaged_commit_is_a_damaged_cache_naming_the_commit(tmp_path, damage):
    write_cache(tmp_path, range(6), max_shard_samples=1)
    last = commit_path(tmp_path, 5)
    text = last.read_text()
    if damage == "truncated":
        last.write_text(text[: len(text) // 2])
    else:  # still valid JSON: the shard's listed sha256 differs in one digit
        commit = json.loads(text)
        digest = commit["add"][0]["sha256"]
        last.write_text(text.replace(digest, ("1" if digest[0] == "0" else "0") + digest[1:]))
    for open_it in (lambda: Cache(tmp_path), lambda: ShardWriter(tmp_path, FINGERPRINT, SCHEMA), lambda: gc(tmp_path)):
        with pytest.raises(DamagedCache, match=r"000000000005\.json is damaged.*backup"):
            open_it()
    report = verify(tmp_path)
    assert report.bad_files == [str(last)] and REPAIR_HINT not in report.problems[0][1]
    result = cli("verify", tmp_path)
    assert result.exit_code == 1 and f"BAD {last}" in result.output


def test_a_writer_refuses_a_log_whose_first_commit_is_lost(tmp_path):
    write_cache(tmp_path, range(6), max_shard_samples=1)
    commit_path(tmp_path, 0).unlink()
    before = files(tmp_path)
    with pytest.raises((DamagedCache, FileNotFoundError, FormatError)) as caught:
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)
    assert isinstance(caught.value, DamagedCache) and "000000000000.json is missing" in str(caught.value)
    assert files(tmp_path) == before


def test_a_snapshot_of_an_empty_cache_loads(tmp_path, monkeypatch):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 1)  # a snapshot after every commit
    write_cache(tmp_path, range(3))
    with ShardWriter(tmp_path, FINGERPRINT, SCHEMA) as w:
        assert w.remove({"key00000", "key00001", "key00002"}) == 3
    assert snapshots(tmp_path)[-1] == Cache(tmp_path).generation and len(Cache(tmp_path)) == 0
    assert verify(tmp_path).ok


def test_a_log_whose_end_was_lost_is_refused_when_the_pointer_says_so(tmp_path, monkeypatch):
    import shards.generations

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 4)
    write_cache(tmp_path, range(12), max_shard_samples=1)
    assert snapshots(tmp_path)[-1] == json.loads((tmp_path / "index.json").read_text())["snapshot_generation"] == 11
    for g in (10, 11):  # the newest commits and the snapshot index.json names are lost
        commit_path(tmp_path, g).unlink()
    (tmp_path / "_snapshots" / "000000000011.safetensors").unlink()
    before = files(tmp_path)
    with pytest.raises(DamagedCache, match=r"names snapshot .*000000000011\.safetensors, but the log and snapshots end at "
                                           r"generation 9"):
        ShardWriter(tmp_path, FINGERPRINT, SCHEMA)  # would delete the shards of commits 10 and 11 as never committed
    assert files(tmp_path) == before and not verify(tmp_path).ok


def test_an_index_json_that_is_not_utf8_is_a_format_error_naming_it(tmp_path):
    write_cache(tmp_path, range(1))
    pointer = tmp_path / "index.json"
    data = bytearray(pointer.read_bytes())
    data[20] = 0xE9
    pointer.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"index\.json is not valid JSON.*the log under _log/ is the truth"):
        Cache(tmp_path)


def test_a_snapshot_whose_replaced_map_cannot_be_read_is_named(tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    monkeypatch.setattr(shards.generations, "COMPACT_MIN", 3)
    write_cache(tmp_path, range(8), max_shard_samples=1)  # a commit a shard, snapshots every few
    path = max((tmp_path / "_snapshots").glob("*.safetensors"))  # an older generation reads its repairs here
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    del meta["replaced"]  # as a flipped byte in its name would leave it; its digest (whose name may be hit too) gone
    meta.pop("sha256", None)
    save_file(tensors, path, meta)
    with pytest.raises(DamagedCache, match=re.escape(str(path))):
        Cache(tmp_path, generation=0)


def test_a_commit_written_while_the_log_is_listed_is_read_not_taken_for_a_gap(tmp_path, monkeypatch):
    write_cache(tmp_path, range(4), max_shard_samples=1)  # a commit a shard
    log = tmp_path / "_log"
    held = {p.name: p.read_bytes() for p in sorted(log.glob("*.json"))[2:]}
    for name in held:
        (log / name).unlink()
    real = shards.generations.read_commit

    def racing(path):  # a writer commits the rest right after a reader found the next commit missing
        commit = real(path)
        if commit is None and held:
            for name, data in held.items():
                (log / name).write_bytes(data)
            held.clear()
        return commit

    monkeypatch.setattr(shards.generations, "read_commit", racing)
    assert sorted(k for k, _ in Cache(tmp_path).keys()) == [f"key{i:05d}" for i in range(4)]
