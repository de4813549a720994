"""Acceptance rules: losslessness as a statistical test against a closed-form toy target.

The toy target is a first-order Markov chain over V tokens: p(x_t | x_{t-1}) = warp(softmax(L[x_{t-1}])),
so the exact law of any generated prefix is known by enumeration. A toy drafter q(x_t | x_{t-1}) is another
fixed table. `_generate_prefixes` does what a speculative decoder does (draft a tree of the given shape,
read p at every node, run an acceptance rule, emit accepted + next token, repeat) and the gate compares the
first generated tokens against the exact law with a chi-square test. The same gate must reject the known
lossy rules (negative controls), or it proves nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from selfdraft.inference import acceptance
from selfdraft.inference.acceptance import (
    AcceptResult,
    SamplingParams,
    accept_greedy,
    accept_rejection,
    accept_typical,
    residual,
    sample,
    warp_probs,
)
from selfdraft.tree import TreeSpec

from stats import chi_square

# ---- toy target and drafters -------------------------------------------------------------------------
V = 8
START = 0
# Per lossless run. One sample costs ~0.2-0.5 ms on a 2-core CPU, which caps the file at ~100k samples.
# With 8k, a correct rule gives chi2 ~ df (~63 for the joint at T = 1) against a critical value of ~108,
# and a subtle bug (skipping repeated i.i.d. siblings without their residual step) scores ~400.
N_SAMPLES = 8_000
# The lossy rules below miss the gate by factors of 10-700 (e.g. chi2 ~13k and ~77k vs. 108 at 12k
# samples), so a few thousand samples detect them with an enormous margin.
N_NEGATIVE = 3_000

_g = torch.Generator().manual_seed(1234)
TARGET_LOGITS = 1.5 * torch.randn(V, V, generator=_g)
# A decent drafter: the target's logits plus noise. The adversarial one piles its mass on the tokens
# the target finds least likely, so almost every draft is rejected and the residual path does the work.
NOISY_Q = torch.softmax(TARGET_LOGITS + torch.randn(V, V, generator=_g), dim=-1)
ADVERSARIAL_Q = torch.softmax(-2.0 * TARGET_LOGITS, dim=-1)

T1 = SamplingParams(temperature=1.0)
T07_TOPK = SamplingParams(temperature=0.7, top_k=4)
TOPP = SamplingParams(temperature=1.0, top_p=0.8)

CHAIN = TreeSpec.chain(3)
WIDE = TreeSpec.from_paths([(0,), (1,), (2,), (3,)])
DEEP = TreeSpec.chain(5)
RAGGED = TreeSpec.from_paths([(0, 0, 0), (0, 1), (1,), (2, 0)])

# How the drafter produces children for each acceptance variant (mismatches are the negative controls).
DRAFT_MODE = {"iid": "iid", "without_replacement": "without_replacement", "deterministic": "topk"}

Accept = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TreeSpec, torch.Generator], AcceptResult]


@dataclass
class ToyDrafter:
    q: torch.Tensor  # [V, V]: q(x_t | x_{t-1})

    def __post_init__(self) -> None:
        rows = self.q.double().tolist()
        self.weights = rows
        self.ranked = [sorted(range(V), key=lambda x, r=row: -r[x]) for row in rows]

    def children(self, prev: int, ranks: list[int], mode: str, rng: random.Random) -> list[int]:
        """Tokens for the children of a node whose token is `prev`, in sibling order."""
        if mode == "iid":
            return rng.choices(range(V), weights=self.weights[prev], k=len(ranks))
        if mode == "without_replacement":
            w, out = list(self.weights[prev]), []
            for _ in ranks:
                x = rng.choices(range(V), weights=w)[0]
                w[x] = 0.0
                out.append(x)
            return out
        assert mode == "topk"  # child of rank r takes the r-th most likely token
        return [self.ranked[prev][r] for r in ranks]

    def tree(self, spec: TreeSpec, root_token: int, mode: str, rng: random.Random) -> list[int]:
        tokens = [root_token] * spec.size
        for u in range(spec.size):  # parents precede children, so tokens[u] is set before use
            kids = spec.children[u]
            if kids:
                drafted = self.children(tokens[u], [spec.ranks[c] for c in kids], mode, rng)
                for c, x in zip(kids, drafted, strict=True):
                    tokens[c] = x
        return tokens


def _rejection(variant: str) -> Accept:
    return lambda p, q, t, spec, gen: accept_rejection(p, t, spec, variant=variant, q=q, generator=gen)


def _typical(p, q, t, spec, gen) -> AcceptResult:
    return accept_typical(p, t, spec, generator=gen)


def _generate_prefixes(
    spec: TreeSpec, params: SamplingParams, q: torch.Tensor, mode: str, accept: Accept, n: int, seed: int
) -> list[tuple[int, int, int]]:
    """n independent generations from START with speculative decoding; first 3 tokens of each."""
    p_table = warp_probs(TARGET_LOGITS, params)  # [V, V] float32, as a real target would hand over
    drafter, rng = ToyDrafter(q), random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        emitted: list[int] = []
        while len(emitted) < 3:
            tokens = drafter.tree(spec, emitted[-1] if emitted else START, mode, rng)
            t = torch.tensor(tokens)
            res = accept(p_table[t], q[t], t, spec, gen)
            emitted += [tokens[i] for i in res.accepted] + [res.next_token]
        out.append((emitted[0], emitted[1], emitted[2]))
    return out


def _exact_laws(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Target's exact joint of (x1, x2): [V, V], and marginal of x3: [V], by enumeration."""
    p = warp_probs(TARGET_LOGITS.double(), params)
    joint12 = p[START][:, None] * p
    return joint12, joint12.sum(dim=0) @ p


# ---- the gate ----------------------------------------------------------------------------------------
# Chi-square goodness of fit at significance alpha = 1e-4 per statistic (two statistics per run, so a
# correct rule fails a run with probability <= 2e-4; seeds are fixed, so the suite is deterministic
# anyway). Cells with expected count < 5 are pooled into one cell so the chi-square approximation holds.
def gate(prefixes: list[tuple[int, int, int]], params: SamplingParams) -> dict[str, tuple[float, float]]:
    """Chi-square statistics for the joint of the first two tokens and the marginal of the third."""
    x = torch.tensor(prefixes)
    counts12 = torch.bincount(x[:, 0] * V + x[:, 1], minlength=V * V).view(V, V)
    counts3 = torch.bincount(x[:, 2], minlength=V)
    joint12, marginal3 = _exact_laws(params)
    return {"joint12": chi_square(counts12, joint12), "marginal3": chi_square(counts3, marginal3)}


def passes(stats: dict[str, tuple[float, float]]) -> bool:
    return all(stat <= crit for stat, crit in stats.values())


# ---- losslessness ------------------------------------------------------------------------------------
LOSSLESS_CASES = [
    # (variant, tree, warp, drafter). The adversarial drafter makes most drafts fail, so the residual
    # path carries the output; it is what exposes subtle bugs (e.g. skipping repeated i.i.d. siblings
    # without their residual step fails the wide iid case).
    ("iid", CHAIN, T1, NOISY_Q),
    ("iid", WIDE, T1, ADVERSARIAL_Q),  # i.i.d. siblings repeat often with V = 8: de-duplication
    ("iid", RAGGED, T07_TOPK, ADVERSARIAL_Q),
    ("iid", DEEP, TOPP, NOISY_Q),
    ("without_replacement", WIDE, T1, ADVERSARIAL_Q),
    ("without_replacement", RAGGED, TOPP, NOISY_Q),
    ("without_replacement", DEEP, T07_TOPK, NOISY_Q),
    ("deterministic", CHAIN, T1, NOISY_Q),
    ("deterministic", WIDE, TOPP, NOISY_Q),
    ("deterministic", RAGGED, T07_TOPK, ADVERSARIAL_Q),
    ("deterministic", DEEP, T1, ADVERSARIAL_Q),
]


@pytest.mark.parametrize(
    ("variant", "spec", "params", "q"),
    LOSSLESS_CASES,
    ids=[f"{v}-{i}" for i, (v, *_) in enumerate(LOSSLESS_CASES)],
)
def test_rejection_sampling_is_lossless(variant, spec, params, q):
    prefixes = _generate_prefixes(spec, params, q, DRAFT_MODE[variant], _rejection(variant), N_SAMPLES, 7)
    stats = gate(prefixes, params)
    assert passes(stats), stats


def test_deterministic_rule_is_lossless_for_any_children():
    """The rule for deterministic children is 'draw y ~ p, descend into the child equal to y': exact
    whatever the children are (even i.i.d. draws from q), as long as they do not depend on the
    verifier's randomness. It only accepts less than the matching rule. So it is not a negative
    control; this pins that down."""
    prefixes = _generate_prefixes(WIDE, T1, NOISY_Q, "iid", _rejection("deterministic"), N_SAMPLES, 11)
    assert passes(gate(prefixes, T1))


@pytest.mark.parametrize(
    ("name", "spec", "mode", "accept"),
    [
        # Medusa typical acceptance accepts any draft above the entropy threshold: biased towards q.
        ("typical", CHAIN, "iid", _typical),
        # Softmax q used with the i.i.d. rule on top-k children (the mixing ANCHORS.md warns about):
        # the top-1 child x is accepted w.p. min(1, p(x)/q(x)) although it was never a draw from q.
        ("iid-rule-on-topk-children", CHAIN, "topk", _rejection("iid")),
        # The i.i.d. rule on children drawn without replacement: q is not updated after a rejection.
        ("iid-rule-on-distinct-children", WIDE, "without_replacement", _rejection("iid")),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_gate_detects_lossy_rules(name, spec, mode, accept):
    q = ADVERSARIAL_Q if mode == "without_replacement" else NOISY_Q  # where each bias is largest
    prefixes = _generate_prefixes(spec, T1, q, mode, accept, N_NEGATIVE, 13)
    stats = gate(prefixes, T1)
    assert not passes(stats), stats


# ---- greedy ------------------------------------------------------------------------------------------
def test_accept_greedy_descends_along_argmax():
    spec = TreeSpec.from_paths([(0, 0), (0, 1), (1, 0), (2,)])
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (2,), 4 (0,0), 5 (0,1), 6 (1,0)
    tokens = torch.tensor([9, 4, 5, 6, 7, 8, 1])
    argmax = torch.tensor([5, 0, 8, 0, 0, 0, 3])  # root wants 5 -> node 2; node 2 wants 8: no such child
    res = accept_greedy(tokens, argmax, spec)
    assert res == AcceptResult(accepted=(2,), next_token=8, next_kind="recovered")
    argmax = torch.tensor([5, 0, 1, 0, 0, 0, 3])  # node 2 wants 1 -> node 6, a leaf: bonus from it
    assert accept_greedy(tokens, argmax, spec) == AcceptResult((2, 6), 3, "bonus")
    argmax = torch.tensor([2, 0, 1, 0, 0, 0, 3])  # nothing accepted at the root
    assert accept_greedy(tokens, argmax, spec) == AcceptResult((), 2, "recovered")


def test_warp_probs_greedy_is_one_hot_of_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    probs = warp_probs(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_rejection_on_one_hot_p_matches_greedy():
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    greedy = SamplingParams()
    drafter = ToyDrafter(NOISY_Q)
    for trial in range(300):
        spec = (CHAIN, WIDE, DEEP, RAGGED)[trial % 4]
        tokens = drafter.tree(spec, rng.randrange(V), "iid", rng)
        t = torch.tensor(tokens)
        logits = TARGET_LOGITS[t] + 0.5 * torch.randn(spec.size, V, generator=gen)
        expected = accept_greedy(t, logits.argmax(dim=-1), spec)
        p = warp_probs(logits, greedy)
        assert accept_rejection(p, t, spec, variant="deterministic", generator=gen) == expected


# ---- units -------------------------------------------------------------------------------------------
def test_warp_probs_top_k_hand_computed():
    logits = torch.tensor([math.log(1.0), math.log(4.0), math.log(2.0), math.log(3.0)])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    # Temperature first: at T = 0.5 the kept weights are squared, 16 : 9.
    probs = warp_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 16 / 25, 0.0, 9 / 25]))


def test_warp_probs_top_p_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.1, 0.3, 0.1]))
    # Sorted: 0.5, 0.3, 0.1, 0.1. top_p = 0.7 needs 0.5 + 0.3 = 0.8 >= 0.7: keep {0, 2}.
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.0, 0.375, 0.0]))
    # top_p smaller than the largest probability still keeps that one token.
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.2))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_warp_probs_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    scores = TemperatureLogitsWarper(0.8)(None, logits)
    scores = TopPLogitsWarper(0.9)(None, TopKLogitsWarper(20)(None, scores))
    torch.testing.assert_close(warp_probs(logits, params), scores.softmax(dim=-1))


def test_sampling_params_validation_and_generator():
    for bad in ({"temperature": -0.1}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 2.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams().make_generator() is None
    seeded = SamplingParams(temperature=1.0, seed=5)
    probs = torch.full((V,), 1.0 / V)
    draws = [sample(probs, seeded.make_generator()) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    unseeded = SamplingParams(temperature=1.0)
    torch.manual_seed(0)
    a = [sample(probs, g) for g in [unseeded.make_generator()] for _ in range(5)]
    torch.manual_seed(0)
    b = [sample(probs, g) for g in [unseeded.make_generator()] for _ in range(5)]
    assert a == b  # follows torch.manual_seed


def test_sample_follows_probs_and_never_draws_a_zero(monkeypatch):
    """Inverse-CDF draws: frequencies match an unnormalized p with zeros at both ends and inside
    (chi-square gate of stats.py, seeded), and a zero-probability token is never drawn, even when the
    uniform lands on the very edge of the cumulative sum."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.0, 0.0], dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([sample(weights, g) for _ in range(6000)]), minlength=V)
    stat, critical = chi_square(counts, weights / weights.sum())
    assert stat < critical, (stat, critical)

    real_rand = torch.rand  # u * total rounded up to the total: the last positive token, not one past it
    monkeypatch.setattr(torch, "rand", lambda *a, generator=None, **k: real_rand(*a, **k).fill_(1.0))
    assert sample(weights, None) == 6


def test_residual_falls_back_to_p_when_it_has_no_mass():
    p = torch.tensor([0.25, 0.75, 0.0], dtype=torch.float64)
    assert torch.equal(residual(p, p), p)
    torch.testing.assert_close(
        residual(p, torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)), p.new_tensor([0, 1, 0])
    )


def test_rejected_everything_still_yields_a_valid_token(monkeypatch):
    """Force every trial to reject (u = 1) in the cases where exact math says that cannot happen: the
    residual underflows to zero mass and the fallback must still produce a token p allows."""
    monkeypatch.setattr(acceptance, "_uniforms", lambda n, generator, device: [1.0] * n)
    spec, gen = WIDE, torch.Generator().manual_seed(0)
    p = torch.zeros(spec.size, V)
    p[0, :4] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tokens = torch.tensor([7, 0, 1, 2, 3])  # children cover p's whole support
    for variant, q in (("iid", p), ("without_replacement", p), ("deterministic", None)):
        res = accept_rejection(p, tokens, spec, variant=variant, q=q, generator=gen)
        assert res.accepted == () and res.next_kind == "recovered"
        assert p[0, res.next_token] > 0, (variant, res)


def test_repeated_sibling_is_never_accepted():
    spec = WIDE
    tokens = torch.tensor([0, 3, 3, 5, 3])
    p = torch.zeros(spec.size, V)
    p[:, 3] = 1.0  # the target insists on token 3
    q = torch.full((spec.size, V), 1.0 / V)
    gen = torch.Generator().manual_seed(0)
    for variant in ("iid", "without_replacement", "deterministic"):
        res = accept_rejection(p, tokens, spec, variant=variant, q=q, generator=gen)
        assert res.accepted == (1,), (variant, res)
    assert accept_typical(p, tokens, spec, generator=gen).accepted == (1,)
    assert accept_greedy(tokens, torch.full((spec.size,), 3), spec).accepted == (1,)
    # The target rejects token 3 outright: the copies (nodes 2, 4) must not be tried again.
    p = torch.zeros(spec.size, V)
    p[:, 5] = 1.0
    for variant in ("iid", "without_replacement", "deterministic"):
        res = accept_rejection(p, tokens, spec, variant=variant, q=q, generator=gen)
        assert res.accepted == (3,), (variant, res)


def test_missing_q_is_an_error():
    with pytest.raises(ValueError, match="needs q"):
        accept_rejection(
            torch.ones(CHAIN.size, V), torch.zeros(CHAIN.size, dtype=torch.long), CHAIN, variant="iid"
        )


def test_fully_accepted_chain_ends_with_a_bonus_token():
    p = torch.zeros(CHAIN.size, V)
    p[:, 2] = 1.0
    tokens = torch.tensor([0, 2, 2, 2])
    res = accept_rejection(p, tokens, CHAIN, variant="deterministic")
    assert res == AcceptResult((1, 2, 3), 2, "bonus")


def test_greedy_ids_break_ties_like_argmax():
    from selfdraft.inference.decoding import greedy_ids

    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 7.0, 7.0]]).to(dtype)
        logits = torch.cat([logits, torch.randn(64, 4).round().to(dtype)])  # many exact ties
        assert torch.equal(greedy_ids(logits), logits.argmax(-1))
        wide = torch.randint(0, 3, (16, 49152)).to(dtype)  # a vocabulary-wide row: ties everywhere
        wide[3] = 2.0
        assert torch.equal(greedy_ids(wide), wide.argmax(-1)) and greedy_ids(wide)[3] == 0
        assert greedy_ids(logits[0]).item() == 1
