"""Simulated acceptance from logits: how far greedy verification would accept, without generating.

For base position b, depth j's draft logits sit at index b + offset_j of that depth's tensors (EAGLE
unroll step j: offset j; Medusa head j: offset 0, all heads read the base feature). Walking a tree,
the path continues into the child whose rank equals the rank of the target's greedy token among the
draft's logits at that node. Teacher-forced on the text's tokens: exact for text the target itself
would produce greedily, an estimate otherwise.
"""

from __future__ import annotations

import torch

from selfdraft.heads.objective import MISS, DepthRanks
from selfdraft.tree import TreeSpec


def _child_table(spec: TreeSpec) -> torch.Tensor:
    """table[u, r] = the child of node u with rank r, or -1.  [N, max_rank + 1]"""
    width = max(spec.ranks) + 1
    table = torch.full((spec.size, width), -1, dtype=torch.long)
    for c in range(1, spec.size):
        table[spec.parents[c], spec.ranks[c]] = c
    return table


def simulated_tau(depths: list[DepthRanks], spec: TreeSpec) -> tuple[list[float], float]:
    """(top-1 accuracy per depth, simulated tau of `spec` with the bonus token counted)."""
    accs = [float((d.ranks[d.valid] == 0).float().mean()) if d.valid.any() else 0.0 for d in depths]
    if not depths:
        return accs, 1.0
    table = _child_table(spec)
    B, T = depths[0].ranks.shape
    node = torch.zeros(B, T, dtype=torch.long)
    alive = torch.ones(B, T, dtype=torch.bool)
    base_valid = torch.zeros(B, T, dtype=torch.bool)
    accepted = torch.zeros(B, T)
    for j, d in enumerate(depths[: spec.max_depth]):
        ranks = torch.full((B, T), MISS, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        span = min(T, d.ranks.shape[1] - d.offset)  # depths may be shorter (Medusa head k: T - k - 1)
        if span > 0:
            ranks[:, :span] = d.ranks[:, d.offset : d.offset + span]
            valid[:, :span] = d.valid[:, d.offset : d.offset + span]
        if j == 0:
            base_valid = valid.clone()
        fits = ranks < table.shape[1]
        child = torch.where(fits, table[node, ranks.clamp(max=table.shape[1] - 1)], torch.full_like(node, -1))
        alive = alive & valid & (child >= 0)
        node = torch.where(alive, child, node)
        accepted += alive.float()
    n = base_valid.float().sum().clamp(min=1)
    return accs, 1.0 + float((accepted * base_valid).sum() / n)
