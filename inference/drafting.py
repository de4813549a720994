"""Drafting: heads propose the tokens of a tree; the target verifies them afterwards.

A drafter is created per `generate` call and owns that call's draft state (the EAGLE head's own KV
cache); nothing is stored on the heads or the target. Both drafters follow one protocol:

    observe(next_tokens [P], hidden_states, positions [P])
                                              the target's features at P positions whose next
                                              token is now known (prompt prefill or accepted path)
    draft(root_token, spec) -> Draft          candidate tokens for every node of `spec`

Children are the head's top-k by rank (deterministic children, acceptance variant C).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfdraft.heads.eagle import EagleHead
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.heads.published import PublishedEagleHead
from selfdraft.inference import kv
from selfdraft.inference.tree import TreeSpec, ancestor_matrix


@dataclass(frozen=True)
class Draft:
    """tokens: [N] target-vocabulary ids (tokens[0] = root); children are deterministic top-k picks."""

    spec: TreeSpec
    tokens: torch.Tensor


def _max_rank_by_parent(spec: TreeSpec) -> dict[int, int]:
    out: dict[int, int] = {}
    for i in range(1, spec.size):
        out[spec.parents[i]] = max(out.get(spec.parents[i], -1), spec.ranks[i])
    return out


def _ranked_candidates(logits: torch.Tensor, k: int, heads) -> torch.Tensor:
    """logits: [..., V'] -> the k best target-vocabulary ids [..., k], best first."""
    ids = torch.topk(logits, k, dim=-1).indices
    vocab = getattr(heads, "draft_vocab", None)
    return vocab.to_target(ids) if vocab is not None else ids


class MedusaDrafter:
    """Head d (0-based) on the last accepted feature proposes the tokens at tree depth d+1."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self.last_feature: torch.Tensor | None = None

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        self.last_feature = hidden_states[self.heads.config.feature_layers[-1]][0, positions[-1]]

    @torch.no_grad()
    def draft(self, root_token: int, spec: TreeSpec) -> Draft:
        if spec.max_depth > self.heads.num_heads:
            raise ValueError(f"tree depth {spec.max_depth} exceeds the {self.heads.num_heads} Medusa heads")
        tokens = torch.empty(spec.size, dtype=torch.long)
        tokens[0] = root_token
        if spec.size > 1:
            logits = self.heads.logits(self.last_feature, slice(0, spec.max_depth))  # [D, V']
            k = max(spec.ranks) + 1
            cands = _ranked_candidates(logits, k, self.heads)  # [D, k]
            for i in range(1, spec.size):
                tokens[i] = cands[spec.depths[i] - 1, spec.ranks[i]]
        return Draft(spec=spec, tokens=tokens)


class EagleDrafter:
    """Runs the EAGLE head depth by depth on its own predicted features, with its own KV cache.

    The head consumes pairs (x_{i+1}, f_i) at position i. Pending pairs (known tokens with the
    target's features) are consumed first; tree nodes are then fed with their parent's predicted
    feature, under an ancestor mask, and cropped from the head's cache once the tree is drafted.
    """

    def __init__(self, heads: EagleHead) -> None:
        self.heads = heads
        self.cache = kv.new_cache()
        self.pending_tokens: list[torch.Tensor] = []
        self.pending_features: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return kv.cache_length(self.cache)

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        # Slice only the layers the head reads; the others stay untouched (None).
        sliced: list[torch.Tensor | None] = [None] * len(hidden_states)
        for layer in self.heads.config.feature_layers:
            sliced[layer] = hidden_states[layer][:, positions]
        self.pending_tokens.append(next_tokens.reshape(-1))
        self.pending_features.append(self.heads.fuse_features(sliced)[0])

    def _consume_pending(self) -> torch.Tensor:
        """Feed the pending pairs; returns the predicted feature at the root's position [h]."""
        tokens = torch.cat(self.pending_tokens)[None]
        feats = torch.cat(self.pending_features)[None]
        self.pending_tokens, self.pending_features = [], []
        start = self.length
        positions = torch.arange(start, start + tokens.shape[1])[None]
        mask = _block_mask(torch.tril(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool)), start, feats)
        out = self.heads(tokens, feats, position_ids=positions, attention_mask=mask, cache=self.cache)
        return out[0, -1]

    @torch.no_grad()
    def draft(self, root_token: int, spec: TreeSpec) -> Draft:
        root_feature = self._consume_pending()
        prefix = self.length
        tokens = torch.empty(spec.size, dtype=torch.long)
        tokens[0] = root_token
        node_feature: dict[int, torch.Tensor] = {0: root_feature}
        max_rank = _max_rank_by_parent(spec)
        ancestors = ancestor_matrix(spec)
        fed: list[int] = []
        for depth in range(spec.max_depth):
            parents = [u for u in spec.nodes_at_depth(depth) if spec.children[u]]
            feats = torch.stack([node_feature[u] for u in parents])
            k = max(max_rank[u] for u in parents) + 1
            cands = _ranked_candidates(self.heads.logits(feats), k, self.heads)  # [len(parents), k]
            for row, u in enumerate(parents):
                for child in spec.children[u]:
                    tokens[child] = cands[row, spec.ranks[child]]
            # Feed the new nodes that will have children of their own.
            new = [c for u in parents for c in spec.children[u] if spec.children[c]]
            if not new:
                break
            cols = fed + new
            allowed = ancestors[new][:, cols]
            mask = _block_mask(allowed, prefix, feats)
            positions = torch.full((1, len(new)), prefix + depth, dtype=torch.long)
            inputs = torch.stack([node_feature[spec.parents[c]] for c in new])[None]
            out = self.heads(tokens[new][None], inputs, position_ids=positions, attention_mask=mask, cache=self.cache)
            for row, c in enumerate(new):
                node_feature[c] = out[0, row]
            fed = cols
        kv.crop(self.cache, prefix)
        return Draft(spec=spec, tokens=tokens)


def _block_mask(allowed: torch.Tensor, prefix: int, like: torch.Tensor) -> torch.Tensor:
    """allowed: bool [q, k] among new entries -> additive mask [1, 1, q, prefix + k] (prefix visible)."""
    full = torch.cat([torch.ones(allowed.shape[0], prefix, dtype=torch.bool), allowed], dim=1)
    mask = torch.zeros(full.shape, dtype=like.dtype).masked_fill(~full, torch.finfo(like.dtype).min)
    return mask[None, None]


def make_drafter(heads):
    """The drafter for `heads`; an object that already implements the protocol is used as is."""
    if callable(getattr(heads, "draft", None)) and callable(getattr(heads, "observe", None)):
        return heads
    if isinstance(heads, MedusaHeads):
        return MedusaDrafter(heads)
    if isinstance(heads, EagleHead | PublishedEagleHead):
        return EagleDrafter(heads)
    raise TypeError(f"no drafter for {type(heads).__name__}")
