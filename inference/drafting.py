"""Drafters: heads propose the tokens of a tree; the target verifies them afterwards.

A drafter is created per `generate` call and owns that call's draft state (the EAGLE head's own KV
cache); nothing is stored on the heads or the target. Every drafter answers the tree shapes'
`selfdraft.tree.Drafter` protocol (`begin`, `children`, `feed`, `end`) and one more call from the
decoding loop:

    observe(next_tokens [P], hidden_states, positions [P])
        the target's features at P positions whose next token is now known (prefill or accepted path)

Children are the head's top-k by draft probability (deterministic picks, see `selfdraft.tree`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfdraft import kv
from selfdraft.errors import UserError
from selfdraft.heads.eagle import EagleHead
from selfdraft.heads.foreign.modules import ForeignEagleHead
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.tree import Grown, additive_mask


def ranked_children(logits: torch.Tensor, k: int, heads) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V'] -> (k best target ids [n, k], their draft log-probabilities [n, k]), best first."""
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
        self.ranked: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        feature = hidden_states[self.heads.config.feature_layers[-1]][0, positions[-1]]
        self.last_feature = feature.to(self.dtype)

    @torch.no_grad()
    def begin(self, root_token: int, max_depth: int) -> None:
        if max_depth > self.heads.num_heads:
            raise UserError(
                f"tree depth {max_depth} exceeds the {self.heads.num_heads} Medusa heads; "
                f"choose a tree at most {self.heads.num_heads} deep (e.g. chain-{self.heads.num_heads})"
            )
        self.logits = self.heads.logits(self.last_feature, slice(0, max(1, max_depth)))  # [D, V']
        self.ranked = None

    def children(self, grown: Grown, nodes: list[int], depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every node at one depth gets the same proposals: Medusa heads see only the last feature
        if self.ranked is None or self.ranked[0].shape[-1] < k:
            self.ranked = ranked_children(self.logits, k, self.heads)  # [D, k]
        ids, logq = self.ranked[0][depth, :k], self.ranked[1][depth, :k]
        return ids.expand(len(nodes), -1), logq.expand(len(nodes), -1)

    def feed(self, grown: Grown, nodes: list[int], depth: int) -> None:
        pass

    def end(self) -> None:
        self.ranked = None


class EagleDrafter:
    """Runs the EAGLE head depth by depth on its own predicted features, with its own KV cache.

    The head consumes pairs (x_{i+1}, f_i) at position i. Pending pairs (known tokens with the
    target's features) are consumed when a tree begins; tree nodes are then fed with their parent's
    predicted feature under an ancestor mask, and cropped from the head's cache when the tree ends.
    """

    def __init__(self, heads: EagleHead | ForeignEagleHead) -> None:
        self.heads = heads
        self.dtype = heads_dtype(heads)
        self.cache = kv.new_cache()
        self.pending_tokens: list[torch.Tensor] = []
        self.pending_features: list[torch.Tensor] = []
        self.prefix = 0  # head cache length before the current tree's nodes
        self.fed: list[int] = []  # tree nodes in the head's cache, in cache order
        self.features: dict[int, torch.Tensor] = {}  # tree node -> the head's predicted feature [h]

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        # Slice only the layers the head reads; the others stay untouched (None).
        sliced: list[torch.Tensor | None] = [None] * len(hidden_states)
        for layer in self.heads.config.feature_layers:
            sliced[layer] = hidden_states[layer][:, positions].to(self.dtype)
        self.pending_tokens.append(next_tokens.reshape(-1))
        self.pending_features.append(self.heads.fuse_features(sliced)[0])

    @torch.no_grad()
    def begin(self, root_token: int, max_depth: int) -> None:
        """Feed the pending pairs; the last one predicts the root's feature."""
        tokens = torch.cat(self.pending_tokens)[None]
        feats = torch.cat(self.pending_features)[None]
        self.pending_tokens, self.pending_features = [], []
        start = kv.cache_length(self.cache)
        n = tokens.shape[1]
        out = self.heads(
            tokens,
            feats,
            position_ids=torch.arange(start, start + n)[None],
            attention_mask=additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), start, feats.dtype),
            cache=self.cache,
        )
        self.prefix = start + n
        self.fed = []
        self.features = {0: out[0, -1]}

    @torch.no_grad()
    def children(self, grown: Grown, nodes: list[int], depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.stack([self.features[u] for u in nodes])
        return ranked_children(self.heads.logits(feats), k, self.heads)

    @torch.no_grad()
    def feed(self, grown: Grown, nodes: list[int], depth: int) -> None:
        """Run the head on depth-`depth` nodes, each fed with its parent's predicted feature."""
        columns = self.fed + nodes
        inputs = torch.stack([self.features[grown.parents[c]] for c in nodes])[None]
        out = self.heads(
            torch.tensor([grown.tokens[c] for c in nodes])[None],
            inputs,
            position_ids=torch.full((1, len(nodes)), self.prefix + depth - 1, dtype=torch.long),
            attention_mask=additive_mask(grown.ancestors(nodes, columns), self.prefix, inputs.dtype),
            cache=self.cache,
        )
        for row, c in enumerate(nodes):
            self.features[c] = out[0, row]
        self.fed = columns

    def end(self) -> None:
        kv.crop(self.cache, self.prefix)  # tree entries never outlive the draft
        self.features = {}


def make_drafter(heads):
    """The drafter for `heads`; an object that already implements the protocol is used as is."""
    if all(callable(getattr(heads, name, None)) for name in ("observe", "begin", "children", "feed", "end")):
        return heads
    if isinstance(heads, MedusaHeads):
        return MedusaDrafter(heads)
    if isinstance(heads, EagleHead | ForeignEagleHead):
        return EagleDrafter(heads)
    raise TypeError(f"no drafter for {type(heads).__name__}")
