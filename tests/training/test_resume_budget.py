"""Resuming: only a whole checkpoint is trusted, a finished run can be extended (steps, minutes,
epochs) while a change of the math is refused naming the key, and the progress output shows what the
log holds (the lr each step ran at, held-out scores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfdraft.errors import MissingFileError
from selfdraft.training import checkpoint as ckpt
from selfdraft.training.config import RunConfig
from selfdraft.training.data.prepare import prepare_from_config


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _worker(config: Path, *extra: str, **train) -> subprocess.CompletedProcess:
    """Prepare the run (`train`: overrides of the train section, as `selfdraft train --max-steps`
    gives them), then run the worker on its resolved config."""
    resolved = prepare_from_config(config, {"train": train} if train else None)
    return subprocess.run(
        [sys.executable, "-m", "selfdraft.training.train", "--config", str(resolved), *extra],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _tag(folder: Path, world: int, zero: bool = True) -> Path:
    """A DeepSpeed-shaped tag folder: model states, and one ZeRO optimizer file per rank."""
    folder.mkdir(parents=True)
    torch.save({"module": torch.ones(3)}, folder / "mp_rank_00_model_states.pt")
    for rank in range(world if zero else 0):
        torch.save({"state": torch.ones(3)}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return folder


def test_only_a_whole_checkpoint_is_trusted(tmp_path):
    """A kill between rank 0 writing `latest` and the other ranks finishing leaves `latest` naming a
    tag with a rank's file missing or cut short: the resume takes the newest whole tag instead."""
    root = tmp_path / "checkpoints"
    ckpt.write_meta(tmp_path, ckpt.run_meta("f", 2))
    _tag(root / "step-0000004", world=2)
    newest = _tag(root / "step-0000008", world=2)
    (root / "latest").write_text("step-0000008")
    assert ckpt.latest_tag(tmp_path) == "step-0000008"
    (newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # rank 1 never wrote
    assert ckpt.latest_tag(tmp_path) == "step-0000004"
    _tag(root / "step-0000012", world=2)
    half = root / "step-0000012" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])  # rank 0 cut off mid-write
    (root / "latest").write_text("step-0000012")
    assert ckpt.latest_tag(tmp_path) == "step-0000004"
    assert ckpt.checkpoint_whole(_tag(tmp_path / "plain", world=1, zero=False), world=1)  # ZeRO off


def test_a_resume_names_the_setting_that_changed_and_allows_a_longer_budget(tmp_path):
    config = RunConfig(output_dir=str(tmp_path))
    config.train.max_steps = 8
    ckpt.write_meta(tmp_path, ckpt.run_meta(config.fingerprint(), 1, "float32", config.settings()))
    (tmp_path / "checkpoints" / "step-0000008").mkdir(parents=True)

    def check(config: RunConfig) -> None:
        meta = ckpt.run_meta(config.fingerprint(), 1, "float32", config.settings())
        ckpt.check_meta(tmp_path, meta, resume=True)

    config.train.max_steps, config.train.max_minutes, config.train.epochs = 30, 5.0, 3.0
    check(config)  # the budget may grow
    config.train.lr = 0.002
    config.heads.draft_vocab_size = 64
    with pytest.raises(ckpt.ResumeError) as err:
        check(config)
    assert "heads.draft_vocab_size: None -> 64; train.lr: 0.0003 -> 0.002" in str(err.value)
    assert "fingerprint" not in str(err.value)


# what selfdraft stored for the default config before train.ttt_stride existed (c9e4964 and earlier)
EARLIER_DEFAULT_FINGERPRINT = "7be1baa817db994f"


@pytest.mark.parametrize("kept", ["settings", "fingerprint"])
def test_a_run_from_before_a_key_existed_resumes_at_that_keys_default(tmp_path, kept):
    """A run written before a key was added (its run.json has no such setting; runs older still keep
    only a fingerprint that hashed no such key) resumes and publishes under a config that leaves the
    key at the value that computes what the run did; any other value is a change, named."""
    from selfdraft.training.config import ADDED_LATER

    config = RunConfig(output_dir=str(tmp_path))
    assert "train.ttt_stride" in ADDED_LATER and not config.settings().keys() & ADDED_LATER.keys()
    settings = config.settings() if kept == "settings" else None
    ckpt.write_meta(tmp_path, ckpt.run_meta(EARLIER_DEFAULT_FINGERPRINT, 1, "float32", settings))
    (tmp_path / "checkpoints" / "step-0000008").mkdir(parents=True)

    def check(config: RunConfig) -> None:
        ckpt.check_meta(tmp_path, ckpt.run_meta(config.fingerprint(), 1, "float32", config.settings()), True)

    check(config)
    config.train.ttt_stride = 2
    with pytest.raises(ckpt.ResumeError, match="train.ttt_stride: None -> 2" if kept == "settings" else "fingerprint"):
        check(config)


def test_a_run_killed_inside_a_save_resumes_from_the_last_whole_one_and_extends(tmp_path, text_run):
    """8 steps saving every 4, then rank 0's optimizer file of the last save is cut short (the state
    a kill inside DeepSpeed's save window leaves, `latest` already naming it): `--resume --max-steps
    12` resumes from step 4 and trains on to 12."""
    config = text_run(
        train={"max_steps": 8, "warmup_steps": 4},
        schedule={"save_every": 4, "eval_every": 4, "eval_examples": 4, "keep_checkpoints": 3},
    )
    run = tmp_path / "run"
    first = _worker(config)
    assert first.returncode == 0, first.stderr[-3000:]
    log = _log(run)
    # the lr each step ran at: the warmup's quarters first
    assert [r["lr"] for r in log if "lr" in r][:4] == pytest.approx([0.00025, 0.0005, 0.00075, 0.001])
    scores = next(r for r in log if r["step"] == 4 and "eval_loss" in r)
    assert f"step 4 held-out: loss {scores['eval_loss']:.4f}, top-1 by depth" in first.stderr
    assert (run / "checkpoints" / "latest").read_text() == "step-0000008"

    optim = next((run / "checkpoints" / "step-0000008").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    changed = tmp_path / "changed.yaml"
    changed.write_text(config.read_text().replace("lr: 0.001", "lr: 0.002"))
    refused = _worker(changed, "--resume")
    assert refused.returncode == 2 and "train.lr: 0.001 -> 0.002" in refused.stderr
    assert "Traceback" not in refused.stderr

    resumed = _worker(config, "--resume", max_steps=12)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _log(run)[len(log) :]
    assert after[0]["event"] == "resume" and after[0]["step"] == 4 and after[0]["total_steps"] == 12
    assert [r["step"] for r in after if "loss" in r] == list(range(5, 13))
    assert after[-1]["event"] == "done" and after[-1]["step"] == 12


def test_a_resume_no_longer_needs_the_heads_the_run_started_from(tmp_path, text_run):
    """A run continued from `heads.init_from` resumes after that folder is gone (a published stage
    replaced it, a fresh clone lacks it): the resume builds its heads from the run's own export, the
    checkpoint brings their weights."""
    first = _worker(text_run(train={"max_steps": 2}))
    assert first.returncode == 0, first.stderr[-3000:]
    init = tmp_path / "init"
    (tmp_path / "run" / "heads").rename(init)
    shutil.rmtree(tmp_path / "run")

    config = text_run(heads={"init_from": str(init)}, train={"max_steps": 4}, schedule={"save_every": 4})
    continued = _worker(config)
    assert continued.returncode == 0, continued.stderr[-3000:]
    shutil.rmtree(init)
    resumed = _worker(config, "--resume", max_steps=6)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = _log(tmp_path / "run")
    start = next(i for i, r in enumerate(log) if r.get("event") == "resume")
    assert log[start]["step"] == 4
    assert [r["step"] for r in log[start:] if "loss" in r] == [5, 6]
    # a fresh run with the folder missing is still told so, before any work
    fresh = subprocess.run(
        [sys.executable, "-m", "selfdraft.scripts.cli", "prepare", "--config", str(config),
         "--output-dir", str(tmp_path / "other")],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert fresh.returncode == 2 and f"heads.init_from: {init} is not a heads folder" in fresh.stderr


def test_a_run_continues_another_runs_optimizer_state(tmp_path, text_run):
    """`heads.init_from` naming a run folder continues its newest checkpoint's AdamW state under a new
    schedule: the start record names the checkpoint and its optimizer's 4 steps, the first steps run at
    this run's warmup lr (not the 0.0001 the first run's cosine ended on, which its saved state holds),
    and a third run continued from the second finds 4 + 2 optimizer steps. A config whose heads the
    state no longer fits, another precision, or a run with nothing saved are refused in one line each."""
    first = _worker(text_run(train={"max_steps": 4}, schedule={"save_every": 4}))
    assert first.returncode == 0, first.stderr[-3000:]
    source = tmp_path / "first"
    (tmp_path / "run").rename(source)

    config = text_run(
        heads={"init_from": str(source)},
        train={"max_steps": 2, "warmup_steps": 2},
        schedule={"save_every": 2},
    )
    second = _worker(config)
    assert second.returncode == 0, second.stderr[-3000:]
    log = _log(tmp_path / "run")
    assert log[0]["event"] == "start" and log[0]["optimizer_steps"] == 4
    assert log[0]["optimizer_from"] == str(source / "checkpoints" / "step-0000004")
    assert [r["lr"] for r in log if "lr" in r] == pytest.approx([0.0005, 0.001])

    (tmp_path / "run").rename(tmp_path / "second")
    third = _worker(text_run(heads={"init_from": str(tmp_path / "second")}, train={"max_steps": 1}))
    assert third.returncode == 0, third.stderr[-3000:]
    assert _log(tmp_path / "run")[0]["optimizer_steps"] == 6

    shutil.rmtree(tmp_path / "run")
    fresh = f"point heads.init_from at {source / 'heads'} "

    def refused(says: str, **sections) -> None:
        out = _worker(text_run(**sections))
        assert out.returncode == 2 and says in out.stderr and fresh in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
        shutil.rmtree(tmp_path / "run", ignore_errors=True)

    refused("this config changes them (", heads={"init_from": str(source), "draft_vocab_size": 128})
    meta = json.loads((source / "run.json").read_text())
    (source / "run.json").write_text(json.dumps({**meta, "precision": "bfloat16"}))
    refused("was trained in bfloat16, but train.precision resolves to float32", heads={"init_from": str(source)})
    (source / "run.json").write_text(json.dumps(meta))
    shutil.rmtree(source / "checkpoints")
    with pytest.raises(MissingFileError, match="holds no whole checkpoint to continue"):
        prepare_from_config(text_run(heads={"init_from": str(source)}))
