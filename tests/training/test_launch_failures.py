"""After a rank dies, `selfdraft train` shows one line with what happened and the command to resume:
torchrun's ChildFailedError report is kept back, the workers' own output (progress bars, a real bug's
traceback) still shows."""

from __future__ import annotations

import random

import pytest

from selfdraft.training.failures import Failure, TorchrunOutput, explain_failure

BAR = "train:   0%|          | 17/100000 [00:01<2:30:40, 11.06step/s, acc0=0.11, loss=5.592]"
# torchrun 2.x's stderr after `kill -9` of rank 1 of a 2-rank CPU run (recorded, paths shortened)
KILLED = (
    "\rtrain:   0%|          | 16/100000 [00:01<2:29:54, 11.12step/s, acc0=0.07, loss=5.597]"
    f"\r{BAR}selfdraft train (rank 0): another rank stopped; stopping too\n"
    "\rtrain:   0%|          | 18/100000 [00:01<3:00:01,  9.26step/s, acc0=0.11, loss=5.592]\n"
    "W1206 01:43:54.725000 25891 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process "
    "25903 closing signal SIGTERM\n"
    "E1206 01:43:54.896000 25891 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: "
    "-9) local_rank: 1 (pid: 25904) of binary: /venv/bin/python\n"
    "Traceback (most recent call last):\n"
    '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>\n'
    "    main()\n"
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent\n'
    "    raise ChildFailedError(\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    "=======================================================\n"
    "selfdraft.training.train FAILED\n"
    "-------------------------------------------------------\n"
    "Failures:\n"
    "[1]:\n"
    "  time      : 2026-12-06_01:43:54\n"
    "  host      : localhost\n"
    "  rank      : 0 (local_rank: 0)\n"
    "  exitcode  : -15 (pid: 25903)  (SIGTERM)\n"
    "  error_file: <N/A>\n"
    "  traceback : Signal 15 (SIGTERM) received by PID 25903\n"
    "-------------------------------------------------------\n"
    "Root Cause (first observed failure):\n"
    "[0]:\n"
    "  time      : 2026-12-06_01:43:54\n"
    "  host      : localhost\n"
    "  rank      : 1 (local_rank: 1)\n"
    "  exitcode  : -9 (pid: 25904)  (SIGKILL)\n"
    "  error_file: <N/A>\n"
    "  traceback : Signal 9 (SIGKILL) received by PID 25904\n"
    "=======================================================\n"
)
BUG = 'Traceback (most recent call last):\n  File "train.py", line 3, in main\n    boom()\nZeroDivisionError: x\n'


def _through(text: str, seed: int) -> tuple[str, TorchrunOutput]:
    """The filter fed in random chunks, as a pipe delivers them."""
    rng, out, at = random.Random(seed), TorchrunOutput(), 0
    shown = []
    while at < len(text):
        size = rng.randint(1, 40)
        shown.append(out.feed(text[at : at + size]))
        at += size
    shown.append(out.close())
    return "".join(shown), out


@pytest.mark.parametrize("seed", range(5))
def test_torchrun_report_is_kept_back_and_read(seed):
    shown, out = _through(KILLED, seed)
    assert "Traceback" not in shown and "ChildFailedError" not in shown and "=====" not in shown
    assert "closing signal" not in shown and "exitcode" not in shown
    assert BAR in shown and "another rank stopped" in shown  # the workers' own output stays
    assert out.failure == Failure(rank=1, exitcode=-9)  # the root cause, not the rank torchrun stopped


def test_a_workers_own_traceback_still_shows():
    shown, out = _through(BUG + KILLED.replace("exitcode  : -9", "exitcode  : 1"), seed=0)
    assert shown.startswith(BUG) and shown.count("Traceback") == 1
    assert out.failure == Failure(rank=1, exitcode=1)


def test_progress_shows_before_its_line_ends():
    out = TorchrunOutput()
    assert out.feed("\r" + BAR) == "\r" + BAR


def test_the_line_says_what_happened_and_how_to_resume():
    resume = "selfdraft train --config run.yaml --nproc 2 --resume"
    line = explain_failure(1, Failure(rank=1, exitcode=-9), False, "step-0000010", resume)
    assert line == (
        "selfdraft train: rank 1 was killed (SIGKILL); the last checkpoint is step-0000010; continue with: "
        + resume
    )
    fresh = explain_failure(1, Failure(0, 1), False, None, resume)
    assert fresh.endswith("no checkpoint was written yet; start it again with: " + resume.removesuffix(" --resume"))
    assert explain_failure(130, Failure(), True, "step-0000004", resume).startswith(
        "selfdraft train: training was interrupted;"
    )
    assert explain_failure(1, Failure(0, 2), False, None, resume) is None  # a user error, said already
    assert explain_failure(0, Failure(), False, "step-0000010", resume) is None


def test_resume_with_no_run_to_continue_is_one_line(tmp_path, capsys):
    from selfdraft.scripts import cli

    config = tmp_path / "run.yaml"
    config.write_text(f"target: smollm2-135m-instruct\noutput_dir: {tmp_path / 'empty'}\n")
    assert cli.main(["train", "--config", str(config), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no run to continue" in err and "drop --resume" in err, err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--nproc", "0"], "--nproc 0: pass a count of at least 1"),
        (["--nproc", "-1"], "--nproc -1: pass a count of at least 1"),
        (["--max-steps", "-1"], "--max-steps -1: pass a count"),
        (["--nnodes", "1", "--node-rank", "3"], "node ranks run from 0 to 0"),
    ],
)
def test_launch_flags_out_of_range_are_one_line(tmp_path, capsys, flags, words):
    from selfdraft.scripts import cli

    assert cli.main(["train", "--config", str(tmp_path / "no.yaml"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_torchruns_report_of_a_passed_on_signal_is_kept_back():
    """After the launcher passes a Ctrl-C on, torchrun stops its workers and dies of the SignalException
    it raised for it: that traceback only repeats the interruption the launcher then explains."""
    signalled = (
        "W1206 07:12:01.000000 2707 torch/distributed/elastic/agent/server/api.py:753] Received Signals.SIGINT "
        "death signal, shutting down workers\n"
        "Traceback (most recent call last):\n"
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86\n'
        "    raise SignalException(f\"Process {os.getpid()} got signal: {sigval}\", sigval=sigval)\n"
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 2707 got signal: 2\n"
    )
    shown, out = _through(BAR + "\n" + signalled, seed=0)
    assert shown == BAR + "\n"
    assert out.failure == Failure()
