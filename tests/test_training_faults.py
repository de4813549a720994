"""Training faults lose nothing: a diverged run stops before it overwrites good weights, and a run
folder has one live writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from selfdraft.training import checkpoint as ckpt

ROOT = Path(__file__).resolve().parent.parent


def write_run(tmp_path: Path, target: Path, lr: float, steps: int) -> Path:
    rows = [{"id": str(i), "text": " ".join(f"w{(i * 7 + j) % 50}" for j in range(40))} for i in range(30)]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "target": str(target),
        "output_dir": str(tmp_path / "run"),
        "deepspeed": str(ROOT / "configs/deepspeed/zero1.json"),
        "heads": {"kind": "eagle", "draft_vocab_size": 256},
        "data": {"sources": [str(tmp_path / "texts.jsonl")], "max_length": 40, "heldout_fraction": 0.1},
        "train": {"max_steps": steps, "micro_batch_size": 2, "lr": lr, "warmup_steps": 0, "precision": "fp32"},
        "schedule": {"save_every": 1, "eval_every": 1000, "log_every": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "selfdraft.training.train", "--config", str(config), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_non_finite_loss_stops_the_run_naming_the_last_good_checkpoint(tmp_path):
    """check_finite runs before backward/step on every micro-batch, so a NaN or inf loss never reaches
    the weights, a checkpoint or heads/; the error names what is kept and what to change."""
    from selfdraft.training.train import DivergedError, check_finite

    (tmp_path / "checkpoints" / "step-0000040").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step-0000040")  # as DeepSpeed writes it
    check_finite(torch.tensor(2.5), 41, tmp_path, "cpu", 1)  # a finite loss passes
    for bad in (float("nan"), float("inf")):
        with pytest.raises(DivergedError, match=r"diverged at step 41.*step-0000040.*lower train.lr"):
            check_finite(torch.tensor(bad), 41, tmp_path, "cpu", 1)
    with pytest.raises(DivergedError, match="nothing was saved"):
        check_finite(torch.tensor(float("nan")), 1, tmp_path / "fresh", "cpu", 1)


def test_second_live_writer_is_refused(tmp_path):
    code = (
        "import sys; from pathlib import Path; from selfdraft.training import checkpoint as c\n"
        "try:\n    c.hold_run_lock(Path(sys.argv[1]))\nexcept Exception as e:\n    print(e); sys.exit(3)"
    )
    held = ckpt.hold_run_lock(tmp_path)
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
        assert proc.returncode == 3, proc.stderr
        assert "is being written by pid" in proc.stdout and str(os.getpid()) in proc.stdout
    finally:
        held.close()
    # the lock goes with its holder: now a new writer gets it
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == 0
