"""Edit caches and an edit preset for the tests of stage two's generic edit support.

`write_edit_cache` writes a cache as stage one writes one for an edit preset (its fingerprint, stage one's record, a
latent and a caption per sample, and the two reference fields of `shards.references`) with shards' own writer, without
any encoder; `edit_preset` registers `tiny-sana-edit`: tiny Sana taking up to two references, whose forward (`EditForward`)
follows the edit batch contract (one transformer call per group of samples whose references share shapes, the
references' values entering the prediction) and records what it was given.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch

from shards import Bucket, CacheSpec, DecoderRecipe, Field, LatentSpec, ShardWriter, TextSpec
from shards.prompts import Prompt, prompt_key
from shards.references import pack, reference_schema
from shards.texts import TEXT_KEYS, key_rows
from train.families import PRESETS, get_family, get_preset
from train.families.base import group_of, masked_call, reference_groups, stacked_references

EDIT_PRESET = "tiny-sana-edit"
CHANNELS = 8  # tiny Sana's latent channels
WIDTH = 32  # its caption width
PROMPT = "a blue square"  # the validation prompt an edit cache with `decoder` holds


def sample_references(i: int, count: int, shapes=((4, 4), (3, 5))) -> list[torch.Tensor]:
    """Sample `i`'s `count` reference latents (C, h, w), of `shapes` in turn, seeded by `i`."""
    g = torch.Generator().manual_seed(1000 + i)
    return [torch.randn(CHANNELS, *shapes[j % len(shapes)], generator=g) for j in range(count)]


def caption(i: int) -> str:
    return f"make shape {i} blue"


def write_edit_cache(root: Path, counts: list[int], *, preset: str = EDIT_PRESET, buckets=((64, 64), (48, 80)),
                     references: bool = True, flip: bool = False, shapes=((4, 4), (3, 5)), decoder: bool = False) -> Path:
    """A cache of len(counts) samples for `preset` (Sana's latent and masked text layout), sample i with counts[i]
    references (`sample_references`), over `buckets` in turn; without `references`, a cache of the same samples
    without reference fields. With `flip`, every sample also has a flipped latent (its latent negated) and its source
    is recorded with flip = true. With `decoder`, what validation reads too: tiny Sana's VAE stored in the cache (as
    stage one stores a tiny preset's), the embeddings of the empty caption and of `PROMPT`, and each text stored once
    with its caption (`caption(i)`)."""
    latent = LatentSpec(CHANNELS, 8, 1.0, 0.0, "deterministic")
    text = TextSpec("masked", WIDTH, 64)
    fingerprint = {"vae": {"id": "test-vae", **latent.fingerprint()}, "text_encoder": {"id": "test-text", **text.fingerprint()}}
    text_schema = {"text": Field(torch.float32, ragged=True)}
    schema = {"latent": Field(torch.float32), "source": Field(torch.uint8, ragged=True),
              **({TEXT_KEYS: Field(torch.uint8, ragged=True)} if decoder else text_schema)}
    if flip:
        schema["flip_latent"] = Field(torch.float32, ragged=True)
    if references:
        schema.update(reference_schema(torch.float32))
    recipe = DecoderRecipe("AutoencoderDC", "vae", 1.0, 0.0, in_cache=True) if decoder else None
    spec = CacheSpec(latent, text, family="sana", preset=preset, base_resolution=256, decoder=recipe)
    with ShardWriter(root, fingerprint, schema, text_schema=text_schema if decoder else None) as w:
        w.set_extra("precompute", spec.record())
        w.set_extra("sources", {"": {"flip": flip}})
        if decoder:
            store_decoder(w)
            g = torch.Generator().manual_seed(99)
            w.add_prompts({prompt_key(""): Prompt("", {"text": torch.zeros(0, WIDTH)}),
                           prompt_key(PROMPT): Prompt(PROMPT, {"text": torch.randn(5, WIDTH, generator=g)})}, text_schema)
        for i, n in enumerate(counts):
            h, w_ = buckets[i % len(buckets)]
            g = torch.Generator().manual_seed(i)
            x = torch.randn(CHANNELS, h // 8, w_ // 8, generator=g)
            embedding = torch.randn(3 + i % 4, WIDTH, generator=g)
            texts = ({TEXT_KEYS: key_rows([w.write_text(caption(i), {"text": embedding})])} if decoder
                     else {"text": embedding})
            fields = {"latent": x, **texts, "source": torch.tensor(list(f"{i}.png".encode()), dtype=torch.uint8)}
            if flip:
                fields["flip_latent"] = -x[None]
            if references:
                fields.update(pack(sample_references(i, n, shapes), CHANNELS, torch.float32))
            w.write(f"s{i:03d}", Bucket(h, w_), fields, source=f"{i}.png")
    return root


def store_decoder(writer: ShardWriter) -> None:
    """Tiny Sana's VAE (stage one's seeded one) into the cache as the decoder's files (`vae/`), as stage one stores a
    tiny preset's."""
    from precompute.families import family
    from precompute.presets import get_preset as stage_one_preset

    vae = stage_one_preset("tiny-sana").vae
    with tempfile.TemporaryDirectory() as tmp:
        family("sana").save_tiny_vae(vae, tmp)
        for f in sorted((Path(tmp) / vae.subfolder).iterdir()):
            writer.add_file(f"decoder:{f.name}", f"vae/{f.name}", f.read_bytes())


class EditForward:
    """A stand-in edit family's forward: tiny Sana called once per group of `reference_groups`, each reference's
    positions joining the caption's tokens (its C channels zero-padded to the caption width), so the prediction depends
    on the references and the sequence grows with them, as an edit model's does. Records each call's references
    (shapes, dtype, device) in `seen`."""

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
            text, mask = part["text"].to(xt.dtype), part["text_mask"]
            for ref in stacked_references(part) if part["references"][0] else []:  # (b, C, h_j, w_j)
                tokens = ref.flatten(2).transpose(1, 2).to(xt.dtype)  # (b, h_j * w_j, C)
                tokens = torch.nn.functional.pad(tokens, (0, text.shape[-1] - tokens.shape[-1]))
                text = torch.cat([text, tokens], dim=1)
                mask = torch.cat([mask, mask.new_ones(tokens.shape[:2])], dim=1)
            pred = masked_call(model, xt[rows], t[rows], {**part, "text": text, "text_mask": mask})
            for k, i in enumerate(rows):
                out[i] = pred[k]
        return torch.stack(out)


def edit_preset(monkeypatch, references: int = 2, requires_references: bool = True) -> EditForward:
    """Register `tiny-sana-edit` (tiny Sana taking up to `references` reference images; with `requires_references`
    False, also generating from text alone) and give the Sana family the `EditForward` it returns, for this test."""
    base = get_preset("tiny-sana")
    monkeypatch.setitem(PRESETS, EDIT_PRESET, lambda: dataclasses.replace(
        base, name=EDIT_PRESET, references=references, reference_pixels=64 * 64, requires_references=requires_references))
    forward = EditForward()
    monkeypatch.setattr(get_family(base.family), "forward", forward)
    return forward


def stage_one_edit_cache(root: Path, model: str, count: int = 6) -> Path:
    """ROOT/cache: stage one's cache of `count` generated edits (`make_edit_folder`: x.png, x.ref.png, x.txt) for edit
    preset `model`."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_edit_folder

    precompute(str(make_edit_folder(root / "data", count)), model, root / "cache", workers=0, progress=False, batch_size=2,
               references=True)
    return root / "cache"
