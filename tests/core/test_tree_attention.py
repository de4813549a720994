"""Tree-pass logits equal sequential logits of every root-to-node path, per architecture/backend."""

import pytest
import torch

from selfdraft import kv
from selfdraft.inference.decoding import prefill, verify
from selfdraft.tree import NAMED_TREES, Draft, TreeSpec, additive_mask, ancestor_matrix

from tiny_models import CONFIGS, tiny_target

RAGGED = TreeSpec.from_paths([(0, 0, 0), (0, 1), (1,), (2, 0), (2, 1, 0)])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize(
    "spec", [RAGGED, NAMED_TREES["small"], TreeSpec.chain(3)], ids=["ragged", "small", "chain"]
)
def test_tree_pass_matches_sequential(arch, attn, spec):
    target = tiny_target(arch, attn)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 96, (1, 7), generator=gen)
    tokens = torch.randint(0, 96, (spec.size,), generator=gen)
    cache = kv.new_cache()
    prefill(target, [prompt[0]], cache)
    tree = verify(target, cache, [Draft(spec, tokens)], [7])
    assert kv.cache_length(cache) == 7 + spec.size
    for node in range(spec.size):
        path = tokens[spec.path_to(node)]
        full = torch.cat([prompt[0], path])[None]
        with torch.no_grad():
            expected = target(input_ids=full).logits[0, -1]
        torch.testing.assert_close(tree.logits[0, node], expected, atol=1e-4, rtol=1e-4)


def test_mask_is_float_additive():
    mask = additive_mask(ancestor_matrix(RAGGED), 3)
    assert mask.dtype == torch.float32 and mask.shape == (1, 1, RAGGED.size, 3 + RAGGED.size)
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    # node 2 = path (0, 0): sees prefix, root, node 1 (0,) and itself only
    row = mask[0, 0, RAGGED.paths.index((0, 0))]
    visible = (row == 0).nonzero().flatten().tolist()
    assert visible == [0, 1, 2, 3 + 0, 3 + RAGGED.paths.index((0,)), 3 + RAGGED.paths.index((0, 0))]
