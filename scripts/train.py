"""`selfdraft train`: prepare data once, then launch the training worker under torchrun."""

from __future__ import annotations

import argparse
import codecs
import ctypes
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from selfdraft.errors import UserError
from selfdraft.scripts.options import add_num_proc_argument, check_counts

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


def _check_launch(args: argparse.Namespace) -> None:
    """The launch flags, before any work: counts >= 1 and a node rank inside the node count."""
    check_counts({"--nproc": args.nproc, "--nnodes": args.nnodes, "--max-steps": args.max_steps})
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(
            f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: node ranks run from 0 to {args.nnodes - 1}"
        )


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


def resume_command(args: argparse.Namespace) -> str:
    """The `selfdraft train` command that continues this run (same shape, `--resume`)."""
    cmd = ["selfdraft", "train", "--config", args.config, "--nproc", str(args.nproc)]
    if args.nnodes > 1:
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank)]
        cmd += ["--rdzv-endpoint", args.rdzv_endpoint]
    for flag, value in (("--output-dir", args.output_dir), ("--max-steps", args.max_steps)):
        if value is not None:
            cmd += [flag, str(value)]
    if getattr(args, "precision", None):
        cmd += ["--precision", args.precision]
    return shlex.join(cmd + ["--resume"])


def run(args: argparse.Namespace) -> int:
    from selfdraft.destinations import check_destination
    from selfdraft.scripts.prepare import prepare_from_config
    from selfdraft.training.checkpoint import check_resumable
    from selfdraft.training.config import check_paths, load_run_config

    # Every node prepares before its ranks start, in parallel: with node-local storage each node needs
    # its own splits (and feature cache); on a shared filesystem the builders' locks make one node build
    # and the others reuse it. Preparing on node 0 alone would leave the other nodes waiting at the
    # rendezvous for as long as the preparation takes.
    _check_launch(args)
    overrides = {"output_dir": args.output_dir} if args.output_dir else {}
    config = load_run_config(args.config, overrides)
    check_paths(config)  # every file the run reads, before any work
    output_dir = Path(config.output_dir)
    # a file there, or a folder that cannot be written, is named before the data is prepared
    check_destination(output_dir, overwrite=True, option="output_dir")
    if args.resume:
        check_resumable(output_dir)  # before the data is prepared
    prepare_from_config(
        args.config,
        args.output_dir,
        fill_cache=not config.data.partial_cache,
        precision=getattr(args, "precision", None),
        num_proc=getattr(args, "num_proc", None),
    )
    cmd = torchrun_command(args)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    returncode, failure, stopped_by = launch(cmd)
    from selfdraft.training.checkpoint import latest_tag
    from selfdraft.training.failures import USER_ERROR_EXIT, explain_failure

    line = explain_failure(
        returncode, failure, stopped_by is not None, latest_tag(Path(config.output_dir)), resume_command(args)
    )
    if line:
        print(line, file=sys.stderr, flush=True)
    if returncode and failure.exitcode == USER_ERROR_EXIT:
        return USER_ERROR_EXIT
    # the shell's convention for a job stopped by a signal (130 after Ctrl-C), whatever torchrun returned
    return 128 + stopped_by if returncode and stopped_by is not None else returncode


def _die_with_parent() -> None:
    """In the child, before exec: Linux sends it SIGTERM when the launcher dies, even by kill -9, and
    torchrun takes its workers down on SIGTERM. Elsewhere the signal handlers below must do."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(cmd: list[str]):
    """Run torchrun and never outlive it nor let it outlive us: signals are passed on, and a killed
    launcher takes torchrun (and so every worker) with it, so no orphan keeps writing the run folder.
    Its stderr (the workers' too) is shown as it comes, less torchrun's failure report and its
    report of the signal we passed on (`TorchrunOutput`). Returns (exit status, the failure torchrun
    reported, the signal that stopped us or None).

    torchrun runs in a session of its own (its workers each start one too), so a terminal's Ctrl-C
    reaches only this launcher and torchrun gets exactly one SIGINT, ours: a second one, landing while
    it shuts its workers down, cut that shutdown short with a traceback."""
    from selfdraft.training.failures import TorchrunOutput

    child = subprocess.Popen(
        cmd, env=os.environ.copy(), preexec_fn=_die_with_parent, start_new_session=True, stderr=subprocess.PIPE
    )
    stopped_by: int | None = None

    def forward(signum, frame):
        nonlocal stopped_by
        if stopped_by is not None:  # a second Ctrl-C would only cut torchrun's shutdown of its workers short
            return
        stopped_by = signum
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    output = TorchrunOutput()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        while chunk := _read(child.stderr.fileno()):
            sys.stderr.write(output.feed(decoder.decode(chunk)))
            sys.stderr.flush()
        sys.stderr.write(output.close())
        return child.wait(), output.failure, stopped_by
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read(fd: int) -> bytes:
    """The next chunk of a pipe (b"" at its end), retried when a forwarded signal interrupts it."""
    while True:
        try:
            return os.read(fd, 65536)
        except InterruptedError:
            continue
