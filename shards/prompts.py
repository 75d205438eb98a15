"""Prompt embeddings stored beside the shards: the empty caption and the validation prompts.

Training needs them without a text encoder (caption dropout, classifier-free guidance, validation
images). One safetensors file, `prompts.safetensors`, keyed by the sha256 of the prompt text, with
the same field layout as the shards (ragged fields packed with offsets) and the prompt text itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shards.schema import (
    BASE_VERSION,
    FORMAT_NAME,
    KEY,
    OFFSETS_SUFFIX,
    FormatError,
    Schema,
    open_file,
    schema_from_json,
    schema_to_json,
    serialize,
)

PROMPTS_FILE = "prompts.safetensors"
TEXT = "__prompt__"


def prompt_key(text: str) -> str:
    """A prompt's key: the sha256 of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Prompt:
    text: str
    fields: dict[str, torch.Tensor]


def _pack(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64).cumsum(0)
    return torch.cat(rows), offsets


def encode_prompts(prompts: dict[str, Prompt], schema: Schema, fingerprint_sha256: str) -> bytes:
    """Serialise prompts (key -> Prompt) to safetensors bytes, in key order."""
    keys = sorted(prompts)
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in schema.items():
        rows = [prompts[k].fields[name].contiguous() for k in keys]
        for k, r in zip(keys, rows):
            if r.dtype != spec.dtype:
                raise ValueError(f"prompt {prompts[k].text!r}: field {name} is {r.dtype}, the schema says {spec.dtype}")
        if spec.ragged:
            tensors[name], tensors[name + OFFSETS_SUFFIX] = _pack(rows)
        else:
            tensors[name] = torch.stack(rows)
    for name, values in ((KEY, keys), (TEXT, [prompts[k].text for k in keys])):
        rows = [torch.frombuffer(bytearray(v.encode("utf-8")), dtype=torch.uint8) if v else torch.zeros(0, dtype=torch.uint8) for v in values]
        tensors[name], tensors[name + OFFSETS_SUFFIX] = _pack(rows)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(BASE_VERSION),
        "kind": "prompts",
        "samples": str(len(keys)),
        "fields": json.dumps(schema_to_json(schema), sort_keys=True),
        "fingerprint_sha256": fingerprint_sha256,
    }
    return serialize(tensors, metadata)


def read_prompts(path: str | os.PathLike) -> dict[str, Prompt]:
    """All prompts of a prompts file, by key.

    Raises:
        FormatError: not a prompts file of this format, or damaged past reading; the message names the file.
    """
    meta, tensors = open_file(Path(path), kind="prompts")
    try:
        return _unpack(meta, tensors)
    except (KeyError, ValueError, IndexError, UnicodeDecodeError) as e:  # JSON errors are ValueErrors
        raise FormatError(f"{path}: the prompts file is damaged ({type(e).__name__}: {e}); it cannot be read") from None


def _unpack(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, Prompt]:
    schema = schema_from_json(json.loads(meta["fields"]))
    n = int(meta["samples"])
    out = {}
    for i in range(n):
        key = _row(tensors, KEY, i).numpy().tobytes().decode("ascii")
        text = _row(tensors, TEXT, i).numpy().tobytes().decode("utf-8")
        out[key] = Prompt(text, {name: _row(tensors, name, i) for name in schema})
    return out


def _row(tensors: dict[str, torch.Tensor], name: str, i: int) -> torch.Tensor:
    """Row `i` of tensor `name` of a prompts file: a slice by its offsets when the field is ragged."""
    if name + OFFSETS_SUFFIX in tensors:
        offs = tensors[name + OFFSETS_SUFFIX]
        return tensors[name][int(offs[i]) : int(offs[i + 1])]
    return tensors[name][i]


def stored_prompts(root: str | os.PathLike, entry: dict | None) -> tuple[dict[str, Prompt], str | None]:
    """The prompts of the file a manifest lists (`entry`: its path, bytes and sha256) when it matches its listing:
    (prompts by key, None); otherwise ({}, what is wrong, with the texts it held where they can still be read), so
    that a damaged file is never merged into the next one."""
    if not entry:
        return {}, None
    path = Path(root) / entry["path"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, f"{path} is missing"
    if len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]:
        return read_prompts(path), None
    try:
        texts = sorted(p.text for p in read_prompts(path).values())
        held = f"; it held {texts}: add the ones you need again with --prompt"
    except Exception:  # noqa: BLE001 - damaged past reading: nothing more to say of it
        held = ""
    return {}, f"{path} does not match the size and sha256 the manifest lists (damaged){held}"

