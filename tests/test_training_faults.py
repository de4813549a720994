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


def test_a_full_disk_is_named_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from selfdraft.errors import UserError

    usage = namedtuple("usage", "total used free")
    (tmp_path / "checkpoints").mkdir()
    calls = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5 * 10**6, 5 * 10**6))
    with pytest.raises(UserError, match=r"no space left on the device .* needs ~20 MB, 5 MB are free"):
        ckpt.save_with_space_check(lambda: calls.append(1), tmp_path, "step-0000002", 20 * 10**6)
    assert calls == []  # refused before writing anything

    def fills_the_disk():  # what torch.save says when the disk fills mid-write
        partial = tmp_path / "checkpoints" / "step-0000003"
        partial.mkdir()
        (partial / "mp_rank_00_model_states.pt").write_bytes(b"trunc")
        raise RuntimeError("unexpected pos 5 vs 64: basic_ios::clear: iostream error")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 0, 10**9))
    with pytest.raises(UserError, match="no space left"):
        ckpt.save_with_space_check(fills_the_disk, tmp_path, "step-0000003", 20 * 10**6)
    assert not (tmp_path / "checkpoints" / "step-0000003").exists()
    with pytest.raises(RuntimeError, match="other failure"):  # anything else is not disguised
        ckpt.save_with_space_check(lambda: (_ for _ in ()).throw(RuntimeError("other failure")), tmp_path, "t", 1)


def test_checkpoint_bytes_counts_every_parameter():
    heads = torch.nn.Linear(10, 10)  # 110 parameters
    assert ckpt.checkpoint_bytes(heads) == 110 * ckpt.CHECKPOINT_BYTES_PER_PARAM
