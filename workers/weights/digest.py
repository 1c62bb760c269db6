"""One digest of a whole model, comparable across trainer and inference (torch-free).

The orchestrator compares the trainer's digest of weights version V (a filesystem step's
index.json, the broadcast offer) with the one each embedded worker reports after applying
V (``weights_digest``); equal means every parameter is bit-identical. Torch-free because
the orchestrator computes it from per-tensor digests it reads from files.
"""
from __future__ import annotations

from typing import Mapping


def state_digest(hashes: Mapping[str, str]) -> str:
    """One digest of a whole model from its per-tensor xxh3 digests (names included, order-free)."""
    import xxhash

    return f"{xxhash.xxh3_64_intdigest(''.join(f'{n}={h};' for n, h in sorted(hashes.items())).encode()):016x}"
