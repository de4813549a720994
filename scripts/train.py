"""`selfdraft train`: prepare data once, then launch the training worker under torchrun."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys

from selfdraft.errors import UserError
from selfdraft.scripts.options import add_num_proc_argument

PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


def torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}"]
    if args.nnodes > 1:
        if not args.rdzv_endpoint:
            raise UserError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
        cmd += [
            f"--nnodes={args.nnodes}",
            f"--node_rank={args.node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={args.rdzv_endpoint}",
        ]
    else:
        cmd.append("--standalone")
    cmd += ["-m", "selfdraft.training.train", "--config", args.config]
    if args.resume:
        cmd.append("--resume")
    if args.output_dir:
        cmd += ["--output-dir", args.output_dir]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    if getattr(args, "precision", None):
        cmd += ["--precision", args.precision]
    return cmd


def run(args: argparse.Namespace) -> int:
    from selfdraft.scripts.prepare import prepare_from_config
    from selfdraft.training.config import load_run_config

    # Every node prepares before its ranks start, in parallel: with node-local storage each node needs
    # its own splits (and feature cache); on a shared filesystem the builders' locks make one node build
    # and the others reuse it. Preparing on node 0 alone would leave the other nodes waiting at the
    # rendezvous for as long as the preparation takes.
    config = load_run_config(args.config)
    prepare_from_config(
        args.config,
        args.output_dir,
        fill_cache=not config.data.partial_cache,
        precision=getattr(args, "precision", None),
        num_proc=getattr(args, "num_proc", None),
    )
    cmd = torchrun_command(args)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return launch(cmd)


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGTERM when the launcher dies, even by kill -9, and
    torchrun takes its workers down on SIGTERM. Elsewhere the signal handlers below must do."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(cmd: list[str]) -> int:
    """Run torchrun and never outlive it nor let it outlive us: signals are passed on, and a killed
    launcher takes torchrun (and so every worker) with it, so no orphan keeps writing the run folder."""
    child = subprocess.Popen(cmd, env=os.environ.copy(), preexec_fn=_die_with_parent)

    def forward(signum, frame):
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
