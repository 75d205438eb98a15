"""Stage one's encoding of an edit preset's reference images, from prepared items (what the loader hands the pass) to
the cache: the reference fields of every sample (empty for a sample without references) are the family's
`encode_references` of each prepared reference, encoded in groups of one size; a text encoder that sees the
references gets each caption's sample's references and keys its text by them."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from precompute.encode import Encoders
from precompute.encoding import EncodingPass
from precompute.presets import get_preset
from precompute.progress import PlainProgress
from precompute.run import texts_stored_once
from precompute.tally import Tally
from shards import Bucket, Cache, ShardWriter
from shards.references import REFERENCE_LATENT, REFERENCE_SHAPE, references_digest, unpack
from shards.texts import TEXT_KEYS, keys_of, text_key

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models

STORAGE = torch.float32


@pytest.fixture(scope="module")
def enc():
    """The tiny Flux encoders as an edit preset's (two references at most)."""
    return Encoders(replace(get_preset("tiny-flux"), references=2), torch.device("cpu"))


def item(i: int, sizes: list[tuple[int, int]], captions: list[str], refs: list[bytes] | None = None) -> dict:
    """A prepared item as the loader yields it for an edit preset: a 64x64 image and a reference of each size (h, w),
    its `pixels` in [-1, 1] and a `text_pixels` image; `refs` are the references' file bytes (default: by `i`)."""
    g = torch.Generator().manual_seed(i)
    refs = refs if refs is not None else [b"reference %d of sample %d" % (r, i) for r in range(len(sizes))]
    references = [{"pixels": torch.rand(3, h, w, generator=g) * 2 - 1,
                   "text_pixels": torch.full((3, 8, 8), sum(data) % 251, dtype=torch.uint8)} for (h, w), data in zip(sizes, refs)]
    return {"status": "ok", "key": f"{i:064x}", "dataset": "", "source": f"{i:03d}.png", "bucket": Bucket(64, 64),
            "pixels": torch.randint(0, 256, (3, 64, 64), generator=g, dtype=torch.uint8), "captions": captions,
            "original_size": (64, 64), "crop": (0, 0, 64, 64), "latent_key": bytes([i]) * 16, "reference_pixels": references,
            **({"reference_digest": references_digest(refs)} if sizes else {})}


def encode(enc: Encoders, items: list[dict], root, dedup: bool = True, batch_size: int = 4) -> Cache:
    """`items` through one stage-one pass into a new cache at `root` (texts stored once, or with each sample)."""
    schema, text_schema = enc.schema(STORAGE), enc.prompt_schema(STORAGE) if dedup else None
    if dedup:
        schema = texts_stored_once(schema, text_schema)
    writer = ShardWriter(root, {**enc.fingerprint(), "storage_dtype": "float32"}, schema, text_schema=text_schema)
    tally = Tally(by_source={"": Counter()})
    EncodingPass(enc, writer, schema, STORAGE, batch_size, 8, False, {"": {}}, {("", 0): {}}, None, tally).run(
        iter(items), PlainProgress(None, 1e9))
    writer.finish()
    assert tally.counts["new"] == len(items) and not tally.failures
    return Cache(root)


def by_source(cache: Cache) -> dict[str, dict]:
    return {bytes(cache[i]["source"].tolist()).decode(): cache[i] for i in range(len(cache))}


def test_an_edit_presets_cache_has_reference_fields_and_a_references_part_others_do_not(enc):
    assert {REFERENCE_LATENT, REFERENCE_SHAPE} <= set(enc.schema(STORAGE))
    part = enc.fingerprint()["references"]
    assert part["max"] == 2 and "mean" in part["latent"] and part["text_sees_references"] is False
    plain = Encoders(get_preset("tiny-flux"), torch.device("cpu"))
    assert not {REFERENCE_LATENT, REFERENCE_SHAPE} & set(plain.schema(STORAGE))
    assert "references" not in plain.fingerprint()
    assert {k: v for k, v in enc.fingerprint().items() if k != "references"} == plain.fingerprint()


def test_each_reference_is_the_familys_latent_of_its_prepared_pixels_grouped_by_size(enc, tmp_path, monkeypatch):
    """Three samples: two references of two sizes, one of the first size, none (a text-to-image sample). The batch's
    references are encoded in one call per size (two calls), and each stored reference is its own latent."""
    calls = []
    original = Encoders.encode_references
    monkeypatch.setattr(Encoders, "encode_references", lambda self, x: calls.append(tuple(x.shape)) or original(self, x))
    items = [item(0, [(64, 64), (32, 48)], ["a red square"]), item(1, [(64, 64)], ["a blue circle"]), item(2, [], ["a cat"])]
    got = by_source(encode(enc, items, tmp_path / "c"))
    assert sorted(calls) == [(1, 3, 32, 48), (2, 3, 64, 64)]
    for it in items:
        refs = unpack(got[it["source"]])
        assert [tuple(r.shape) for r in refs] == [(16, h // 8, w // 8) for h, w in (r["pixels"].shape[1:] for r in it["reference_pixels"])]
        for ref, prepared in zip(refs, it["reference_pixels"]):
            alone = original(enc, prepared["pixels"][None])[0]  # the family's encode_references of this reference alone
            torch.testing.assert_close(ref, alone, rtol=1e-5, atol=1e-5)
    empty = got["002.png"]
    assert empty[REFERENCE_LATENT].shape == (0, 16) and empty[REFERENCE_SHAPE].shape == (0, 2)


def test_references_of_one_size_go_at_most_batch_size_to_a_call(enc, tmp_path, monkeypatch):
    calls = []
    original = Encoders.encode_references
    monkeypatch.setattr(Encoders, "encode_references", lambda self, x: calls.append(x.shape[0]) or original(self, x))
    encode(enc, [item(i, [(32, 32), (32, 32)], [f"caption {i}"]) for i in range(3)], tmp_path / "c", batch_size=2)
    assert calls == [2, 2, 2]  # two items' four references in two calls, then the last item's two


@pytest.fixture
def seeing(enc, monkeypatch):
    """The tiny encoders' text family as one whose text encoder sees the references (`text_takes_references`): each
    caption's `text` moves by the mean of its references' `text_pixels`, and every call is recorded."""
    base = enc.text_family
    calls = []

    class Seeing(type(base)):
        text_takes_references = True

        def encode_text(self, side, captions, device, instruction=True, references=None):
            calls.append((list(captions), references))
            out = base.encode_text(side, captions, device, instruction)
            for fields, refs in zip(out, references if references is not None else [[]] * len(captions)):
                fields["text"] = fields["text"] + sum(float(r.float().mean()) for r in refs)
            return out

    monkeypatch.setattr(enc, "text_family", Seeing())
    return calls


def test_a_text_that_sees_references_is_keyed_and_stored_per_references(enc, seeing, tmp_path):
    """Two samples with one caption and other references store two texts, two with the same references one; each
    text is encoded with its sample's references; a sample without references keeps the caption's plain key."""
    same = [b"the same reference"]
    items = [item(0, [(32, 32)], ["make it red"], [b"one reference"]), item(1, [(32, 32)], ["make it red"], [b"another one"]),
             item(2, [(32, 32)], ["make it blue"], same), item(3, [(32, 32)], ["make it blue"], same),
             item(4, [], ["a cat"])]
    cache = encode(enc, items, tmp_path / "c")
    got = by_source(cache)
    raw = {bytes(s["source"].tolist()).decode(): s for s in (cache.read(i, resolve=False) for i in range(len(cache)))}
    keys = {it["source"]: keys_of(raw[it["source"]][TEXT_KEYS]) for it in items}
    assert keys["000.png"] == [text_key("make it red", references_digest([b"one reference"]))]
    assert keys["001.png"] == [text_key("make it red", references_digest([b"another one"]))]
    assert keys["002.png"] == keys["003.png"] == [text_key("make it blue", references_digest(same))]
    assert keys["004.png"] == [text_key("a cat")]
    assert cache.manifest.text_stats()["texts"] == 4
    encoded = [(c, [int(r[0, 0, 0]) for r in refs]) for cs, rs in seeing for c, refs in zip(cs, rs)]
    assert sorted(encoded) == sorted([("make it red", [sum(b"one reference") % 251]), ("make it red", [sum(b"another one") % 251]),
                                      ("make it blue", [sum(same[0]) % 251]), ("a cat", [])])
    plain = type(enc.text_family).__mro__[1].encode_text(enc.text_family, enc.text, ["make it red"], enc.device)[0]["text"]
    shift = sum(b"another one") % 251
    torch.testing.assert_close(got["001.png"]["text"], plain + shift)


def test_caption_variants_and_texts_stored_with_each_sample_see_their_samples_references(enc, seeing, tmp_path):
    items = [item(0, [(32, 32)], ["variant a", "variant b"], [b"r0"]), item(1, [(32, 32), (32, 32)], ["variant a"], [b"r1", b"r2"])]
    got = by_source(encode(enc, items, tmp_path / "c", dedup=False))
    (captions, references), = seeing  # one text-encoder batch: every caption with its own sample's references
    assert captions == ["variant a", "variant b", "variant a"]
    assert [[int(r[0, 0, 0]) for r in refs] for refs in references] == [[sum(b"r0") % 251]] * 2 + [[sum(b"r1") % 251, sum(b"r2") % 251]]
    base = type(enc.text_family).__mro__[1].encode_text(enc.text_family, enc.text, ["variant a", "variant b"], enc.device)
    tokens = base[0]["text"].shape[0]
    stored = got["000.png"]["text"]
    torch.testing.assert_close(stored[:tokens], base[0]["text"] + sum(b"r0") % 251)
    torch.testing.assert_close(stored[tokens:], base[1]["text"] + sum(b"r0") % 251)
    torch.testing.assert_close(got["001.png"]["text"], base[0]["text"] + sum(b"r1") % 251 + sum(b"r2") % 251)
