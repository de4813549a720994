"""The target's sampling distribution, and which drafted tree nodes it accepts.

`SamplingParams` and `warp_probs` are the one place where temperature, top-k and top-p turn logits
into the distribution p that lossless verification must reproduce: they apply them exactly as a plain
(non-speculative) sampler does, in the order transformers applies its warpers (temperature, top-k,
top-p).

Pure functions over one verified tree (N nodes, node 0 = root, see `tree.TreeSpec`):

- `accept_greedy`: temperature 0; follow the child equal to the target's argmax.
- `accept_rejection`: lossless at any temperature. Per-branch recursive rejection sampling: at each node
  try its children in order, accept x with probability min(1, p(x) / q(x)), on rejection replace p by
  the residual normalize(max(0, p - q)); if every child fails, draw the recovered token from what is left
  of p. The variant must match how the children were really produced, or exactness is lost.
- `accept_typical`: Medusa's typical acceptance. LOSSY; only for callers who opt in explicitly.

Vocabulary as in vLLM's RejectionSampler: accepted tokens, then either a bonus token (the last accepted
node has no children: a free extra token from p) or a recovered token (a correction, drawn after every
child of the last accepted node was rejected).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from selfdraft.errors import UserError
from selfdraft.tree import TreeSpec

_SEED_RANGE = 2**62  # seeds drawn from torch's global RNG for unseeded runs


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples. temperature == 0 means greedy (top_k / top_p are then irrelevant)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise UserError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise UserError(f"top_k must be an integer or None, got {self.top_k!r}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be >= 1 (or None to disable), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (or None to disable), got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise UserError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The RNG every random draw of one generation call uses, passed explicitly (never global).

        Greedy decoding draws no random numbers, so it gets None. With `seed` set the generator is
        seeded with it (reproducible regardless of global state); otherwise it is seeded from torch's
        global RNG, so `torch.manual_seed(...)` before generating still makes runs repeatable.
        """
        if self.is_greedy:
            return None
        seed = self.seed
        if seed is None:
            seed = int(torch.randint(_SEED_RANGE, (1,)).item())
        return torch.Generator(device=device).manual_seed(seed)


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities a plain sampler would draw from.  logits: [..., V] -> probs: [..., V].

    Computed in float32 (float64 if the logits are float64). Greedy params give a one-hot of the
    argmax (ties go to the lowest index, as `torch.argmax`). Otherwise, as transformers does:
    scores = logits / temperature; top-k keeps every token whose score is >= the k-th largest (ties
    at the boundary are kept); top-p drops the lowest-probability tokens while their cumulative
    probability stays <= 1 - top_p, i.e. keeps the smallest high-probability set with mass >= top_p,
    and always at least one token.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype)
    vocab = scores.shape[-1]
    if params.is_greedy:
        return torch.nn.functional.one_hot(scores.argmax(dim=-1), vocab).to(dtype)
    scores = scores / params.temperature
    if params.top_k is not None and params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p is not None and params.top_p < 1.0:
        scores = scores.masked_fill(_top_p_removed(scores, params.top_p), -math.inf)
    return scores.softmax(dim=-1)


def _top_p_removed(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool [..., V]: tokens outside the nucleus. Mirrors transformers' TopPLogitsWarper bit for bit
    (ascending sort, cumulative mass <= 1 - top_p removed) so p matches a plain HF sampler exactly."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    sorted_removed = cumulative <= 1.0 - top_p
    sorted_removed[..., -1] = False  # the most likely token always survives
    return sorted_removed.scatter(-1, order, sorted_removed)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from probs: [V] (non-negative, positive total; need not be normalized).

    Inverse CDF: the first x with F(x) > u * F(V), F the float64 cumulative sum, u ~ U[0, 1); a token
    of zero probability adds no width, so it is never drawn. One uniform and one pass over the
    vocabulary: `torch.multinomial` takes ~0.9 ms for one draw over a 49k vocabulary on CPU, this ~0.05.
    """
    cdf = probs.to(torch.float64).cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    x = int(torch.searchsorted(cdf, u, right=True))
    if x < cdf.numel():
        return x
    return int(torch.nonzero(probs > 0)[-1])  # u rounded up to the total: the last possible token


Variant = Literal["iid", "without_replacement", "deterministic"]
VARIANTS: tuple[Variant, ...] = ("iid", "without_replacement", "deterministic")

# A residual (or a renormalized p / q) with less float64 mass than this is rounding noise, not a
# distribution. It only arises after a rejection that had probability ~0 in exact arithmetic (p <= q
# everywhere means p == q, where acceptance is certain), so what we sample instead changes the output
# distribution by at most ~this much; we keep the last valid distribution rather than divide noise.
_MIN_MASS = 1e-12


@dataclass(frozen=True)
class AcceptResult:
    """accepted: tree node indices along the accepted path (root excluded, in depth order).
    next_token: the token the target adds after them; next_kind says which kind it is."""

    accepted: tuple[int, ...]
    next_token: int
    next_kind: Literal["bonus", "recovered"]


# A step looks at node u and its (node, token) children and returns (accepted child node, None) or
# (None, next token). `_walk` owns the descent so the three rules share it.
Step = Callable[[int, list[tuple[int, int]]], tuple[int | None, int | None]]


def _walk(spec: TreeSpec, tokens: list[int], step: Step) -> AcceptResult:
    u, accepted = 0, []
    while True:
        children = [(c, tokens[c]) for c in spec.children[u]]
        child, token = step(u, children)
        if child is None:
            assert token is not None
            kind: Literal["bonus", "recovered"] = "recovered" if spec.children[u] else "bonus"
            return AcceptResult(tuple(accepted), token, kind)
        accepted.append(child)
        u = child


def _first_occurrences(children: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Children whose token no earlier sibling has: a repeated token is never tried (it would
    lead to an identical subtree, and after the first copy's rejection p gives it zero mass)."""
    seen: set[int] = set()
    out = []
    for node, x in children:
        if x not in seen:
            seen.add(x)
            out.append((node, x))
    return out


def _check_shapes(spec: TreeSpec, tokens: torch.Tensor, **dists: torch.Tensor | None) -> None:
    if tokens.shape != (spec.size,):
        raise ValueError(f"tokens must have shape [{spec.size}], got {tuple(tokens.shape)}")
    for name, d in dists.items():
        if d is not None and (d.dim() != 2 or d.shape[0] != spec.size):
            raise ValueError(f"{name} must have shape [{spec.size}, V], got {tuple(d.shape)}")


# ---- greedy ------------------------------------------------------------------------------------------
def accept_greedy(tokens: torch.Tensor, target_argmax: torch.Tensor, spec: TreeSpec) -> AcceptResult:
    """Temperature-0 acceptance. tokens: [N] drafted token per node (tokens[0] = root's token);
    target_argmax: [N] the target's argmax after each node. Descends into the first child equal to
    the argmax; next_token is the argmax at the last accepted node."""
    _check_shapes(spec, tokens)
    if target_argmax.shape != tokens.shape:
        raise ValueError(f"target_argmax must have shape [{spec.size}], got {tuple(target_argmax.shape)}")
    want = target_argmax.tolist()

    def step(u: int, children: list[tuple[int, int]]) -> tuple[int | None, int | None]:
        for node, x in children:
            if x == want[u]:
                return node, None
        return None, want[u]

    return _walk(spec, tokens.tolist(), step)


# ---- lossless rejection sampling --------------------------------------------------------------------
def _normalize(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """x / sum(x), or `fallback` when x has (numerically) no mass; see _MIN_MASS."""
    mass = float(x.sum())
    return x / mass if mass > _MIN_MASS else fallback


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)): what p still owes after a draft from q was rejected.  [V] -> [V].

    Falls back to p itself when the residual has no mass: that means p <= q everywhere, i.e. p == q
    up to rounding, where the rejection that led here had probability ~0, so any valid choice is exact
    up to float error; p (the last valid distribution) is the natural one.
    """
    return _normalize(torch.clamp(p - q, min=0.0), fallback=p)


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> list[float]:
    """n fresh independent U[0, 1) draws, one per trial; accepting when u < ratio gives probability
    exactly min(1, ratio). Drawn in one call (one device sync) even if an early trial accepts."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device).tolist()


def _accept_ratio(p_x: float, q_x: float) -> float:
    """p(x) / q(x), with x/0 = inf for p(x) > 0 (a draft q called impossible; min(1, .) = 1)."""
    if q_x > 0.0:
        return p_x / q_x
    return math.inf if p_x > 0.0 else 0.0


def _verify_deterministic(
    p: torch.Tensor, children: list[tuple[int, int]], generator: torch.Generator | None
) -> tuple[int | None, int | None]:
    """One node whose children were chosen without randomness. p: float64 [V], normalized.

    q is one-hot at the tried child, so x_i is accepted with prob p'(x_i), p' = p with the rejected
    earlier siblings zeroed and renormalized, i.e. p(x_i) / (1 - rejected mass); if all fail, the
    recovered token comes from p with every child zeroed. Equivalent to drawing y ~ p once and
    descending into the child equal to y. Repeated tokens are skipped: p' already gives them 0.
    """
    firsts = _first_occurrences(children)
    p_x = p[[x for _, x in firsts]].tolist()
    rejected_mass = 0.0
    for (node, _), p_xi, u in zip(firsts, p_x, _uniforms(len(firsts), generator, p.device), strict=True):
        # u < p'(x_i), written without dividing by ~0; p(x_i) > 0 guards rounding past mass 1
        if p_xi > 0.0 and u * (1.0 - rejected_mass) < p_xi:
            return node, None
        rejected_mass += p_xi
    tried = torch.tensor([x for _, x in firsts], device=p.device)
    # Zero mass left only if the children cover p's support and all were rejected: probability 0 in
    # exact arithmetic (the last one had p' = 1), so fall back to p, see _MIN_MASS.
    return None, sample(_normalize(p.index_fill(0, tried, 0.0), fallback=p), generator)


def _verify_sampled(
    p: torch.Tensor,
    q: torch.Tensor,
    children: list[tuple[int, int]],
    variant: Variant,
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:
    """One node whose children were drawn from q (iid or without_replacement). p, q: float64 [V], normalized.

    Accept x_i with prob min(1, p(x_i) / q(x_i)); on rejection p <- residual(p, q). iid: q stays
    fixed. without_replacement: then q(x_i) <- 0 and q is renormalized, because the next sibling
    was drawn from exactly that. If all fail, the recovered token is drawn from the final residual.
    """
    us = iter(_uniforms(len(_first_occurrences(children)), generator, p.device))
    tried: set[int] = set()
    for node, x in children:
        if x in tried:
            # A repeated sibling is never tried: its first copy was rejected, so p(x) is now 0 and it
            # would be rejected for sure. Under iid it was still one more i.i.d. draw from q, and the
            # exactness proof counts every draw's residual step, so take that step (skipping it
            # biases the output); without replacement a repeat cannot have been drawn, so it is ignored.
            if variant == "iid":
                p = residual(p, q)
            continue
        tried.add(x)
        q_x = float(q[x])
        if next(us) < _accept_ratio(float(p[x]), q_x):
            return node, None
        p = residual(p, q)
        if variant == "without_replacement" and 1.0 - q_x > _MIN_MASS:
            # (once q's support is used up no further sibling can have been drawn from it; keep q)
            q = q.clone()
            q[x] = 0.0
            q /= 1.0 - q_x
    return None, sample(p, generator)


def accept_rejection(
    p: torch.Tensor,
    tokens: torch.Tensor,
    spec: TreeSpec,
    *,
    variant: Variant,
    q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Lossless tree verification: the emitted tokens are distributed exactly as the target's sampler.

    p: [N, V] the target's warped next-token distribution after node u (`sampling.warp_probs`);
    tokens: [N] drafted token per node (tokens[0] = root's token, unused);
    q: [N, V] the draft distribution u's children were drawn from; required for "iid" (children drawn
    i.i.d. from q[u]) and "without_replacement" (drawn from q[u] without replacement), ignored for
    "deterministic" (children chosen without randomness: top-k of a head, a beam, a static tree).
    generator: the source of every uniform and sample (fresh, independent draws per trial).
    Computation is in float64; p and q rows are renormalized there before use.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if variant != "deterministic" and q is None:
        raise ValueError(f"variant {variant!r} needs q, the distribution the children were drawn from")
    _check_shapes(spec, tokens, p=p, q=q)

    def step(u: int, children: list[tuple[int, int]]) -> tuple[int | None, int | None]:
        p_u = p[u].to(torch.float64)
        p_u = _normalize(p_u, fallback=p_u)
        if not children:
            return None, sample(p_u, generator)
        if variant == "deterministic":
            return _verify_deterministic(p_u, children, generator)
        assert q is not None
        q_u = q[u].to(torch.float64)
        return _verify_sampled(p_u, _normalize(q_u, fallback=q_u), children, variant, generator)

    return _walk(spec, tokens.tolist(), step)


# ---- typical acceptance (lossy) ---------------------------------------------------------------------
def typical_threshold(p: torch.Tensor, posterior_threshold: float, posterior_alpha: float) -> float:
    """min(eps, delta * exp(-H(p))) for p: [V], with H in nats and 0 log 0 = 0."""
    p = p.to(torch.float64)
    entropy = -float(torch.special.xlogy(p, p).sum())
    return min(posterior_threshold, posterior_alpha * math.exp(-entropy))


def accept_typical(
    p: torch.Tensor,
    tokens: torch.Tensor,
    spec: TreeSpec,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Medusa's typical acceptance. LOSSY: the output is NOT distributed as the target's sampler
    (drafts the target finds merely plausible are accepted outright). Opt-in only; never a default.

    p: [N, V] target's warped distributions; tokens: [N]. At node u, descend into the first child x
    (repeated tokens skipped) with p_u(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_u)));
    if none qualifies, the next token is sampled from p_u.
    """
    _check_shapes(spec, tokens, p=p)

    def step(u: int, children: list[tuple[int, int]]) -> tuple[int | None, int | None]:
        p_u = p[u].to(torch.float64)
        threshold = typical_threshold(p_u, posterior_threshold, posterior_alpha)
        for node, x in _first_occurrences(children):
            if float(p_u[x]) > threshold:
                return node, None
        return None, sample(p_u, generator)

    return _walk(spec, tokens.tolist(), step)
