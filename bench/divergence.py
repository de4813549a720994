"""Telling a bf16 near-tie from a verification bug.

In float32, greedy speculative output is token-identical to `target.generate`. In bfloat16 (or
float16) the target's own argmax depends on how many tokens one forward holds: where float32 puts the
two best logits within about 2 rounding steps of the low-precision dtype, a 1-token forward (plain
decoding) and a many-token forward (tree verification, or transformers' own prompt-lookup decoding)
can round them in opposite order. Outputs then part at that token, and neither is wrong.
`first_divergence` measures the gap at the first differing token with a float32 copy of the target;
`NEAR_TIE_NOTE` is the one wording of this rule that reports and model cards print.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from selfdraft import kv

NEAR_TIE_NOTE = (
    "identical = greedy tokens equal to the baseline's. k/n (m near-tie): k of n prompts identical; m of "
    "the others part where the target's two logits, computed in float32, differ by less than the target's "
    "own logit gap moves between a 1-token and a many-token forward in its dtype (or by 2 ulps): a tie "
    "its rounding breaks differently in plain decoding and in a verified block (bf16). "
    "NO marks a divergence that is not such a tie."
)


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing of `dtype` numbers at |magnitude| (the rounding step of a value that large)."""
    x = torch.tensor(abs(magnitude), dtype=dtype)
    return float(torch.nextafter(x, torch.tensor(float("inf"), dtype=dtype)).float() - x.float())


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs first differ, and how close the two tokens are for the target.

    gap: |logit(a) - logit(b)| computed in float32 by one plain forward over prompt + common prefix
    (float32 stands in for exact arithmetic); gap_ulps: that gap in units of the target dtype's
    spacing at that magnitude. spread: how far the target's OWN logit(a) - logit(b), in its own dtype,
    moves when the last BLOCK_SIZES tokens go through one forward (plain decoding: 1 token; tree
    verification: many) - the measured size of the batch-shape rounding. A near-tie is a gap within
    that spread (or within 2 ulps, where rounding alone can swap the order); a larger gap is an error.
    """

    position: int
    token_a: int
    token_b: int
    gap: float
    gap_ulps: float
    spread: float = 0.0

    @property
    def near_tie(self) -> bool:
        return self.gap_ulps <= 2.0 or self.gap <= self.spread


def float32_reference(target: torch.nn.Module) -> torch.nn.Module:
    """The target itself when it computes in float32, else a float32 copy (same weights, upcast)."""
    if target.get_input_embeddings().weight.dtype == torch.float32:
        return target
    return copy.deepcopy(target).to(torch.float32)


# Tokens in the last forward block: plain decoding, then sizes at most 4 apart up to 32, past the
# largest block a shipped tree verifies (30). The target's own gap does not move monotonically with the
# block size, so sparse sizes miss flips: a ShareGPT answer's gap went +0.19 at 8 tokens, 0 at 12,
# -0.06 at 24 (a flip 1, 4, 13 and 32 did not show). 13, a size sampled before, stays so that no
# near-tie found then is lost.
BLOCK_SIZES = (1, 2, 4, 8, 12, 13, 16, 20, 24, 28, 32)


@torch.no_grad()
def own_gap_spread(target, ids: torch.Tensor, a: int, b: int, blocks: tuple[int, ...] = BLOCK_SIZES) -> float:
    """max - min over blocks m of the target's own logit(a) - logit(b) at the last position of ids
    [1, T], computed in its own dtype with the last m tokens in one forward after a cached prefix."""
    gaps = []
    for m in blocks:
        if m > ids.shape[1]:
            break
        cache = kv.new_cache()
        if ids.shape[1] > m:
            target(input_ids=ids[:, :-m], **kv.cache_kwargs(target, cache))
        logits = target(input_ids=ids[:, -m:], **kv.cache_kwargs(target, cache)).logits[0, -1]
        gaps.append(float(logits[a].float() - logits[b].float()))
    return max(gaps) - min(gaps) if gaps else 0.0


@torch.no_grad()
def first_divergence(
    target,
    prompt_ids: torch.Tensor,
    a: list[int],
    b: list[int],
    reference: torch.nn.Module | None = None,
) -> Divergence | None:
    """prompt_ids: [1, T]; a, b: generated token lists. None when one is a prefix of the other.

    reference: `float32_reference(target)`, passed in to build it once for many calls.
    """
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if k is None:
        return None
    reference = reference if reference is not None else float32_reference(target)
    prefix = torch.tensor([a[:k]], dtype=torch.long, device=prompt_ids.device)
    ids = torch.cat([prompt_ids, prefix], dim=1)
    logits = reference(input_ids=ids).logits[0, -1].float()
    la, lb = float(logits[a[k]]), float(logits[b[k]])
    gap = abs(la - lb)
    step = ulp(target.get_input_embeddings().weight.dtype, max(abs(la), abs(lb)))
    spread = own_gap_spread(target, ids, a[k], b[k])
    return Divergence(position=k, token_a=a[k], token_b=b[k], gap=gap, gap_ulps=gap / step, spread=spread)
