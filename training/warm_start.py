"""A run that starts where another run ended: `heads.init_from` naming a run folder (one holding
run.json), not a heads folder, continues that run's newest whole checkpoint - its heads *and* its
AdamW state (moments, step counts and, under bf16, the fp32 master weights) - under this run's own
lr schedule, step count, data and sample order.

Why: a heads folder restarts Adam from zero moments, so a run continued from one re-estimates every
parameter's gradient scale while its warmup climbs. Continuing the state is how one long run would
have gone on, with a new schedule, and costs nothing; on the SmolLM2 CPU campaign it measured a near
tie with a fresh optimizer over 24 minutes (docs/training.md, "The optimizer across sessions").
The state is split across ranks (ZeRO), so the run must have the source run's world size and
precision; heads the run config would adapt (another draft vocabulary, more feature layers) no longer
fit it and are refused.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from selfdraft.errors import UserError
from selfdraft.training import checkpoint as ckpt


def source_run(init_from: str | None) -> Path | None:
    """The run folder heads.init_from names, or None when it names a heads folder (or nothing)."""
    if not init_from:
        return None
    folder = Path(init_from)
    return folder if (folder / ckpt.RUN_FILE).is_file() else None


def source_heads(run_dir: Path) -> Path:
    """The heads export beside the run's newest whole checkpoint: the heads' shape (and weights)."""
    heads = ckpt.resumable_heads(run_dir)
    if heads is None:
        raise UserError(
            f"heads.init_from: run {run_dir} holds no whole checkpoint with its heads export to continue; "
            "point heads.init_from at a heads folder (a fresh optimizer) or resume that run first"
        )
    return heads


def shapes(heads: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in heads.state_dict().items()}


def check_unadapted(before: dict[str, tuple[int, ...]], heads: nn.Module, run_dir: Path) -> None:
    """The heads as the run config adapted them (`Objective.continue_from`) must keep the source run's
    tensors: its optimizer state holds one slot per parameter of that shape."""
    after = shapes(heads)
    if after != before:
        changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        raise UserError(
            f"heads.init_from: run {run_dir}'s optimizer state fits its heads, but this config changes "
            f"them ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); keep that run's "
            f"heads settings, or point heads.init_from at {run_dir / 'heads'} (its heads, a fresh optimizer)"
        )


def check_compatible(run_dir: Path, world: int, precision: str) -> None:
    """Read-only (every rank runs it before any collective): the source run's world size and precision
    must be this run's, since its optimizer state is partitioned by rank and kept in that precision."""
    stored = ckpt.read_meta(run_dir) or {}
    theirs = stored.get("world_size", world)
    fresh = f"or point heads.init_from at {run_dir / 'heads'} (its heads, a fresh optimizer)"
    if theirs != world:
        raise UserError(
            f"heads.init_from: run {run_dir} was trained by {theirs} processes and its optimizer state "
            f"is split {theirs} ways, this job has {world}; train with --nproc {theirs}, {fresh}"
        )
    if stored.get("precision", precision) != precision:
        raise UserError(
            f"heads.init_from: run {run_dir} was trained in {stored['precision']}, but train.precision "
            f"resolves to {precision} here; set train.precision to match it, {fresh}"
        )


def adam_steps(optimizer) -> int:
    """The optimizer steps its state has taken (0 for a fresh one); ZeRO's wrapper exposes the state
    of the optimizer it wraps."""
    steps = [int(slot["step"]) for slot in optimizer.state.values() if "step" in slot]
    return max(steps, default=0)


def continue_optimizer(engine, run_dir: Path) -> dict:
    """Load the source run's newest whole checkpoint into the engine (weights and optimizer state, not
    its lr schedule or progress), then give the param groups back this run's hyperparameters: the
    loaded groups carry the source run's last lr (the end of its decay) and its weight decay.
    Returns what the run's start record says about it."""
    tag = ckpt.latest_tag(run_dir)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    where = run_dir / "checkpoints" / str(tag)
    try:
        path, _ = engine.load_checkpoint(
            str(run_dir / "checkpoints"), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
    except (RuntimeError, ValueError, KeyError, AssertionError) as err:  # another ZeRO stage or heads
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"heads.init_from: the checkpoint {where} does not load into this run ({first}); use that "
            f"run's deepspeed config, or point heads.init_from at {run_dir / 'heads'} (a fresh optimizer)"
        ) from err
    if path is None:
        raise UserError(
            f"heads.init_from: the checkpoint {where} could not be read; resume that run to rewrite it"
        )
    for group, ours in zip(engine.optimizer.param_groups, groups, strict=True):
        group.update(ours)
    return {"optimizer_from": str(where), "optimizer_steps": adam_steps(engine.optimizer)}
