"""A tensor that may be a DTensor, read the same way everywhere: whole, or this rank's part.

Why in common: the trainer's optimizer, gradient clipping and FSDP plan read this rank's part of
its parameters, and the weight publishers read parameters whole; none of them should import the
other for two one-line helpers. Duck-typed (``full_tensor`` / ``to_local``), so importing this
module imports no torch.
"""
from __future__ import annotations

from typing import Any


def full_tensor(t: Any) -> Any:
    """The whole tensor (collective over its mesh for a DTensor: every rank of it calls, in step)."""
    fn = getattr(t, "full_tensor", None)
    return fn() if callable(fn) else t


def local_part(t: Any) -> Any:
    """This rank's shard of a DTensor; a plain tensor itself."""
    fn = getattr(t, "to_local", None)
    return fn() if callable(fn) else t
