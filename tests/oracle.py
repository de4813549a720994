"""A test drafter that knows the reference continuation: it makes multi-token acceptance happen on
demand, so compaction, bonus tokens and stops inside accepted blocks are exercised deterministically."""

from __future__ import annotations

import torch

from selfdraft.inference.drafting import Draft


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

    def draft(self, root_token: int, spec) -> Draft:
        self.calls += 1
        miss = self.miss_every and self.calls % self.miss_every == 0
        tokens = torch.empty(spec.size, dtype=torch.long)
        tokens[0] = root_token
        for i in range(1, spec.size):
            at = self.known + spec.depths[i]  # index of this node's token in the reference
            right = self.reference[at] if at < len(self.reference) else 0
            on_path = all(spec.ranks[a] == self.correct_rank for a in spec.path_to(i)[1:])
            good = on_path and spec.ranks[i] == self.correct_rank and not miss
            tokens[i] = right if good else self._wrong(right, spec.ranks[i])
        return Draft(spec=spec, tokens=tokens)
