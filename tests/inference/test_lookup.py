"""Prompt lookup grafted onto the heads' tree: the n-gram search, the graft, the tree syntax, and that
output stays the target's (greedy identity; the two-token law under sampling)."""

import pytest
import torch

from selfdraft.inference import SelfDraftModel
from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.decoding import draft_trees
from selfdraft.tree import (
    LookupTree,
    PerRow,
    PromptLookup,
    TreeSpec,
    first_choice_path,
    graft_chain,
    lookup_continuation,
)
from selfdraft.tree_syntax import read_tree_file, resolve_tree, write_tree_file

from oracle import OracleDrafter
from stats import chi_square, exact_two_token_law
from tiny_models import greedy_reference, random_heads, tiny_target


def test_lookup_takes_the_latest_occurrence_of_the_longest_ngram():
    three = PromptLookup(tokens=3, max_ngram=3)
    assert lookup_continuation([1, 2, 3, 9, 8, 1, 2, 3], three) == [9, 8, 1]
    # [4, 5] occurs at 0 and 3: the latest wins
    assert lookup_continuation([4, 5, 1, 4, 5, 2, 4, 5], PromptLookup(tokens=3, max_ngram=2)) == [2, 4, 5]
    # the 3-gram [7, 4, 5] beats a later match of the 2-gram [4, 5]
    assert lookup_continuation([7, 4, 5, 1, 9, 4, 5, 2, 7, 4, 5], three) == [1, 9, 4]
    # a continuation is cut at the end of the context
    assert lookup_continuation([3, 6, 3], three) == [6, 3]
    assert lookup_continuation([1, 2, 3, 4], three) == []
    assert lookup_continuation([5, 1, 2, 5], PromptLookup(tokens=2, min_ngram=2)) == []
    assert lookup_continuation([5], three) == []


def test_graft_follows_matching_children_and_branches_at_the_first_mismatch():
    spec = TreeSpec.chain(2)
    tokens = torch.tensor([10, 11, 12])
    grown, values = graft_chain(spec, tokens, [11, 13, 14])
    assert grown.parents == (-1, 0, 1, 1, 3)
    assert grown.ranks == (0, 0, 0, 1, 0)  # the new sibling of node 2 takes the next free rank
    assert values.tolist() == [10, 11, 12, 13, 14]
    # a chain the tree already holds, or no chain, leaves the draft as it is
    assert graft_chain(spec, tokens, [11, 12]) == (spec, tokens)
    assert graft_chain(spec, tokens, []) == (spec, tokens)
    # under the root: a new branch beside the heads' first choice
    grown, values = graft_chain(spec, tokens, [20, 21])
    assert grown.parents == (-1, 0, 1, 0, 3) and grown.ranks == (0, 0, 0, 1, 0)
    assert values.tolist() == [10, 11, 12, 20, 21]


def drafted(shape, drafter, root: int, context: list[int]) -> tuple[TreeSpec, torch.Tensor]:
    """One row's tree as the generate loop drafts it: the drafter's part, then the looked-up branch."""
    (draft,) = draft_trees(PerRow([drafter]), [shape], [root], [context])
    return draft.spec, draft.tokens


def heads_proposing(path: list[int]) -> OracleDrafter:
    """A drafter whose first choice below the root 9 is `path` (one child per node on a chain)."""
    return OracleDrafter([9, *path], vocab_size=50)


def test_extension_continues_the_heads_first_choice_path():
    # the root 9 is new, so the branch from the root finds nothing; the heads' path 6, 7 occurred at
    # the start of the context, so the extension grafts what followed it there below the path's end
    context = [6, 7, 40, 41, 42, 9]
    plain = LookupTree(TreeSpec.chain(2), PromptLookup(tokens=5))
    spec, tokens = drafted(plain, heads_proposing([6, 7]), 9, context)
    assert spec == TreeSpec.chain(2) and tokens.tolist() == [9, 6, 7]
    extended = LookupTree(TreeSpec.chain(2), PromptLookup(tokens=5, extend=2))
    spec, tokens = drafted(extended, heads_proposing([6, 7]), 9, context)
    assert spec.parents == (-1, 0, 1, 2, 3) and tokens.tolist() == [9, 6, 7, 40, 41]
    # the root branch (5) can run past the heads' path and carry the extension (2) below its end
    assert extended.max_depth == 5 + 2 and extended.max_tokens == 3 + 5 + 2
    # a path the context never held is not extended, nor one whose last token alone occurred (7):
    # the key must hold at least two tokens
    for path in ([8, 3], [8, 7]):
        spec, tokens = drafted(extended, heads_proposing(path), 9, context)
        assert tokens.tolist() == [9, *path]


def test_first_choice_path_follows_the_best_kept_rank():
    # the root's rank-0 child was not kept (a dynamic tree dropped it): rank 1 is the first choice
    spec = TreeSpec.from_parents([-1, 0, 0, 1, 2, 2], [0, 2, 1, 0, 3, 1])
    assert first_choice_path(spec) == [2, 5]
    assert first_choice_path(TreeSpec.chain(0)) == []


def test_tree_syntax_and_tree_file(tmp_path):
    tree = resolve_tree("chain-3+lookup=4")
    assert tree == LookupTree(TreeSpec.chain(3), PromptLookup(tokens=4))
    assert tree.max_depth == 4
    # the most tokens one pass may verify, root included: what `selfdraft tune --max-tree-tokens` caps
    assert tree.max_tokens == 4 + 4
    assert resolve_tree("dynamic:depth=4,top_k=4,total_tokens=10+lookup=5").max_tokens == 11 + 5
    assert resolve_tree("small").max_tokens == resolve_tree("small").size
    assert resolve_tree("dynamic:depth=4,top_k=2,total_tokens=8+lookup").lookup == PromptLookup()
    extended = resolve_tree("chain-3+lookup=4,extend=2")
    assert extended.lookup == PromptLookup(tokens=4, extend=2) and extended.max_depth == 4 + 2
    for bad in ("chain-3+lookup=x", "chain-3+lookup+lookup", "nope+lookup", "chain-3+lookup=4,extend=y"):
        with pytest.raises(ValueError):
            resolve_tree(bad)
    path = tmp_path / "tree.yaml"
    write_tree_file(path, tree, description="test")
    assert read_tree_file(path) == tree
    assert "extend" not in path.read_text()  # a file without an extension reads as before extensions
    write_tree_file(path, extended, description="test")
    assert read_tree_file(path) == extended
    path.write_text("paths: [[0]]\nlookup: {tokens: 3, window: 2}\n")
    with pytest.raises(ValueError, match="lookup"):
        read_tree_file(path)


def _repetitive_prompt() -> torch.Tensor:
    return torch.tensor([[7, 21, 33, 8, 7, 21, 33, 8, 7, 21]])


@pytest.mark.parametrize(
    "kind,tree",
    [("eagle", "chain-2+lookup=5"), ("eagle", "chain-2+lookup=5,extend=3"), ("medusa", "small+lookup=4")],
)
def test_greedy_identity_with_lookup(kind, tree):
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, kind, 3), tree=tree)
    plain = SelfDraftModel(target, None, model.heads, tree=resolve_tree(tree).base)
    for prompt in (_repetitive_prompt(), torch.tensor([[5, 9, 11, 40]])):
        ref = greedy_reference(target, prompt, 40)
        out = model.generate(prompt, 40, stop_token_ids=[])
        assert out.tokens == ref
        base = plain.generate(prompt, 40, stop_token_ids=[])
        assert base.tokens == ref
        # grafting only adds nodes, so it never verifies fewer tokens per pass than the heads' tree
        assert (
            out.stats.tree_tokens / out.stats.tree_passes >= base.stats.tree_tokens / base.stats.tree_passes
        )


def test_lookup_accepts_long_blocks_when_the_real_target_repeats(smollm):
    """SmolLM2 asked to repeat a phrase: random heads accept ~nothing, the lookup branch accepts runs."""
    target, tokenizer = smollm
    heads = random_heads(target, "eagle", 0, draft_vocab_size=4096)
    model = SelfDraftModel(target, tokenizer, heads, tree="chain-1+lookup=6")
    plain = SelfDraftModel(target, tokenizer, heads, tree="chain-1")
    ids = model.chat_ids("Repeat this sentence three times: the quick brown fox jumps over the lazy dog.")
    ref = target.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
    out = model.generate(ids, 48)
    base = plain.generate(ids, 48)
    assert out.tokens == ref == base.tokens
    assert base.stats.mean_accepted < 1.2
    assert out.stats.mean_accepted > 1.8, out.stats.accepted_lengths


@pytest.mark.slow  # 1,500 generate calls
@pytest.mark.parametrize("extend", [0, 2])
def test_two_token_law_with_lookup_branch(extend):
    """1,500 sampled `generate` calls with a lookup branch vs the exact law of the first two tokens;
    with `extend`, the looked-up continuation of the heads' first child joins many of the trees."""
    target = tiny_target("llama")
    V = target.config.vocab_size
    # every token occurs once in the prompt, so whatever the first token is, the lookup finds it
    prompt = torch.randperm(V, generator=torch.Generator().manual_seed(0))[None]
    params = SamplingParams(temperature=1.0)
    tree = f"chain-1+lookup=3,extend={extend}"
    model = SelfDraftModel(target, None, random_heads(target, "eagle", 0), tree=tree)
    counts = torch.zeros(V, V)
    grafted = extended = 0
    torch.manual_seed(4321)
    for _ in range(1500):
        out = model.generate(prompt, 2, temperature=1.0, stop_token_ids=[])
        counts[out.tokens[0], out.tokens[1]] += 1
        grafted += int(out.stats.tree_tokens > 2 * out.stats.tree_passes)  # chain-1 alone verifies 2
        # chain-1 + a 3-token branch verifies at most 5; only an extension adds more
        extended += int(out.stats.tree_tokens > 5 * out.stats.tree_passes)
    stat, critical = chi_square(counts, exact_two_token_law(target, prompt, params))
    assert stat <= critical, f"chi2 {stat:.1f} > {critical:.1f}"
    assert grafted > 1000  # the lookup branch was in the verified tree, not only the heads' chain
    # the extension needs the 2-gram (first token, heads' child) in the prompt: 387 of the 1,500 trees
    # held one with this seed; without it no tree can exceed 5 tokens
    assert extended > 300 if extend else extended == 0


def test_lookup_depth_bound_holds_when_the_branch_runs_past_the_heads_path():
    """The root's lookup branch follows the heads' whole first-choice path (6) and runs past its leaf; its
    nodes become the first-choice path, and the extension hangs below them: depth tokens + extend."""
    context = [5, 9, 6, 1, 2, 3, 4, 8, 5, 9]
    tree = LookupTree(TreeSpec.chain(1), PromptLookup(tokens=5, extend=3))
    spec, tokens = drafted(tree, heads_proposing([6]), 9, context)
    # the branch [6, 1, 2, 3, 4] took over the heads' node 6; the extension [8, 5, 9] hangs below it
    assert tokens.tolist() == [9, 6, 1, 2, 3, 4, 8, 5, 9]
    assert spec.max_depth == 8 == tree.max_depth


def _constant_target(arch: str):
    """A target whose logits are all zero (final norm zeroed): its next token is always 0, so a prompt
    of a repeated pattern that holds one 0 makes every first tree as deep as the lookup can grow it."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from selfdraft.target import prepare_target

    if arch == "gpt2":  # learned positions: a position id past the table is an IndexError
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        target = prepare_target(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
        norm = target.transformer.ln_f
        norm.bias.data.zero_()
    else:
        target = tiny_target("llama")
        norm = target.model.norm
    norm.weight.data.zero_()
    return target


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lookup_extension_near_the_context_end_keeps_positions_inside(arch, monkeypatch):
    """Every distance from the context end: no position id reaches the context (RoPE would compute past
    it silently, learned positions raise), and the output is the target's."""
    from selfdraft.inference.decoding import speculative_generate
    from selfdraft.target import max_context

    target = _constant_target(arch)
    limit = max_context(target)
    seen = []
    forward = target.forward

    def spy(*args, **kwargs):
        if kwargs.get("position_ids") is not None:
            seen.append(int(kwargs["position_ids"].max()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    tree = resolve_tree("chain-1+lookup=5,extend=3")
    pattern = [0, 11, 12, 13, 14, 15, 16, 17, 18]
    deepest = 0
    for length in range(limit - 14, limit):
        # ends with 18, so the root 0 continues the pattern: the branch from the root is 11..15, the
        # heads' first choice 11 is its first node, and the extension below 15 adds 16, 17, 18: depth 8
        prompt = torch.tensor([(pattern * limit)[-length:]])
        (out,) = speculative_generate(
            target,
            OracleDrafter([*prompt[0].tolist(), *pattern * 20], vocab_size=96),
            [prompt[0]],
            spec=tree,
            max_new_tokens=20,
            sampling=SamplingParams(),
            stop_token_ids=[],
        )
        assert out.tokens == [0] * len(out.tokens) and out.stats.finish_reason in ("context", "length")
        deepest = max(deepest, len(out.stats.depth_offered))
    assert seen and max(seen) < limit
    assert deepest == 8  # far enough from the end, the full depth was drafted
