"""How Medusa heads draft: head d on the last accepted feature ranks the tokens at tree depth d+1."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfdraft.errors import UserError
from selfdraft.heads.int8 import heads_dtype
from selfdraft.heads.vocab import ranked_children
from selfdraft.tree import Frontier


class MedusaDrafter:
    """Head d (0-based) on the last accepted feature proposes the tokens at tree depth d+1."""

    def __init__(self, heads) -> None:
        self.heads = heads
        self.dtype = heads_dtype(heads)
        self.last_feature: torch.Tensor | None = None
        self.ranked: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        feature = hidden_states[self.heads.config.feature_layers[-1]][0, positions[-1]]
        self.last_feature = feature.to(self.dtype)

    @torch.no_grad()
    def children(self, frontier: Frontier) -> tuple[torch.Tensor, torch.Tensor]:
        # every node at one depth gets the same proposals: Medusa heads see only the last feature
        if frontier.depth == 0:  # a new tree: every depth's logits from one projection
            if frontier.max_depth > self.heads.num_heads:
                raise UserError(
                    f"tree depth {frontier.max_depth} exceeds the {self.heads.num_heads} Medusa heads; "
                    f"choose a tree at most {self.heads.num_heads} deep (e.g. chain-{self.heads.num_heads})"
                )
            self.logits = self.heads.logits(self.last_feature, slice(0, frontier.max_depth))  # [D, V']
            self.ranked = None
        k, n = frontier.k, len(frontier.nodes)
        if self.ranked is None or self.ranked[0].shape[-1] < k:
            self.ranked = ranked_children(self.logits, k, self.heads)  # [D, k]
        ids, logq = self.ranked[0][frontier.depth, :k], self.ranked[1][frontier.depth, :k]
        return ids.expand(n, -1), logq.expand(n, -1)
