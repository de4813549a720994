"""Training runs side by side on their held-out evaluation (ablations: one setting changed per run).

Each run is named by its config; the row holds the settings an ablation changes (head layout, fused
target layers, training-time-test steps, draft vocabulary, data) and the run's last held-out evaluation:
top-1 agreement with the target by draft depth and the simulated chain tau. Runs compare only when they
evaluated the same held-out sequences, which the same `data:` section and `eval_examples` guarantee; the
table says when they differ.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow.compute as pc

from selfdraft.errors import UserError
from selfdraft.training.config import load_run_config
from selfdraft.training.data.prepare import DATA_DIR
from selfdraft.training.release.publish import run_summary


@dataclass(frozen=True)
class RunRow:
    name: str
    layout: str
    feature_layers: list[int] | None
    ttt_steps: int
    draft_vocab_size: int | None
    steps: int
    train_minutes: float
    top1_by_depth: list[float]
    simulated_tau_chain: float
    data_key: str  # the data section and eval size: rows with different keys saw different held-out text
    # tokens in the run's training split (None: its split is gone); for a snapshot, the tokens fed by then
    train_tokens: int | None = None
    snapshot: bool = False  # heads kept along a run (schedule.snapshot_tokens), not its last evaluation


def train_split_tokens(run_dir: Path) -> int | None:
    """Tokens in the training split a run prepared (output_dir/data/train), or None without one."""
    folder = run_dir / DATA_DIR / "train"
    if not any(folder.glob("*.arrow")):
        return None
    table = datasets.load_from_disk(str(folder)).data.column("input_ids")
    return int(pc.sum(pc.list_value_length(table)).as_py() or 0)


def read_run(config_path: str | Path) -> RunRow:
    """The row of the run that `config_path` trains (its output_dir), from its log.jsonl."""
    config = load_run_config(config_path)
    run_dir = Path(config.output_dir)
    if not (run_dir / "log.jsonl").is_file():
        raise UserError(
            f"{config_path}: no training log in {run_dir}; train it first "
            f"(selfdraft train --config {config_path}) or drop it from the comparison"
        )
    summary = run_summary(run_dir)
    evaluation = summary["last_eval"]
    if evaluation is None:
        raise UserError(
            f"{config_path}: run {run_dir} has no held-out evaluation yet; set schedule.eval_every to at "
            "most train.max_steps and finish the run (selfdraft train --resume)"
        )
    row = _row(config, Path(config_path).stem, summary["steps"], summary["train_seconds"] / 60, evaluation)
    return dataclasses.replace(row, train_tokens=train_split_tokens(run_dir))


def _row(config, name: str, steps: int, minutes: float, evaluation: dict) -> RunRow:
    # a token budget changes only the training rows (`data.train_tokens`): the held-out text is the same
    data = dataclasses.asdict(config.data) | {"eval_examples": config.schedule.eval_examples}
    data.pop("train_tokens")
    return RunRow(
        name=name,
        layout=config.heads.layout,
        feature_layers=config.heads.feature_layers,
        ttt_steps=config.train.ttt_steps,
        draft_vocab_size=config.heads.draft_vocab_size,
        steps=steps,
        train_minutes=minutes,
        top1_by_depth=list(evaluation["eval_top1_by_depth"]),
        simulated_tau_chain=float(evaluation["eval_simulated_tau_chain"]),
        data_key=json.dumps(data, sort_keys=True),
    )


def read_snapshots(config_path: str | Path) -> list[RunRow]:
    """One row per heads snapshot of the run that `config_path` trains (`schedule.snapshot_tokens`),
    scored by training when it kept them; train_tokens is what the run had fed by then (distinct data
    while the run is within its first epoch). Empty when the run kept none."""
    config = load_run_config(config_path)
    path = Path(config.output_dir) / "log.jsonl"
    log = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows, seen = [], set()
    for r in log:
        # a resumed run replays the steps after its last checkpoint and keeps their snapshots again
        if r.get("event") != "snapshot" or "eval_top1_by_depth" not in r or r["path"] in seen:
            continue
        seen.add(r["path"])
        name = f"{Path(config_path).stem}@{Path(r['path']).name}"
        row = _row(config, name, r["step"], train_minutes_until(log, r["time"]), r)
        rows.append(dataclasses.replace(row, train_tokens=r["tokens_fed"], snapshot=True))
    return rows


def train_minutes_until(log: list[dict], when: float) -> float:
    """Wall minutes a run's log spent training up to time `when`: each session (start or resume) counts
    from its start to its last row at or before `when`."""
    total, start, last = 0.0, None, None
    for r in log:
        if r["time"] > when:
            break
        if r.get("event") in ("start", "resume"):
            total += (last - start) if start is not None else 0.0
            start = r["time"]
        last = r["time"]
    total += (last - start) if start is not None else 0.0
    return total / 60


def comparison_markdown(rows: list[RunRow]) -> str:
    """A table, one row per run, with the top-1 difference to the first row at each depth."""
    depths = max(len(r.top1_by_depth) for r in rows)
    head = ["run", "layout", "layers", "ttt", "vocab", "train tokens", "steps", "min"]
    head += [f"top-1 d{d + 1}" for d in range(depths)] + ["sim. tau"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = rows[0]
    for r in rows:
        cells = [r.name, r.layout, str(r.feature_layers), str(r.ttt_steps), str(r.draft_vocab_size)]
        cells.append("-" if r.train_tokens is None else f"{r.train_tokens:,}")
        cells += [str(r.steps), f"{r.train_minutes:.1f}"]
        for d in range(depths):
            if d >= len(r.top1_by_depth):
                cells.append("-")
                continue
            delta = ""
            if r is not first and d < len(first.top1_by_depth):
                delta = f" ({r.top1_by_depth[d] - first.top1_by_depth[d]:+.3f})"
            cells.append(f"{r.top1_by_depth[d]:.3f}{delta}")
        cells.append(f"{r.simulated_tau_chain:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    if len({r.data_key for r in rows}) > 1:
        lines.append("")
        lines.append("Not comparable as they stand: the runs differ in `data:` or `eval_examples`, so they were")
        lines.append("evaluated on different held-out sequences.")
    return "\n".join(lines) + "\n"


def plot_comparison(rows: list[RunRow], path: Path) -> Path:
    """Held-out top-1 by draft depth, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(range(1, len(r.top1_by_depth) + 1), r.top1_by_depth, marker="o", label=r.name)
    ax.set(xlabel="draft depth", ylabel="held-out top-1 agreement", title="Training runs compared")
    ax.set_xticks(range(1, max((len(r.top1_by_depth) for r in rows), default=1) + 1))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def shows_scaling(rows: list[RunRow]) -> bool:
    """Whether the runs trained on at least two known data sizes (a data-size study)."""
    sizes = {r.train_tokens for r in rows}
    return None not in sizes and len(sizes) > 1


def token_count_label(n: int) -> str:
    """A token count to two significant digits: 22,703 -> '23k', 500,507 -> '500k', 1,369,222 -> '1.4M'."""
    rounded = round(n, 2 - len(str(n))) if n >= 100 else n
    if rounded >= 1_000_000:
        return f"{rounded / 1e6:g}M"
    if rounded >= 1_000:
        return f"{rounded / 1e3:g}k"
    return str(rounded)


def plot_scaling(rows: list[RunRow], path: Path) -> Path:
    """Held-out top-1 against training tokens (log scale), one line per draft depth: runs on data budgets
    (`data.train_tokens`) or snapshots along one pass (`read_snapshots`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    ordered = sorted(rows, key=lambda r: r.train_tokens)
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in range(max(len(r.top1_by_depth) for r in rows)):
        points = [(r.train_tokens, r.top1_by_depth[d]) for r in ordered if d < len(r.top1_by_depth)]
        ax.plot(*zip(*points, strict=True), marker="o", label=f"depth {d + 1}")
    ax.set_xscale("log")
    # Log-scale minor labels collide at these spans; label the measured sizes themselves.
    sizes = sorted({r.train_tokens for r in rows})
    ax.set_xticks(sizes, [token_count_label(n) for n in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    if all(r.snapshot for r in rows):
        xlabel, title = "tokens fed, each seen once", "Data size along one pass (flat lr)"
    else:
        steps = sorted({r.steps for r in rows})
        xlabel, title = "tokens in the training split", f"Data size, {'/'.join(map(str, steps))} steps each"
    ax.set(xlabel=xlabel, ylabel="held-out top-1 agreement", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
