"""The whole generate loop samples the target's law at every depth, not just the first two tokens.

A drafter that proposes the target's own top-k makes deep acceptance routine, so nodes at depth >= 1,
bonus tokens after a fully accepted path, and corrections deep in the tree all occur. With a vocab of
8 the exact law of 4 generated tokens is enumerable (8^4 paths). Gate: chi-square at alpha = 1e-4
(tests/stats.py) on the marginal of each token, on (x3, x4), and on the rank of each token under the
target's own conditional (where a wrong deep sampler shows most), fixed seeds. Three wrong samplers
patched into the loop fail the same gate, so the test can tell.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from selfdraft.inference import decoding
from selfdraft.inference.acceptance import SamplingParams, _walk, sample, warp_probs
from selfdraft.target import prepare_target
from selfdraft.tree import TreeSpec

from stats import chi_square
from tiny_models import COMMON

V = 8
PARAMS = SamplingParams(temperature=1.5)
TREE = TreeSpec.from_paths([(0, 0, 0), (0, 1), (1, 0), (1, 1)])
PROMPT = torch.tensor([[3, 1, 4]])
DRAWS = 2000


def small_vocab_target():
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "vocab_size": V}), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return prepare_target(model)


class TopKOracle:
    """Proposes the target's own k most likely tokens after every node's path (deterministic top-k)."""

    def __init__(self, target) -> None:
        self.target = target
        self.context: list[int] = []

    def observe(self, next_tokens, hidden_states, positions) -> None:
        if not self.context:
            self.context = PROMPT[0, :1].tolist()
        self.context += next_tokens.tolist()

    @torch.no_grad()
    def children(self, request):
        grown, paths = request.grown, []
        for u in request.nodes:  # root .. u, root excluded (the context already ends with it)
            path = []
            while u > 0:
                path.append(int(grown.tokens[u]))
                u = grown.parents[u]
            paths.append(self.context + path[::-1])
        logits = self.target(torch.tensor(paths)).logits[:, -1]  # same depth: same length
        top = torch.topk(torch.log_softmax(logits, -1), request.k, dim=-1)
        return top.indices, top.values


def exact_four_token_law(target) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(P(x1..x4 | prompt) as [V, V, V, V], and the conditionals p(x_d | prompt, x_<d) as [V]*d),
    each factor warped like the sampler."""
    law = torch.ones(1, dtype=torch.float64)
    conditionals = []
    prefixes = PROMPT
    with torch.no_grad():
        for d in range(4):
            p = warp_probs(target(prefixes).logits[:, -1].double(), PARAMS)  # [V^d, V]
            conditionals.append(p.view(*([V] * (d + 1))))
            law = (law[:, None] * p).flatten()
            prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes))[:, None]], 1)
    return law.view(V, V, V, V), conditionals


def rank_laws(law: torch.Tensor, conditionals: list[torch.Tensor], counts: torch.Tensor) -> dict:
    """Per depth d: (observed, exact) counts of the rank of x_d under p(. | prompt, x_<d), over all
    4-token outcomes. A sampler that is wrong only deep in the tree moves mass between ranks there."""
    out = {}
    for d, cond in enumerate(conditionals):
        ranks = cond.argsort(-1, descending=True).argsort(-1)  # rank of each token given its prefix
        ranks = ranks.view(*ranks.shape, *([1] * (3 - d))).expand(V, V, V, V)
        observed = torch.zeros(V, dtype=torch.float64).index_add_(0, ranks.flatten(), counts.flatten().double())
        exact = torch.zeros(V, dtype=torch.float64).index_add_(0, ranks.flatten(), law.flatten())
        out[f"rank of x{d + 1}"] = (observed, exact)
    return out


def sample_four_tokens(target, draws: int = DRAWS, heads=None) -> tuple[torch.Tensor, int]:
    """Counts [V, V, V, V] of DRAWS generate calls, and how many drafted tokens were accepted at depth >= 2.
    The drafter is a fresh `TopKOracle` per call (`speculative_generate` takes any object with the
    drafter protocol), or `heads`."""
    counts = torch.zeros(V, V, V, V)
    deep = 0
    for seed in range(draws):
        (out,) = decoding.speculative_generate(
            target, heads or TopKOracle(target), [PROMPT[0]], spec=TREE, max_new_tokens=4,
            sampling=SamplingParams(temperature=PARAMS.temperature, seed=seed), stop_token_ids=[],
        )
        counts[tuple(out.tokens)] += 1
        deep += sum(max(0, n - 1) for n in out.stats.accepted_lengths)
    return counts, deep


def failed_gates(counts: torch.Tensor, law: torch.Tensor, conditionals: list[torch.Tensor]) -> list[str]:
    summed_out = {"x1": (1, 2, 3), "x2": (0, 2, 3), "x3": (0, 1, 3), "x4": (0, 1, 2), "(x3, x4)": (0, 1)}
    views = {name: (counts.sum(dims), law.sum(dims)) for name, dims in summed_out.items()}
    views.update(rank_laws(law, conditionals, counts))
    failed = []
    for name, (observed, exact) in views.items():
        stat, critical = chi_square(observed, exact)
        if stat > critical:
            failed.append(f"{name}: chi2 {stat:.1f} > {critical:.1f}")
    return failed


# ---- wrong samplers, each differing from the exact rule in one place (the descent is the real one) -
def mutant(kind: str):
    def accept(p, tokens, spec, *, variant, q=None, generator=None):
        toks = tokens.tolist()

        def step(u, children):
            row = spec.parents[u] if kind == "parent_row" and u > 0 else u
            p_u = p[row].double() / p[row].double().sum()
            if not children:
                return None, int(p_u.argmax()) if kind == "argmax_bonus" else sample(p_u, generator)
            rejected = 0.0
            seen = []
            for node, x in children:
                if x in seen:
                    continue
                seen.append(x)
                u01 = float(torch.rand(1, generator=generator, dtype=torch.float64))
                ratio = float(p_u[x]) if kind == "no_renormalisation" else float(p_u[x]) / (1.0 - rejected)
                if u01 < ratio:
                    return node, None
                rejected += float(p_u[x])
            rest = p_u.index_fill(0, torch.tensor(seen), 0.0)
            return None, sample(rest / rest.sum(), generator)

        return _walk(spec, toks, step)

    return accept


@pytest.mark.slow  # 2,000 generate calls with an oracle drafter
def test_four_token_law_with_deep_acceptance():
    target = small_vocab_target()
    law, conditionals = exact_four_token_law(target)
    counts, deep = sample_four_tokens(target)
    assert deep > DRAWS // 2, "the oracle should make deep acceptance routine"
    assert failed_gates(counts, law, conditionals) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["no_renormalisation", "argmax_bonus", "parent_row"])
def test_wrong_samplers_fail_the_gate(kind, monkeypatch):
    target = small_vocab_target()
    law, conditionals = exact_four_token_law(target)
    monkeypatch.setattr(decoding, "accept_rejection", mutant(kind))
    counts, _ = sample_four_tokens(target, draws=1500)  # each mutant is off by far more than noise
    failed = failed_gates(counts, law, conditionals)
    assert failed, f"the {kind} sampler passed the gate"


def drawing_eagle_heads(target):
    """EAGLE heads whose q is far from uniform, so drawn children are sometimes rejected and sometimes
    accepted deep in the tree."""
    from selfdraft.heads import HeadsConfig, build_heads

    torch.manual_seed(5)
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind="eagle")).attach(target)
    with torch.no_grad():
        for p in heads.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return heads


@pytest.mark.slow  # 2,000 generate calls
def test_four_token_law_with_children_drawn_from_the_heads(monkeypatch):
    """At T > 0 on a static tree an EAGLE drafter draws children without replacement from its own q,
    verified by the without-replacement rule: the same four-token gate holds."""
    target = small_vocab_target()
    law, conditionals = exact_four_token_law(target)
    variants = []
    exact = decoding.accept_rejection

    def spy(*args, **kwargs):
        variants.append(kwargs["variant"])
        return exact(*args, **kwargs)

    monkeypatch.setattr(decoding, "accept_rejection", spy)
    counts, deep = sample_four_tokens(target, heads=drawing_eagle_heads(target))
    assert set(variants) == {"without_replacement"}
    assert deep > DRAWS // 10, "drawn children should be accepted deep in the tree often"
    assert failed_gates(counts, law, conditionals) == []


@pytest.mark.slow
def test_drawing_from_one_q_and_verifying_with_another_fails_the_gate(monkeypatch):
    """The gate can tell: children drawn at temperature 1 but verified as if drawn at PARAMS' 1.5."""
    from selfdraft.heads.eagle import drafter

    target = small_vocab_target()
    law, conditionals = exact_four_token_law(target)
    honest = drafter.drawn_children

    def mismatched(logits, k, temperature, generator, heads):
        ids, logq, q = honest(logits, k, temperature, generator, heads)
        return honest(logits, k, 1.0, generator, heads)[:2] + (q,)

    monkeypatch.setattr(drafter, "drawn_children", mismatched)
    counts, _ = sample_four_tokens(target, draws=1500, heads=drawing_eagle_heads(target))
    assert failed_gates(counts, law, conditionals), "a q mismatch passed the gate"
