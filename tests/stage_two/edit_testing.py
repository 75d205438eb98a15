"""Edit caches and an edit preset for the tests of stage two's generic edit support.

`write_edit_cache` writes a cache as stage one writes one for an edit preset (its fingerprint, stage one's record, a
latent and a caption per sample, and the two reference fields of `shards.references`) with shards' own writer, without
any encoder; `with_references` copies a cache stage one built (its decoder and prompts included) adding reference
fields. `edit_preset` registers `tiny-sana-edit`: tiny Sana taking up to two references, whose forward (`EditForward`)
follows the edit batch contract (one transformer call per group of samples whose references share shapes, the
references' values entering the prediction) and records what it was given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shards import Bucket, CacheSpec, Field, LatentSpec, ShardWriter, TextSpec, open_cache
from shards.references import pack, reference_schema
from train.families import PRESETS, get_family, get_preset
from train.families.base import group_of, masked_call, reference_groups, stacked_references

EDIT_PRESET = "tiny-sana-edit"
CHANNELS = 8  # tiny Sana's latent channels
WIDTH = 32  # its caption width


def sample_references(i: int, count: int, shapes=((4, 4), (3, 5))) -> list[torch.Tensor]:
    """Sample `i`'s `count` reference latents (C, h, w), of `shapes` in turn, seeded by `i`."""
    g = torch.Generator().manual_seed(1000 + i)
    return [torch.randn(CHANNELS, *shapes[j % len(shapes)], generator=g) for j in range(count)]


def write_edit_cache(root: Path, counts: list[int], *, preset: str = EDIT_PRESET, buckets=((64, 64), (48, 80)),
                     references: bool = True, flip: bool = False, shapes=((4, 4), (3, 5))) -> Path:
    """A cache of len(counts) samples for `preset` (Sana's latent and masked text layout), sample i with counts[i]
    references (`sample_references`), over `buckets` in turn; without `references`, a cache of the same samples
    without reference fields. With `flip`, every sample also has a flipped latent (its latent negated) and its source
    is recorded with flip = true."""
    latent = LatentSpec(CHANNELS, 8, 1.0, 0.0, "deterministic")
    text = TextSpec("masked", WIDTH, 64)
    fingerprint = {"vae": {"id": "test-vae", **latent.fingerprint()}, "text_encoder": {"id": "test-text", **text.fingerprint()}}
    schema = {"latent": Field(torch.float32), "text": Field(torch.float32, ragged=True),
              "source": Field(torch.uint8, ragged=True)}
    if flip:
        schema["flip_latent"] = Field(torch.float32, ragged=True)
    if references:
        schema.update(reference_schema(torch.float32))
    spec = CacheSpec(latent, text, family="sana", preset=preset, base_resolution=256)
    with ShardWriter(root, fingerprint, schema) as w:
        w.set_extra("precompute", spec.record())
        w.set_extra("sources", {"": {"flip": flip}})
        for i, n in enumerate(counts):
            h, w_ = buckets[i % len(buckets)]
            g = torch.Generator().manual_seed(i)
            x = torch.randn(CHANNELS, h // 8, w_ // 8, generator=g)
            fields = {"latent": x, "text": torch.randn(3 + i % 4, WIDTH, generator=g),
                      "source": torch.tensor(list(f"{i}.png".encode()), dtype=torch.uint8)}
            if flip:
                fields["flip_latent"] = -x[None]
            if references:
                fields.update(pack(sample_references(i, n, shapes), CHANNELS, torch.float32))
            w.write(f"s{i:03d}", Bucket(h, w_), fields, source=f"{i}.png")
    return root


def with_references(src: Path, dst: Path, count=lambda i: 1, preset: str | None = None) -> Path:
    """A copy of the cache stage one built at `src` (its files: decoder weights, prompts; its record, with `preset`
    as the preset it was built for) whose sample i has count(i) references: the latents of other samples of the cache
    (the posteriors' means), so that they decode to pictures."""
    cache = open_cache(src)
    manifest = cache.manifest
    storage = manifest.schema[cache.spec.latent.fields[0]].dtype
    schema = {**cache.schema, **reference_schema(storage)}
    latents = [cache[i].fields[cache.spec.latent.fields[0]] for i in range(len(cache))]
    with ShardWriter(dst, manifest.fingerprint, schema) as w:
        for role, entry in manifest.files.items():
            info = {k: v for k, v in entry.items() if k not in ("path", "bytes", "sha256")}
            w.add_file(role, entry["path"], (Path(src) / entry["path"]).read_bytes(), **info)
        for name, value in manifest.extra.items():
            w.set_extra(name, {**value, "preset": preset} if name == "precompute" and preset else value)
        for i in range(len(cache)):
            s = cache[i]
            refs = [latents[(i + 1 + j) % len(latents)].float() for j in range(count(i))]
            fields = {**s.fields, **pack(refs, cache.spec.latent.channels, storage)}
            w.write(s.key, s.bucket, fields, source=bytes(s.fields["source"].numpy()).decode())
    return dst


class EditForward:
    """A stand-in edit family's forward: tiny Sana called once per group of `reference_groups`, on the noisy latents
    shifted by each reference's per-channel mean, so the prediction depends on the references. Records each call's
    references (shapes, dtype, device) in `seen`."""

    def __init__(self):
        self.seen: list[list[list[tuple]]] = []

    def __call__(self, model, config, xt, t, batch, guidance):
        refs = batch.get("references")
        if refs is None:
            raise AssertionError("an edit preset's batch has no references")
        self.seen.append([[(tuple(r.shape), r.dtype, r.device.type) for r in sample] for sample in refs])
        out = [None] * xt.shape[0]
        for rows in reference_groups(batch):
            part = group_of(batch, rows)
            x = xt[rows]
            for ref in stacked_references(part) if part["references"][0] else []:  # (b, C, h_j, w_j)
                x = x + ref.float().mean(dim=(2, 3), keepdim=True).to(x.dtype)
            pred = masked_call(model, x, t[rows], part)
            for k, i in enumerate(rows):
                out[i] = pred[k]
        return torch.stack(out)


def edit_preset(monkeypatch, references: int = 2) -> EditForward:
    """Register `tiny-sana-edit` (tiny Sana taking up to `references` reference images) and give the Sana family the
    `EditForward` it returns, for this test."""
    base = get_preset("tiny-sana")
    monkeypatch.setitem(PRESETS, EDIT_PRESET, lambda: dataclasses.replace(base, name=EDIT_PRESET, references=references,
                                                                           reference_pixels=64 * 64))
    forward = EditForward()
    monkeypatch.setattr(get_family(base.family), "forward", forward)
    return forward
