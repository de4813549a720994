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
from selfdraft.inference.dynamic_tree import Candidate, DynamicTree, candidate_ancestors, grow, select_tree
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


def _ranked_with_logq(logits: torch.Tensor, k: int, heads) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V'] -> (k best target ids [n, k], their draft log-probabilities [n, k])."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logq, k, dim=-1)
    vocab = getattr(heads, "draft_vocab", None)
    ids = vocab.to_target(top.indices) if vocab is not None else top.indices
    return ids, top.values


def heads_dtype(heads: torch.nn.Module) -> torch.dtype:
    """The floating dtype the heads compute in; it may differ from the target's (see `draft_dtype`)."""
    for p in heads.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class MedusaDrafter:
    """Head d (0-based) on the last accepted feature proposes the tokens at tree depth d+1."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self.dtype = heads_dtype(heads)
        self.last_feature: torch.Tensor | None = None

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        feature = hidden_states[self.heads.config.feature_layers[-1]][0, positions[-1]]
        self.last_feature = feature.to(self.dtype)

    @torch.no_grad()
    def draft(self, root_token: int, shape: TreeSpec | DynamicTree) -> Draft:
        if shape.max_depth > self.heads.num_heads:
            raise ValueError(f"tree depth {shape.max_depth} exceeds the {self.heads.num_heads} Medusa heads")
        logits = self.heads.logits(self.last_feature, slice(0, max(1, shape.max_depth)))  # [D, V']
        if isinstance(shape, DynamicTree):
            ids, logq = _ranked_with_logq(logits, shape.top_k, self.heads)  # [D, k]: same for every node

            def expand(nodes: list[int], depth: int):
                return ids[depth].expand(len(nodes), -1), logq[depth].expand(len(nodes), -1)

            cands: list[Candidate] = []
            grow(shape, root_token, expand, None, cands)
            spec, tokens = select_tree(cands, shape.total_tokens)
            return Draft(spec=spec, tokens=tokens)
        spec = shape
        tokens = torch.empty(spec.size, dtype=torch.long)
        tokens[0] = root_token
        if spec.size > 1:
            cands = _ranked_candidates(logits, max(spec.ranks) + 1, self.heads)  # [D, k]
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
        self.dtype = heads_dtype(heads)
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
            sliced[layer] = hidden_states[layer][:, positions].to(self.dtype)
        self.pending_tokens.append(next_tokens.reshape(-1))
        self.pending_features.append(self.heads.fuse_features(sliced)[0])

    def _consume_pending(self) -> torch.Tensor:
        """Feed the pending pairs; returns the predicted feature at the root's position [h]."""
        tokens = torch.cat(self.pending_tokens)[None]
        feats = torch.cat(self.pending_features)[None]
        self.pending_tokens, self.pending_features = [], []
        start = self.length
        positions = torch.arange(start, start + tokens.shape[1])[None]
        causal = torch.tril(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool))
        out = self.heads(
            tokens,
            feats,
            position_ids=positions,
            attention_mask=_block_mask(causal, start, feats),
            cache=self.cache,
        )
        return out[0, -1]

    def _feed(self, nodes: list[int], depth: int, tokens, parents, allowed_fn, scratch) -> None:
        """Run the head on depth-`depth` nodes (fed with their parent's predicted feature)."""
        prefix, fed, node_feature = scratch["prefix"], scratch["fed"], scratch["feature"]
        cols = fed + nodes
        inputs = torch.stack([node_feature[parents(c)] for c in nodes])[None]
        mask = _block_mask(allowed_fn(nodes, cols), prefix, inputs)
        positions = torch.full((1, len(nodes)), prefix + depth - 1, dtype=torch.long)
        ids = torch.tensor([tokens(c) for c in nodes])[None]
        out = self.heads(ids, inputs, position_ids=positions, attention_mask=mask, cache=self.cache)
        for row, c in enumerate(nodes):
            node_feature[c] = out[0, row]
        scratch["fed"] = cols

    def _children(self, nodes: list[int], k: int, node_feature) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.stack([node_feature[u] for u in nodes])
        return _ranked_with_logq(self.heads.logits(feats), k, self.heads)

    @torch.no_grad()
    def draft(self, root_token: int, shape: TreeSpec | DynamicTree) -> Draft:
        scratch = {"prefix": None, "fed": [], "feature": {0: self._consume_pending()}}
        scratch["prefix"] = self.length
        try:
            if isinstance(shape, DynamicTree):
                return self._draft_dynamic(root_token, shape, scratch)
            return self._draft_static(root_token, shape, scratch)
        finally:
            kv.crop(self.cache, scratch["prefix"])  # tree entries never outlive the draft

    def _draft_dynamic(self, root_token: int, shape: DynamicTree, scratch) -> Draft:
        cands: list[Candidate] = []

        def feed(nodes: list[int], depth: int) -> None:
            self._feed(
                nodes,
                depth,
                lambda c: cands[c].token,
                lambda c: cands[c].parent,
                lambda rows, cols: candidate_ancestors(cands, rows, cols),
                scratch,
            )

        grow(
            shape,
            root_token,
            lambda nodes, _: self._children(nodes, shape.top_k, scratch["feature"]),
            feed,
            cands,
        )
        spec, tokens = select_tree(cands, shape.total_tokens)
        return Draft(spec=spec, tokens=tokens)

    def _draft_static(self, root_token: int, spec: TreeSpec, scratch) -> Draft:
        tokens = torch.empty(spec.size, dtype=torch.long)
        tokens[0] = root_token
        max_rank = _max_rank_by_parent(spec)
        ancestors = ancestor_matrix(spec)
        for depth in range(spec.max_depth):
            parents = [u for u in spec.nodes_at_depth(depth) if spec.children[u]]
            k = max(max_rank[u] for u in parents) + 1
            ids, _ = self._children(parents, k, scratch["feature"])  # [len(parents), k]
            for row, u in enumerate(parents):
                for child in spec.children[u]:
                    tokens[child] = ids[row, spec.ranks[child]]
            new = [c for u in parents for c in spec.children[u] if spec.children[c]]
            if not new:
                break
            self._feed(
                new,
                depth + 1,
                lambda c: int(tokens[c]),
                lambda c: spec.parents[c],
                lambda rows, cols: ancestors[rows][:, cols],
                scratch,
            )
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
