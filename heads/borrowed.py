"""Target modules the heads use without owning them (embeddings, lm_head).

Held in a plain dataclass, not as submodules, so they never enter the heads' `state_dict`, their
parameters, or an optimizer: nothing is copied and nothing of the target is ever saved with heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Borrowed:
    embed: nn.Module
    lm_head: nn.Module

    @classmethod
    def from_target(cls, target: nn.Module) -> Borrowed:
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or lm_head is None:
            raise ValueError(f"{type(target).__name__} exposes no input embeddings or lm_head to borrow")
        return cls(embed=embed, lm_head=lm_head)


class BorrowingModule(nn.Module):
    """Base for heads: `attach(target)` borrows its embeddings and lm_head."""

    borrowed: Borrowed | None = None

    def attach(self, target: nn.Module) -> BorrowingModule:
        self.borrowed = Borrowed.from_target(target)
        return self

    def _need(self) -> Borrowed:
        if self.borrowed is None:
            raise RuntimeError("heads are not attached to a target: call heads.attach(target) first")
        return self.borrowed

    # EAGLE-style heads set `self.lm_head`: their own projection over a draft vocabulary (with
    # `self.draft_vocab` mapping draft ids to target ids), or None to use the target's. No class-level
    # default: it would shadow the submodule nn.Module registers under that name.

    def init_projection_from_target(self) -> None:
        """An own draft projection starts as the target's lm_head rows of the draft vocabulary."""
        if self.lm_head is None:
            return
        weight = self._need().lm_head.weight[self.draft_vocab.target_ids()]
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., h] -> logits [..., V'] by the own projection, or the target's lm_head
        (which may hold another dtype than the heads)."""
        if self.lm_head is None:
            lm_head = self._need().lm_head
            return lm_head(features.to(lm_head.weight.dtype))
        return self.lm_head(features)
