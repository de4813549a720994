"""Sampling parameters and the target's warped next-token distribution.

`warp_probs` is the one place where temperature, top-k and top-p turn logits into the distribution p
that lossless verification must reproduce: it applies them exactly as a plain (non-speculative) sampler
does, in the order Hugging Face transformers applies its warpers (temperature, then top-k, then top-p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_SEED_RANGE = 2**62  # seeds drawn from torch's global RNG for unseeded runs


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples. temperature == 0 means greedy (top_k / top_p are then irrelevant)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ValueError(f"top_k must be an integer or None, got {self.top_k!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or None to disable), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (or None to disable), got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

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
    """One token id drawn from probs: [V] (non-negative, positive total; need not be normalized)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
