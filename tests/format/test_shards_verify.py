"""verify catches damage and names the file; the CLI exits non-zero on it."""

import json
import os

import torch
from conftest import FINGERPRINT, SCHEMA, make_sample
from typer.testing import CliRunner

from shards import ShardWriter, verify
from shards.cli import app


def build(root, n=24):
    with ShardWriter(root, FINGERPRINT, SCHEMA, max_shard_samples=4) as w:
        for i in range(n):
            w.write(*make_sample(i), source=f"images/{i:03d}.png")
    return w.manifest


def test_clean_cache_verifies(tmp_path):
    build(tmp_path)
    report = verify(tmp_path)
    assert report.ok and report.samples == 24 and report.shards == 6


def test_flipped_byte_is_caught_and_named(tmp_path):
    manifest = build(tmp_path)
    victim = tmp_path / manifest.shards[2].path
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes
    victim.write_bytes(bytes(data))
    report = verify(tmp_path)
    assert report.bad_files == [str(victim)]
    assert "sha256" in report.problems[0][1]
    # without checksums the per-sample digests still catch it
    report = verify(tmp_path, checksums=False)
    assert report.bad_files == [str(victim)]


def test_truncated_shard_is_caught_and_named(tmp_path):
    manifest = build(tmp_path)
    victim = tmp_path / manifest.shards[4].path
    os.truncate(victim, victim.stat().st_size - 100)
    report = verify(tmp_path)
    assert report.bad_files == [str(victim)]
    assert "truncated" in report.problems[0][1]


def test_missing_shard_orphans_and_nan(tmp_path):
    manifest = build(tmp_path)
    (tmp_path / manifest.shards[0].path).unlink()
    orphan = tmp_path / "64x64" / "stray.safetensors"
    orphan.write_bytes(b"x")
    report = verify(tmp_path)
    assert report.bad_files == sorted([str(tmp_path / manifest.shards[0].path), str(orphan)])

    nan_root = tmp_path / "nan"
    with ShardWriter(nan_root, FINGERPRINT, SCHEMA, check_finite=False) as w:
        key, bucket, fields = make_sample(3)
        w.write(key, bucket, {**fields, "text": torch.full((2, 16), float("inf"), dtype=torch.bfloat16)})
    report = verify(nan_root)
    assert any("NaN or Inf" in m for _, m in report.problems)


def test_cli_inspect_ls_verify(tmp_path):
    manifest = build(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["inspect", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["samples"] == 24 and set(info["buckets"]) == {"64x64", "48x80", "80x48"}
    assert info["fields"]["text"]["kind"] == "ragged" and info["fields"]["text"]["bytes_per_sample"] > 0
    assert info["fingerprint"] == FINGERPRINT

    out = runner.invoke(app, ["inspect", str(tmp_path)])
    assert out.exit_code == 0 and "48x80" in out.output and "bytes per sample" in out.output

    out = runner.invoke(app, ["ls", str(tmp_path)])
    lines = out.output.splitlines()
    assert len(lines) == 24
    key, bucket, shard, digest, source, name = lines[0].split("\t")
    assert key == "key00000" and bucket == "64x64" and shard.endswith(".safetensors") and len(digest) == 32
    assert source == "images/000.png" and name == ""  # from the manifest's sample index; no named source

    assert runner.invoke(app, ["verify", str(tmp_path)]).exit_code == 0
    victim = tmp_path / manifest.shards[1].path
    os.truncate(victim, 10)
    out = runner.invoke(app, ["verify", str(tmp_path)])
    assert out.exit_code == 1 and str(victim) in out.output
