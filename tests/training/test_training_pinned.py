"""Pinned training runs: for a fixed seed, every head kind's losses, held-out scores and final weights
are exactly those the trainer produced before its objectives moved behind one interface
(each kind's `heads/*/objective.py` now). A change of the math, however small, changes the digest of the weights.

The numbers were first recorded with the trainer of commit c605cd2 (before the refactor) and the
refactored trainer reproduced them bit for bit; they were re-recorded once when the training texts
became near-duplicate-free (the split keeps near-duplicates on one side, and the old shifted-word
rows were all one group, leaving nothing held out). One process, fp32, one thread. Every value a
default might change is written out in the configs below (layout, feature / CE weights, ttt steps),
so a later default does not move the pins.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from selfdraft.training.data.prepare import prepare_from_config

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

# Recorded as the module docstring says: losses of steps 1..4, the
# held-out scores at step 4, and the sha256 of the final heads' parameters.
PINNED_ON = "avx512f avx512_bf16"  # `cpu_kind()` of the machine the pins were recorded on
PINNED: dict[str, dict] = {
    "eagle": {
        "losses": [10.124303817749023, 10.114242553710938, 10.115907669067383, 10.113621711730957],
        "eval_loss": 16.577797889709473,
        "eval_top1_by_depth": [
            0.016393441706895828,
            0.006756756920367479,
            0.008771929889917374,
            0.0181818176060915,
        ],
        "params_sha256": "84af1232b2fbb14806a4cc60ccf8f4a768e12d1559bbf772f3ea20a15573df8f",
    },
    "eagle-continued": {
        "losses": [8.84874153137207, 8.842967987060547, 8.846177101135254, 8.847654342651367],
        "eval_loss": 14.495688438415527,
        "eval_top1_by_depth": [
            0.09027178585529327,
            0.13536417484283447,
            0.05409356765449047,
            0.032467531971633434,
        ],
        "params_sha256": "9216d8fa098e8b2d03a6edc28fa6d9739f15c636509b2387cf62073996e8dcfa",
    },
    "eagle3": {
        "losses": [9.99321460723877, 9.9879732131958, 9.983491897583008, 9.981868743896484],
        "eval_loss": 16.368626594543457,
        "eval_top1_by_depth": [
            0.02297238912433386,
            0.016949152573943138,
            0.02631578966975212,
            0.00909090880304575,
        ],
        "params_sha256": "5c8ca9e5ed6d16332e7c3e3956201d9ad8121fd8a007ba79f1332ff63566aa30",
    },
    "medusa": {
        "losses": [0.018096923828125, 0.017072290182113647, 0.016885779798030853, 0.018676672130823135],
        "eval_loss": 0.016326388344168663,
        "eval_top1_by_depth": [
            0.031169111840426922,
            0.05748969130218029,
        ],
        "params_sha256": "2f723406969a27235c0cba3242a26511ee2b3f85695e075355b5c0ce94497fc8",
    },
}


@pytest.fixture(scope="module")
def deep_tiny_target(tmp_path_factory):
    """A tiny random Llama of four layers (eagle3 fuses three of them) with the real tokenizer."""
    from tiny_models import save_tiny_llama_with_real_tokenizer

    return save_tiny_llama_with_real_tokenizer(tmp_path_factory.mktemp("deep-tiny-target"), num_hidden_layers=4)


def _config(tmp_path: Path, target: Path, kind: str, init_from: Path | None = None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    texts = tmp_path / "texts.jsonl"
    rows = [
        {"id": str(i), "text": " ".join(f"w{rng.randrange(90)}" for _ in range(36))}
        for i, rng in enumerate(random.Random(1000 + i) for i in range(24))
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
        [sys.executable, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(config))],
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
