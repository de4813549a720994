"""Trainable draft heads, one package per kind (medusa/, eagle/, eagle3/), behind one registry."""

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.folder import HeadsMismatchError, check_compatible, save_heads
from selfdraft.heads.load import load_heads
from selfdraft.heads.registry import DraftHeads, Heads, build_heads, head_type

__all__ = [
    "DraftHeads",
    "Heads",
    "HeadsConfig",
    "HeadsMismatchError",
    "build_heads",
    "check_compatible",
    "head_type",
    "load_heads",
    "save_heads",
]
