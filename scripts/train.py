"""`selfdraft train`: prepare data once, then launch the training worker under torchrun
(`selfdraft.training.launch`)."""

from __future__ import annotations

import argparse

from selfdraft.errors import UserError
from selfdraft.scripts.options import add_num_proc_argument, check_counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--nproc", type=int, default=1, help="processes per node (GPUs, or CPU ranks)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 for multi-node runs")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default=None,
        help="override train.precision (auto: bf16 on CUDA and on CPUs with native bf16, else fp32)",
    )
    add_num_proc_argument(parser)


def _check_launch(args: argparse.Namespace) -> None:
    """The launch flags, before any work: counts >= 1 and a node rank inside the node count."""
    check_counts({"--nproc": args.nproc, "--nnodes": args.nnodes, "--max-steps": args.max_steps})
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(
            f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: node ranks run from 0 to {args.nnodes - 1}"
        )


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from selfdraft.training.launch import Launch, train

    _check_launch(args)
    return train(Launch(**{f.name: getattr(args, f.name) for f in fields(Launch)}))
