"""One precision path for training on CPU and GPU (train.precision), the engine's own forward for every
micro-step (gradient accumulation, ZeRO-3), and collective evaluation / saving.

The multi-rank tests launch the worker the way `selfdraft train` does (torchrun, 2 CPU ranks, gloo) on a
tiny random Llama, so CI runs the same dtype handling as a GPU job.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from selfdraft.training import config as run_config
from selfdraft.training.config import (
    ConfigError,
    RunConfig,
    command_line_overrides,
    load_run_config,
    resolve_precision,
)
from selfdraft.training.data.prepare import prepare_from_config

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


# ------------------------------------------------------------------------------------------ fast unit tests


def test_precision_setting_resolves_per_device(monkeypatch, tmp_path):
    monkeypatch.setattr(run_config, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(run_config, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == torch.float32  # AVX2-only: bf16 would be emulated
    assert resolve_precision("bf16", "cpu") == torch.bfloat16
    assert resolve_precision("fp32", torch.device("cpu")) == torch.float32
    assert load_run_config(_yaml(tmp_path, "{}\n")).train.precision == "auto"
    with pytest.raises(ConfigError, match="train.precision"):
        load_run_config(_yaml(tmp_path, "train:\n  precision: fp16\n"))


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_deepspeed_mixed_precision_follows_the_run_precision(tmp_path):
    from selfdraft.errors import UserError
    from selfdraft.training.engine import deepspeed_config

    config = RunConfig(deepspeed=str(ROOT / "configs/deepspeed/zero3.json"))
    on = deepspeed_config(config, 2, torch.bfloat16)  # on CPU too: fp32 master weights, bf16 compute
    assert on["bf16"]["enabled"] is True and on["fp16"]["enabled"] is False
    assert on["train_batch_size"] == 2 * config.train.micro_batch_size
    assert deepspeed_config(config, 1, torch.float32)["bf16"]["enabled"] is False
    conflicting = tmp_path / "ds.json"
    conflicting.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}))
    with pytest.raises(UserError, match="train.precision"):
        deepspeed_config(RunConfig(deepspeed=str(conflicting)), 1, torch.float32)
    conflicting.write_text(json.dumps({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}))
    with pytest.raises(UserError, match="fp16"):
        deepspeed_config(RunConfig(deepspeed=str(conflicting)), 1, torch.bfloat16)


def test_rank_report_digests_bf16_parameters(tmp_path):
    from selfdraft.training.checkpoint import write_rank_report

    module = torch.nn.Linear(4, 3).to(torch.bfloat16)
    write_rank_report(tmp_path, 0, 1, 5, module)  # numpy has no bfloat16: this used to raise
    report = json.loads((tmp_path / "ranks" / "rank0.json").read_text())
    assert report["step"] == 5 and len(report["params_sha256"]) == 64


def test_resume_refuses_another_resolved_precision(tmp_path):
    from selfdraft.training import checkpoint as ckpt

    ckpt.write_meta(tmp_path, ckpt.run_meta("abc", 1, "bfloat16"))
    ckpt.check_meta(tmp_path, ckpt.run_meta("abc", 1, "bfloat16"), resume=True)
    with pytest.raises(ckpt.ResumeError, match="train.precision"):  # `auto` on an AVX2-only machine
        ckpt.check_meta(tmp_path, ckpt.run_meta("abc", 1, "float32"), resume=True)
    ckpt.write_meta(tmp_path, ckpt.run_meta("abc", 1))  # run.json of an older version: no precision
    ckpt.check_meta(tmp_path, ckpt.run_meta("abc", 1, "float32"), resume=True)


def test_features_keep_the_compute_dtype(tmp_path):
    import datasets
    from transformers import AutoModelForCausalLM, LlamaConfig

    from selfdraft.training.batches import collate
    from selfdraft.training.data.feature_cache import HiddenStateCache, cache_hidden_states, compute_features

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 7))
    online = compute_features(model, ids, [-1])["features"][2]
    assert online.dtype == torch.bfloat16  # no float32 copy of the online features
    rows = [{"input_ids": row.tolist(), "loss_mask": [1] * 7} for row in ids]
    cache_hidden_states(model, datasets.Dataset.from_list(rows), tmp_path, [-1], batch_size=2)
    cache = HiddenStateCache(tmp_path, dtype=torch.bfloat16)
    assert cache.holds(datasets.Dataset.from_list(rows))
    item = cache[1]
    assert item["features"][2].dtype == torch.bfloat16
    # bf16 -> fp16 (storage) -> bf16 is exact for values in fp16's normal range
    assert torch.equal(item["features"][2], online[1])
    short = {"input_ids": item["input_ids"][:5], "loss_mask": item["loss_mask"][:5]}
    short["features"] = {2: item["features"][2][:5]}
    batch = collate([short, cache[0]])  # padded, still bf16
    assert batch["features"][2].dtype == torch.bfloat16 and batch["features"][2].shape == (2, 7, 16)


def test_bf16_step_reduces_the_loss_in_float32():
    from selfdraft.heads import HeadsConfig, build_heads
    from selfdraft.heads.eagle.objective import eagle_step
    from selfdraft.training.engine import DraftObjective
    from selfdraft.training.output_head import output_head

    from tiny_models import tiny_target

    target = tiny_target().to(torch.bfloat16)
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind="eagle")).attach(target)
    objective = DraftObjective(heads.to(torch.bfloat16), eagle_step)
    ids = torch.randint(0, target.config.vocab_size, (2, 12))
    with torch.no_grad():
        hidden = list(target(ids, output_hidden_states=True).hidden_states)
    assert hidden[-1].dtype == torch.bfloat16
    out = objective(
        ids, torch.ones_like(ids), hidden, output_head(target),
        ttt_steps=2, ttt_decay=0.8, feature_weight=0.1, ce_weight=1.0,
    )  # fmt: skip
    assert isinstance(out, tuple) and out.loss.dtype == torch.float32 and math.isfinite(out.metrics["loss"])
    out.loss.backward()
    assert heads.fc.weight.grad is not None and heads.fc.weight.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ multi-rank worker runs


def _write_config(tmp_path: Path, name: str, target: Path, stage: int, data: dict, **train) -> Path:
    config = {
        "target": str(target),
        "output_dir": str(tmp_path / name),
        "deepspeed": str(ROOT / f"configs/deepspeed/zero{stage}.json"),
        "heads": {"kind": "eagle", "layout": "selfdraft", "draft_vocab_size": 512},
        "data": data,
        "train": {"lr": 0.01, "warmup_steps": 1, "ttt_steps": 2, **train},
        "schedule": {"save_every": 100, "eval_every": 100, "log_every": 1, "eval_examples": 4},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _torchrun(config: Path, precision: str | None = None, nproc: int = 2, timeout: int = 180) -> None:
    """Prepare the run (with `selfdraft prepare --precision`'s override), then torchrun the worker."""
    resolved = prepare_from_config(config, command_line_overrides(precision=precision))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "selfdraft.training.train", "--config", str(resolved)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _equal_length_texts(tiny_target_dir: Path, tmp_path: Path, length: int, count: int) -> Path:
    """JSONL text records of exactly `length` tokens each, every token trained on: every micro-batch then
    counts the same number of loss positions, so a mean over 2 micro-batches of m rows equals the mean
    over one batch of 2m rows, and the two schedules must give the same update."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "is", "of", "in"]
    rng = random.Random(0)
    rows = []
    while len(rows) < count:
        text = " ".join(rng.choice(words) for _ in range(length))
        ids = tok(text)["input_ids"]
        if len(ids) > length:
            text = tok.decode(ids[:length])
            ids = tok(text)["input_ids"]
        if len(ids) == length:
            rows.append({"id": f"t{len(rows)}", "text": text})
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_accumulation_matches_a_larger_micro_batch(tmp_path, tiny_target_dir, stage, precision):
    """2 ranks: accumulation 2 x micro-batch 1 ends with the same heads as accumulation 1 x micro-batch
    2 (both see the same 4 rows per optimizer step), after 4 AdamW steps that move the heads by > 1e-3
    (measured 3e-2). fp32: max |diff| <= 1e-5 (summation order only; measured 1.5e-6 at ZeRO-1 and 3).
    bf16: ||diff|| <= 0.1 ||change from init|| (bf16 rounding, amplified by Adam on near-zero
    gradients; measured 0.017 at ZeRO-1, 0.025 at ZeRO-3). Micro-steps through `engine.module` instead
    of `engine` gave, at ZeRO-3, a max |diff| of 6e-2 in fp32 and a norm ratio of 0.64 in bf16: the
    engine's forward is what tells ZeRO where an accumulation boundary is."""
    import datasets

    texts = _equal_length_texts(tiny_target_dir, tmp_path, length=24, count=40)
    data = {"sources": [str(texts)], "max_length": 24, "heldout_fraction": 0.1}
    # the loss is a mean over each micro-batch's trained positions: equal-length rows give every
    # micro-batch the same count only while no position is dropped for lying outside the draft vocab
    common = {"max_steps": 4, "mask_out_of_vocab": False}
    accumulated = _write_config(tmp_path, "acc", tiny_target_dir, stage, data,
                                micro_batch_size=1, gradient_accumulation_steps=2, **common)  # fmt: skip
    single = _write_config(tmp_path, "one", tiny_target_dir, stage, data,
                           micro_batch_size=2, gradient_accumulation_steps=1, **common)  # fmt: skip
    _torchrun(accumulated, precision)  # the flag overrides train.precision (auto)
    _torchrun(single, precision)
    lengths = {len(r["input_ids"]) for r in datasets.load_from_disk(str(tmp_path / "acc/data/train"))}
    assert lengths == {24}  # equal loss counts per micro-batch (see _equal_length_texts)
    a = load_file(str(tmp_path / "acc" / "heads" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "heads" / "model.safetensors"))
    assert a.keys() == b.keys()
    init = _initial_heads(tmp_path / "acc")
    floats = [k for k in a if a[k].is_floating_point()]
    worst = max(float((a[k] - b[k]).abs().max()) for k in floats)
    moved = max(float((a[k] - init[k]).abs().max()) for k in floats)
    assert moved > 1e-3, moved  # the comparison is not vacuous: training changed the weights
    if precision == "fp32":
        assert worst <= 1e-5, worst
    else:
        diff = sum(float((a[k] - b[k]).norm() ** 2) for k in floats) ** 0.5
        change = sum(float((a[k] - init[k]).norm() ** 2) for k in floats) ** 0.5
        assert diff <= 0.1 * change, (diff, change)
    assert _log(tmp_path / "acc")[0]["precision"] == {"fp32": "float32", "bf16": "bfloat16"}[precision]
    for name in ("acc", "one"):  # under ZeRO-3 the rank reports digest the gathered parameters
        reports = [json.loads((tmp_path / name / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert reports[0]["params_sha256"] == reports[1]["params_sha256"]


def _initial_heads(run: Path) -> dict[str, torch.Tensor]:
    """The heads a run started from, rebuilt the way the worker builds them (seeded)."""
    import datasets

    from selfdraft.target import load_target
    from selfdraft.training.train import build_run_heads

    config = load_run_config(run.parent / f"{run.name}.yaml")
    target, _ = load_target(config.target)
    train = datasets.load_from_disk(str(run / "data" / "train"))
    return {k: v.float() for k, v in build_run_heads(config, target, train).state_dict().items()}


@pytest.mark.slow
def test_bf16_two_rank_zero3_run_evaluates_saves_and_loads(tmp_path, tiny_target_dir):
    """The GPU dtype path on 2 CPU ranks: bf16 target and features, DeepSpeed bf16 mode at ZeRO-3, with
    evaluation and saving at the same step (evaluation on rank 0 alone used to hang ZeRO-3)."""
    data = {"sources": ["sharegpt"], "limit_records": 30, "max_length": 64, "heldout_fraction": 0.1}
    config = _write_config(tmp_path, "run", tiny_target_dir, 3, data,
                           max_steps=4, micro_batch_size=2, precision="bf16")  # fmt: skip
    cfg = yaml.safe_load(config.read_text())
    cfg["schedule"].update(save_every=2, eval_every=2)
    config.write_text(yaml.safe_dump(cfg))
    _torchrun(config)
    run = tmp_path / "run"
    log = _log(run)
    assert log[0]["precision"] == "bfloat16" and log[0]["world_size"] == 2
    assert log[0]["eval_features"] == "online"
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) and x > 0 for x in losses)
    evals = [r for r in log if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(math.isfinite(r["eval_loss"]) for r in evals)
    assert len(evals[-1]["eval_top1_by_depth"]) == 4
    reports = [json.loads((run / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]

    from selfdraft.heads import load_heads
    from selfdraft.target import load_target

    stored = load_file(str(run / "heads" / "model.safetensors"))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float32}
    assert all(torch.isfinite(t).all() for t in stored.values() if t.is_floating_point())
    target, _ = load_target(str(tiny_target_dir))
    heads = load_heads(run / "heads", target)
    assert torch.equal(heads.fc.weight, stored["fc.weight"])


@pytest.mark.slow
def test_bf16_single_rank_run_trains_and_evaluates_on_cached_features(tmp_path, tiny_target_dir):
    """`selfdraft prepare` fills the feature cache (training and held-out splits) in bf16; one process
    trains on it."""
    data = {
        "sources": ["sharegpt"], "limit_records": 30, "max_length": 64, "heldout_fraction": 0.1,
        "feature_cache": str(tmp_path / "features"),
    }  # fmt: skip
    config = _write_config(tmp_path, "run", tiny_target_dir, 1, data,
                           max_steps=3, micro_batch_size=2, precision="bf16")  # fmt: skip
    proc = subprocess.run(
        [PY, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(config))],
        capture_output=True, text=True, env=_env(), timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "features" / "index.json").is_file()
    assert (tmp_path / "features" / "heldout" / "index.json").is_file()  # evaluation reads this cache
    log = _log(tmp_path / "run")
    assert log[0]["precision"] == "bfloat16" and log[0]["eval_features"] == "cached"
    assert all(math.isfinite(r["loss"]) for r in log if "loss" in r)
    evals = [r for r in log if "eval_loss" in r]
    assert evals and math.isfinite(evals[-1]["eval_loss"])
