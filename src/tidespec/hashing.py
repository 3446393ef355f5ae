"""Seeded, stable splits and samples: a string key hashed to a float uniform in [0, 1)."""
from __future__ import annotations

import hashlib


def unit_hash(key: str) -> float:
    """sha256(key) → [0, 1) (first 8 bytes, big-endian): the same key always maps to the same value,
    on every machine and Python version (unlike `hash()`)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64
