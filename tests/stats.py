"""Chi-square goodness-of-fit gate shared by the statistical losslessness tests."""

import math

import torch

from selfdraft.inference.acceptance import SamplingParams, warp_probs

# The critical value uses the Wilson-Hilferty approximation chi2_{df,1-alpha} ~= df (1 - 2/(9 df) +
# z sqrt(2/(9 df)))^3 with z = 3.7190 (the N(0,1) 1 - 1e-4 quantile); for df = 1..63 it is within ~7%
# of the exact value and on the conservative (larger) side. Any count in a cell of exact probability 0
# (a token top-k / top-p removed) fails outright.
Z_ALPHA = 3.7190


def chi2_critical(df: int) -> float:
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_ALPHA * math.sqrt(c)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) for counts vs. exact probs (same shape, any)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if bool((counts[probs == 0] > 0).any()):
        return math.inf, 0.0
    expected = counts.sum() * probs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, chi2_critical(max(len(exp) - 1, 1))


def exact_two_token_law(target, prompt: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt, x1), warped like the sampler: [V, V]."""
    V = target.config.vocab_size
    with torch.no_grad():
        p1 = warp_probs(target(prompt).logits[0, -1].double(), params)
        batch = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
        p2 = warp_probs(target(batch).logits[:, -1].double(), params)
    return p1[:, None] * p2
