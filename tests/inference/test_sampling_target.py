"""Sampling through the whole speculative stack follows the target's own distribution.

Gate: chi-square goodness of fit at alpha = 1e-4 (tests/stats.py), fixed seeds.
"""

import pytest
import torch

from selfdraft import kv
from selfdraft.inference import SelfDraftModel
from selfdraft.inference.acceptance import SamplingParams, accept_rejection, warp_probs
from selfdraft.inference.decoding import prefill, verify
from selfdraft.tree import Draft, TreeSpec

from stats import chi_square, exact_two_token_law
from tiny_models import random_heads, tiny_target


@pytest.mark.slow  # 1,500 generate calls
@pytest.mark.parametrize(
    "kind,tree,params",
    [
        ("medusa", "small", SamplingParams(temperature=0.8, top_k=6, top_p=0.9)),
        ("eagle", "dynamic:depth=3,top_k=2,total_tokens=5", SamplingParams(temperature=1.0)),
    ],
)
def test_full_generate_loop_two_token_law(kind, tree, params):
    """1,500 independent `generate` calls on a tiny target vs the exact law of the first two tokens."""
    target = tiny_target("llama")
    prompt = torch.tensor([[3, 14, 15]])
    model = SelfDraftModel(target, None, random_heads(target, kind, 0), tree=tree)
    V = target.config.vocab_size
    counts = torch.zeros(V, V)
    accepted = 0
    torch.manual_seed(1234)
    for _ in range(1500):
        out = model.generate(
            prompt,
            2,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop_token_ids=[],
        )
        counts[out.tokens[0], out.tokens[1]] += 1
        accepted += sum(out.stats.accepted_lengths)
    stat, critical = chi_square(counts, exact_two_token_law(target, prompt, params))
    assert stat <= critical, f"chi2 {stat:.1f} > {critical:.1f}"
    assert accepted > 50  # the accept branch was exercised, not only corrections
    print(f"{kind} {tree}: chi2 {stat:.1f} <= {critical:.1f}, drafted tokens accepted: {accepted}")


def test_seeded_sampling_is_reproducible():
    target = tiny_target("qwen2")
    model = SelfDraftModel(target, None, random_heads(target, "eagle", 0), tree="small")
    prompt = torch.tensor([[5, 6, 7]])
    runs = [model.generate(prompt, 24, temperature=1.0, seed=s).tokens for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_greedy_default_is_deterministic_and_typical_is_opt_in():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, "medusa", 0), tree="small")
    prompt = torch.tensor([[1, 2, 3]])
    assert model.generate(prompt, 10).tokens == model.generate(prompt, 10).tokens
    out = model.generate(prompt, 10, temperature=1.0, seed=0, acceptance="typical")
    assert len(out.tokens) == 10
    with pytest.raises(ValueError, match="acceptance"):
        model.generate(prompt, 4, acceptance="fast")


def test_smollm_second_token_distribution(smollm):
    """Real target at T=1: for the three likeliest first tokens, the emitted second token follows
    p(x2 | prompt, x1). The tree pass and the reference forward are computed once per x1; each of the
    1,000 draws per x1 is a fresh acceptance over the same tree (the only random step given x1)."""
    target, tokenizer = smollm
    model = SelfDraftModel(target, tokenizer, random_heads(target, "eagle", 0))
    prompt = model.chat_ids("Name one primary color.")
    params = SamplingParams(temperature=1.0)
    cache = kv.new_cache()
    first = prefill(target, [prompt[0]], cache)
    prefix = kv.cache_length(cache)
    p1 = warp_probs(first.logits[0].double(), params)
    spec = TreeSpec.from_paths([(0, 0), (1,), (2,), (3,)])
    gen = torch.Generator().manual_seed(0)
    for x1 in torch.topk(p1, 3).indices.tolist():
        with torch.no_grad():
            p2 = warp_probs(
                target(torch.cat([prompt[0], torch.tensor([x1])])[None]).logits[0, -1].double(), params
            )
        # children: the two likeliest tokens, an unlikely one and a mid-ranked one; then a grandchild
        ranked = torch.argsort(p2, descending=True)
        picks = [ranked[0], ranked[1], ranked[500], ranked[5], ranked[2]]
        tokens = torch.tensor([x1, *[int(t) for t in picks]])
        passed = verify(target, cache, [Draft(spec, tokens)], [prefix])
        kv.crop(cache, prefix)
        p = warp_probs(passed.logits[0].double(), params)
        counts = torch.zeros_like(p2)
        for _ in range(1000):
            result = accept_rejection(p, tokens, spec, variant="deterministic", generator=gen)
            x2 = int(tokens[result.accepted[0]]) if result.accepted else result.next_token
            counts[x2] += 1
        stat, critical = chi_square(counts, p2)
        assert stat <= critical, f"x1={tokenizer.decode([x1])!r}: chi2 {stat:.1f} > {critical:.1f}"
