"""`selfdraft prepare`: render the data splits, write the resolved run config and fill the feature cache
of a run (resumable)."""

from __future__ import annotations

import argparse

from selfdraft.scripts.options import add_device_argument, add_num_proc_argument, check_counts, resolve_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    parser.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default=None, help="override train.precision"
    )
    add_num_proc_argument(parser)
    add_device_argument(parser)


def run(args: argparse.Namespace) -> int:
    from selfdraft.training.config import command_line_overrides
    from selfdraft.training.data.prepare import prepare_from_config

    check_counts({"--batch-size": args.batch_size, "--num-proc": args.num_proc})
    prepare_from_config(
        args.config,
        command_line_overrides(output_dir=args.output_dir, precision=args.precision),
        batch_size=args.batch_size,
        device=resolve_device(args.device),
        num_proc=args.num_proc,
    )
    return 0
