"""Training with DeepSpeed on a tiny random Llama: 2-rank ZeRO-1/2 jobs, kill -9 and resume, configs."""

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
import yaml

from selfdraft.training.config import ConfigError, load_run_config
from selfdraft.training.data.prepare import prepare_from_config

from tiny_models import greedy_reference

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def write_config(tmp_path: Path, target: Path, stage: int = 1, **train) -> Path:
    config = {
        "target": str(target),
        "output_dir": str(tmp_path / "run"),
        "deepspeed": str(ROOT / f"configs/deepspeed/zero{stage}.json"),
        "heads": {"kind": "eagle", "layout": "selfdraft", "draft_vocab_size": 512},
        "data": {"sources": ["sharegpt"], "limit_records": 40, "max_length": 96, "heldout_fraction": 0.1},
        "train": {
            "max_steps": 16,
            "micro_batch_size": 2,
            "lr": 0.01,
            "warmup_steps": 1,
            "ttt_steps": 2,
            **train,
        },
        "schedule": {"save_every": 8, "eval_every": 8, "log_every": 1, "eval_examples": 4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_log(run: Path) -> list[dict]:
    path = run / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def train_in_one_process(config: Path) -> Path:
    """Prepare the run (`selfdraft prepare`), then run the worker on its resolved config as one plain
    process (no launcher); its run folder."""
    proc = subprocess.run(
        [PY, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(config))],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(yaml.safe_load(config.read_text())["output_dir"])


@pytest.mark.parametrize("stage", [1, 2])
def test_two_rank_deepspeed_job(tmp_path, tiny_target_dir, stage):
    config = write_config(tmp_path, tiny_target_dir, stage)
    proc = subprocess.run(
        [PY, "-m", "selfdraft.scripts.cli", "train", "--config", str(config), "--nproc", "2"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    reports = [json.loads((run / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in reports] == [2, 2] and [r["step"] for r in reports] == [16, 16]
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]  # replicas stayed identical
    losses = [r["loss"] for r in read_log(run) if "loss" in r]
    assert len(losses) == 16
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # it learns
    evals = [r for r in read_log(run) if "eval_top1_by_depth" in r]
    assert (
        evals and len(evals[-1]["eval_top1_by_depth"]) == 4 and evals[-1]["eval_simulated_tau_chain"] >= 1.0
    )

    # the consolidated export loads straight into SelfDraftModel and stays lossless
    from selfdraft.inference import SelfDraftModel

    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=run / "heads", tree="small")
    prompt = model.chat_ids("Tell me about trains.")
    out = model.generate(prompt, 24, stop_token_ids=[])
    assert out.tokens == greedy_reference(model.target, prompt, 24)


def test_kill_and_resume(tmp_path, tiny_target_dir):
    steps, interval = 40, 5
    config = write_config(tmp_path, tiny_target_dir, max_steps=steps)
    cfg = yaml.safe_load(config.read_text())
    cfg["schedule"]["save_every"] = interval
    cfg["train"]["length_grouping"] = 2  # the resumed run must replay the grouped order too
    config.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    worker = [PY, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(config))]
    proc = subprocess.Popen(
        worker, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        saved = [r["step"] for r in read_log(run) if r.get("event") == "checkpoint"]
        if saved and saved[-1] >= 10:
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    logged = [r["step"] for r in read_log(run) if "loss" in r]
    assert logged and logged[-1] < steps, "the run finished before it could be killed"

    # a fresh start in the same folder is refused; so is a resume with another config
    again = subprocess.run(worker, env=_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "--resume" in again.stderr
    changed = tmp_path / "changed.yaml"
    changed.write_text(config.read_text().replace("lr: 0.01", "lr: 0.02"))
    bad = subprocess.run(
        [PY, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(changed)), "--resume"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "different config" in bad.stderr

    prepare_from_config(config)  # the run's own config again (`changed` rewrote resolved.yaml)
    resumed = subprocess.run(worker + ["--resume"], env=_env(), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = read_log(run)
    resume = next(r for r in log if r.get("event") == "resume")
    assert logged[-1] - resume["step"] <= interval  # at most one checkpoint interval was lost
    assert resume["step"] >= 10
    done = [r for r in log if r.get("event") == "done"]
    assert done[-1]["step"] == steps
    after = [r["step"] for r in log[log.index(resume) :] if "loss" in r]
    assert after == list(range(resume["step"] + 1, steps + 1))  # no step skipped or repeated

    # the resumed run ends where an uninterrupted run ends
    straight = tmp_path / "straight"
    resolved = prepare_from_config(config, {"output_dir": str(straight)})  # `selfdraft prepare --output-dir`
    ok = subprocess.run(
        [PY, "-m", "selfdraft.training.train", "--config", str(resolved)],
        env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    digest = json.loads((run / "ranks" / "rank0.json").read_text())["params_sha256"]
    reference = json.loads((straight / "ranks" / "rank0.json").read_text())["params_sha256"]
    assert digest == reference
    # and has counted the tokens fed before the kill: the count comes back with the checkpoint
    fed = [r["tokens_fed"] for r in log if "tokens_fed" in r and r["step"] == steps]
    assert fed == [r["tokens_fed"] for r in read_log(straight) if "tokens_fed" in r and r["step"] == steps]


def test_configs_in_repo_parse():
    for path in sorted((ROOT / "configs" / "train").rglob("*.yaml")):  # ablations/ too
        load_run_config(path)
    for path in sorted((ROOT / "configs" / "deepspeed").glob("*.json")):
        assert "zero_optimization" in json.loads(path.read_text())
    from selfdraft.bench.run import BenchConfig
    from selfdraft.tree_syntax import resolve_tree
    from selfdraft.typed_config import build_dataclass

    for path in sorted((ROOT / "configs" / "bench").glob("*.yaml")):
        build_dataclass(BenchConfig, yaml.safe_load(path.read_text()))
    trees = sorted((ROOT / "configs" / "trees").glob("*.yaml"))
    assert trees and all(resolve_tree(str(path)).max_depth >= 1 for path in trees)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  lerning_rate: 0.1\n", "unknown key train.'lerning_rate'"),
        ("heads:\n  draft_vocab_size: many\n", "heads.draft_vocab_size"),
        ("train:\n  lr_schedule: linear\n", "train.lr_schedule: 'linear' is not one of cosine, constant"),
        ("schedule:\n  snapshot_tokens: [0, 100]\n", "schedule.snapshot_tokens"),
        ("optimiser: adam\n", "'optimiser'"),
    ],
)
def test_unknown_and_mistyped_keys_are_rejected(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_run_config(path)


def test_deepspeed_private_hook_still_exists():
    """init_distributed replaces this private function to avoid a C++ build on CPU (pinned version)."""
    import importlib

    from selfdraft.training.distributed import DEEPSPEED_SHM_HOOK

    assert hasattr(importlib.import_module("deepspeed.comm.torch"), DEEPSPEED_SHM_HOOK)


def test_a_finished_worker_destroys_its_process_group(tmp_path, tiny_target_dir):
    """Process groups left to interpreter shutdown can abort a rank after its run finished (gloo's
    threads, SIGABRT, the job fails): the worker destroys them before it returns."""
    config = write_config(tmp_path, tiny_target_dir, max_steps=2)
    probe = (
        "import sys, torch.distributed as dist\n"
        "from selfdraft.training.train import main\n"
        "code = main(['--config', sys.argv[1]])\n"
        "print('AFTER', code, dist.is_initialized())\n"
    )
    resolved = prepare_from_config(config)
    proc = subprocess.run([PY, "-c", probe, str(resolved)], env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AFTER 0 False" in proc.stdout, proc.stdout[-500:]


def test_single_process_medusa_run(tmp_path, tiny_target_dir):
    """The same worker in one plain process, for Medusa heads with Medusa-1's hard labels."""
    config = write_config(tmp_path, tiny_target_dir, max_steps=6, medusa_hard_labels=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["heads"] = {"kind": "medusa", "medusa_num_heads": 3}
    config.write_text(yaml.safe_dump(cfg))
    run = train_in_one_process(config)
    log = read_log(run)
    assert json.loads((run / "ranks" / "rank0.json").read_text())["world_size"] == 1
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 6 and all(x == x and x > 0 for x in losses)
    evals = [r for r in log if "eval_simulated_tau_tree" in r]
    assert evals and len(evals[-1]["eval_top1_by_depth"]) == 3  # one per Medusa head

    from selfdraft.inference import SelfDraftModel

    model = SelfDraftModel.from_pretrained(str(tiny_target_dir), heads=run / "heads", tree="chain-3")
    assert model.heads.num_heads == 3
    prompt = model.chat_ids("Hello")
    assert model.generate(prompt, 10, stop_token_ids=[]).tokens == greedy_reference(model.target, prompt, 10)


def test_constant_lr_run_keeps_snapshots_along_the_way(tmp_path, tiny_target_dir):
    """One run, several data sizes: heads kept where the tokens fed reach the listed counts,
    under a flat lr so that no snapshot is taken mid-decay."""
    config = write_config(tmp_path, tiny_target_dir, max_steps=6, lr_schedule="constant", warmup_steps=3)
    cfg = yaml.safe_load(config.read_text())
    cfg["schedule"].update(snapshot_tokens=[1, 2, 400], save_every=6)
    config.write_text(yaml.safe_dump(cfg))
    run = train_in_one_process(config)
    log = read_log(run)
    # the lr each step ran at: the warmup's thirds, then flat (cosine would decay)
    assert [r["lr"] for r in log if "lr" in r] == pytest.approx([0.01 / 3, 0.01 * 2 / 3] + [0.01] * 4)
    fed = {r["step"]: r["tokens_fed"] for r in log if "loss" in r}
    assert all(fed[s] < fed[s + 1] for s in range(1, 6))
    at = next(s for s in range(1, 7) if fed[s] >= 400)
    assert 1 < at < 6, "choose a snapshot count that falls mid-run"
    snaps = [r for r in log if r.get("event") == "snapshot"]
    # 1 and 2 are both reached by step 1: two snapshots of the same heads
    assert [(r["step"], r["tokens_fed"]) for r in snaps] == [(1, fed[1]), (1, fed[1]), (at, fed[at])]
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["tokens-1", "tokens-2", "tokens-400"]

    from selfdraft.heads import load_heads

    kept = [load_heads(run / "snapshots" / f"tokens-{n}").state_dict() for n in (2, 400)]
    final = load_heads(run / "heads").state_dict()
    for earlier, later in zip(kept, kept[1:] + [final], strict=True):
        assert earlier.keys() == later.keys()
        assert any(not torch.equal(earlier[k], later[k]) for k in earlier)  # each is its own step's heads

    # the schedule is named in the fingerprint: a resume under the other schedule is refused
    assert load_run_config(config).fingerprint() != load_run_config(
        config, {"train": {"lr_schedule": "cosine"}}
    ).fingerprint()


def test_time_budget_ends_the_cosine_and_stops_where_it_saves(tmp_path, tiny_target_dir):
    """train.max_minutes: the run stops at the first step past the budget (long before max_steps),
    evaluates and saves there; a resume finds the budget spent and trains no further."""
    from selfdraft.training.engine import TimeBudget, lr_lambda

    budget = TimeBudget(seconds=100.0)
    f = lr_lambda(2, 1000, "cosine", budget.fraction)
    budget.elapsed = 50.0
    assert f(0) == pytest.approx(0.5) and f(3) == pytest.approx(0.55, abs=1e-3)  # time, not step 3 of 1000
    budget.elapsed = 250.0
    assert budget.spent and f(4) == pytest.approx(0.1)
    assert not TimeBudget(seconds=None, elapsed=1e9).spent

    config = write_config(tmp_path, tiny_target_dir, max_steps=60, max_minutes=0.002)
    run = train_in_one_process(config)
    log = read_log(run)
    done = next(r for r in log if r.get("event") == "done")
    assert done["stopped"] == "max_minutes" and 1 <= done["step"] < 60
    last = [r for r in log if r["step"] == done["step"]]
    assert {"loss", "eval_loss"} <= {k for r in last for k in r}
    assert any(r.get("event") == "checkpoint" for r in last) and (run / "heads").is_dir()

    worker = [PY, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(config)), "--resume"]
    again = subprocess.run(worker, env=_env(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = read_log(run)[len(log) :]
    assert [r.get("event") for r in resumed] == ["resume", "done"] and resumed[-1]["step"] == done["step"]

    with pytest.raises(ConfigError, match="train.max_minutes"):
        load_run_config(config, {"train": {"max_minutes": 0}})


def test_length_grouped_stream_keeps_epochs_whole_and_cuts_padding():
    """Grouped micro-batches still cover every example once per epoch, in a deterministic order (a
    resumed run replays it), across ranks; they pad far less than random ones."""
    from selfdraft.training.batches import SampleStream

    gen = torch.Generator().manual_seed(0)
    n, B, world = 240, 4, 2
    lengths = torch.randint(10, 500, (n,), generator=gen).tolist()

    def epoch(window: int) -> list[list[int]]:
        streams = [SampleStream(n, 7, world, r, B, lengths, window) for r in range(world)]
        return [s.micro_batch(m) for m in range(n // (B * world)) for s in streams]

    grouped, plain = epoch(16), epoch(0)
    assert sorted(i for b in grouped for i in b) == list(range(n))
    assert grouped == epoch(16) and grouped != plain

    def padding(batches: list[list[int]]) -> float:
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in batches) / sum(lengths)

    assert padding(grouped) < 0.1 < 0.4 < padding(plain)
    with pytest.raises(ValueError, match="length of every example"):
        SampleStream(n, 7, 1, 0, B, lengths[:-1], 16)
