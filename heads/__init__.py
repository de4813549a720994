"""Trainable draft heads: config, Medusa heads, EAGLE head, save/load."""

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.eagle import EagleHead
from selfdraft.heads.folder import HeadsMismatchError, build_heads, check_compatible, save_heads
from selfdraft.heads.load import load_heads
from selfdraft.heads.medusa import MedusaHeads

__all__ = [
    "EagleHead",
    "HeadsConfig",
    "HeadsMismatchError",
    "MedusaHeads",
    "build_heads",
    "check_compatible",
    "load_heads",
    "save_heads",
]
