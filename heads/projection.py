"""Vocabulary projection of draft features: the target's borrowed lm_head, or an own head over a
reduced draft vocabulary (EAGLE-3's `d2t` / `t2d` maps: target_id = draft_id + d2t[draft_id])."""

from __future__ import annotations

import torch
from torch import nn


class DraftVocab(nn.Module):
    """Maps between a reduced draft vocabulary [Vd] and the target vocabulary [V]."""

    def __init__(self, draft_vocab_size: int, target_vocab_size: int) -> None:
        super().__init__()
        # Identity maps until trained maps are loaded (the first Vd target ids).
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"map shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not match the draft vocab")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft_ids: [...] -> target ids [...]."""
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id: [Vd]."""
        return self.to_target(torch.arange(self.d2t.numel(), device=self.d2t.device))

    def scatter_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: [..., Vd] over the draft vocab -> [..., V] over the target vocab (zeros elsewhere)."""
        out = probs.new_zeros(*probs.shape[:-1], self.t2d.numel())
        return out.index_copy_(-1, self.target_ids(), probs)
