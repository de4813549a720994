"""Dynamic draft trees (EAGLE-2): grow by cumulative draft log-probability, keep the best nodes.

Growth: at each depth the `top_k` frontier nodes with the highest cumulative log q are expanded into
their `top_k` most likely children; after `depth` levels, the `total_tokens` best candidates (an
ancestor-closed set, since a child never scores above its parent) become the verified TreeSpec.
Children are deterministic top-k picks, so acceptance variant C keeps this lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfdraft.inference.tree import TreeSpec


@dataclass(frozen=True)
class DynamicTree:
    depth: int = 4
    top_k: int = 4
    total_tokens: int = 12  # drafted nodes verified (root excluded)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError("DynamicTree needs depth, top_k and total_tokens >= 1")

    @property
    def max_depth(self) -> int:
        return self.depth


@dataclass(frozen=True)
class Candidate:
    parent: int  # index into the candidate list (-1 for the root)
    token: int
    score: float  # cumulative draft log-probability from the root
    depth: int
    rank: int  # position among its parent's ranked children


# expand(nodes, depth) -> (target ids [n, k], log q [n, k]) of each node's k best children
Expand = Callable[[list[int], int], tuple[torch.Tensor, torch.Tensor]]
# feed(nodes, depth) -> None: make these depth-`depth` nodes expandable (EAGLE runs its head on them)
Feed = Callable[[list[int], int], None]


def grow(
    policy: DynamicTree, root_token: int, expand: Expand, feed: Feed | None, cands: list[Candidate]
) -> None:
    """Fill `cands` (index 0 = root) by beam-style expansion; `feed` sees nodes before they expand."""
    cands.append(Candidate(parent=-1, token=root_token, score=0.0, depth=0, rank=0))
    frontier = [0]
    for depth in range(policy.depth):
        ids, logq = expand(frontier, depth)
        new: list[int] = []
        for row, u in enumerate(frontier):
            for r in range(ids.shape[1]):
                new.append(len(cands))
                cands.append(
                    Candidate(u, int(ids[row, r]), cands[u].score + float(logq[row, r]), depth + 1, r)
                )
        if depth + 1 == policy.depth:
            break
        frontier = sorted(new, key=lambda i: -cands[i].score)[: policy.top_k]
        if feed is not None:
            feed(frontier, depth + 1)


def select_tree(cands: list[Candidate], total_tokens: int) -> tuple[TreeSpec, torch.Tensor]:
    """Keep the `total_tokens` best candidates (plus any missing ancestor) -> (TreeSpec, tokens [N])."""
    best = sorted(range(1, len(cands)), key=lambda i: (-cands[i].score, i))[:total_tokens]
    keep = set(best)
    for i in best:  # ties can rank a child level with its parent; never keep an orphan
        while cands[i].parent > 0 and cands[i].parent not in keep:
            keep.add(cands[i].parent)
            i = cands[i].parent
    order = [0] + sorted(keep, key=lambda i: (cands[i].depth, i))
    index = {c: n for n, c in enumerate(order)}
    parents = [-1] + [index[cands[c].parent] for c in order[1:]]
    ranks = [0] + [cands[c].rank for c in order[1:]]
    tokens = torch.tensor([cands[c].token for c in order], dtype=torch.long)
    return TreeSpec.from_parents(parents, ranks), tokens


def candidate_ancestors(cands: list[Candidate], nodes: list[int], columns: list[int]) -> torch.Tensor:
    """allowed[i, j] = columns[j] is nodes[i] or one of its ancestors (the root excluded). bool [n, m]."""
    position = {c: j for j, c in enumerate(columns)}
    allowed = torch.zeros(len(nodes), len(columns), dtype=torch.bool)
    for i, u in enumerate(nodes):
        while u > 0:
            if u in position:
                allowed[i, position[u]] = True
            u = cands[u].parent
    return allowed
