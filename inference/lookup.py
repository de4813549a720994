"""Prompt lookup as an extra branch of the drafted tree.

Small models repeat their context (code identifiers, lists, quoted text). The continuation that
followed the latest earlier occurrence of the current n-gram is grafted onto the heads' tree as one
more path from the root; where it agrees with drafted nodes it follows them, elsewhere it adds new
nodes. Its tokens are a deterministic function of the context, so the exact acceptance rule for
deterministic children (variant C) still applies: output stays the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfdraft.inference.dynamic_tree import DynamicTree
from selfdraft.inference.tree import TreeSpec


@dataclass(frozen=True)
class PromptLookup:
    """tokens: the longest grafted continuation; n-grams of max_ngram..min_ngram tokens are matched."""

    tokens: int = 5
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"bad prompt lookup {self}: need tokens >= 1 and 1 <= min_ngram <= max_ngram")


@dataclass(frozen=True)
class LookupTree:
    """A heads' tree shape plus a prompt-lookup branch grafted on every drafted tree."""

    base: TreeSpec | DynamicTree
    lookup: PromptLookup

    @property
    def max_depth(self) -> int:
        # the grafted branch is the looked-up continuation itself, so no path is longer than it
        return max(self.base.max_depth, self.lookup.tokens)


def lookup_continuation(context: Sequence[int], lookup: PromptLookup) -> list[int]:
    """The tokens that followed the latest earlier occurrence of context's last n-gram.

    Longer n-grams are tried first (they predict better); [] when nothing matches.
    """
    length = len(context)
    for n in range(min(lookup.max_ngram, length - 1), lookup.min_ngram - 1, -1):
        pattern = list(context[length - n :])
        for start in range(length - n - 1, -1, -1):  # latest first; the n-gram itself is excluded
            if list(context[start : start + n]) == pattern:
                return list(context[start + n : start + n + lookup.tokens])
    return []


def graft_chain(spec: TreeSpec, tokens: torch.Tensor, chain: Sequence[int]) -> tuple[TreeSpec, torch.Tensor]:
    """Add `chain` (tokens for depths 1..len) as a path from the root of a drafted tree.

    spec, tokens [N]: the drafted tree. The chain follows existing children whose token matches and
    appends new nodes from the first mismatch on (rank = one past the parent's highest), so siblings
    keep distinct tokens. Returns the grown (spec, tokens [N + added]).
    """
    parents, ranks, values = list(spec.parents), list(spec.ranks), tokens.tolist()
    children = [list(c) for c in spec.children]
    node = 0
    for token in chain:
        match = next((c for c in children[node] if values[c] == token), None)
        if match is None:
            parents.append(node)
            ranks.append(1 + max((ranks[c] for c in children[node]), default=-1))
            values.append(int(token))
            children[node].append(len(values) - 1)
            children.append([])
            match = len(values) - 1
        node = match
    if len(values) == spec.size:
        return spec, tokens
    return TreeSpec(parents=tuple(parents), ranks=tuple(ranks)), torch.tensor(values, dtype=tokens.dtype)
