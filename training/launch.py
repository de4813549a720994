"""`selfdraft train`: the recipe read once, the data prepared once, then the training workers launched
under torchrun, each reading the resolved config (`resolved.py`) the launcher wrote."""

from __future__ import annotations

import codecs
import ctypes
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from selfdraft.errors import UserError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Launch:
    """What `selfdraft train` was asked: the recipe, the process shape and the command line's overrides."""

    config: str
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    resume: bool = False
    output_dir: str | None = None
    max_steps: int | None = None
    precision: str | None = None
    num_proc: int | None = None


def torchrun_command(launch: Launch, resolved: Path) -> list[str]:
    """torchrun running the worker on the resolved config (the worker takes no overrides: the launcher
    folded them into that file)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={launch.nproc}"]
    if launch.nnodes > 1:
        if not launch.rdzv_endpoint:
            raise UserError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
        cmd += [
            f"--nnodes={launch.nnodes}",
            f"--node_rank={launch.node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={launch.rdzv_endpoint}",
        ]
    else:
        cmd.append("--standalone")
    cmd += ["-m", "selfdraft.training.train", "--config", str(resolved)]
    return cmd + (["--resume"] if launch.resume else [])


def resume_command(launch: Launch) -> str:
    """The `selfdraft train` command that continues this run (same shape, `--resume`)."""
    cmd = ["selfdraft", "train", "--config", launch.config, "--nproc", str(launch.nproc)]
    if launch.nnodes > 1:
        cmd += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        cmd += ["--rdzv-endpoint", launch.rdzv_endpoint]
    for flag, value in (("--output-dir", launch.output_dir), ("--max-steps", launch.max_steps)):
        if value is not None:
            cmd += [flag, str(value)]
    if launch.precision:
        cmd += ["--precision", launch.precision]
    return shlex.join(cmd + ["--resume"])


def train(launch: Launch) -> int:
    """`selfdraft train`: read and check the recipe (the run's one parse), prepare the data and write
    the resolved config, run the workers; the exit status, a failure explained in one line."""
    from selfdraft.destinations import check_destination
    from selfdraft.training.checkpoint import check_resumable, latest_tag
    from selfdraft.training.config import check_paths, command_line_overrides, load_run_config
    from selfdraft.training.data.prepare import prepare_run
    from selfdraft.training.failures import USER_ERROR_EXIT, explain_failure

    overrides = command_line_overrides(launch.output_dir, launch.max_steps, launch.precision)
    config = load_run_config(launch.config, overrides)
    check_paths(config)  # every file the run reads, before any work
    output_dir = Path(config.output_dir)
    # a file there, or a folder that cannot be written, is named before the data is prepared
    check_destination(output_dir, overwrite=True, option="output_dir")
    if launch.resume:
        check_resumable(output_dir)  # before the data is prepared
    # Every node prepares before its ranks start, in parallel: with node-local storage each node needs
    # its own splits (and feature cache); on a shared filesystem the builders' locks make one node build
    # and the others reuse it. Preparing on node 0 alone would leave the other nodes waiting at the
    # rendezvous for as long as the preparation takes.
    resolved = prepare_run(
        config, launch.config, fill_cache=not config.data.partial_cache, num_proc=launch.num_proc
    )
    cmd = torchrun_command(launch, resolved)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    returncode, failure, stopped_by = run_torchrun(cmd)
    line = explain_failure(
        returncode, failure, stopped_by is not None, latest_tag(output_dir), resume_command(launch)
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


def run_torchrun(cmd: list[str]):
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
