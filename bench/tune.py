"""Choosing a tree for given heads on this machine.

Expected speed of a tree = tau / (draft + verify + other time per step): tau, draft time and the rest
of the step (acceptance, KV compaction, the drafter taking the accepted path, Python bookkeeping) are
measured by generating with the heads on held-out prompts, the verify time comes from the measured
verify-cost curve of the target. The tree with the highest expected tokens/s wins.

The rest of the step counts: with cheap int8 drafting it is as large as drafting (a few ms per step),
and a model without it over-rates shallow trees, which take more steps for the same tokens.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

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
    "dynamic:depth=3,top_k=3,total_tokens=6+lookup=5",
    "dynamic:depth=4,top_k=4,total_tokens=10+lookup=5",
    "dynamic:depth=3,top_k=3,total_tokens=6+lookup=5,extend=3",
    "dynamic:depth=4,top_k=4,total_tokens=10+lookup=5,extend=5",
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
    other_s: float = 0.0  # per step: acceptance, compaction, observing the accepted path, bookkeeping


# Expected tokens/s (tau over the modelled step cost) ranks the trees; candidates within this fraction
# of the best expected are a tie that the model cannot separate, and the measured tokens/s decides.
EXPECTED_TIE = 0.02


def rank_scores(scores: list[TreeScore], tie: float = EXPECTED_TIE) -> list[TreeScore]:
    """Best first: of the trees whose expected tokens/s is within `tie` of the best, the one measured
    fastest; the rest follow by expected tokens/s."""
    ranked = sorted(scores, key=lambda s: -s.expected_tokens_per_s)
    if not ranked:
        return ranked
    floor = (1.0 - tie) * ranked[0].expected_tokens_per_s
    best = max((s for s in ranked if s.expected_tokens_per_s >= floor), key=lambda s: s.measured_tokens_per_s)
    return [best] + [s for s in ranked if s is not best]


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


def _drafted_shapes(model: SelfDraftModel, candidates: list[str]) -> dict:
    """The candidates the heads can draft (the deeper ones are skipped, with a warning)."""
    limit = getattr(model.heads, "max_draft_depth", None)
    shapes = {c: resolve_tree(c) for c in candidates}
    skipped = [c for c, shape in shapes.items() if limit is not None and shape.draft_depth > limit]
    if skipped:
        logger.warning("skipped %d trees deeper than the heads' %d levels: %s", len(skipped), limit, skipped)
    shapes = {c: shape for c, shape in shapes.items() if c not in skipped}
    if not shapes:
        raise UserError(f"no candidate tree fits heads that draft {limit} levels; pass shallower --candidates")
    return shapes


def _other_step_time(stats) -> float:
    """Seconds of a generation's tree passes spent outside drafting and the target's verification."""
    return stats.accept_time + stats.compact_time + stats.observe_time + stats.other_time


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
    seed + i, the same for every candidate); best first (`rank_scores`)."""
    shapes = _drafted_shapes(model, candidates)
    curve = curve or verify_cost_curve(model.target, [1, 2, 4, 8, 16, 32, 64])
    runs: dict[str, list] = {c: [] for c in shapes}
    with tqdm(total=len(prompts) * len(shapes), desc="tune", unit="run") as bar:
        for i, ids in enumerate(prompts):
            for c in shapes:  # interleaved per prompt
                bar.set_postfix_str(c)
                out = model.generate(
                    ids, max_new_tokens, tree=shapes[c], temperature=temperature, seed=seed + i, profile=True
                )
                runs[c].append(out)
                bar.update()
    scores = []
    for c, outs in runs.items():
        passes = sum(o.stats.tree_passes for o in outs)
        tau = sum(o.stats.mean_accepted * o.stats.tree_passes for o in outs) / max(1, passes)
        size = sum(o.stats.tree_tokens for o in outs) / max(1, passes)
        draft = sum(o.stats.draft_time for o in outs) / max(1, passes)
        other = sum(_other_step_time(o.stats) for o in outs) / max(1, passes)
        verify = interpolate(curve, size)
        measured = statistics.median(len(o.tokens) / o.stats.total_time for o in outs)
        scores.append(TreeScore(c, tau, size, draft, verify, tau / (draft + verify + other), measured, other))
    return rank_scores(scores)


def score_trees_batched(
    model: SelfDraftModel,
    prompts: list[torch.Tensor],
    candidates: list[str],
    batch: int,
    max_new_tokens: int = 64,
) -> list[TreeScore]:
    """Every candidate on batches of `batch` prompts (greedy, interleaved per batch); best measured
    total tokens/s first. A shared pass verifies every row's tree, so no single-prompt verify curve
    predicts a batch's cost: the score is measured throughput (`expected_tokens_per_s` repeats it).

    prompts: [T] id tensors, taken in order in groups of `batch`, cycled when fewer than one group."""
    shapes = _drafted_shapes(model, candidates)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    groups = groups or [[prompts[i % len(prompts)] for i in range(batch)]]
    model.generate(groups[0], 4, tree=next(iter(shapes.values())))  # warm-up, not measured
    runs: dict[str, list] = {c: [] for c in shapes}
    with tqdm(total=len(groups) * len(shapes), desc=f"tune batch {batch}", unit="run") as bar:
        for group in groups:
            for c, shape in shapes.items():  # interleaved per batch
                bar.set_postfix_str(c)
                start = time.perf_counter()
                outs = model.generate(group, max_new_tokens, tree=shape, profile=True)
                runs[c].append((outs, time.perf_counter() - start))
                bar.update()
    scores = []
    for c, done in runs.items():
        outs = [o for group_outs, _ in done for o in group_outs]
        passes = sum(o.stats.tree_passes for o in outs)
        tau = sum(o.stats.mean_accepted * o.stats.tree_passes for o in outs) / max(1, passes)
        size = sum(o.stats.tree_tokens for o in outs) / max(1, passes)
        # the shared passes: the longest-running row of a batch took part in all of them
        longest = [max(group_outs, key=lambda o: o.stats.tree_passes).stats for group_outs, _ in done]
        steps = max(1, sum(st.tree_passes for st in longest))
        draft = sum(st.draft_time for st in longest) / steps
        verify = sum(st.verify_time for st in longest) / steps
        other = sum(_other_step_time(st) for st in longest) / steps
        measured = sum(len(o.tokens) for o in outs) / sum(seconds for _, seconds in done)
        scores.append(TreeScore(c, tau, size, draft, verify, measured, measured, other))
    return sorted(scores, key=lambda s: -s.measured_tokens_per_s)


def tree_description(score: TreeScore, batch: int = 1) -> str:
    if batch > 1:
        return (
            f"chosen by selfdraft tune at batch {batch}: tau {score.tau:.2f}, {score.tree_tokens:.1f} tokens "
            f"per row per pass, measured {score.measured_tokens_per_s:.1f} tok/s in total"
        )
    return (
        f"chosen by selfdraft tune: tau {score.tau:.2f}, {score.tree_tokens:.1f} tokens per pass, "
        f"expected {score.expected_tokens_per_s:.1f} tok/s, measured {score.measured_tokens_per_s:.1f} tok/s"
    )
