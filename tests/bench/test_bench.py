"""`selfdraft bench` end to end on a tiny target: report structure and the identity cross-check."""

import json
import subprocess
import sys

import yaml


def test_bench_end_to_end(tmp_path, tiny_target_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "Tell me a story."})
        + "\n"
        + json.dumps({"id": "b", "prompt": "def add(a, b):", "chat": False})
        + "\n"
    )
    config = tmp_path / "bench.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "target": str(tiny_target_dir),
                "prompts": [str(prompts)],
                "methods": ["baseline", "prompt-lookup", "selfdraft:none", "selfdraft:none:chain-2@int8"],
                "temperatures": [0.0, 1.0],
                "max_new_tokens": 12,
                "repeats": 2,
                "threads": 1,
                "draft_dtype": "bfloat16",  # heads in bf16 on the fp32 target: still identical
                "verify_curve": [1, 2, 4],
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "selfdraft.scripts.cli", "bench", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "bench.json").read_text())
    assert set(report) >= {"config", "machine", "runs", "summary", "verify_cost_seconds", "prompt_sets"}
    assert len(report["runs"]) == 2 * 2 * 2 * 4  # prompts x temperatures x repeats x methods
    # methods interleaved per prompt: A B C D A B C D ...
    first = [r["method"] for r in report["runs"][:8]]
    assert first == ["baseline", "prompt-lookup", "selfdraft:none", "selfdraft:none:chain-2@int8"] * 2
    greedy = [r for r in report["summary"] if r["temperature"] == 0.0]
    assert {r["method"] for r in greedy} == set(first[:4])
    assert all(r["identical_to_baseline"] for r in greedy)  # lossless methods match the baseline
    spec = [r for r in report["summary"] if r["method"] == "selfdraft:none:chain-2@int8"]
    assert all(r["tau"] >= 1.0 and r["per_depth_acceptance"] for r in spec)
    assert all(r["draft_ms_per_step"] >= 0 and r["verify_ms_per_step"] > 0 for r in spec)
    # no trained heads and no tree: no head runs, only a prompt-lookup branch
    plain = [r for r in report["summary"] if r["method"] == "selfdraft:none"]
    assert plain and all(r["tau"] >= 1.0 for r in plain)
    assert report["trees"]["selfdraft:none"].startswith("prompt lookup alone (no heads)")
    assert set(report["verify_cost_seconds"]) == {"1", "2", "4"}
    assert report["trees"]["selfdraft:none:chain-2@int8"] == "chain of 2"
    assert set(report["trees"]) == {"selfdraft:none", "selfdraft:none:chain-2@int8"}
    # a method's @int8 overrides the bench's draft dtype: int8 weights computing in auto's dtype
    int8_label = report["dtypes"].pop("selfdraft:none:chain-2@int8")
    assert int8_label.endswith(" (int8 weights)"), int8_label
    assert report["dtypes"] == {"target": "float32", "selfdraft:none": "bfloat16"}
    for r in spec:  # every phase of a step is timed (only the leftover "other" may round to 0)
        timed = [r[f"{phase}_ms_per_step"] for phase in ("draft", "verify", "accept", "compact", "observe")]
        assert all(v > 0 for v in timed) and r["other_ms_per_step"] >= 0 and r["decode_ms_per_token"] > 0
    table = (out / "bench.md").read_text()
    main, _, phase_table = table.partition("Step phases")
    rows = [line for line in main.splitlines() if line.startswith("| ")]
    assert len(rows) == len(report["summary"]) + 1 and "bonus" in table  # header + one row each
    phase_rows = [line for line in phase_table.splitlines() if line.startswith("| ")]
    assert len(phase_rows) == len(spec) + len(plain) + 1 and all(line.endswith("x |") for line in phase_rows[1:])
    for name in ("verify_cost.png", "acceptance_by_depth.png", "speedup_by_tree_size.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_tree_text_names_the_tree_each_temperature_used():
    from types import SimpleNamespace

    from selfdraft.bench.run import tree_text

    def shape(text):
        return SimpleNamespace(describe=lambda: text)

    two = SimpleNamespace(tree=shape("dynamic (depth 5)"), sampling_tree=shape("chain of 1"))
    assert tree_text(two, [0.0]) == "dynamic (depth 5)"
    assert tree_text(two, [1.0]) == "chain of 1"
    assert tree_text(two, [0.0, 1.0]) == "dynamic (depth 5) at T = 0, chain of 1 at T > 0"
    one = SimpleNamespace(tree=shape("chain of 2"), sampling_tree=shape("chain of 2"))
    assert tree_text(one, [0.0, 1.0]) == "chain of 2"


def test_prompt_sets(tmp_path):
    import pytest

    from selfdraft.bench.prompts import load_prompt_set

    humaneval = load_prompt_set("humaneval:4")
    assert len(humaneval) == 4 and humaneval[0].id == "HumanEval/0" and not humaneval[0].chat
    assert [p.id for p in load_prompt_set("humaneval:2:skip=2")] == [p.id for p in humaneval[2:]]
    sharegpt = load_prompt_set("sharegpt:3")
    assert len(sharegpt) == 3 and all(p.chat and p.text for p in sharegpt)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_prompt_set(str(bad))
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompt_set("mmlu:3")
