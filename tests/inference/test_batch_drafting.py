"""Batched drafting (`heads/eagle/drafter.py:EagleRows`, through `decoding.draft_trees`) against one
single-row `EagleRows` per row: every row of the batch drafts exactly the tree it drafts alone, across
ragged pending blocks, steps and rows leaving the batch."""

import pytest
import torch

from selfdraft.heads.eagle.drafter import EagleRows
from selfdraft.inference.decoding import draft_trees
from selfdraft.tree import DynamicTree, LookupTree, PerRow, PromptLookup, TreeSpec

from oracle import OracleDrafter
from tiny_models import random_heads, tiny_target

SHAPES = {
    "dynamic": DynamicTree(depth=3, top_k=2, total_tokens=5),
    "static": TreeSpec.from_paths([(0, 0, 0), (0, 1), (1, 0), (2,)]),
    "lookup": LookupTree(DynamicTree(depth=2, top_k=3, total_tokens=4), PromptLookup(tokens=3)),
}


def _features(target, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return target(ids[None], output_hidden_states=True).hidden_states


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_row_drafts_what_it_drafts_alone(arch, shape):
    torch.manual_seed(0)
    target = tiny_target(arch)
    heads = random_heads(target, "eagle", 3).attach(target)
    tree = SHAPES[shape]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (5, 9, 3)]
    contexts = [p.tolist() for p in prompts]
    alone = [EagleRows(heads, 1) for _ in prompts]
    batch = EagleRows(heads, len(prompts))
    for b, p in enumerate(prompts):  # prefill: pairs (x_{i+1}, f_i) with the first token appended
        nxt = torch.cat([p[1:], torch.tensor([7])])
        hidden = _features(target, p)
        positions = torch.arange(p.numel())
        alone[b].observe(0, nxt, hidden, positions)
        batch.observe(b, nxt, hidden, positions)
    roots = [7, 7, 7]
    live = [0, 1, 2]
    for step in range(4):
        want = [draft_trees(alone[b], [tree], [roots[i]], [contexts[b]])[0] for i, b in enumerate(live)]
        got = draft_trees(batch, [tree] * len(live), roots, [contexts[b] for b in live])
        for w, g in zip(want, got, strict=True):
            assert w.spec == g.spec and torch.equal(w.tokens, g.tokens)
        # each row accepts a different number of tokens (1..3 pairs of the target's features)
        for i, b in enumerate(live):
            accepted = torch.randint(0, 96, (1 + (b + step) % 3,), generator=gen)
            shapes = [h.shape for h in _features(target, accepted)]
            hidden = tuple(torch.randn(*shape, generator=gen) for shape in shapes)
            positions = torch.arange(accepted.numel())
            alone[b].observe(0, accepted, hidden, positions)
            batch.observe(i, accepted, hidden, positions)
            contexts[b] += accepted.tolist()
            roots[i] = int(accepted[-1])
        if step == 1:  # the middle row finishes: the batch goes on with rows 0 and 2
            batch.retire([0, 2])
            live = [0, 2]
            roots = [roots[0], roots[2]]


def test_rows_drafter_protocol_errors_and_per_row_adapter():
    target = tiny_target()
    heads = random_heads(target, "eagle", 0).attach(target)
    batch = EagleRows(heads, 2)
    for b in range(2):
        p = torch.arange(1, 4 + b)
        batch.observe(b, p, _features(target, p), torch.arange(p.numel()))
    tree = TreeSpec.chain(2)
    with pytest.raises(ValueError, match="every one of the 2 rows"):
        batch.propose([tree], [1])
    # PerRow serves each row with its own drafter
    alone = [OracleDrafter([1, 2, 3, 4, 5, 6], 96) for _ in range(2)]
    rows = PerRow(alone)
    for b in range(2):
        p = torch.arange(1, 4 + b)
        rows.observe(b, p, _features(target, p), torch.arange(p.numel()))
    got = rows.propose([tree, tree], [1, 2])
    assert [d.spec.size for d in got] == [3, 3] and [int(d.tokens[0]) for d in got] == [1, 2]
