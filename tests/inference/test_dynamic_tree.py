"""Dynamic (EAGLE-2) trees: selection by cumulative draft log-probability, drafting, greedy identity."""

import math

import pytest
import torch

from selfdraft import kv
from selfdraft.heads import HeadsConfig, build_heads
from selfdraft.inference import SelfDraftModel
from selfdraft.tree import DynamicTree, PerRow
from selfdraft.tree_syntax import resolve_tree

from reference_heads import eagle_after_prompt, input_features, reference_tokens
from tiny_models import greedy_reference, tiny_target


class TableDrafter:
    """Children log-probs from a fixed random table keyed by (depth, node): a pure, known drafter."""

    def __init__(self, seed: int, k: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.k = k
        self.table: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.fed: list[tuple[int, list[int]]] = []  # the frontiers below the root, which a head would feed

    def observe(self, next_tokens, hidden_states, positions):
        pass

    def children(self, request):
        if request.depth:
            self.fed.append((request.depth, list(request.nodes)))
        self.grown = request.grown
        ids, logq = [], []
        depth, k = request.depth, request.k
        for u in request.nodes:
            if (depth, u) not in self.table:
                logits = torch.randn(20, generator=self.gen) * 2
                top = torch.topk(torch.log_softmax(logits, -1), k)
                self.table[(depth, u)] = (top.indices, top.values)
            ids.append(self.table[(depth, u)][0])
            logq.append(self.table[(depth, u)][1])
        return torch.stack(ids), torch.stack(logq)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", [DynamicTree(3, 2, 5), DynamicTree(4, 3, 10), DynamicTree(2, 4, 30)])
def test_selection_is_best_scoring_and_ancestor_closed(seed, policy):
    drafter = TableDrafter(seed, policy.top_k)
    (draft,) = PerRow([drafter]).propose([policy], [7])
    spec, tokens, grown = draft.spec, draft.tokens, drafter.grown
    assert tokens[0] == 7 and spec.max_depth <= policy.depth
    # every fed frontier is exactly the top_k nodes of its depth by cumulative score
    assert [d for d, _ in drafter.fed] == list(range(1, policy.depth))
    for depth, fed in drafter.fed:
        at_depth = [i for i, d in enumerate(grown.depths) if d == depth]
        best = sorted(at_depth, key=lambda i: -grown.scores[i])[: policy.top_k]
        assert sorted(grown.scores[i] for i in fed) == sorted(grown.scores[i] for i in best)
    # map every selected node back to the candidate it came from (parent, rank identify it)
    child = {(grown.parents[i], grown.ranks[i]): i for i in range(1, len(grown.tokens))}
    origin = [0]
    for i in range(1, spec.size):
        origin.append(child[(origin[spec.parents[i]], spec.ranks[i])])
    assert tokens.tolist() == grown.tokens[origin].tolist()
    # the selection holds the total_tokens best candidates (ancestors only added, never swapped in)
    n_drafted = min(policy.total_tokens, len(grown.tokens) - 1)
    threshold = sorted(grown.scores[1:].tolist(), reverse=True)[n_drafted - 1]
    selected = set(origin[1:])
    assert all(i in selected for i in range(1, len(grown.tokens)) if grown.scores[i] > threshold + 1e-9)
    assert sum(1 for i in selected if grown.scores[i] >= threshold - 1e-9) >= n_drafted
    assert all(math.isfinite(score) and score <= 0 for score in grown.scores)


def test_resolve_dynamic_names():
    assert resolve_tree("dynamic") == DynamicTree()
    assert resolve_tree("dynamic:depth=5,top_k=3,total_tokens=16") == DynamicTree(5, 3, 16)
    with pytest.raises(ValueError, match="bad dynamic tree option"):
        resolve_tree("dynamic:width=3")


@pytest.mark.parametrize("layout", ["selfdraft", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_eagle_dynamic_draft_matches_recomputation(arch, layout):
    heads, prompt, passed, root, drafter = eagle_after_prompt(arch, prompt_seed=3, layout=layout)
    with torch.no_grad():
        (draft,) = drafter.propose([DynamicTree(depth=3, top_k=3, total_tokens=8)], [root])
        spec, tokens = draft.spec, draft.tokens
        # the dynamic tree's nodes are exactly what the head proposes along each path (ranks included)
        expected = reference_tokens(heads, prompt[0].tolist(), root, input_features(heads, passed), spec, 3)
    assert tokens.tolist() == expected
    assert spec.size == 9 and kv.cache_length(drafter.cache) == 5


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_dynamic_tree_greedy_identity(arch, kind):
    target = tiny_target(arch)
    torch.manual_seed(1)
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind=kind))
    model = SelfDraftModel(target, None, heads, tree="dynamic:depth=3,top_k=3,total_tokens=8")
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, 30, stop_token_ids=[])
    assert out.tokens == greedy_reference(target, prompt, 30)
    assert out.stats.tree_tokens == 9 * out.stats.tree_passes
