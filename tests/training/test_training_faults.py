"""Training faults lose nothing: a diverged run stops before it overwrites good weights, and a run
folder has one live writer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from selfdraft.training import checkpoint as ckpt
from selfdraft.training.data.prepare import prepare_from_config

ROOT = Path(__file__).resolve().parents[2]


def test_non_finite_loss_stops_the_run_naming_the_last_good_checkpoint(tmp_path):
    """check_finite runs before backward/step on every micro-batch, so a NaN or inf loss never reaches
    the weights, a checkpoint or heads/; the error names what is kept and what to change."""
    from selfdraft.training.train import DivergedError, check_finite

    (tmp_path / "checkpoints" / "step-0000040").mkdir(parents=True)
    torch.save({}, tmp_path / "checkpoints" / "step-0000040" / "mp_rank_00_model_states.pt")  # a whole save
    (tmp_path / "checkpoints" / "latest").write_text("step-0000040")
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


@pytest.mark.slow
def test_two_rank_zero3_run_is_killed_and_resumes(tmp_path, text_run):
    """ZeRO-3 with 2 ranks: collective evaluation and saving run, a kill -9 of the whole job loses at
    most one checkpoint interval, and the resumed job finishes without skipping or repeating a step."""
    steps = 24
    path = text_run(
        stage=3,
        train={"max_steps": steps},
        schedule={"save_every": 3, "eval_every": 3, "eval_examples": 4},
    )
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "selfdraft.training.train", "--config", str(prepare_from_config(path))]  # fmt: skip

    def log() -> list[dict]:
        file = run / "log.jsonl"
        return [json.loads(x) for x in file.read_text().splitlines()] if file.is_file() else []

    proc = subprocess.Popen(job, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        saved = [r["step"] for r in log() if r.get("event") == "checkpoint"]
        if saved and saved[-1] >= 6:
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    logged = [r["step"] for r in log() if "loss" in r]
    assert logged[-1] < steps, "the job finished before it could be killed"
    assert any("eval_loss" in r for r in log())  # evaluation ran on both ranks without a hang

    resumed = subprocess.run(job + ["--resume"], env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = log()
    resume = next(r for r in records if r.get("event") == "resume")
    assert resume["step"] >= 6 and logged[-1] - resume["step"] <= 3
    after = [r["step"] for r in records[records.index(resume) :] if "loss" in r]
    assert after == list(range(resume["step"] + 1, steps + 1))
    assert [r for r in records if r.get("event") == "done"][-1]["step"] == steps
