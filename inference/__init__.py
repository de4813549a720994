"""Inference: drafters, acceptance, the generate loop and `SelfDraftModel`."""

from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.model import SelfDraftModel
from selfdraft.target import load_target
from selfdraft.tree import TreeSpec

__all__ = ["SamplingParams", "SelfDraftModel", "TreeSpec", "load_target"]
