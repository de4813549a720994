"""`selfdraft train` never leaves torchrun or its workers running after it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (this test's unique tmp folder: it holds the recipe the
    launcher reads and the run folder whose resolved.yaml torchrun and the workers read)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def survivors(text: str, wait: float = 30.0) -> list[int]:
    """`processes_mentioning(text)` once they are gone, or after `wait` seconds."""
    deadline = time.time() + wait
    while time.time() < deadline and processes_mentioning(text):
        time.sleep(0.5)
    return processes_mentioning(text)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_killing_the_launcher_stops_torchrun_and_workers(tmp_path, text_run):
    path = text_run(train={"max_steps": 100000}, schedule={"save_every": 100000, "eval_every": 100000})
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "selfdraft.scripts.cli", "train", "--config", str(path), "--nproc", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        log = run / "log.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (log.is_file() and '"step"' in log.read_text()):
            time.sleep(0.5)
        assert log.is_file(), "training never started"
        workers = [p for p in processes_mentioning(str(tmp_path)) if p != launcher.pid]
        assert workers, "no torchrun / worker process found"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert survivors(str(tmp_path)) == []
    finally:
        for pid in processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def _rank_pids(marker: str, rank: str) -> list[int]:
    """Worker pids of this test's run with RANK=`rank` in their environment."""
    found = []
    for pid in processes_mentioning(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + rank.encode() in env:
            found.append(pid)
    return found


def _two_ranks_past_a_checkpoint(tmp_path, text_run, **popen) -> tuple[Path, subprocess.Popen]:
    """`selfdraft train --nproc 2` of an endless run, once its first checkpoint is written: (its
    config, the launcher with stderr piped as text)."""
    path = text_run(train={"max_steps": 100000}, schedule={"save_every": 3, "eval_every": 100000})
    latest = tmp_path / "run" / "checkpoints" / "latest"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "selfdraft.scripts.cli", "train", "--config", str(path), "--nproc", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    deadline = time.time() + 180
    while time.time() < deadline and not latest.is_file() and launcher.poll() is None:
        time.sleep(0.5)
    if not latest.is_file():
        for pid in processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
        pytest.fail("no checkpoint was written")
    return path, launcher


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_rank_ends_in_one_line_with_the_resume_command(tmp_path, text_run):
    """kill -9 of rank 1 mid-run: no gloo traceback, no ChildFailedError report; the launcher's last
    line names the rank, the signal, the last checkpoint and the exact command to continue."""
    path, launcher = _two_ranks_past_a_checkpoint(tmp_path, text_run)
    try:
        victims = _rank_pids(str(tmp_path), "1")
        assert victims, "rank 1 not found"
        os.kill(victims[0], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        for pid in processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    assert launcher.returncode != 0
    assert "Traceback" not in err and "ChildFailedError" not in err and "Connection reset" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("selfdraft train: rank 1 was killed (SIGKILL); the last checkpoint is step-"), last
    assert last.endswith(f"continue with: selfdraft train --config {path} --nproc 2 --resume"), last


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_ends_in_one_line_with_the_resume_command(tmp_path, text_run):
    """A terminal's Ctrl-C reaches the whole foreground process group: the launcher, torchrun and both
    ranks at once. The run stops with status 130, no traceback from any of them (torchrun's
    SignalException, a rank's KeyboardInterrupt), the last line saying how to continue, no process left."""
    path, launcher = _two_ranks_past_a_checkpoint(
        tmp_path,
        text_run,
        start_new_session=True,  # its own process group, like a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background job inherits it ignored
    )
    try:
        # the terminal's SIGINT must reach torchrun only through the launcher: once, not twice (the
        # second cut torchrun's shutdown of its workers short with a traceback)
        ours = processes_mentioning(str(tmp_path))
        torchrun = [p for p in processes_mentioning("torch.distributed.run") if p in ours]
        assert torchrun and all(os.getsid(p) != os.getsid(launcher.pid) for p in torchrun)
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
        assert survivors(str(tmp_path)) == []
    finally:
        for pid in processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 130, err[-3000:]
    for noise in ("Traceback", "SignalException", "KeyboardInterrupt", "ChildFailedError"):
        assert noise not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("selfdraft train: training was interrupted; the last checkpoint is step-"), last
    assert last.endswith(f"continue with: selfdraft train --config {path} --nproc 2 --resume"), last
