"""KV compaction after an accepted path, and EAGLE tree drafting against a cache-free recomputation."""

import pytest
import torch

from selfdraft import kv
from selfdraft.heads import HeadsConfig, build_heads
from selfdraft.heads.medusa.drafter import MedusaDrafter
from selfdraft.inference.decoding import prefill, verify
from selfdraft.tree import NAMED_TREES, Draft, PerRow, TreeSpec

from reference_heads import eagle_after_prompt, input_features, reference_tokens
from tiny_models import tiny_target

SPEC = TreeSpec.from_paths([(0, 0, 0), (0, 1), (1, 0), (2,)])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("path_ranks", [(), (0,), (0, 1), (1, 0), (0, 0, 0)])
def test_compacted_cache_equals_fresh_forward(arch, path_ranks):
    target = tiny_target(arch)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (1, 6), generator=gen)
    tokens = torch.randint(0, 96, (SPEC.size,), generator=gen)
    cache = kv.new_cache()
    prefill(target, [prompt[0]], cache)
    verify(target, cache, [Draft(SPEC, tokens)], [6])
    node = SPEC.paths.index(path_ranks)
    path = SPEC.path_to(node)
    kv.keep_positions(cache, 6, 6 + torch.tensor(path))
    assert kv.cache_length(cache) == 6 + len(path)
    nxt = torch.tensor([[17, 4]])
    with torch.no_grad():
        step = target(input_ids=nxt, **kv.cache_kwargs(target, cache)).logits[0]
        fresh = target(input_ids=torch.cat([prompt[0], tokens[path], nxt[0]])[None]).logits[0, -2:]
    torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)


def test_crop_and_errors():
    target = tiny_target("llama")
    cache = kv.new_cache()
    prefill(target, [torch.arange(10)], cache)
    kv.crop(cache, 4)
    assert kv.cache_length(cache) == 4
    with pytest.raises(ValueError):
        kv.crop(cache, 9)


@pytest.mark.parametrize("layout", ["selfdraft", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("spec", [NAMED_TREES["small"], TreeSpec.chain(4)], ids=["small", "chain"])
def test_eagle_tree_drafting_matches_cache_free_recomputation(arch, spec, layout):
    heads, prompt, passed, root, drafter = eagle_after_prompt(arch, prompt_seed=2, layout=layout)
    with torch.no_grad():
        tokens = drafter.propose([spec], [root])[0].tokens
        expected = reference_tokens(
            heads, prompt[0].tolist(), root, input_features(heads, passed), spec, 4
        )
    assert tokens.tolist() == expected
    assert kv.cache_length(drafter.cache) == 5  # the tree's entries were cropped from the head's cache


def test_medusa_drafting_uses_head_per_depth():
    target = tiny_target("llama")
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind="medusa")).attach(target)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    hidden = torch.randn(1, 3, 32)
    drafter = PerRow([MedusaDrafter(heads)])
    drafter.observe(0, torch.tensor([1, 2, 3]), (hidden,), torch.arange(3))
    spec = NAMED_TREES["small"]
    tokens = drafter.propose([spec], [7])[0].tokens
    with torch.no_grad():
        logits = heads.logits(hidden[0, -1])
    for i in range(1, spec.size):
        top = torch.topk(logits[spec.depths[i] - 1], spec.ranks[i] + 1).indices
        assert tokens[i] == top[spec.ranks[i]]
    with pytest.raises(ValueError, match="Medusa heads"):
        drafter.propose([TreeSpec.chain(5)], [7])
