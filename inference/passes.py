"""The target's two passes in the generate loop, each ONE forward over every row of the batch:
the prefill over the prompts and the verification of every row's drafted tree.

Cache layout, an invariant between steps: row b's valid keys/values are the physical slots
[0, len_b) of every layer ([B, H, L, d], L = max len_b); slots [len_b, L) hold filler that no query
ever attends to. Tree node i of row b sits at physical slot L + i during verification and at
position_ids len_b + depth(i), so every row sees exactly what it would see alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from selfdraft import kv
from selfdraft.tree import TreeSpec, ancestor_matrix, float_mask

PAD_ID = 0  # any id in the vocabulary: pad slots and dummy nodes are masked


@dataclass(frozen=True)
class TargetPass:
    """logits: [B, V] (prefill: at each row's last prompt token) or [B, N, V] (verify: at each node);
    hidden_states: tuple of [B, n, h] per layer."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


@lru_cache(maxsize=64)
def takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


@torch.no_grad()
def prefill(target, prompts: list[torch.Tensor], cache) -> TargetPass:
    """One causal pass over the prompts (1-D, any lengths), right-padded to the longest. Real queries
    never see a pad slot; pad queries see plain causal context (any non-empty row keeps softmax finite;
    their outputs are unused). Prompts of one length (a single prompt among them) need no mask at all.

    Returns logits [B, V] at each row's last prompt token (only those are projected onto the
    vocabulary when the target takes `logits_to_keep`) and hidden states [B, P, h] per layer."""
    lengths = [p.numel() for p in prompts]
    width, rows = max(lengths), len(prompts)
    device = prompts[0].device
    last = [n - 1 for n in lengths]
    keep = sorted(set(last))
    extra = {}
    if takes_logits_to_keep(type(target)):  # [B, P, V] logits of a long batch can take gigabytes
        extra["logits_to_keep"] = torch.tensor(keep, device=device)
    if len(keep) == 1:  # no padding: the target's own causal attention, as in its `generate`
        ids = torch.stack(prompts)
        out = target(input_ids=ids, output_hidden_states=True, **extra, **kv.cache_kwargs(target, cache))
    else:
        ids = torch.full((rows, width), PAD_ID, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, : p.numel()] = p
        i = torch.arange(width)
        length = torch.tensor(lengths)
        causal = i[None, :] <= i[:, None]  # [q, k]
        real_key = i[None, :] < length[:, None]  # [B, k]
        pad_query = i[None, :] >= length[:, None]  # [B, q]
        allowed = causal[None] & (real_key[:, None, :] | pad_query[:, :, None])
        dtype = target.get_input_embeddings().weight.dtype
        with kv.masked_gqa(device, width):
            out = target(
                input_ids=ids,
                attention_mask=float_mask(allowed.to(device), dtype)[:, None],
                position_ids=i.to(device)[None].expand(rows, -1),
                output_hidden_states=True,
                **extra,
                **kv.cache_kwargs(target, cache),
            )
    column = [keep.index(n) for n in last] if extra else last
    logits = out.logits[torch.arange(rows, device=device), torch.tensor(column, device=device)]
    return TargetPass(logits=logits, hidden_states=tuple(out.hidden_states))


@torch.no_grad()
def verify(target, cache, trees: list[tuple[TreeSpec, torch.Tensor]], lengths: list[int]) -> TargetPass:
    """One target pass over every row's tree (spec, tokens [N_b]) after its lengths[b] cached entries.
    Smaller trees are padded with dummy nodes that see only themselves and that no real node sees.
    Returns logits [B, N, V], N = the largest tree; row b's nodes are its first N_b. The trees' keys
    and values are appended to `cache` (the caller compacts it to the accepted paths)."""
    physical = kv.cache_length(cache)
    width = max(spec.size for spec, _ in trees)
    rows = len(trees)
    tokens = torch.full((rows, width), PAD_ID, dtype=torch.long)
    positions = torch.empty((rows, width), dtype=torch.long)
    tree_part = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)  # dummies see only themselves
    for b, (spec, toks) in enumerate(trees):
        n = spec.size
        tokens[b, :n] = toks
        positions[b] = lengths[b]
        positions[b, :n] += torch.tensor(spec.depths)
        tree_part[b, :n, :n] = ancestor_matrix(spec)
    prefix = torch.arange(physical)[None, :] < torch.tensor(lengths)[:, None]  # [B, physical]
    allowed = torch.cat([prefix[:, None, :].expand(-1, width, -1), tree_part], dim=2)
    dtype = target.get_input_embeddings().weight.dtype
    device = target.get_input_embeddings().weight.device
    with kv.masked_gqa(device, width):
        out = target(
            input_ids=tokens.to(device),
            attention_mask=float_mask(allowed.to(device), dtype)[:, None],
            position_ids=positions.to(device),
            output_hidden_states=True,
            **kv.cache_kwargs(target, cache),
        )
    return TargetPass(logits=out.logits, hidden_states=tuple(out.hidden_states))
