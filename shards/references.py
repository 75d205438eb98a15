"""Reference images of an edit sample (an instruction-editing model's inputs beside its caption), as the cache stores
their latents.

Each reference is prepared as the family's pipeline prepares the image it is given (its own size, not the target's)
and encoded by the cache's VAE, so a sample's references have shapes of their own. They are stored in two ragged
fields: `reference_latent`, every reference's latent with its positions flattened, channel last, one reference after
the other ((sum of h_i * w_i, C)), and `reference_shape`, each reference's latent height and width ((n, 2) int32).
`pack` and `unpack` go between that and the list of (C, h, w) latents the families work with. A cache without
references has neither field. See FORMAT.md.
"""

from __future__ import annotations

import hashlib

import torch

from shards.schema import Field, FormatError, Schema

REFERENCE_LATENT = "reference_latent"  # ragged (sum h_i * w_i, C): the references' latents, positions flattened
REFERENCE_SHAPE = "reference_shape"  # ragged (n, 2) int32: each reference's latent (h, w)
REFERENCE_FIELDS = (REFERENCE_LATENT, REFERENCE_SHAPE)


def reference_schema(storage_dtype: torch.dtype) -> Schema:
    """The two fields of a cache whose samples have reference images."""
    return {REFERENCE_LATENT: Field(storage_dtype, ragged=True), REFERENCE_SHAPE: Field(torch.int32, ragged=True)}


def pack(latents: list[torch.Tensor], channels: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A sample's reference latents, each (C, h, w) with C = `channels`, as its two fields in `dtype` (the storage
    dtype). None is a sample without references (a text-to-image sample of a cache that has edit samples too):
    (0, C) rows and (0, 2) shapes."""
    if any(t.dim() != 3 or t.shape[0] != channels for t in latents):
        raise ValueError(f"reference latents must be (C, h, w) with C = {channels}, got {[tuple(t.shape) for t in latents]}")
    rows = torch.cat([t.flatten(1).t() for t in latents]) if latents else torch.zeros(0, channels)
    rows = rows.to(dtype).contiguous()  # (sum h*w, C)
    shapes = torch.tensor([tuple(t.shape[1:]) for t in latents], dtype=torch.int32).reshape(-1, 2)
    return {REFERENCE_LATENT: rows, REFERENCE_SHAPE: shapes}


def unpack(fields) -> list[torch.Tensor]:
    """The (C, h, w) latents of a sample's references, in order (views of the stored rows where the layout allows).

    Raises:
        FormatError: the shapes do not add up to the stored rows.
    """
    rows, shapes = fields[REFERENCE_LATENT], fields[REFERENCE_SHAPE]
    sizes = [int(h) * int(w) for h, w in shapes.tolist()]
    if sum(sizes) != rows.shape[0]:
        raise FormatError(f"reference shapes {shapes.tolist()} hold {sum(sizes)} positions, the stored latent has "
                          f"{rows.shape[0]}: the sample is damaged; run `python -m shards verify` on the cache")
    out, start = [], 0
    for (h, w), n in zip(shapes.tolist(), sizes):
        out.append(rows[start : start + n].t().reshape(rows.shape[1], h, w))
        start += n
    return out


def references_digest(references: list[bytes]) -> bytes:
    """What a text that depends on its sample's reference images (an edit model whose text encoder sees them) adds to
    its text key: the sha256 of each reference's bytes, in order."""
    h = hashlib.sha256(b"references\0")
    for data in references:
        h.update(hashlib.sha256(data).digest())
    return h.digest()
