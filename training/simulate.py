"""Simulated acceptance from logits: how far greedy verification would accept, without generating.

For base position b, depth j's draft logits sit at index b + offset_j of that depth's tensors (EAGLE
unroll step j: offset j; Medusa head j: offset 0, all heads read the base feature). Walking a tree,
the path continues into the child whose rank equals the rank of the target's greedy token among the
draft's logits at that node. Teacher-forced on the text's tokens: exact for text the target itself
would produce greedily, an estimate otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfdraft.tree import TreeSpec

MISS = 1 << 30  # rank of a token the draft cannot propose (outside its vocabulary)


class DepthRanks(NamedTuple):  # a tuple: DeepSpeed's ZeRO-3 hooks walk a forward's outputs
    ranks: torch.Tensor  # [B, T] long: rank of the target's greedy token among the draft logits
    valid: torch.Tensor  # [B, T] bool
    offset: int


def label_ranks(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab=None) -> torch.Tensor:
    """draft_logits: [B, T, V']; target_ids: [B, T] target-vocabulary ids -> ranks [B, T] (0 = top-1,
    strictly above every other logit).

    vocab: the heads' DraftVocab (None when the draft speaks the target vocabulary)."""
    if vocab is None:
        ids = target_ids
        outside = torch.zeros_like(target_ids, dtype=torch.bool)
    else:
        to_draft = torch.full((vocab.t2d.numel(),), -1, dtype=torch.long, device=target_ids.device)
        to_draft[vocab.target_ids()] = torch.arange(vocab.d2t.numel(), device=target_ids.device)
        ids = to_draft[target_ids]
        outside = ids < 0
        ids = ids.clamp(min=0)
    chosen = draft_logits.gather(-1, ids[..., None])
    # Ties count against the label (top-k may pick the other token first), and NaN logits are a miss:
    # diverged heads must never score as accurate.
    ranks = (draft_logits > chosen).sum(-1) + (draft_logits == chosen).sum(-1) - 1
    broken = torch.isnan(draft_logits).any(-1)
    return ranks.clamp(min=0).masked_fill(outside | broken, MISS)


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
