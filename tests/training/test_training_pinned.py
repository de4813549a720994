"""Pinned training runs: for a fixed seed, every head kind's losses, held-out scores and final weights
are exactly those the trainer produced before its objectives moved behind one interface
(`training/strategies.py`). A change of the math, however small, changes the digest of the weights.

The numbers were recorded with the trainer of commit c605cd2 (before the refactor), on this
project's CPU machine, one process, fp32, one thread. Every value a default might change is written
out in the configs below (layout, feature / CE weights, ttt steps), so a later default does not move
the pins.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# (kind, layout) -> heads section; every other section is shared (see `_config`)
HEADS = {
    "medusa": {
        "kind": "medusa",
        "layout": "selfdraft",
        "medusa_num_heads": 2,
        "feature_layers": [-1],
        "fc_bias": True,
    },
    "eagle": {
        "kind": "eagle",
        "layout": "selfdraft",
        "draft_vocab_size": 256,
        "feature_layers": [-1],
        "fc_bias": True,
    },
    "eagle3": {
        "kind": "eagle",
        "layout": "eagle3",
        "draft_vocab_size": 256,
        "feature_layers": [1, 2, 3],
        "fc_bias": False,
    },
    # continues the "eagle" run's heads, fusing one more layer (`EagleHead.widened`) over a smaller
    # draft vocabulary (`EagleHead.with_draft_vocab`)
    "eagle-continued": {
        "kind": "eagle",
        "layout": "selfdraft",
        "draft_vocab_size": 128,
        "feature_layers": [2, -1],
        "fc_bias": True,
    },
}
TRAIN = {
    "eagle": {"ttt_steps": 2, "ttt_decay": 0.8, "feature_weight": 0.1, "ce_weight": 1.0},
    "eagle3": {"ttt_steps": 2, "ttt_decay": 0.8, "feature_weight": 0.0, "ce_weight": 1.0},
    "eagle-continued": {"ttt_steps": 2, "ttt_decay": 0.8, "feature_weight": 0.1, "ce_weight": 1.0},
    "medusa": {"medusa_decay": 0.8, "medusa_hard_labels": False},
}

# Recorded with the pre-refactor trainer (see the module docstring): losses of steps 1..4, the
# held-out scores at step 4, and the sha256 of the final heads' parameters.
PINNED_ON = "avx512f avx512_bf16"  # `cpu_kind()` of the machine the pins were recorded on
PINNED: dict[str, dict] = {
    "eagle": {
        "losses": [10.12822437286377, 10.124629974365234, 10.112486839294434, 10.108074188232422],
        "eval_loss": 16.572444915771484,
        "eval_top1_by_depth": [
            0.03157894778996706,
            0.05778191797435284,
            0.015873016323894262,
            0.059259260073304176,
        ],
        "params_sha256": "4a7c8f814cf390a4d1a499af04d6f82a5a87b033d56499cc791a64f1247912be",
    },
    "eagle-continued": {
        "losses": [8.856934547424316, 8.852927207946777, 8.84212875366211, 8.843573570251465],
        "eval_loss": 14.492508888244629,
        "eval_top1_by_depth": [
            0.12236842140555382,
            0.055917988531291485,
            0.0545634925365448,
            0.07989418134093285,
        ],
        "params_sha256": "90855d57662958d33486c8808fe4348938b96405358f8f548fdf62c3640c027b",
    },
    "eagle3": {
        "losses": [9.992716789245605, 9.9886474609375, 9.98349666595459, 9.982135772705078],
        "eval_loss": 16.370100021362305,
        "eval_top1_by_depth": [
            0.12061403319239616,
            0.0848089437931776,
            0.09623016230762005,
            0.06851851940155029,
        ],
        "params_sha256": "1ab475af41c851dca1cb2404eaf257b63280058c55798ea7aa8c5098a709439b",
    },
    "medusa": {
        "losses": [0.016075387597084045, 0.014500996097922325, 0.018018919974565506, 0.01801818609237671],
        "eval_loss": 0.01641085185110569,
        "eval_top1_by_depth": [0.02982456237077713, 0.10088536515831947],
        "params_sha256": "834e67b96b9096819d1af37164436414e90594933687d07fa2e5761d9b395da8",
    },
}


@pytest.fixture(scope="module")
def deep_tiny_target(tmp_path_factory):
    """A tiny random Llama of four layers (eagle3 fuses three of them) with the real tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from selfdraft.target import resolve_target_path

    from tiny_models import COMMON

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        **{**COMMON, "vocab_size": len(tok), "num_hidden_layers": 4},
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    path = tmp_path_factory.mktemp("deep-tiny-target")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _config(tmp_path: Path, target: Path, kind: str, init_from: Path | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    texts = tmp_path / "texts.jsonl"
    rows = [
        {"id": str(i), "text": " ".join(f"w{(7 * i + 3 * j) % 90}" for j in range(36))} for i in range(24)
    ]
    texts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "target": str(target),
        "output_dir": str(tmp_path / "run"),
        "deepspeed": str(ROOT / "configs/deepspeed/zero1.json"),
        "heads": {**HEADS[kind], **({"init_from": str(init_from)} if init_from else {})},
        "data": {"sources": [str(texts)], "max_length": 40, "heldout_fraction": 0.2, "seed": 0},
        "train": {
            "max_steps": 4,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "lr": 0.003,
            "warmup_steps": 2,
            "lr_schedule": "cosine",
            "precision": "fp32",
            "seed": 0,
            "mask_out_of_vocab": True,
            **TRAIN[kind],
        },
        "schedule": {"log_every": 1, "eval_every": 4, "save_every": 4, "eval_examples": 4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def pinned_run(tmp_path: Path, target: Path, kind: str, init_from: Path | None = None) -> dict:
    """Train `kind` for four steps in one plain process; what the pins compare."""
    config = _config(tmp_path, target, kind, init_from)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "selfdraft.training.train", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    scores = next(r for r in log if "eval_loss" in r)
    return {
        "losses": [r["loss"] for r in log if "loss" in r],
        "eval_loss": scores["eval_loss"],
        "eval_top1_by_depth": scores["eval_top1_by_depth"],
        "params_sha256": json.loads((run / "ranks" / "rank0.json").read_text())["params_sha256"],
    }


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_training_reproduces_the_pinned_run(tmp_path, deep_tiny_target, kind):
    init_from = None
    if kind == "eagle-continued":
        pinned_run(tmp_path / "base", deep_tiny_target, "eagle")
        init_from = tmp_path / "base" / "run" / "heads"
    got = pinned_run(tmp_path, deep_tiny_target, kind, init_from)
    if os.environ.get("SELFDRAFT_PRINT_PINS"):  # how the pins were recorded
        print(f"PIN {kind} {json.dumps(got)}")
    pinned = PINNED[kind]
    if cpu_kind() == PINNED_ON:  # the recording machine's kernels: bit for bit
        assert got == pinned  # exact: floats as logged (json round-trips them bit for bit)
    else:  # other CPUs round fp32 matmuls in another order: the same math within a few ulps per step
        assert got["losses"] == pytest.approx(pinned["losses"], rel=1e-4)
        assert got["eval_loss"] == pytest.approx(pinned["eval_loss"], rel=1e-4)
        assert got["eval_top1_by_depth"] == pytest.approx(pinned["eval_top1_by_depth"], abs=0.02)


def cpu_kind() -> str:
    """The instruction sets that pick the CPU's fp32/bf16 kernels ("" where /proc/cpuinfo is absent)."""
    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.exists() else set()
    return " ".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags)
