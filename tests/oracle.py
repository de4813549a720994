"""A test drafter that knows the reference continuation: it makes multi-token acceptance happen on
demand, so compaction, bonus tokens and stops inside accepted blocks are exercised deterministically."""

from __future__ import annotations

import torch


class OracleDrafter:
    """Rank `correct_rank` at each depth is the reference token; every other rank is a wrong token.

    reference: the full expected sequence (prompt + continuation) as a list of ids.
    miss_every: every n-th draft call puts a wrong token everywhere (forces rejections).
    """

    def __init__(self, reference: list[int], vocab_size: int, correct_rank: int = 0, miss_every: int = 0):
        self.reference = reference
        self.vocab = vocab_size
        self.correct_rank = correct_rank
        self.miss_every = miss_every
        self.known = 0  # tokens of the sequence whose successor the drafter has been shown
        self.calls = 0

    def observe(self, next_tokens, hidden_states, positions) -> None:
        self.known += int(next_tokens.numel())

    def _wrong(self, right: int, salt: int) -> int:
        return (right + 1 + salt) % self.vocab

    def children(self, frontier) -> tuple[torch.Tensor, torch.Tensor]:
        grown, nodes, depth, k = frontier.grown, frontier.nodes, frontier.depth, frontier.k
        if depth == 0:  # a new tree
            self.calls += 1
            self.miss = bool(self.miss_every and self.calls % self.miss_every == 0)
        at = self.known + depth + 1  # index of the children's token in the reference
        right = self.reference[at] if at < len(self.reference) else 0
        ids = torch.empty(len(nodes), k, dtype=torch.long)
        for row, u in enumerate(nodes):
            on_path = True
            while u > 0:
                on_path &= grown.ranks[u] == self.correct_rank
                u = grown.parents[u]
            for r in range(k):
                good = on_path and r == self.correct_rank and not self.miss
                ids[row, r] = right if good else self._wrong(right, r)
        logq = -torch.arange(k, dtype=torch.float32).expand(len(nodes), k)  # rank order
        return ids, logq
