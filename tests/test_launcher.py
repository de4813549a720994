"""`selfdraft train` never leaves torchrun or its workers running after it dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (this test's unique run folder)."""
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


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_killing_the_launcher_stops_torchrun_and_workers(tmp_path, tiny_target_dir):
    rows = [{"id": str(i), "text": " ".join(f"word{j}" for j in range(i, i + 40))} for i in range(40)]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run-launcher-test"
    config = {
        "target": str(tiny_target_dir),
        "output_dir": str(run),
        "deepspeed": str(ROOT / "configs/deepspeed/zero1.json"),
        "heads": {"kind": "eagle", "draft_vocab_size": 256},
        "data": {"sources": [str(tmp_path / "texts.jsonl")], "max_length": 48, "heldout_fraction": 0.1},
        "train": {"max_steps": 100000, "micro_batch_size": 2, "lr": 0.001, "warmup_steps": 1},
        "schedule": {"save_every": 100000, "eval_every": 100000, "log_every": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
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
        workers = [p for p in processes_mentioning(str(path)) if p != launcher.pid]
        assert workers, "no torchrun / worker process found"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 30
        while time.time() < deadline and processes_mentioning(str(path)):
            time.sleep(0.5)
        assert processes_mentioning(str(path)) == []
    finally:
        for pid in processes_mentioning(str(path)):
            os.kill(pid, signal.SIGKILL)
