"""Fingerprints: canonical JSON of everything that determines the cached values, and its hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> str:
    """Key-sorted, whitespace-free, ASCII JSON: the same settings always give the same text.

    Non-finite floats are refused, since JSON has no canonical spelling for them.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def fingerprint_hash(fingerprint: dict) -> str:
    """sha256 hex digest of the canonical JSON of `fingerprint`."""
    return hashlib.sha256(canonical_json(fingerprint).encode()).hexdigest()


def normalize(fingerprint: dict) -> dict:
    """The fingerprint as it reads back from JSON (tuples become lists), checked to be serialisable."""
    return json.loads(canonical_json(fingerprint))


def diff_fingerprints(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Dotted paths whose values differ between two fingerprints, with both values.

    A key missing on one side shows as `None` there.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                out.append((path, a.get(key), b.get(key)))
            else:
                out += diff_fingerprints(a[key], b[key], path)
        return out
    return [] if a == b else [(prefix or "<root>", a, b)]
