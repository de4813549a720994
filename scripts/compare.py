"""`selfdraft compare`: training runs side by side on their held-out evaluation (a table and a plot)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "configs",
        nargs="+",
        help="run configs whose runs (their output_dir) to compare; the first is the reference. A run that "
        "kept snapshots (schedule.snapshot_tokens) gives one row per snapshot",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="folder for compare.md and compare.png, plus scaling.png when the runs trained on different "
        "data sizes (data.train_tokens, or snapshots along one run) (default: print only)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier comparison in --out (other files stay)"
    )


def run(args: argparse.Namespace) -> int:
    from selfdraft.destinations import COMPARE_REPORT_NAMES, check_destination
    from selfdraft.training.release.comparison import (
        comparison_markdown,
        plot_comparison,
        plot_scaling,
        read_run,
        read_snapshots,
        shows_scaling,
    )

    if args.out:
        check_destination(
            args.out, overwrite=args.overwrite, owned=COMPARE_REPORT_NAMES, option="--out", shared_folder=True
        )
    rows = [row for c in args.configs for row in (read_snapshots(c) or [read_run(c)])]
    table = comparison_markdown(rows)
    print(table, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(table)
        wrote = [out / "compare.md", plot_comparison(rows, out / "compare.png")]
        if shows_scaling(rows):
            wrote.append(plot_scaling(rows, out / "scaling.png"))
        print("wrote " + ", ".join(map(str, wrote)))
    return 0
