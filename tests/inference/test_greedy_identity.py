"""Greedy speculative output is token-identical to the target's own greedy `generate` (fp32)."""

import pytest
import torch

from selfdraft.inference import SelfDraftModel
from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.decoding import speculative_generate
from selfdraft.tree import NAMED_TREES, TreeSpec

from oracle import OracleDrafter
from tiny_models import greedy_reference, random_heads, tiny_target

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "def quicksort(xs):",
    "Give me a haiku about autumn.",
    "What does HTTP stand for?",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def references(smollm):
    target, tokenizer = smollm
    model = SelfDraftModel(target, tokenizer, random_heads(target, "eagle", 0))
    refs = []
    for prompt in PROMPTS:
        ids = model.chat_ids(prompt)
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        refs.append((ids, out[0, ids.shape[1] :].tolist()))
    return refs


CASES = [
    ("medusa", "small", None),
    ("eagle", "small", None),
    ("medusa", "chain-4", None),
    ("eagle", "chain-4", 4096),
]


@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_smollm_greedy_identity(smollm, references, case):
    target, tokenizer = smollm
    kind, tree, vocab = CASES[case % len(CASES)]
    model = SelfDraftModel(target, tokenizer, random_heads(target, kind, case, vocab), tree=tree)
    ids, ref = references[case]
    out = model.generate(ids, max_new_tokens=NEW_TOKENS)
    assert out.tokens == ref, tokenizer.decode(out.tokens) + " != " + tokenizer.decode(ref)
    assert out.stats.tree_passes >= 1 and out.stats.mean_accepted >= 1.0


@pytest.mark.parametrize("spec", [NAMED_TREES["small"], TreeSpec.chain(5)], ids=["tree", "chain"])
def test_smollm_multi_token_acceptance_and_eos_inside_block(smollm, references, spec):
    """An oracle drafter gets long blocks accepted; a stop token inside an accepted block ends there."""
    target, tokenizer = smollm
    ids, ref = references[1]
    full = ids[0].tolist() + ref
    (out,) = speculative_generate(
        target,
        OracleDrafter(full, target.config.vocab_size, miss_every=3),
        [ids[0]],
        spec=spec,
        max_new_tokens=NEW_TOKENS,
        sampling=SamplingParams(),
        stop_token_ids=[],
    )
    assert out.tokens == ref
    assert out.stats.mean_accepted > 2.0  # blocks were really accepted, so compaction was exercised
    # Stop at a token that sits in the middle of an accepted block: nothing after it is emitted.
    stop_at = 7
    stop = ref[stop_at]
    first = ref.index(stop)
    (out,) = speculative_generate(
        target,
        OracleDrafter(full, target.config.vocab_size),
        [ids[0]],
        spec=spec,
        max_new_tokens=NEW_TOKENS,
        sampling=SamplingParams(),
        stop_token_ids=[stop],
    )
    assert out.tokens == ref[: first + 1]
    assert out.stats.finish_reason == "stop"


@pytest.mark.parametrize("budget", [1, 2, 6, 7])
def test_max_new_tokens_exact_inside_block(budget):
    target = tiny_target("llama")
    prompt = torch.tensor([[5, 9, 11]])
    ref = prompt[0].tolist() + greedy_reference(target, prompt, 12)
    (out,) = speculative_generate(
        target,
        OracleDrafter(ref, 96),
        [prompt[0]],
        spec=TreeSpec.chain(4),
        max_new_tokens=budget,
        sampling=SamplingParams(),
        stop_token_ids=[],
    )
    assert out.tokens == ref[3 : 3 + budget]
    assert out.stats.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_tiny_architectures_greedy_identity(arch, kind):
    target = tiny_target(arch)
    heads = random_heads(target, kind, 1, draft_vocab_size=None if kind == "medusa" else 64)
    model = SelfDraftModel(target, None, heads, tree="small" if kind == "medusa" else "medium")
    for seed in range(2):
        prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        ref = greedy_reference(target, prompt, 30)
        out = model.generate(prompt, 30, stop_token_ids=[])
        assert out.tokens == ref
        # An oracle on the same target: long accepted blocks, same text
        (oracle,) = speculative_generate(
            target,
            OracleDrafter(prompt[0].tolist() + ref, 96, correct_rank=1),
            [prompt[0]],
            spec=NAMED_TREES["medium"],
            max_new_tokens=30,
            sampling=SamplingParams(),
            stop_token_ids=[],
        )
        assert oracle.tokens == ref and oracle.stats.mean_accepted > 2.5


def test_prompt_longer_than_context_is_refused():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, "medusa", 0))
    with pytest.raises(ValueError, match="context"):
        model.generate(torch.zeros(1, 300, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="one sequence"):
        model.generate(torch.zeros(2, 3, dtype=torch.long), 4)


def test_generation_stops_at_context_end():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, "eagle", 0), tree="chain-4")
    prompt = torch.randint(0, 96, (1, 250), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, 50, stop_token_ids=[])
    # positions 250..255 can be fed; the token predicted at position 255 is the 7th and last.
    assert out.tokens == greedy_reference(target, prompt, 7)
    assert out.stats.finish_reason == "context"
