"""One target forward over every node of a drafted tree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfdraft.inference import kv
from selfdraft.inference.tree import TreeSpec, tree_attention_mask, tree_position_ids


@dataclass(frozen=True)
class TargetPass:
    """logits: [N, V] next-token logits at each node; hidden_states: tuple of [1, N, h] per layer."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


@torch.no_grad()
def prefill(target, input_ids: torch.Tensor, cache) -> TargetPass:
    """Plain causal forward over the prompt input_ids: [1, T] (fills `cache`)."""
    out = target(input_ids=input_ids, output_hidden_states=True, **kv.cache_kwargs(target, cache))
    return TargetPass(logits=out.logits[0], hidden_states=tuple(out.hidden_states))


@torch.no_grad()
def verify_tree(target, cache, tokens: torch.Tensor, spec: TreeSpec) -> TargetPass:
    """Run the target once on the tree: tokens [N] at positions prefix + depth, ancestor-only mask.

    The tree's N keys/values are appended to `cache`; the caller compacts it to the accepted path.
    """
    prefix = kv.cache_length(cache)
    dtype = target.get_input_embeddings().weight.dtype
    device = tokens.device
    out = target(
        input_ids=tokens[None],
        attention_mask=tree_attention_mask(spec, prefix, dtype=dtype, device=device),
        position_ids=tree_position_ids(spec, prefix, device=device),
        output_hidden_states=True,
        **kv.cache_kwargs(target, cache),
    )
    return TargetPass(logits=out.logits[0], hidden_states=tuple(out.hidden_states))
