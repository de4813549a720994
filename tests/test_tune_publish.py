"""`selfdraft tune` picks and saves a tree that generate then uses; `publish` writes a model card."""

import json

import torch

from selfdraft.heads import HeadsConfig, build_heads, save_heads
from selfdraft.inference import SelfDraftModel
from selfdraft.inference.model import TREE_FILE, resolve_tree, write_tree_file
from selfdraft.inference.tune import interpolate, score_trees, tree_description


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
    assert [s.expected_tokens_per_s for s in scores] == sorted(
        (s.expected_tokens_per_s for s in scores), reverse=True
    )
    assert {s.tree for s in scores} == set(candidates)
    assert all(s.tau >= 1.0 and s.measured_tokens_per_s > 0 for s in scores)
    heads_dir = tmp_path / "heads"
    torch.manual_seed(0)
    save_heads(build_heads(HeadsConfig.for_target(model.target.config, head_kind="eagle")), heads_dir)
    write_tree_file(heads_dir / TREE_FILE, resolve_tree(scores[0].tree), tree_description(scores[0]))
    loaded = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=heads_dir)
    assert loaded.tree == resolve_tree(scores[0].tree)


def test_publish_writes_model_card(tmp_path, tiny_target_dir):
    from selfdraft.training.publish import publish

    run = tmp_path / "run"
    torch.manual_seed(0)
    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=None)
    save_heads(model.heads, run / "heads")
    (run / "run.json").write_text(json.dumps({"fingerprint": "x", "world_size": 2}))
    log = [
        {"step": 0, "event": "start", "examples": 10},
        {"step": 5, "loss": 1.0, "tokens_per_s_rank": 100.0},
        {"step": 5, "eval_loss": 1.0, "eval_top1_by_depth": [0.5, 0.3], "eval_simulated_tau_chain": 1.6},
        {"step": 5, "event": "done", "train_seconds": 120.0},
    ]
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    config = tmp_path / "run.yaml"
    config.write_text("target: x\n")
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
    dest = publish(
        run,
        tmp_path / "card",
        target="smollm2-135m-instruct",
        config_path=config,
        bench_json=bench,
        bench_command="selfdraft bench ...",
        tokens=12345,
    )
    names = sorted(p.name for p in dest.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors", "training_config.yaml"]
    card = (dest / "README.md").read_text()
    header = card.split("---")[1]
    for key in (
        "base_model: HuggingFaceTB/SmolLM2-135M-Instruct",
        "library_name: selfdraft",
        "license:",
        "datasets:",
    ):
        assert key in header
    for fact in ("12345", "Steps: 5", "2.0 min", "| 2.10 |", "1.25x", "selfdraft bench ...", "world size 2"):
        assert fact in card, fact
