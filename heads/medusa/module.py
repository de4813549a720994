"""Medusa heads: K parallel heads on the target's last feature; head k predicts token t+k+1."""

from __future__ import annotations

import torch
from torch import nn

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.medusa.drafter import MedusaDrafter
from selfdraft.heads.vocab import BorrowingModule, DraftVocab
from selfdraft.tree import PerRow


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so an untrained head starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(BorrowingModule):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        h, k = config.target_hidden_size, config.medusa_num_heads
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(h) for _ in range(config.medusa_num_layers))) for _ in range(k)
        )
        own = config.medusa_own_lm_head or config.draft_vocab_size is not None
        out = config.draft_vocab_size or config.target_vocab_size
        self.lm_heads = nn.ModuleList(nn.Linear(h, out, bias=False) for _ in range(k)) if own else None
        self.draft_vocab = (
            DraftVocab(config.draft_vocab_size, config.target_vocab_size) if config.draft_vocab_size else None
        )

    def drafter(self, rows: int) -> PerRow:
        """One drafter per row: Medusa's drafting has no head pass for rows to share."""
        return PerRow([MedusaDrafter(self) for _ in range(rows)])

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def max_draft_depth(self) -> int:
        """Head d proposes depth d+1, so no drafted tree can be deeper than the number of heads."""
        return self.num_heads

    def init_projection_from_target(self) -> None:
        """Own vocab projections start as (rows of) the target's lm_head, as Medusa does."""
        if self.lm_heads is None:
            return
        weight = self._need().lm_head.weight
        if self.draft_vocab is not None:
            weight = weight[self.draft_vocab.target_ids()]
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(weight)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., h] (target's last feature) -> per-head features [K, ..., h]."""
        return torch.stack([block(hidden) for block in self.blocks])

    def logits(self, hidden: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
        """hidden: [..., h] -> logits [K, ..., V'] (V' = draft vocab size when one is used)."""
        heads = heads or slice(None)
        feats = [block(hidden) for block in self.blocks[heads]]
        if self.lm_heads is None:
            lm_head = self._need().lm_head  # the target's: it may hold another dtype than the heads
            return torch.stack([lm_head(f.to(lm_head.weight.dtype)) for f in feats])
        return torch.stack([proj(f) for proj, f in zip(self.lm_heads[heads], feats, strict=True)])
