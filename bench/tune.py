"""Choosing a tree for given heads on this machine.

Expected speed of a tree = tau / (draft time + verify time of its size): tau and draft time are
measured by generating with the heads on held-out prompts, the verify time comes from the measured
verify-cost curve of the target. The tree with the highest expected tokens/s wins.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

import torch

from selfdraft.bench.timing import verify_cost_curve
from selfdraft.errors import UserError
from selfdraft.inference.model import SelfDraftModel
from selfdraft.tree_syntax import resolve_tree

logger = logging.getLogger(__name__)

CANDIDATES = [
    "chain-1",
    "chain-2",
    "chain-3",
    "chain-4",
    "small",
    "medium",
    "dynamic:depth=3,top_k=3,total_tokens=6",
    "dynamic:depth=4,top_k=4,total_tokens=10",
    "dynamic:depth=5,top_k=4,total_tokens=16",
    "chain-2+lookup=5",
    "chain-3+lookup=5",
    "small+lookup=5",
    "chain-4+lookup=8",
    "small+lookup=8",
    "dynamic:depth=4,top_k=4,total_tokens=10+lookup=5",
]


@dataclass
class TreeScore:
    tree: str
    tau: float
    tree_tokens: float
    draft_s: float
    verify_s: float
    expected_tokens_per_s: float
    measured_tokens_per_s: float


def interpolate(curve: dict[int, float], size: float) -> float:
    """Verify seconds for `size` tokens, log-linear between measured block sizes."""
    sizes = sorted(curve)
    if size <= sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if size <= hi:
            w = (math.log(size) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return curve[lo] + w * (curve[hi] - curve[lo])
    return curve[sizes[-1]] * size / sizes[-1]


def score_trees(
    model: SelfDraftModel,
    prompts: list[torch.Tensor],
    candidates: list[str],
    max_new_tokens: int = 64,
    curve: dict[int, float] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[TreeScore]:
    """Every candidate on every prompt (interleaved per prompt), at `temperature` (prompt i with seed
    seed + i, the same for every candidate); best expected tokens/s first."""
    limit = getattr(model.heads, "max_draft_depth", None)
    shapes = {c: resolve_tree(c) for c in candidates}
    skipped = [c for c, shape in shapes.items() if limit is not None and shape.draft_depth > limit]
    if skipped:
        logger.warning("skipped %d trees deeper than the heads' %d levels: %s", len(skipped), limit, skipped)
    shapes = {c: shape for c, shape in shapes.items() if c not in skipped}
    if not shapes:
        raise UserError(f"no candidate tree fits heads that draft {limit} levels; pass shallower --candidates")
    curve = curve or verify_cost_curve(model.target, [1, 2, 4, 8, 16, 32, 64])
    runs: dict[str, list] = {c: [] for c in shapes}
    for i, ids in enumerate(prompts):
        for c in shapes:  # interleaved per prompt
            out = model.generate(ids, max_new_tokens, tree=shapes[c], temperature=temperature, seed=seed + i)
            runs[c].append(out)
    scores = []
    for c, outs in runs.items():
        passes = sum(o.stats.tree_passes for o in outs)
        tau = sum(o.stats.mean_accepted * o.stats.tree_passes for o in outs) / max(1, passes)
        size = sum(o.stats.tree_tokens for o in outs) / max(1, passes)
        draft = sum(o.stats.draft_time for o in outs) / max(1, passes)
        verify = interpolate(curve, size)
        measured = statistics.median(len(o.tokens) / o.stats.total_time for o in outs)
        scores.append(TreeScore(c, tau, size, draft, verify, tau / (draft + verify), measured))
    return sorted(scores, key=lambda s: -s.expected_tokens_per_s)


def tree_description(score: TreeScore) -> str:
    return (
        f"chosen by selfdraft tune: tau {score.tau:.2f}, {score.tree_tokens:.1f} tokens per pass, "
        f"expected {score.expected_tokens_per_s:.1f} tok/s, measured {score.measured_tokens_per_s:.1f} tok/s"
    )
