"""MT-bench as a report set: its prompt sets, the two-turn mode, per-category rows, and the refusals."""

import json
from collections import Counter

import pytest
import torch

from selfdraft.bench.prompts import load_prompt_set
from selfdraft.bench.run import BenchConfig, run_bench
from selfdraft.corpora.mtbench import mtbench_questions, refuse_for_selection, refuse_mtbench_texts
from selfdraft.errors import UserError
from selfdraft.scripts import cli


def test_mtbench_first_turns_and_both_turns():
    first = load_prompt_set("mtbench")
    assert len(first) == 80 and all(p.chat and not p.history for p in first)
    assert Counter(p.category for p in first) == {c: 10 for c in Counter(p.category for p in first)}
    assert len(Counter(p.category for p in first)) == 8
    # skip and the limit count whole questions, for both modes
    assert [p.id for p in load_prompt_set("mtbench:2:skip=3")] == ["mtbench:84", "mtbench:85"]
    both = load_prompt_set("mtbench-2turn:2:skip=3")
    assert [p.id for p in both] == ["mtbench:84:1", "mtbench:84:2", "mtbench:85:1", "mtbench:85:2"]
    q84 = next(q for q in mtbench_questions() if q["question_id"] == 84)
    assert both[1].history == (q84["turns"][0],) and both[1].text == q84["turns"][1]
    assert both[1].turn == 2 and both[0].turn == 1 and both[0].text == q84["turns"][0]


def test_selection_steps_refuse_mtbench(tmp_path, capsys):
    for spec in ("mtbench", "mtbench:10", "MTBench-2turn:4:skip=2"):
        with pytest.raises(UserError, match="report set only"):
            refuse_for_selection(spec, "selfdraft tune")
    refuse_for_selection("sharegpt:16:skip=40", "selfdraft tune")  # a selection set passes
    # the CLI refuses before loading anything: one line, exit 2
    assert cli.main(["tune", "--heads", str(tmp_path), "--prompts", "mtbench:8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report set only" in err[0]
    # a prompt file carrying an MT-bench question is refused too
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "Hi, how are you?"}, {"prompt": mtbench_questions()[5]["turns"][0]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match="repeat MT-bench"):
        refuse_mtbench_texts([p.text for p in load_prompt_set(str(prompts))], "selfdraft tune")
    refuse_mtbench_texts(["Hi, how are you?"], "selfdraft tune")
    # publish: a bench whose MT-bench prompts "chose" the heads is refused as a selection bench
    from selfdraft.training.release.publish import publish

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"prompt_sets": {"sharegpt:8": [], "mtbench": []}}))
    with pytest.raises(UserError, match="report set only"):
        publish(tmp_path, tmp_path / "out", target="t", config_path="c.yaml", selection_benches=[(bench, "x")])


def test_two_turn_bench_asks_turn_two_after_the_targets_own_answer(tmp_path, tiny_target_dir):
    config = BenchConfig(
        target=str(tiny_target_dir),
        prompts=["mtbench-2turn:2:skip=10", "mtbench:1:skip=20"],
        methods=["baseline", "selfdraft:none:chain-2"],
        temperatures=[0.0],
        max_new_tokens=12,
        threads=1,
        verify_curve=[1, 2],
        output_dir=str(tmp_path),
    )
    report = run_bench(config)
    from selfdraft.bench.report import markdown_table, write_report

    q = mtbench_questions()[10]
    # per category and per turn rows, speculative methods greedy-identical on both turns
    groups = {r["prompts"] for r in report["group_summary"]}
    cat = q["category"]
    assert {f"mtbench-2turn:2:skip=10 / {cat}", "mtbench-2turn:2:skip=10 / turn 1",
            "mtbench-2turn:2:skip=10 / turn 2", f"mtbench:1:skip=20 / {mtbench_questions()[20]['category']}"} <= groups
    turn2_rows = [r for r in report["group_summary"] if r["prompts"].endswith("turn 2")]
    assert all(r["n"] == 2 for r in turn2_rows)
    assert all(r["identical_to_baseline"] for r in report["group_summary"] if r["method"] != "baseline")
    assert "By category" in markdown_table(report)
    paths = write_report(report, tmp_path)
    assert paths["by_category_mtbench-2turn_2_skip_10"].read_bytes()[:4] == b"\x89PNG"


def test_turn_two_follows_the_targets_own_turn_one_answer():
    """On the real target (a random tiny one answers with blank lines): turn 2's prompt is turn 1, the
    target's own greedy answer to it, then turn 2, all in the chat template."""
    from selfdraft.bench.run import Runner

    runner = Runner(BenchConfig(methods=["baseline"], max_new_tokens=12))
    tok, target = runner.tokenizer, runner.target
    q = mtbench_questions()[10]
    first = [{"role": "user", "content": q["turns"][0]}]

    def template(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, return_tensors="pt", add_special_tokens=False).input_ids

    ids = template(first)
    with torch.no_grad():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert len(answer.split()) >= 3
    messages = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]
    turn2 = load_prompt_set("mtbench-2turn:1:skip=10")[1]
    assert runner.ids(turn2).tolist() == template(messages).tolist()
