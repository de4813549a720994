"""The DeepSpeed engine around the heads' objective: its JSON config, AdamW, the lr schedule and the
wall-clock budget, and the token count every rank has fed."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from selfdraft.errors import UserError
from selfdraft.heads.objective import Objective, StepOutput
from selfdraft.heads.registry import training_objective
from selfdraft.training.config import RunConfig
from selfdraft.training.output_head import OutputHead


def objective_for(config: RunConfig) -> Objective:
    """The training objective of the run's heads.kind and heads.layout (the heads registry names it)."""
    return training_objective(config.heads.kind, config.heads.layout)


class DraftObjective(nn.Module):
    """The heads and their training objective as one module whose forward returns the step's loss.

    DeepSpeed's engine wraps this module, so every micro-step runs through `engine(...)`: the engine's
    forward registers the backward hooks that tell ZeRO where a gradient-accumulation boundary is, and
    ZeRO-3 gathers the heads' partitioned parameters around it. The target is not a submodule: its
    output head (`OutputHead`, the lm_head weight) comes in as an argument and never enters the engine
    or its optimizer.
    step: the heads kind's step function (`Objective.step` of the kind's package, heads/*/objective.py).
    """

    def __init__(self, heads: nn.Module, step: Callable[..., StepOutput]) -> None:
        super().__init__()
        self.heads = heads
        self.step = step

    def forward(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: list[torch.Tensor | None],
        head: OutputHead,
        **step_kwargs,
    ) -> StepOutput:
        """Arguments of the step function, without the heads."""
        return self.step(self.heads, input_ids, loss_mask, hidden, head, **step_kwargs)


def deepspeed_config(config: RunConfig, world: int, dtype: torch.dtype) -> dict:
    """The DeepSpeed JSON with the run's batch shape and precision filled in.

    dtype (from train.precision) alone sets the mixed-precision mode, on CPU and GPU alike: bfloat16
    turns on DeepSpeed's `bf16` mode (bf16 parameters and activations, fp32 master weights and
    optimizer state); float32 turns it off. A JSON that asks for something else is refused."""
    ds = json.loads(Path(config.deepspeed).read_text())
    t = config.train
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.gradient_accumulation_steps
    ds["train_batch_size"] = t.micro_batch_size * t.gradient_accumulation_steps * world
    ds["gradient_clipping"] = t.grad_clip
    ds.setdefault("steps_per_print", 10**9)
    bf16 = dtype == torch.bfloat16
    if ds.get("fp16", {}).get("enabled", False):
        raise UserError(
            f"{config.deepspeed}: fp16 is not supported; set train.precision (auto | bf16 | fp32)"
        )
    if "enabled" in ds.get("bf16", {}) and ds["bf16"]["enabled"] != bf16:
        raise UserError(
            f"{config.deepspeed} sets bf16.enabled={ds['bf16']['enabled']}, but train.precision "
            f"{config.train.precision!r} resolves to {dtype}; drop bf16 from the JSON (train.precision owns it)"
        )
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16}
    ds["fp16"] = {"enabled": False}
    return ds


def lr_lambda(
    warmup: int, total: int, schedule: str = "cosine", time_fraction: Callable[[], float] = lambda: 0.0
):
    """LR multiplier by optimizer step: a linear warmup, then a cosine to 0.1 by `total` (or by the
    end of the time budget, `time_fraction` in [0, 1], whichever comes first) or flat."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = max((step - warmup) / max(1, total - warmup), time_fraction())
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


@dataclass
class TimeBudget:
    """train.max_minutes: training seconds so far (`before`: those of the runs resumed from) against
    the budget. Rank 0's clock rules, broadcast once per step, so every rank takes the same lr and
    stops at the same step."""

    seconds: float | None
    before: float = 0.0
    elapsed: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def sync(self, device: torch.device, world: int) -> None:
        now = self.before + time.perf_counter() - self.start
        if self.seconds is not None and world > 1:  # a collective only where a budget is set
            clock = torch.tensor([now], dtype=torch.float64, device=device)
            dist.broadcast(clock, 0)
            now = float(clock.item())
        self.elapsed = now

    def fraction(self) -> float:
        return 0.0 if self.seconds is None else min(1.0, self.elapsed / self.seconds)

    @property
    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed >= self.seconds


def build_engine(config: RunConfig, objective: Objective, heads, total: int, world: int, dtype: torch.dtype):
    """DeepSpeed's engine around the heads' objective, with AdamW and the lr schedule;
    returns (engine, scheduler, budget, ZeRO stage)."""
    import deepspeed

    t = config.train
    optimizer = torch.optim.AdamW(
        [p for p in heads.parameters() if p.requires_grad], lr=t.lr, weight_decay=t.weight_decay
    )
    budget = TimeBudget(None if t.max_minutes is None else 60.0 * t.max_minutes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.warmup_steps, total, t.lr_schedule, budget.fraction)
    )
    ds_config = deepspeed_config(config, world, dtype)
    engine, _, _, _ = deepspeed.initialize(
        model=DraftObjective(heads, objective.step),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
    )
    return engine, scheduler, budget, ds_config.get("zero_optimization", {}).get("stage", 0)


def fed_tokens(before: int, local: int, device: torch.device, world: int) -> int:
    """Tokens (attention-mask ones) every rank has fed the heads since the run began: `before` came
    from the checkpoint resumed, `local` is this rank's count since then (collective when world > 1)."""
    if world == 1:
        return before + local
    count = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    return before + int(count.item())
