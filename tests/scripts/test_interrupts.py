"""Ctrl-C in a multi-process command prints one line and leaves no process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfdraft.interrupts import was_interrupted

ROOT = Path(__file__).resolve().parents[2]


def test_an_error_raised_while_handling_ctrl_c_is_the_interruption():
    def cleanup_after(err: BaseException) -> BaseException:
        try:
            raise err
        except BaseException:
            try:
                raise TimeoutError("pool still busy")  # what datasets' pool cleanup raises
            except TimeoutError as cleanup:
                return cleanup

    assert was_interrupted(KeyboardInterrupt())
    assert was_interrupted(cleanup_after(KeyboardInterrupt()))
    assert not was_interrupted(cleanup_after(ValueError("a real bug")))
    assert not was_interrupted(TimeoutError("no Ctrl-C"))
    assert not was_interrupted(None)


def _read_until(proc: subprocess.Popen, marker: bytes, timeout: float) -> bytes:
    """What the process wrote to its (merged) output up to and including `marker`."""
    seen = b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout} s: {seen[-2000:]!r}"
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, f"the command ended before {marker!r}: {seen[-2000:]!r}"
        seen += chunk
    return seen


@pytest.mark.slow
def test_ctrl_c_during_a_two_process_render_is_one_line(tmp_path):
    """`selfdraft prepare --num-proc 2` on the recipe's ~31k records renders for tens of seconds in two
    `datasets` workers; SIGINT to the whole process group (a terminal's Ctrl-C) mid-render must end
    it with status 130, one line, no traceback from any process, and no worker left running."""
    cmd = [
        sys.executable,
        "-m",
        "selfdraft.scripts.cli",
        "prepare",
        "--config",
        str(ROOT / "configs" / "train" / "smollm2-135m.yaml"),
        "--output-dir",
        str(tmp_path / "run"),
        "--num-proc",
        "2",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, like a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # pytest may run us with it ignored
    )
    try:
        seen = _read_until(proc, b"render (num_proc=2)", timeout=300)
        time.sleep(3)  # well inside the render: both workers are tokenizing
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (seen + rest).decode(errors="replace")
    lines = [
        line for line in text.replace("\r", "\n").splitlines() if "examples/s" not in line and line.strip()
    ]
    assert proc.returncode == 130, lines[-30:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, lines[-30:]
    assert lines[-1] == "selfdraft prepare: interrupted"
    time.sleep(1)
    with pytest.raises(ProcessLookupError):  # no member of its process group survives
        os.killpg(proc.pid, 0)
    assert not (tmp_path / "run" / "data").exists()  # nothing half-built passes for the splits
