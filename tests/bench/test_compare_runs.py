"""`selfdraft compare`: training runs side by side on their held-out evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfdraft.errors import UserError
from selfdraft.scripts.cli import main
from selfdraft.training.release.comparison import comparison_markdown, read_run, token_count_label


def _run(tmp_path: Path, name: str, extra: str, top1: list[float] | None, minutes: float = 2.0) -> Path:
    """A config and the log of the run it trained (no heads: the comparison reads only the log)."""
    run = tmp_path / "runs" / name
    run.mkdir(parents=True)
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"target: x\noutput_dir: {run}\ndata:\n  sources: [data.jsonl]\n  max_length: 128\n"
        f"schedule:\n  eval_examples: 8\n{extra}"
        # target x has no config to read: runs without heads settings use the layout that needs none
        + ("" if "heads:" in extra else "heads:\n  layout: selfdraft\n")
    )
    (run / "run.json").write_text(json.dumps({"fingerprint": "x", "world_size": 1, "precision": "bfloat16"}))
    log = [{"step": 0, "event": "start", "examples": 40}]
    if top1 is not None:
        log.append(
            {"step": 30, "eval_loss": 2.0, "eval_top1_by_depth": top1, "eval_simulated_tau_chain": 1 + sum(top1)}
        )
    log.append({"step": 30, "event": "done", "train_seconds": 60 * minutes})
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    return config


def test_compare_reads_each_runs_settings_and_last_evaluation(tmp_path, capsys):
    ref = _run(tmp_path, "ref", "train:\n  ttt_steps: 2\n", [0.5, 0.4, 0.3])
    fused = _run(
        tmp_path,
        "fused",
        "heads:\n  layout: eagle3\n  draft_vocab_size: 64\n  feature_layers: [2, 4, 6]\ntrain:\n  ttt_steps: 4\n",
        [0.55, 0.38, 0.33],
        minutes=3.0,
    )
    rows = [read_run(ref), read_run(fused)]
    assert rows[1].layout == "eagle3" and rows[1].feature_layers == [2, 4, 6]
    assert rows[1].ttt_steps == 4 and rows[1].draft_vocab_size == 64
    assert rows[1].steps == 30 and rows[1].train_minutes == pytest.approx(3.0)
    table = comparison_markdown(rows)
    fused_line = next(line for line in table.splitlines() if line.startswith("| fused"))
    # differences are to the first (reference) run, depth by depth
    assert "0.550 (+0.050)" in fused_line and "0.380 (-0.020)" in fused_line and "0.330 (+0.030)" in fused_line
    assert "Not comparable" not in table

    out = tmp_path / "report"
    assert main(["compare", str(ref), str(fused), "--out", str(out)]) == 0
    assert (out / "compare.md").read_text() == table
    assert (out / "compare.png").stat().st_size > 0
    assert "| ref |" in capsys.readouterr().out


def test_compare_flags_runs_evaluated_on_other_data_and_refuses_runs_without_evaluation(tmp_path, capsys):
    ref = _run(tmp_path, "ref", "", [0.5, 0.4])
    other = _run(tmp_path, "other", "", [0.6, 0.5])
    text = other.read_text().replace("max_length: 128", "max_length: 256")
    other.write_text(text)
    assert "Not comparable" in comparison_markdown([read_run(ref), read_run(other)])

    unevaluated = _run(tmp_path, "noeval", "", None)
    with pytest.raises(UserError, match="no held-out evaluation"):
        read_run(unevaluated)
    untrained = tmp_path / "untrained.yaml"
    untrained.write_text(f"target: x\noutput_dir: {tmp_path / 'nowhere'}\nheads:\n  layout: selfdraft\n")
    assert main(["compare", str(ref), str(untrained)]) != 0
    err = capsys.readouterr().err
    assert "train it first" in err and "Traceback" not in err


def test_data_size_runs_compare_and_plot_a_scaling_curve(tmp_path, capsys):
    """Runs that differ only in `data.train_tokens` evaluated the same held-out text: comparable, with
    each run's training-split size in the table and a scaling plot beside it."""
    from selfdraft.training.data.dataset import rows_to_dataset

    runs = []
    for name, rows, top1 in (("small", 3, [0.2, 0.1]), ("big", 9, [0.4, 0.3])):
        config = _run(tmp_path, name, "", top1)
        if name == "small":  # a budget of 15 tokens: its split holds 3 rows of 5
            config.write_text(config.read_text().replace("data:\n", "data:\n  train_tokens: 15\n"))
        split = [{"id": str(i), "input_ids": [1] * 5, "loss_mask": [1] * 5} for i in range(rows)]
        rows_to_dataset(split).save_to_disk(str(tmp_path / "runs" / name / "data" / "train"))
        runs.append(config)
    rows = [read_run(c) for c in runs]
    assert [r.train_tokens for r in rows] == [15, 45]
    table = comparison_markdown(rows)
    assert "Not comparable" not in table and "| 15 |" in table and "| 45 |" in table
    out = tmp_path / "report"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    assert (out / "scaling.png").stat().st_size > 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("tokens", "label"),
    [(22_703, "23k"), (500_507, "500k"), (1_001_887, "1M"), (1_369_222, "1.4M"), (10_512_345, "11M"), (64, "64")],
)
def test_scaling_axis_labels_the_token_counts_to_two_digits(tokens, label):
    assert token_count_label(tokens) == label


def test_snapshots_along_one_run_give_the_data_size_rows(tmp_path, capsys):
    """A run that kept snapshots (schedule.snapshot_tokens) is one row per snapshot: its tokens fed,
    the scores training logged with it, and the minutes trained by then over every session; a snapshot
    that a resumed run kept again counts once."""
    from selfdraft.training.release.comparison import read_snapshots

    config = _run(tmp_path, "pass", "", [0.6, 0.5])
    run = tmp_path / "runs" / "pass"

    def snap(step, n, fed, top1, time):
        path = str(run / "snapshots" / f"tokens-{n}")
        scores = {"eval_top1_by_depth": top1, "eval_simulated_tau_chain": 1 + sum(top1)}
        return {"step": step, "event": "snapshot", "path": path, "tokens_fed": fed, **scores, "time": time}

    log = [
        {"step": 0, "event": "start", "time": 0.0},
        snap(10, 1000, 1020, [0.3, 0.2], 120.0),
        {"step": 20, "event": "checkpoint", "time": 300.0},
        {"step": 25, "loss": 3.0, "time": 360.0},  # killed here; the resume replays steps 21-25
        {"step": 20, "event": "resume", "time": 1000.0},
        snap(22, 3000, 3050, [0.4, 0.3], 1060.0),
        snap(22, 3000, 3050, [0.4, 0.3], 1060.0),
        snap(40, 10000, 10010, [0.5, 0.45], 1600.0),
    ]
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    rows = read_snapshots(config)
    assert [(r.name, r.steps, r.train_tokens) for r in rows] == [
        ("pass@tokens-1000", 10, 1020),
        ("pass@tokens-3000", 22, 3050),
        ("pass@tokens-10000", 40, 10010),
    ]
    assert [r.top1_by_depth for r in rows] == [[0.3, 0.2], [0.4, 0.3], [0.5, 0.45]]
    assert [r.train_minutes for r in rows] == pytest.approx([2.0, 7.0, 16.0])  # 6 min before the kill
    assert all(r.snapshot for r in rows) and read_snapshots(_run(tmp_path, "plain", "", [0.1])) == []

    out = tmp_path / "report"
    assert main(["compare", str(config), "--out", str(out)]) == 0
    table = (out / "compare.md").read_text()
    assert "| pass@tokens-3000 |" in table and "| 10,010 |" in table and "| pass |" not in table
    assert (out / "scaling.png").stat().st_size > 0
    capsys.readouterr()
