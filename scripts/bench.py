"""`selfdraft bench`: side-by-side benchmark -> JSON, Markdown table and PNG plots."""

from __future__ import annotations

import argparse

from selfdraft.scripts.options import add_precision_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="bench YAML (configs/bench/default.yaml)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--prompts", nargs="+", default=None, help="sharegpt:N humaneval:N file.jsonl")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="baseline prompt-lookup assisted:DRAFT selfdraft:HEADS[:TREE], and where vLLM is installed "
        "vllm vllm:eagle3[:HEADS[:K]]",
    )
    parser.add_argument("--temperatures", nargs="+", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier report in --output-dir (other files stay)"
    )
    parser.add_argument(
        "--batch",
        nargs="+",
        type=int,
        default=None,
        dest="batch_sizes",
        help="batch sizes (e.g. 1 4 8 16): total tokens/s of batched selfdraft vs the target's batched generate",
    )
    add_precision_arguments(parser, with_defaults=False)


def load_bench_config(args: argparse.Namespace):
    from selfdraft.bench.run import BenchConfig
    from selfdraft.typed_config import build_dataclass, read_yaml

    raw = (read_yaml(args.config, "bench config") or {}) if args.config else {}
    for key in (
        "target",
        "prompts",
        "methods",
        "temperatures",
        "max_new_tokens",
        "repeats",
        "threads",
        "dtype",
        "draft_dtype",
        "output_dir",
        "batch_sizes",
    ):
        value = getattr(args, key)
        if value is not None:
            raw[key] = value
    return build_dataclass(BenchConfig, raw or {})


def run(args: argparse.Namespace) -> int:
    from selfdraft.bench.report import write_report
    from selfdraft.bench.run import run_bench
    from selfdraft.destinations import BENCH_REPORT_NAMES, check_destination

    config = load_bench_config(args)
    # before minutes of benchmarking: the folder's other files stay, an earlier report only with --overwrite
    check_destination(
        config.output_dir,
        overwrite=args.overwrite,
        owned=BENCH_REPORT_NAMES,
        option="--output-dir",
        shared_folder=True,
    )
    report = run_bench(config)
    paths = write_report(report, config.output_dir)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
