"""Generation up to the end of the target's context: every tree kind, greedy and sampled, with the
prompt at every distance from the context's last position, alone and in a batch. Each run goes on
until the cache is full (finish reason "context"), never gives a token a position past the
context, and greedy rows equal the target's own decoding."""

import pytest
import torch

from selfdraft.inference import SelfDraftModel

from tiny_models import greedy_reference, random_heads, tiny_target

LIMIT = 20  # the tiny target's context (max_position_embeddings)
TREES = [
    "chain-4",
    "small",
    "medium",
    "dynamic:depth=3,top_k=2,total_tokens=5",
    "small+lookup=3",
    "dynamic:depth=3,top_k=2,total_tokens=5+lookup=3",
]
DISTANCES = range(8)  # free positions after the prompt: 0 = the prompt fills the context


def positions_seen(target) -> tuple[list[int], object]:
    """The largest position id of every target forward that passes them (a hook; .remove() it)."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            seen.append(int(kwargs["position_ids"].max()))

    return seen, target.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.fixture(scope="module")
def short_target():
    return tiny_target("llama", max_position_embeddings=LIMIT)


def prompt_at(distance: int) -> torch.Tensor:
    """A prompt leaving `distance` free positions; it repeats itself, so lookup branches find matches."""
    return (torch.arange(LIMIT - distance) % 7 + 3)[None]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("tree", TREES)
def test_every_tree_at_every_distance_from_the_context_end(short_target, tree, temperature):
    model = SelfDraftModel(short_target, None, random_heads(short_target, "eagle", 0), tree=tree)
    prompts = [prompt_at(d) for d in DISTANCES]
    seen, hook = positions_seen(short_target)
    try:
        alone = [
            model.generate(p, 4 * LIMIT, temperature=temperature, seed=d, stop_token_ids=[])
            for d, p in zip(DISTANCES, prompts, strict=True)
        ]
        batch = model.generate([p[0] for p in prompts], 4 * LIMIT, temperature=temperature, seed=0, stop_token_ids=[])
    finally:
        hook.remove()
    assert seen and max(seen) < LIMIT  # no token was placed past the context
    for d, prompt, out, row in zip(DISTANCES, prompts, alone, batch, strict=True):
        # the cache ends full: the prompt and every emitted token but the last hold one position each
        assert len(out.tokens) == d + 1 and out.stats.finish_reason == "context", (d, out.stats.finish_reason)
        assert len(row.tokens) == d + 1 and row.stats.finish_reason == "context"
        if temperature == 0:
            assert out.tokens == row.tokens == greedy_reference(short_target, prompt, d + 1)


def test_medusa_heads_at_every_distance_from_the_context_end(short_target):
    model = SelfDraftModel(short_target, None, random_heads(short_target, "medusa", 0), tree="small")
    for d in DISTANCES:
        for temperature in (0.0, 1.0):
            out = model.generate(prompt_at(d), 4 * LIMIT, temperature=temperature, seed=d, stop_token_ids=[])
            assert len(out.tokens) == d + 1 and out.stats.finish_reason == "context"
