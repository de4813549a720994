"""Batched generation (`generate([ids_1, ..., ids_B])`): one target pass per step verifies every row's
tree, and every row is exactly what it would be alone (greedy: the target's own `generate`; sampled:
the same law, and the same tokens as a single-sequence call with that row's seed)."""

import json
import subprocess
import sys

import pytest
import torch

from selfdraft.errors import UserError
from selfdraft.inference import SelfDraftModel
from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.decoding import GenerationOutput, row_seeds, speculative_generate
from selfdraft.tree import NAMED_TREES, TreeSpec

from oracle import OracleDrafter
from stats import chi_square, exact_two_token_law
from tiny_models import greedy_reference, random_heads, tiny_target

LENGTHS = (3, 9, 1, 6)  # ragged prompts: right padding and pad slots are exercised


def ragged_prompts(seed: int, lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g) for n in lengths]


def batch_sizes_seen(target) -> tuple[list[int], object]:
    """Record the batch size of every target forward (a hook; remove it with .remove())."""
    seen: list[int] = []
    handle = target.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    return seen, handle


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize(
    "kind,tree",
    [("eagle", "small"), ("medusa", "small"), ("eagle", "dynamic:depth=3,top_k=2,total_tokens=5")],
    ids=["eagle-static", "medusa-static", "eagle-dynamic"],
)
def test_greedy_rows_equal_target_generate(arch, kind, tree):
    target = tiny_target(arch)
    model = SelfDraftModel(target, None, random_heads(target, kind, 1), tree=tree)
    prompts = ragged_prompts(0)
    outs = model.generate(prompts, 16, stop_token_ids=[])
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.tokens == greedy_reference(target, prompt[None], 16)
        assert out.tokens == model.generate(prompt, 16, stop_token_ids=[]).tokens
        assert out.stats.finish_reason == "length" and out.stats.tree_passes >= 1


@pytest.mark.parametrize("spec", [NAMED_TREES["small"], TreeSpec.chain(5)], ids=["tree", "chain"])
def test_deep_acceptance_stops_and_budgets_finish_rows_at_different_times(spec):
    """Oracle drafters get long blocks accepted (compaction of different path lengths per row); rows end
    by a stop token inside an accepted block, by their budget, at different steps, and leave the batch."""
    target = tiny_target("llama")
    prompts = ragged_prompts(3, (4, 11, 2, 7, 5))
    refs = [greedy_reference(target, p[None], 30) for p in prompts]
    stop = refs[1][9]  # ends row 1 (and any row producing this token) inside a block
    drafters = [
        OracleDrafter(p.tolist() + r, 96, miss_every=m)
        for p, r, m in zip(prompts, refs, (0, 3, 2, 0, 4), strict=True)
    ]
    seen, hook = batch_sizes_seen(target)
    try:
        outs = speculative_generate(
            target,
            drafters,
            prompts,
            spec=spec,
            max_new_tokens=24,
            sampling=SamplingParams(),
            stop_token_ids=[stop],
        )
    finally:
        hook.remove()
    for ref, out in zip(refs, outs, strict=True):
        want = ref[: ref.index(stop) + 1] if stop in ref[:24] else ref[:24]
        assert out.tokens == want
        assert out.stats.finish_reason == ("stop" if stop in ref[:24] else "length")
    assert outs[1].stats.finish_reason == "stop"
    assert sum(out.stats.mean_accepted for out in outs) / len(outs) > 2.0  # blocks really accepted
    passes = [out.stats.target_forwards for out in outs]
    assert len(set(passes)) > 1  # rows finished at different steps
    assert seen[0] == len(prompts) and seen == sorted(seen, reverse=True) and seen[-1] < len(prompts)
    assert len(seen) == max(passes)  # one target pass per step for the whole batch


def test_budget_one_and_context_limit_rows():
    """A row that ends at the prefill token leaves at once; a row that reaches the context ends there
    (finish reason "context") while the others go on; each equals its single-sequence run."""
    target = tiny_target("qwen2")  # context 256
    model = SelfDraftModel(target, None, random_heads(target, "eagle", 2), tree="small")
    prompts = [*ragged_prompts(5, (3, 5)), ragged_prompts(6, (250,))[0]]
    outs = model.generate(prompts, 12, stop_token_ids=[])
    for prompt, out in zip(prompts, outs, strict=True):
        single = model.generate(prompt, 12, stop_token_ids=[])
        assert out.tokens == single.tokens and out.stats.finish_reason == single.stats.finish_reason
    assert outs[2].stats.finish_reason == "context" and outs[0].stats.finish_reason == "length"
    outs = model.generate(prompts[:2], 1, stop_token_ids=[])
    assert [len(o.tokens) for o in outs] == [1, 1] and all(o.stats.tree_passes == 0 for o in outs)


def test_sampled_row_independent_of_neighbours():
    """Same prompt + same seed gives the same sampled tokens whatever the other rows are, and the
    same tokens as a single-sequence call with that seed."""
    target = tiny_target("llama")
    model = SelfDraftModel(
        target, None, random_heads(target, "eagle", 0), tree="dynamic:depth=3,top_k=2,total_tokens=5"
    )
    row = torch.tensor([7, 8, 9, 10])
    kw = dict(temperature=0.9, top_k=20, stop_token_ids=[])
    alone = model.generate(row, 20, seed=11, **kw).tokens
    a = model.generate([row, *ragged_prompts(1)], 20, seed=[11, 1, 2, 3, 4], **kw)
    b = model.generate([*ragged_prompts(2, (12, 2)), row], 20, seed=[5, 6, 11], **kw)
    assert a[0].tokens == b[2].tokens == alone
    c = model.generate([*ragged_prompts(4, (5,)), row], 20, seed=10, **kw)  # one int: row i uses 10 + i
    assert c[1].tokens == alone
    assert alone != model.generate(row, 20, seed=12, **kw).tokens  # the seed matters


@pytest.mark.parametrize(
    "kind,tree,params,heads_dtype",
    [
        ("medusa", "small", SamplingParams(temperature=0.8, top_k=6, top_p=0.9), torch.float32),
        ("eagle", "dynamic:depth=3,top_k=2,total_tokens=5", SamplingParams(temperature=1.0), torch.float32),
        # a static tree at T > 0: every row draws its children from the head's q (EagleRows.draw_with)
        ("eagle", "small", SamplingParams(temperature=0.9, top_k=20), torch.float32),
        # bfloat16 heads: a row's drafts round with its neighbours in the head's batched pass, so its
        # tokens need not equal a single run's; its law is still the target's (SelfDraftModel.generate)
        ("eagle", "small", SamplingParams(temperature=0.9, top_k=20), torch.bfloat16),
    ],
    ids=["medusa", "eagle-dynamic", "eagle-drawn", "eagle-drawn-bf16-heads"],
)
def test_sampled_rows_follow_two_token_law(kind, tree, params, heads_dtype):
    """Each row of 8-row batches (two prompts of different lengths, 4 rows each, distinct seeds) vs the
    exact law of its first two tokens: chi-square at alpha = 1e-4 per prompt, fixed seeds."""
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, kind, 0).to(heads_dtype), tree=tree)
    prompts = [torch.tensor([3, 14, 15]), torch.tensor([2, 7, 1, 8, 28, 18])]
    batch = [prompts[i % 2] for i in range(8)]
    V = target.config.vocab_size
    counts = torch.zeros(2, V, V)
    accepted = 0
    for call in range(150):
        outs = model.generate(
            batch,
            2,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=1000 + 8 * call,  # row i: 1000 + 8 call + i, all distinct
            stop_token_ids=[],
        )
        for i, out in enumerate(outs):
            counts[i % 2, out.tokens[0], out.tokens[1]] += 1
            accepted += sum(out.stats.accepted_lengths)
    for j, prompt in enumerate(prompts):
        stat, critical = chi_square(counts[j], exact_two_token_law(target, prompt[None], params))
        assert stat <= critical, f"prompt {j}: chi2 {stat:.1f} > {critical:.1f}"
    assert accepted > 20  # the accept branch was exercised, not only corrections


def test_single_sequence_api_unchanged_and_batch_errors():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, "medusa", 0), tree="small")
    flat = model.generate([5, 6, 7], 5, stop_token_ids=[])
    assert isinstance(flat, GenerationOutput)
    assert flat.tokens == model.generate(torch.tensor([[5, 6, 7]]), 5, stop_token_ids=[]).tokens
    one = model.generate([[5, 6, 7]], 5, stop_token_ids=[])
    assert isinstance(one, list) and one[0].tokens == flat.tokens
    assert model.generate([torch.tensor([[5, 6, 7]])], 5, stop_token_ids=[])[0].tokens == flat.tokens  # [1, T]
    assert model.generate((torch.tensor([5, 6, 7]), [1, 2]), 5, stop_token_ids=[])[0].tokens == flat.tokens
    with pytest.raises(UserError, match="one seed per prompt"):
        model.generate([[1, 2], [3]], 4, temperature=1.0, seed=[1, 2, 3])
    with pytest.raises(UserError, match="streamer"):
        model.generate([[1, 2], [3]], 4, streamer=object())
    with pytest.raises(UserError, match="empty"):
        model.generate([], 4)
    with pytest.raises(UserError, match="mixing"):
        model.generate([1, [2, 3]], 4)
    with pytest.raises(UserError, match="empty"):
        model.generate([[1, 2], []], 4)
    with pytest.raises(UserError, match="vocabulary"):
        model.generate([[1, 2], [500]], 4)
    with pytest.raises(UserError, match="one drafter"):
        speculative_generate(
            target,
            OracleDrafter([1, 2, 3], 96),
            [torch.tensor([1]), torch.tensor([2])],
            spec=TreeSpec.chain(2),
            max_new_tokens=2,
            sampling=SamplingParams(),
        )
    assert row_seeds(5, 3) == [5, 6, 7] and row_seeds(None, 2) == [None, None]


def test_cli_prompts_file(tmp_path, tiny_target_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "prompt": "Tell me a story."},
                {"prompt": "def add(a, b):", "chat": False},
                {"id": 7, "prompt": "Hi"},
            ]
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    base = [sys.executable, "-m", "selfdraft.scripts.cli", "generate", "--target", str(tiny_target_dir)]
    args = [*base, "--heads", "none", "--tree", "chain-2", "--max-new-tokens", "6"]
    proc = subprocess.run(
        [*args, "--prompts-file", str(prompts), "--out", str(out), "--batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", 2, 7]
    assert all(set(r) == {"id", "text", "tokens", "stats"} and 1 <= len(r["tokens"]) <= 6 for r in rows)
    assert all(r["stats"]["tau"] >= 1.0 for r in rows)
    missing = subprocess.run(
        [*args, "--prompts-file", str(prompts)], capture_output=True, text=True, timeout=300
    )
    assert missing.returncode == 2 and "--out" in missing.stderr


def test_bench_batch_section(tmp_path, tiny_target_dir):
    """`selfdraft bench --batch 1 3`: batched selfdraft vs the target's batched generate, interleaved
    per batch size, with a table and a line per method saying where batching stops paying."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "Tell me a story."}) + "\n" + json.dumps({"id": "b", "prompt": "Hi"}) + "\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "selfdraft.scripts.cli",
            "bench",
            "--target",
            str(tiny_target_dir),
            "--prompts",
            str(prompts),
            "--methods",
            "baseline",
            "selfdraft:none:chain-2",
            "--temperatures",
            "0",
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
            "--batch",
            "1",
            "3",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["batch_sizes"] == [1, 3]
    order = [(r["batch"], r["method"]) for r in report["batch_runs"]]
    assert order == [(1, "baseline"), (1, "selfdraft:none:chain-2"), (3, "baseline"), (3, "selfdraft:none:chain-2")]
    assert all(len(r["row_tokens"]) == r["batch"] and r["tokens"] >= r["batch"] for r in report["batch_runs"])
    spec = [r for r in report["batch_summary"] if r["method"] != "baseline"]
    assert len(spec) == 2 and all(r["speedup"] > 0 and "identical_rows" in r for r in spec)
    table = (out / "bench.md").read_text()
    assert "Batched generation" in table and "- selfdraft:none:chain-2, T=0: total tok/s peaks at batch" in table


def test_prefill_without_logits_to_keep(monkeypatch):
    """A target whose forward lacks `logits_to_keep` gets full prefill logits, sliced per row."""
    from selfdraft.inference import decoding as passes

    target = tiny_target("llama")
    model = SelfDraftModel(target, None, random_heads(target, "medusa", 0), tree="small")
    prompts = ragged_prompts(8)
    kept = [o.tokens for o in model.generate(prompts, 6, stop_token_ids=[])]
    monkeypatch.setattr(passes, "takes_logits_to_keep", lambda cls: False)
    assert [o.tokens for o in model.generate(prompts, 6, stop_token_ids=[])] == kept
    assert kept == [greedy_reference(target, p[None], 6) for p in prompts]


def test_smollm_batch_greedy_identity(smollm):
    """The real target in float32: each row of a ragged batch equals that prompt's own greedy generate."""
    target, tokenizer = smollm
    model = SelfDraftModel(target, tokenizer, random_heads(target, "eagle", 0), tree="small")
    prompts = [model.chat_ids(q) for q in ("What is 2 + 2?", "Write a short poem about the sea and the wind.", "Hi")]
    outs = model.generate(prompts, 12)
    for ids, out in zip(prompts, outs, strict=True):
        ref = target.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out.tokens == ref, tokenizer.decode(out.tokens) + " != " + tokenizer.decode(ref)
