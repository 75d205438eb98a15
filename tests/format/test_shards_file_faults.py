"""Faults of shard and prompts files and of the folders around them: a missing shard, a shard header that renames
a tensor, a damaged prompts file, a symbolic link in a remote cache's local folder, and verify beside a running
writer. Each is named with what to do, and nothing outside the cache is touched."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import FINGERPRINT, SCHEMA, make_sample, write_cache
from shards_testing import cli

import shards
from shards import Cache, DamagedCache, FormatError, ShardWriter, open_cache, verify

HERE = Path(__file__).resolve().parents[1]  # tests/, where conftest is; its parent the project


def test_ls_on_a_missing_shard_names_it_and_the_repair(tmp_path):
    manifest = write_cache(tmp_path, range(6), max_shard_samples=2)
    missing = tmp_path / manifest.shards[1].path
    missing.unlink()
    result = cli("ls", tmp_path)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"{missing} is listed" in result.output and "--repair" in result.output


# A writer that stops twice (at its first shard) and says so: with a shard's temp file written (before its rename), and with the shard
# renamed but not committed yet (before the link of its commit); a line on stdin lets it go on.
WRITER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from conftest import FINGERPRINT, SCHEMA, make_sample
    import shards.atomic
    from shards import ShardWriter

    real_publish, real_link = shards.atomic.publish, os.link
    paused = set()

    def pause(what):
        if what not in paused:
            paused.add(what)
            print(what, flush=True)
            sys.stdin.readline()

    def publish(tmp, path):
        if Path(path).suffix == ".safetensors":
            pause("temp")
        real_publish(tmp, path)

    def link(tmp, path, **kwargs):
        if Path(path).parent.name == "_log":
            pause("uncommitted")
        real_link(tmp, path, **kwargs)

    shards.atomic.publish, os.link = publish, link
    with ShardWriter(sys.argv[1], FINGERPRINT, SCHEMA, max_shard_samples=2) as w:
        for i in range(6, 8):
            w.write(*make_sample(i))
    print("done", flush=True)
    """
)


def test_verify_beside_a_running_writer_finds_no_damage(tmp_path):
    write_cache(tmp_path, range(6), max_shard_samples=2)
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for moment in ("temp", "uncommitted"):
            assert child.stdout.readline().strip() == moment, child.stderr.read()
            if moment == "temp":
                assert list(tmp_path.glob("*/.r00000-*.tmp"))
            report = verify(tmp_path)
            assert report.ok and report.problems == [], (moment, report.problems)
            result = cli("verify", tmp_path)
            assert result.exit_code == 0 and "BAD" not in result.output, result.output
            child.stdin.write("go\n")
            child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
    finally:
        child.stdin.close()
        child.wait(timeout=120)
    assert child.returncode == 0 and verify(tmp_path).ok and len(Cache(tmp_path)) == 8


def test_a_remote_cache_evicts_nothing_through_a_symbolic_link(tmp_path):
    bucket, local, outside = tmp_path / "bucket", tmp_path / "local", tmp_path / "outside"
    write_cache(bucket, range(6), max_shard_samples=1)
    outside.mkdir()
    victim = outside / "r00000-000000.safetensors"
    victim.write_bytes(b"not the cache's" * 1000)
    os.utime(victim, (1, 1))  # the least recently used of all
    local.mkdir()
    (local / "96x96").symlink_to(outside, target_is_directory=True)
    remote = open_cache(f"file://{bucket}", local_dir=local, limit_bytes=1)  # evicts all it may after each fetch
    for j in range(len(remote.shards)):
        remote.fetch(j)
    assert victim.exists() and (local / "96x96").is_symlink()


@pytest.mark.parametrize("tensor", ["text.offsets", "__key__.offsets", "__key__", "__digest__", "latent_mean"])
def test_a_shard_whose_header_renames_a_tensor_is_a_corrupt_sample_naming_it(tmp_path, tensor):
    manifest = write_cache(tmp_path, range(1))
    shard = tmp_path / manifest.shards[0].path
    data = shard.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    quoted = f'"{tensor}"'.encode()
    assert data.count(quoted, 0, header) == 1
    shard.write_bytes(data.replace(quoted, quoted[:-2] + b'X"', 1))  # same length: only the name changes
    with pytest.raises(shards.CorruptSample, match=rf"{re.escape(str(shard))}.*{re.escape(repr(tensor))} is missing.*--repair"):
        Cache(tmp_path, check_digests=True)[0]


def _cache_with_prompts(root: Path):
    from shards import Prompt, prompt_key

    with ShardWriter(root, FINGERPRINT, SCHEMA) as w:
        w.write(*make_sample(1))
        w.add_prompts({prompt_key(t): Prompt(t, {"text": make_sample(i + 3)[2]["text"]}) for i, t in enumerate(["", "a cat"])},
                      {"text": SCHEMA["text"]})
    return root / w.manifest.files["prompts"]["path"]


def test_a_damaged_prompts_file_is_refused_naming_it_and_how_to_rebuild_it(tmp_path):
    path = _cache_with_prompts(tmp_path)
    good = path.read_bytes()
    header = 8 + int.from_bytes(good[:8], "little")
    for at in (len(good) - 1, 12, header - 40):  # a stored embedding, the header's JSON, a tensor name or offset
        path.write_bytes(good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1:])
        with pytest.raises(DamagedCache, match=rf"{re.escape(str(path))} does not match the size and sha256.*"
                                               rf"python -m precompute prompts {re.escape(str(tmp_path))} --prompt"):
            Cache(tmp_path).prompts()
    path.write_bytes(good)
    assert sorted(p.text for p in Cache(tmp_path).prompts().values()) == ["", "a cat"]


def test_a_prompts_file_damaged_past_reading_is_a_format_error_naming_it(tmp_path):
    from shards.prompts import read_prompts

    path = _cache_with_prompts(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"__prompt__"', b'"__prompt_X"', 1))
    with pytest.raises(FormatError, match=re.escape(str(path))):
        read_prompts(path)


def test_prompts_read_once_stay_as_checked_when_the_file_changes_later(tmp_path):
    path = _cache_with_prompts(tmp_path)
    before = {k: p.fields["text"].clone() for k, p in Cache(tmp_path).prompts().items()}
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    path.write_bytes(data[:header] + bytes(len(data) - header))  # in place: a map of the file would see it
    after = Cache(tmp_path).prompts()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k].fields["text"]) for k in before)
