"""The reference fields of an edit sample: references of their own shapes packed into two ragged fields and back."""

import hashlib

import pytest
import torch

from shards import Bucket, Cache, Field, FormatError, ShardWriter
from shards.references import REFERENCE_LATENT, REFERENCE_SHAPE, pack, reference_schema, references_digest, unpack
from shards.texts import text_key


def test_references_of_their_own_shapes_come_back_exactly_from_a_written_cache(tmp_path):
    """Sample s0 has none (a text-to-image sample of a cache with edit samples), s1 one, s2 two of other sizes."""
    g = torch.Generator().manual_seed(0)
    samples = {f"s{i}": [torch.randn(4, 2 + i, 3 + 2 * j, generator=g).to(torch.bfloat16) for j in range(i)] for i in range(3)}
    schema = {"latent": Field(torch.bfloat16), **reference_schema(torch.bfloat16)}
    with ShardWriter(tmp_path / "c", {"test": "references"}, schema) as w:
        for key, refs in samples.items():
            w.write(key, Bucket(64, 64), {"latent": torch.zeros(4, 8, 8, dtype=torch.bfloat16), **pack(refs, 4, torch.bfloat16)})
    cache = Cache(tmp_path / "c")
    for key, i in cache.keys():
        got = unpack(cache[i])
        assert [t.shape for t in got] == [t.shape for t in samples[key]]
        assert all(torch.equal(a, b) for a, b in zip(got, samples[key]))


def test_damaged_shapes_and_bad_latents_are_named():
    fields = pack([torch.zeros(4, 2, 2)], 4, torch.float32)
    with pytest.raises(FormatError, match="reference shapes"):
        unpack({REFERENCE_LATENT: fields[REFERENCE_LATENT], REFERENCE_SHAPE: torch.tensor([[3, 3]], dtype=torch.int32)})
    with pytest.raises(ValueError, match="C = 4"):
        pack([torch.zeros(4, 2, 2), torch.zeros(8, 2, 2)], 4, torch.float32)


def test_a_text_that_sees_its_references_is_keyed_by_them_and_a_plain_text_keeps_its_key():
    assert text_key("a cat") == hashlib.sha256(b"a cat").hexdigest()  # every existing cache's keys
    one, other = references_digest([b"ref one"]), references_digest([b"ref two"])
    assert len({text_key("a cat"), text_key("a cat", one), text_key("a cat", other)}) == 3
    assert text_key("a cat", one) == text_key("a cat", references_digest([b"ref one"]))
    assert references_digest([b"a", b"b"]) != references_digest([b"b", b"a"])
