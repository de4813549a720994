"""The run config: typed dataclasses read from YAML; an unknown key is an error naming the key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from selfdraft.precision import cpu_has_native_bf16
from selfdraft.typed_config import ConfigError, build_dataclass

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class HeadsSection:
    kind: str = "eagle"  # "eagle" | "medusa"
    draft_vocab_size: int | None = None  # reduced draft vocabulary (most frequent training tokens)
    feature_layers: list[int] = field(default_factory=lambda: [-1])
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    medusa_own_lm_head: bool = False
    init_from: str | None = None  # a heads folder to continue from (fine-tuning)


@dataclass
class DataSection:
    sources: list[str] = field(
        default_factory=lambda: ["sharegpt"]
    )  # sharegpt | python-stdlib | path | hf name
    max_length: int = 512
    limit_records: int | None = None
    heldout_fraction: float = 0.02
    seed: int = 0
    feature_cache: str | None = None  # folder for cached target features; None = computed online
    partial_cache: bool = False  # train on the shards cached so far (a staged, resumable data build)


@dataclass
class TrainSection:
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs when set
    micro_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    grad_clip: float = 1.0
    ttt_steps: int = 1  # EAGLE "training-time test": unroll the head on its own features n times
    ttt_decay: float = 0.8
    feature_weight: float = 0.1  # SmoothL1 on predicted features (EAGLE-1); 0 disables
    ce_weight: float = 1.0  # soft CE / forward KL against the target's distribution
    medusa_decay: float = 0.8
    medusa_hard_labels: bool = False  # CE on the text tokens (Medusa-1) instead of the target's distribution
    seed: int = 0
    # auto | bf16 | fp32: the dtype of the frozen target, its features and the heads' compute (see
    # `resolve_precision`). bf16 keeps fp32 master weights in the optimizer (DeepSpeed's bf16 mode).
    precision: str = "auto"


@dataclass
class ScheduleSection:
    save_every: int = 200
    eval_every: int = 200
    log_every: int = 10
    eval_examples: int = 64
    eval_tree: str = "small"  # tree whose acceptance length evaluation simulates (besides a chain)
    keep_checkpoints: int = 2


@dataclass
class RunConfig:
    target: str = "smollm2-135m-instruct"
    output_dir: str = "runs/default"
    deepspeed: str = "configs/deepspeed/zero1.json"
    heads: HeadsSection = field(default_factory=HeadsSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)

    def fingerprint(self) -> str:
        """Hash of everything that changes what a step computes (not where or how often it saves)."""
        data = dataclasses.asdict(self)
        data.pop("schedule")
        data.pop("output_dir")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def load_run_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read a run config; `overrides` is a nested dict merged over the file (CLI flags)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    for key, value in (overrides or {}).items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    config = build_dataclass(RunConfig, raw)
    if config.heads.kind not in ("eagle", "medusa"):
        raise ConfigError(f"heads.kind: {config.heads.kind!r} is not one of eagle, medusa")
    if config.train.precision not in PRECISIONS:
        raise ConfigError(
            f"train.precision: {config.train.precision!r} is not one of {', '.join(PRECISIONS)}"
        )
    return config


def resolve_precision(precision: str, device: torch.device | str) -> torch.dtype:
    """train.precision -> the run's compute dtype on `device`.

    auto: bfloat16 on CUDA GPUs that support it (Ampere and later) and on CPUs that multiply bf16
    natively (AVX512-BF16 / AMX / Arm BF16); float32 elsewhere (an AVX2-only CPU emulates bf16,
    slower than float32)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        cuda = torch.device(device).type == "cuda"
        native = torch.cuda.is_bf16_supported() if cuda else cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32
