"""`selfdraft tune` picks and saves a tree that generate then uses; `publish` writes a model card."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from selfdraft.bench.tune import (
    TreeScore,
    interpolate,
    rank_scores,
    score_trees,
    score_trees_batched,
    tree_description,
)
from selfdraft.heads import HeadsConfig, build_heads, save_heads
from selfdraft.inference import SelfDraftModel, decoding
from selfdraft.inference.model import TREE_FILE
from selfdraft.tree_syntax import resolve_tree, write_tree_file


def test_interpolation_of_verify_curve():
    curve = {1: 1.0, 4: 2.0, 16: 4.0}
    assert interpolate(curve, 1) == 1.0 and interpolate(curve, 4) == 2.0
    assert abs(interpolate(curve, 2) - 1.5) < 1e-9  # halfway on a log scale
    assert interpolate(curve, 32) == 8.0


def test_tune_scores_and_saved_tree_is_used(tmp_path, tiny_target_dir):
    model = SelfDraftModel.from_pretrained(
        str(tiny_target_dir), heads=None, head_kind="eagle", tree="chain-1"
    )
    prompts = [model.chat_ids("Say hello."), model.chat_ids("Count to five.")]
    candidates = ["chain-1", "chain-3", "dynamic:depth=2,top_k=2,total_tokens=3"]
    scores = score_trees(model, prompts, candidates, max_new_tokens=8, curve={1: 0.01, 2: 0.011, 4: 0.012})
    assert scores == rank_scores(scores)
    assert {s.tree for s in scores} == set(candidates)
    assert all(s.tau >= 1.0 and s.measured_tokens_per_s > 0 for s in scores)
    # a step costs more than drafting and verifying: acceptance, compaction, bookkeeping count too
    assert all(s.other_s > 0 for s in scores)
    for s in scores:
        assert abs(s.expected_tokens_per_s - s.tau / (s.draft_s + s.verify_s + s.other_s)) < 1e-9
    heads_dir = tmp_path / "heads"
    torch.manual_seed(0)
    save_heads(build_heads(HeadsConfig.for_target(model.target.config, head_kind="eagle")), heads_dir)
    write_tree_file(heads_dir / TREE_FILE, resolve_tree(scores[0].tree), tree_description(scores[0]))
    loaded = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=heads_dir)
    assert loaded.tree == resolve_tree(scores[0].tree)


def test_expected_ties_are_decided_by_measured_speed():
    """Trees within 2% of the best expected tokens/s are a tie for the cost model: the one measured
    fastest goes first; a tree measured fast but expected well below the best does not."""

    def score(tree: str, expected: float, measured: float) -> TreeScore:
        return TreeScore(tree, 3.0, 10.0, 0.005, 0.03, expected, measured)

    a, b, c, d = score("a", 104.8, 83.4), score("b", 103.4, 94.8), score("c", 101.0, 99.0), score("d", 90.0, 80.0)
    assert [s.tree for s in rank_scores([d, c, a, b])] == ["b", "a", "c", "d"]
    assert [s.tree for s in rank_scores([a, b], tie=0.0)] == ["a", "b"]  # no tie band: expected alone
    assert rank_scores([]) == []


def test_tree_file_holds_one_tree_per_dtype(tmp_path, caplog):
    """tune writes its dtype's entry and keeps the others; the model reads the entry of its target's
    dtype; a dtype without an entry falls back to the first one, with a warning."""
    from selfdraft.tree_syntax import read_tree_file

    from tiny_models import tiny_target

    heads_dir = tmp_path / "heads"
    target = tiny_target()
    save_heads(build_heads(HeadsConfig.for_target(target.config, head_kind="eagle")), heads_dir)
    path = heads_dir / TREE_FILE
    write_tree_file(path, resolve_tree("chain-2"))  # a one-tree file of an older tune: replaced
    write_tree_file(path, resolve_tree("dynamic:depth=3,top_k=2,total_tokens=6"), "bf16", dtype="bfloat16")
    write_tree_file(path, resolve_tree("chain-1+lookup=3"), "fp32", dtype="float32")
    write_tree_file(
        path, resolve_tree("dynamic:depth=4,top_k=3,total_tokens=12"), "bf16 again", dtype="bfloat16"
    )
    assert list(yaml.safe_load(path.read_text())) == ["bfloat16", "float32"]
    assert read_tree_file(path, "float32") == resolve_tree("chain-1+lookup=3")
    wanted = {torch.bfloat16: "dynamic:depth=4,top_k=3,total_tokens=12", torch.float32: "chain-1+lookup=3"}
    for dtype, want in wanted.items():
        model = SelfDraftModel.with_heads(target.to(dtype), None, heads_dir, draft_dtype=None)
        assert model.tree == resolve_tree(want)
    with caplog.at_level("WARNING"):
        assert read_tree_file(path, "float16") == resolve_tree("dynamic:depth=4,top_k=3,total_tokens=12")
    assert "no tree for float16" in caplog.text
    with pytest.raises(ValueError, match="dtype"):
        write_tree_file(path, resolve_tree("chain-1"), dtype="int8")
    path.write_text("bfloat16: {paths: [[0]]}\nchain: 3\n")  # dtype entries mixed with other keys
    with pytest.raises(ValueError, match="exactly one of"):
        read_tree_file(path, "bfloat16")


def test_tree_file_machine_entries_serve_their_kind_of_machine(tmp_path, monkeypatch):
    """tune --this-machine writes `dtype@kind`; a model on that kind of machine drafts with it, and with
    the dtype's `sampling:` / `batch:` trees where the machine entry has none; other kinds (and other
    dtypes) keep the dtype's entry."""
    from selfdraft.inference import model as model_mod
    from selfdraft.tree_syntax import read_batch_trees, read_tree_file

    from tiny_models import tiny_target

    heads_dir = tmp_path / "heads"
    target = tiny_target()
    save_heads(build_heads(HeadsConfig.for_target(target.config, head_kind="eagle")), heads_dir)
    path = heads_dir / TREE_FILE
    kind = "cpu-avx512bf16"
    with pytest.raises(ValueError, match="greedy tree"):
        write_tree_file(path, resolve_tree("small"), dtype="float32", sampling=True, machine=kind)
    write_tree_file(path, resolve_tree("dynamic:depth=4,top_k=4,total_tokens=12"), dtype="float32")
    write_tree_file(path, resolve_tree("small"), dtype="float32", sampling=True)
    write_tree_file(path, resolve_tree("chain-1"), dtype="float32", batch=4)
    write_tree_file(path, resolve_tree("chain-3"), "here", dtype="float32", machine=kind)
    write_tree_file(path, resolve_tree("chain-2"), dtype="bfloat16")
    assert list(yaml.safe_load(path.read_text())) == ["bfloat16", "float32", f"float32@{kind}"]
    assert read_tree_file(path, "float32", machine=kind) == resolve_tree("chain-3")
    assert read_tree_file(path, "float32", machine="cpu-amx") == resolve_tree(
        "dynamic:depth=4,top_k=4,total_tokens=12"
    )
    assert read_tree_file(path, "bfloat16", machine=kind) == resolve_tree("chain-2")
    assert read_tree_file(path, "float32", sampling=True, machine=kind) == resolve_tree("small")
    assert read_batch_trees(path, "float32", kind) == {4: resolve_tree("chain-1")}
    write_tree_file(path, resolve_tree("chain-2"), dtype="float32", sampling=True, machine=kind)
    assert read_tree_file(path, "float32", sampling=True, machine=kind) == resolve_tree("chain-2")
    assert read_tree_file(path, "float32", sampling=True) == resolve_tree("small")
    for machine, want in ((kind, "chain-3"), ("cpu-amx", "dynamic:depth=4,top_k=4,total_tokens=12")):
        monkeypatch.setattr(model_mod, "machine_kind", lambda device, machine=machine: machine)
        model = SelfDraftModel.with_heads(target, None, heads_dir, draft_dtype=None)
        assert model.tree == resolve_tree(want)
        assert model.batch_trees == {4: resolve_tree("chain-1")}
    for dtype, machine in ((None, kind), ("float32", "a@b")):
        with pytest.raises(ValueError, match="machine entry"):
            write_tree_file(path, resolve_tree("chain-1"), dtype=dtype, machine=machine)


def test_tree_file_sampling_tree_serves_temperatures_above_zero(tmp_path):
    """tune --temperature T > 0 writes a `sampling:` tree next to the greedy one; the model drafts
    with it at T > 0 only; re-tuning the greedy tree keeps it."""

    from tiny_models import tiny_target

    heads_dir = tmp_path / "heads"
    target = tiny_target()
    save_heads(build_heads(HeadsConfig.for_target(target.config, head_kind="eagle")), heads_dir)
    path = heads_dir / TREE_FILE
    with pytest.raises(ValueError, match="greedy tree"):
        write_tree_file(path, resolve_tree("small"), dtype="float32", sampling=True)
    write_tree_file(path, resolve_tree("dynamic:depth=2,top_k=2,total_tokens=3"), dtype="float32")
    write_tree_file(path, resolve_tree("small"), "drawn", dtype="float32", sampling=True)
    write_tree_file(path, resolve_tree("chain-2"), dtype="float32")  # re-tuned greedy tree
    model = SelfDraftModel.with_heads(target, None, heads_dir, draft_dtype=None)
    assert model.tree == resolve_tree("chain-2") and model.sampling_tree == resolve_tree("small")
    used = []
    real = decoding.speculative_generate

    def spy(*args, **kwargs):
        used.append(kwargs["spec"])
        return real(*args, **kwargs)

    decoding_generate = "selfdraft.inference.model.speculative_generate"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding_generate, spy)
        model.generate(torch.tensor([1, 2, 3]), 3)
        model.generate(torch.tensor([1, 2, 3]), 3, temperature=0.7, seed=0)
    assert used == [resolve_tree("chain-2"), resolve_tree("small")]
    # a one-tree file without a sampling tree: T > 0 uses the greedy tree
    assert SelfDraftModel(target, None, model.heads, tree="chain-1").sampling_tree == resolve_tree("chain-1")


def test_tree_file_batch_trees_serve_batches_of_at_least_their_size(tmp_path):
    """tune --batch B writes a `batch:` tree into the dtype's entry; generate() on a list of n prompts
    drafts with the tree of the largest B <= n (greedy only), one prompt with the entry's own tree;
    re-tuning the single-prompt tree keeps the batch trees; a bad `batch:` block is refused on load."""
    from selfdraft.tree_syntax import read_batch_trees

    from tiny_models import tiny_target

    heads_dir = tmp_path / "heads"
    target = tiny_target()
    save_heads(build_heads(HeadsConfig.for_target(target.config, head_kind="eagle")), heads_dir)
    path = heads_dir / TREE_FILE
    with pytest.raises(ValueError, match="first"):
        write_tree_file(path, resolve_tree("chain-1"), dtype="float32", batch=4)
    write_tree_file(path, resolve_tree("dynamic:depth=2,top_k=2,total_tokens=4"), dtype="float32")
    write_tree_file(path, resolve_tree("chain-1"), "b8", dtype="float32", batch=8)
    write_tree_file(path, resolve_tree("chain-2"), "b4", dtype="float32", batch=4)
    write_tree_file(path, resolve_tree("small"), "drawn", dtype="float32", sampling=True)
    write_tree_file(path, resolve_tree("chain-3"), dtype="float32")  # re-tuned single-prompt tree
    assert list(read_batch_trees(path, "float32")) == [4, 8]
    model = SelfDraftModel.with_heads(target, None, heads_dir, draft_dtype=None)
    used = []
    real = decoding.speculative_generate

    def spy(*args, **kwargs):
        used.append(kwargs["spec"])
        return real(*args, **kwargs)

    prompts = [torch.tensor([1, 2, 3 + i]) for i in range(9)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("selfdraft.inference.model.speculative_generate", spy)
        for n in (2, 4, 7, 9):
            model.generate(prompts[:n], 2)
        model.generate(prompts[:4], 2, temperature=0.7, seed=0)
    names = ["chain-3", "chain-2", "chain-2", "chain-1", "small"]
    assert used == [resolve_tree(name) for name in names]
    with pytest.raises(ValueError, match="greedy"):
        write_tree_file(path, resolve_tree("chain-1"), dtype="float32", sampling=True, batch=4)
    path.write_text("float32: {paths: [[0]], batch: {1: {paths: [[0]]}}}\n")
    with pytest.raises(ValueError, match="integers >= 2"):
        SelfDraftModel.with_heads(target, None, heads_dir, draft_dtype=None)


def test_tune_at_a_batch_size_scores_measured_throughput(tmp_path, tiny_target_dir):
    model = SelfDraftModel.from_pretrained(
        str(tiny_target_dir), heads=None, head_kind="eagle", tree="chain-1"
    )
    prompts = [model.chat_ids(text)[0] for text in ("Say hello.", "Count to five.", "Name a color.")]
    candidates = ["chain-1", "dynamic:depth=2,top_k=2,total_tokens=3"]
    scores = score_trees_batched(model, prompts, candidates, batch=2, max_new_tokens=6)
    assert {s.tree for s in scores} == set(candidates)
    rates = [s.measured_tokens_per_s for s in scores]
    assert rates == sorted(rates, reverse=True) and all(r > 0 for r in rates)
    assert all(s.tau >= 1.0 and s.verify_s > 0 and s.draft_s > 0 and s.other_s > 0 for s in scores)


def _fake_run(run: Path, model, steps: int, examples: int, seconds: float) -> None:
    save_heads(model.heads, run / "heads")
    (run / "run.json").write_text(json.dumps({"fingerprint": "x", "world_size": 2}))
    log = [
        {"step": 0, "event": "start", "examples": examples},
        {"step": steps, "loss": 1.0, "tokens_per_s_rank": 100.0},
        {"step": steps, "eval_loss": 1.0, "eval_top1_by_depth": [0.5, 0.3], "eval_simulated_tau_chain": 1.6},
        {"step": steps, "event": "done", "train_seconds": seconds},
    ]
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))


def test_publish_writes_model_card(tmp_path, tiny_target_dir):
    from selfdraft.training.release.publish import publish

    run = tmp_path / "run"
    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None, draft_dtype=None)
    _fake_run(run, model, steps=5, examples=10, seconds=120.0)
    config = tmp_path / "run.yaml"
    config.write_text(
        "target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\n"
        "data:\n  sources: [runs/distilled.jsonl, 'sharegpt:100']\n"
    )
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "summary": [
                    {
                        "prompts": "sharegpt:4",
                        "method": "baseline",
                        "temperature": 0.0,
                        "tokens_per_s": 10.0,
                        "speedup": 1.0,
                        "identical_to_baseline": True,
                    },
                    {
                        "prompts": "sharegpt:4",
                        "method": "selfdraft:shipped",
                        "temperature": 0.0,
                        "tau": 2.1,
                        "tokens_per_s": 12.5,
                        "speedup": 1.25,
                        "identical_to_baseline": True,
                    },
                ]
            }
        )
    )
    bf16 = tmp_path / "bench-bf16.json"
    bf16.write_text(
        json.dumps(
            {
                "config": {"temperatures": [0.0, 1.0]},
                "dtypes": {"target": "bfloat16", "selfdraft:shipped": "bfloat16"},
                "summary": [
                    {
                        "prompts": "sharegpt:4",
                        "method": "selfdraft:shipped",
                        "temperature": 0.0,
                        "n": 4,
                        "tau": 2.3,
                        "tokens_per_s": 30.0,
                        "speedup": 1.6,
                        "identical_to_baseline": False,
                        "identical_prompts": 3,
                        "near_tie_prompts": 1,
                    },
                ],
            }
        )
    )
    dest = publish(
        run,
        tmp_path / "card",
        target="smollm2-135m-instruct",
        config_path=config,
        benches=[(bench, "selfdraft bench ..."), (bf16, "selfdraft bench --dtype bfloat16")],
        tokens=12345,
    )
    names = sorted(p.name for p in dest.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors", "training_config.yaml"]
    assert (dest / "training_config.yaml").read_text() == config.read_text()
    card = (dest / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    assert header["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert header["library_name"] == "selfdraft" and header["license"] and header["datasets"]
    assert "eagle" in header["tags"] and "speculative-decoding" in header["tags"]
    assert len(card.encode()) <= 8 * 1024
    for fact in (
        "12345",
        "5 steps",
        "2.0 min",
        "40 sequences (4.0 passes over its 10)",  # 5 steps x 4 sequences (the default micro-batch) x 2 ranks
        "| 2.10 |",
        "1.25x",
        "selfdraft bench ...",
        "world size 2",
        "speedup on this machine across prompt sets: `selfdraft:shipped` 1.25x-1.25x.",
        "### 1. Benchmark\n",
        "### 2. Target in bfloat16, T = 0, 1\n\nCommand: `selfdraft bench --dtype bfloat16`",
        "dtypes: target bfloat16, selfdraft:shipped bfloat16.",
        "| sharegpt:4 | selfdraft:shipped | 0 | 2.30 | 30.0 | 1.60x | 3/4 (1 near-tie) |",
        "between a 1-token and a many-token forward in its dtype",
        "`selfdraft:shipped` 1.60x-1.60x.",
        "Data: sources `runs/distilled.jsonl`, `sharegpt:100` (held-out split excluded)",  # the run's own
    ):
        assert fact in card, fact


def test_publish_quotes_no_speedup_from_the_prompts_that_chose(tmp_path, tiny_target_dir):
    """--selection-bench: the prompts that chose the heads (or their tree) give tau and identity in the
    card, numbered ahead of the report benches, and none of their tok/s or speedups."""
    from selfdraft.training.release.publish import SELECTION_NOTE, publish

    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None, draft_dtype=None)
    _fake_run(tmp_path / "run", model, steps=5, examples=10, seconds=120.0)
    config = tmp_path / "run.yaml"
    config.write_text("target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\n")

    def bench(name: str, tau: float, tok_s: float, speedup: float, dtype: str) -> Path:
        row = {"prompts": "sharegpt:4", "temperature": 0.0, "identical_to_baseline": True}
        summary = [
            {**row, "method": "baseline", "tokens_per_s": 10.0, "speedup": 1.0},
            {**row, "method": "selfdraft:shipped", "tau": tau, "tokens_per_s": tok_s, "speedup": speedup},
        ]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"dtypes": {"target": dtype}, "summary": summary}))
        return path

    chose = bench("select", 3.02, 99.9, 9.99, "float32")
    report = bench("report", 3.56, 86.8, 2.15, "bfloat16")
    dest = publish(
        tmp_path / "run",
        tmp_path / "card",
        target="smollm2-135m-instruct",
        config_path=config,
        benches=[(report, "selfdraft bench --dtype bfloat16")],
        selection_benches=[(chose, "selfdraft bench --dtype float32")],
    )
    card = (dest / "README.md").read_text()
    for fact in (
        "### 1. Target in float32 (selection prompts)\n\nCommand: `selfdraft bench --dtype float32`",
        "| sharegpt:4 | selfdraft:shipped | 0 | 3.02 | yes |",
        SELECTION_NOTE,
        "### 2. Target in bfloat16\n",
        "| sharegpt:4 | selfdraft:shipped | 0 | 3.56 | 86.8 | 2.15x | yes |",
        "speedup on this machine across prompt sets: `selfdraft:shipped` 2.15x-2.15x.",
    ):
        assert fact in card, fact
    assert "9.99" not in card and "99.9" not in card


def test_the_card_leads_with_mtbench(tmp_path, tiny_target_dir):
    """A report bench on MT-bench gives the card's first numbers (right under the title's paragraph,
    before Load) and is numbered first under Measured, whatever order the benches were passed in."""
    from selfdraft.training.release.publish import publish

    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None, draft_dtype=None)
    _fake_run(tmp_path / "run", model, steps=5, examples=10, seconds=120.0)
    config = tmp_path / "run.yaml"
    config.write_text("target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\n")

    def bench(name: str, prompts: str, rows: list[tuple[float, float, float]], dtype: str) -> Path:
        summary = [
            {
                "prompts": prompts,
                "method": "baseline",
                "temperature": 0.0,
                "tokens_per_s": 10.0,
                "speedup": 1.0,
            }
        ]
        summary += [
            {"prompts": prompts, "method": "selfdraft:shipped", "temperature": temperature, "tau": tau}
            | {"tokens_per_s": 10.0 * speedup, "speedup": speedup, "identical_to_baseline": True}
            for temperature, tau, speedup in rows
        ]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"dtypes": {"target": dtype}, "summary": summary}))
        return path

    sharegpt = bench("sharegpt", "sharegpt:8", [(0.0, 4.56, 2.5)], "bfloat16")
    mtbench = bench("mtbench", "mtbench", [(0.0, 3.24, 1.85), (1.0, 1.79, 1.4)], "bfloat16")
    fp32 = bench("fp32", "mtbench", [(0.0, 2.93, 1.35)], "float32")
    commands = ["selfdraft bench --prompts sharegpt:8", "selfdraft bench --prompts mtbench", "... float32"]
    dest = publish(
        tmp_path / "run",
        tmp_path / "card",
        target="smollm2-135m-instruct",
        config_path=config,
        benches=list(zip([sharegpt, mtbench, fp32], commands, strict=True)),
    )
    card = (dest / "README.md").read_text()
    headline = (
        "bfloat16 T=0 tau 3.24, **1.85x**; bfloat16 T=1 tau 1.79, **1.40x**; float32 T=0 tau 2.93, **1.35x**."
    )
    assert headline in card and card.index(headline) < card.index("## Load")
    assert "4.56" not in card[: card.index("## Load")]
    assert card.index("Command: `selfdraft bench --prompts mtbench`") < card.index("Command: `... float32`")
    assert card.index("Command: `... float32`") < card.index(
        "Command: `selfdraft bench --prompts sharegpt:8`"
    )
    plain = publish(
        tmp_path / "run",
        tmp_path / "plain",
        target="smollm2-135m-instruct",
        config_path=config,
        benches=[(sharegpt, commands[0])],
    )
    assert "**MT-bench**" not in (plain / "README.md").read_text()


def test_publish_states_every_training_stage(tmp_path, tiny_target_dir):
    """A run continued from an earlier run's heads: the card sums both stages; the folder keeps only
    the last stage's config, in the Hub shape (no per-stage copies, no history file)."""
    from selfdraft.training.release.publish import FOLDER_FILES, publish

    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None, draft_dtype=None)
    _fake_run(tmp_path / "stage1", model, steps=5, examples=10, seconds=120.0)
    _fake_run(tmp_path / "stage2", model, steps=7, examples=30, seconds=180.0)
    first, second = tmp_path / "one.yaml", tmp_path / "two.yaml"
    first.write_text("target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\ntrain:\n  micro_batch_size: 2\n")
    second.write_text(
        "target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\n  init_from: stage1/heads\n"
        "train:\n  micro_batch_size: 3\n"
    )
    tree = tmp_path / "tree.yaml"
    write_tree_file(tree, resolve_tree("chain-2"))
    dest = publish(
        tmp_path / "stage2",
        tmp_path / "card",
        target="smollm2-135m-instruct",
        config_path=second,
        earlier=[(tmp_path / "stage1", first)],
        tree_file=tree,
    )
    assert sorted(p.name for p in dest.iterdir()) == sorted(FOLDER_FILES)
    assert (dest / "training_config.yaml").read_text() == second.read_text()
    card = (dest / "README.md").read_text()
    for fact in (
        f"Stage 1 of 2: `selfdraft train --config {first} --nproc 2`: 5 steps",
        "20 sequences (2.0 passes over its 10)",  # 5 steps x 2 sequences x 2 ranks
        f"Stage 2 of 2: `selfdraft train --config {second} --nproc 2`: 7 steps",
        "42 sequences (1.4 passes over its 30)",
        "In all: 12 steps, 62 sequences, 5.0 min of training",
        "Run config of the last stage: `training_config.yaml` here.",
        "No benchmark was recorded",
    ):
        assert fact in card, fact
    assert "init_from: stage1/heads" not in card  # configs live in the folder, not in the card


def test_publish_counts_a_stopped_run(tmp_path, tiny_target_dir):
    """A run stopped between checkpoints counts up to its last checkpoint, with the tokens its steps
    fed (as the run counted them at that step, else replayed from its split), its wall time to its last
    logged row, its precision and where it ran."""
    from selfdraft.training.data.dataset import rows_to_dataset
    from selfdraft.training.release.publish import publish

    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None, draft_dtype=None)
    _fake_run(tmp_path / "stage1", model, steps=5, examples=10, seconds=120.0)
    first = tmp_path / "one.yaml"
    first.write_text("target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\ntrain:\n  micro_batch_size: 2\n")
    run = tmp_path / "stage2"
    save_heads(model.heads, run / "heads")
    (run / "run.json").write_text(json.dumps({"fingerprint": "x", "world_size": 2, "precision": "bfloat16"}))
    log = [
        {"step": 0, "event": "start", "examples": 12, "device": "cuda:0", "time": 1000.0},
        {"step": 4, "loss": 1.0, "tokens_per_s_rank": 50.0, "tokens_fed": 111, "time": 1100.0},
        {
            "step": 4,
            "eval_loss": 1.0,
            "eval_top1_by_depth": [0.6, 0.4],
            "eval_simulated_tau_chain": 1.9,
            "time": 1110.0,
        },
        {"step": 4, "event": "checkpoint", "time": 1120.0},
        # stopped before step 8's save: step 6's count is not what the published heads were fed
        {"step": 6, "loss": 0.9, "tokens_per_s_rank": 50.0, "tokens_fed": 999, "time": 1180.0},
    ]
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    rows = [{"id": str(i), "input_ids": [1] * 7, "loss_mask": [1] * 7} for i in range(12)]
    rows_to_dataset(rows).save_to_disk(str(run / "data" / "train"))
    second = tmp_path / "two.yaml"
    second.write_text(
        f"target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\n  init_from: {tmp_path / 'stage1'}\n"
        "train:\n  micro_batch_size: 2\n  max_steps: 10\n"
    )
    dest = publish(
        run,
        tmp_path / "card",
        target="smollm2-135m-instruct",
        config_path=second,
        earlier=[(tmp_path / "stage1", first)],
    )
    card = (dest / "README.md").read_text()
    for fact in (
        f"Stage 1 of 2: `selfdraft train --config {first} --nproc 2`: 5 steps, world size 2",
        f"Stage 2 of 2: `selfdraft train --config {second} --nproc 2`: 4 steps (stopped at a checkpoint; "
        # the tokens the run counted at the published step (a replay of its split would say 112)
        "10 planned), world size 2, 16 sequences (1.3 passes over its 12), 111 tokens, wall time 3.0 min",
        "(2-core CPU, float32)",  # stage 1's log names no device: this project's CPU runs
        "wall time 3.0 min over 1 session(s) (CUDA GPU, bfloat16)",
        "by depth: 0.600, 0.400",
        "Last stage's training split: 84 tokens in 12 sequences",
    ):
        assert fact in card, fact
    # a folder outside checkpoints/ is not what selfdraft loads by default, and its card says so
    assert "not the shipped default" in card and "loads these heads by default" not in card


def test_publish_refuses_a_card_over_the_limit_before_writing(tmp_path, tiny_target_dir):
    """Benches enough to push the card past CARD_LIMIT bytes are a user error naming the fix, and
    nothing is written."""
    from selfdraft.errors import UserError
    from selfdraft.training.release.publish import CARD_LIMIT, publish

    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None, draft_dtype=None)
    _fake_run(tmp_path / "run", model, steps=5, examples=10, seconds=120.0)
    config = tmp_path / "one.yaml"
    config.write_text("target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\n")
    row = {"prompts": "sharegpt:4", "temperature": 0.0, "identical_to_baseline": True, "tokens_per_s": 1.0}
    summary = [{**row, "method": f"selfdraft:runs/heads-{i}", "tau": 2.0, "speedup": 1.5} for i in range(40)]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"summary": summary}))
    kwargs = {"target": "smollm2-135m-instruct", "config_path": config}
    small = publish(tmp_path / "run", tmp_path / "small", **kwargs, benches=[(bench, "selfdraft bench")])
    assert len((small / "README.md").read_bytes()) <= CARD_LIMIT
    with pytest.raises(UserError, match="fewer --bench"):
        publish(tmp_path / "run", tmp_path / "big", **kwargs, benches=[(bench, "selfdraft bench")] * 3)
    assert not (tmp_path / "big").exists() and not list(tmp_path.glob("*big*tmp*")) and not list(tmp_path.glob(".big*"))
