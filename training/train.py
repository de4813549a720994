"""The training worker: frozen target + trainable heads under a DeepSpeed engine.

One module for every launch shape:
    python -m selfdraft.training.train --config configs/train/run.yaml          (one process)
    torchrun --nproc_per_node N -m selfdraft.training.train --config ...       (N processes / nodes)
    deepspeed --num_gpus N <path to this file> --config ...                     (DeepSpeed launcher)
The target never enters the optimizer and runs without grad; DeepSpeed holds only the heads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from selfdraft.errors import UserError
from selfdraft.heads import EagleHead, HeadsConfig, build_heads, load_heads
from selfdraft.precision import dtype_name
from selfdraft.target import load_target
from selfdraft.training import checkpoint as ckpt
from selfdraft.training.allocator import keep_freed_memory
from selfdraft.training.batches import SampleStream, collate, split_lengths
from selfdraft.training.config import (
    PRECISIONS,
    RunConfig,
    load_run_config,
    resolve_for_target,
    resolve_precision,
)
from selfdraft.training.distributed import init_distributed
from selfdraft.training.feature_cache import HiddenStateCache, compute_features, normalize_layers
from selfdraft.training.objectives import build_draft_vocab, count_tokens
from selfdraft.training.prepare import (
    cache_ready,
    feature_layers,
    heldout_cache_dir,
    prepare_features,
    prepare_splits,
)
from selfdraft.training.simulate import simulated_tau
from selfdraft.training.steps import DraftObjective, StepOutput
from selfdraft.tree import TreeSpec
from selfdraft.tree_syntax import resolve_tree

EVAL_DEPTHS = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train draft heads on a frozen target with DeepSpeed.")
    parser.add_argument("--config", required=True, help="run config YAML (configs/train/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--output-dir", default=None, help="override output_dir")
    parser.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    parser.add_argument("--precision", choices=PRECISIONS, default=None, help="override train.precision")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _check_init_from(config: RunConfig, heads, target) -> None:
    """Heads continued from heads.init_from must be what the run config says: the same EAGLE layout
    and the feature layers the run computes or caches."""
    h, loaded = config.heads, heads.config
    if loaded.head_kind != h.kind:
        raise UserError(
            f"heads.init_from {h.init_from} holds {loaded.head_kind} heads, but heads.kind is {h.kind!r}; "
            "make them match"
        )
    if h.layout == "eagle3" and loaded.eagle_layout != "eagle3":
        raise UserError(
            f"heads.init_from {h.init_from} holds eagle_layout {loaded.eagle_layout!r} heads, which vLLM and "
            "SGLang cannot serve, but heads.layout is eagle3 (the default for EAGLE heads); continue from EAGLE-3 "
            "heads or set heads.layout: selfdraft"
        )
    if h.layout == "eagle3" and loaded.eagle_fc_bias:
        raise UserError(
            f"heads.init_from {h.init_from} has an fc bias, which vLLM and SGLang cannot serve; continue "
            "from heads without one"
        )
    theirs = normalize_layers(target, loaded.feature_layers)
    if h.kind == "eagle" and normalize_layers(target, h.feature_layers) != theirs:
        raise UserError(
            f"heads.init_from {h.init_from} reads target layers {loaded.feature_layers}, but "
            f"heads.feature_layers is {h.feature_layers}; set heads.feature_layers: {loaded.feature_layers}, "
            "or a list of several layers that includes it (the heads then learn to fuse them)"
        )


def _widen_init(config: RunConfig, heads, target):
    """Heads continued from one target layer on a run that fuses several layers including it start
    as those heads with the fusion picking that layer (`EagleHead.widened`); other heads as loaded."""
    h = config.heads
    if h.kind != "eagle" or not isinstance(heads, EagleHead) or heads.fuse is not None or not h.feature_layers:
        return heads
    ours = [normalize_layers(target, [layer])[0] for layer in h.feature_layers]
    theirs = normalize_layers(target, heads.config.feature_layers)
    if len(ours) < 2 or len(set(ours)) != len(ours) or theirs[0] not in ours:
        return heads
    return heads.widened(h.feature_layers, ours.index(theirs[0]))


def _revocab_init(config: RunConfig, heads, train):
    """Heads continued on a run whose heads.draft_vocab_size differs from theirs get a vocabulary of
    that size rebuilt from the run's training tokens, keeping their trained rows for the tokens both
    hold (`EagleHead.with_draft_vocab`); unset or equal sizes keep theirs."""
    h = config.heads
    size = h.draft_vocab_size
    theirs = heads.config.draft_vocab_size if getattr(heads, "draft_vocab", None) is not None else None
    if h.kind != "eagle" or not size or size == theirs:
        return heads
    if not isinstance(heads, EagleHead):
        raise UserError(
            f"heads.init_from {h.init_from} holds {type(heads).__name__} heads with draft vocabulary "
            f"{theirs}, and heads.draft_vocab_size is {size}; only selfdraft-layout EAGLE heads can change "
            f"their draft vocabulary: set heads.draft_vocab_size: {theirs}"
        )
    counts = count_tokens(train, heads.config.target_vocab_size)
    return heads.with_draft_vocab(*build_draft_vocab(counts, size))


def build_run_heads(config: RunConfig, target, train) -> torch.nn.Module:
    h = config.heads
    resolve_for_target(config, target.config)  # idempotent: `main` resolved it already
    if h.init_from:
        heads = _widen_init(config, load_heads(h.init_from, target), target)
        _check_init_from(config, heads, target)
        return _revocab_init(config, heads, train)
    heads_config = HeadsConfig.for_target(
        target.config,
        head_kind=h.kind,
        draft_vocab_size=h.draft_vocab_size,
        feature_layers=h.feature_layers,
        medusa_num_heads=h.medusa_num_heads,
        medusa_num_layers=h.medusa_num_layers,
        medusa_own_lm_head=h.medusa_own_lm_head,
        eagle_fc_bias=h.fc_bias,
        eagle_layout=h.layout if h.kind == "eagle" else "selfdraft",
    )
    torch.manual_seed(config.train.seed)  # identical initial heads on every rank
    heads = build_heads(heads_config).attach(target)
    if heads.draft_vocab is not None:
        counts = count_tokens(train, heads_config.target_vocab_size)
        heads.draft_vocab.set_maps(*build_draft_vocab(counts, h.draft_vocab_size))
    heads.init_projection_from_target()
    return heads


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


def grouping_lengths(config: RunConfig, train, examples) -> list[int] | None:
    """Every training example's length, for `train.length_grouping` (None when it is off). A feature
    cache holds the split's examples in its order; a partial one holds fewer and cannot be grouped."""
    if not config.train.length_grouping:
        return None
    if len(examples) != len(train):
        raise UserError(
            f"train.length_grouping needs the whole training split, but the feature cache "
            f"{config.data.feature_cache} holds {len(examples)} of its {len(train)} examples; finish it "
            "with `selfdraft prepare` or set train.length_grouping: 0"
        )
    return split_lengths(train)


def hidden_list(features: dict[int, torch.Tensor], num_layers: int) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = [None] * (num_layers + 1)
    for layer, tensor in features.items():
        out[layer] = tensor
    return out


def run_step(
    config: RunConfig, model, batch: dict, target, ttt_steps: int | None = None, exact_labels: bool = False
) -> StepOutput:
    """One forward of the heads' objective. model: the DeepSpeed engine (training, evaluation) or a bare
    `DraftObjective`; both return a `StepOutput`."""
    hidden = hidden_list(batch["features"], target.config.num_hidden_layers)
    lm_head_weight = target.get_output_embeddings().weight
    t = config.train
    if config.heads.kind == "medusa":
        kwargs = {"decay": t.medusa_decay, "hard_labels": t.medusa_hard_labels}
    else:
        kwargs = {
            "ttt_steps": ttt_steps or t.ttt_steps,
            "ttt_decay": t.ttt_decay,
            "feature_weight": t.feature_weight,
            "ce_weight": t.ce_weight,
            "mask_out_of_vocab": t.mask_out_of_vocab,
        }
    return model(
        batch["input_ids"], batch["loss_mask"], hidden, lm_head_weight, exact_labels=exact_labels, **kwargs
    )


def with_features(batch: dict, target, layers: list[int], device, dtype: torch.dtype) -> dict:
    """Put a batch on `device` with its features in `dtype` (the heads' compute dtype); a batch without
    cached features gets them from the frozen target (the online path), already on its device."""
    batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    if "features" not in batch:
        out = compute_features(target, batch["input_ids"], layers, attention_mask=batch["attention_mask"])
        batch["features"] = out["features"]
    batch["features"] = {k: v.to(device, dtype) for k, v in batch["features"].items()}
    return batch


def eval_depths(config: RunConfig, tree: TreeSpec) -> int:
    """How many draft depths evaluation scores: the EAGLE unroll length, or the Medusa head count."""
    if config.heads.kind == "medusa":
        return config.heads.medusa_num_heads
    return max(EVAL_DEPTHS, tree.max_depth, config.train.ttt_steps)


@torch.no_grad()
def evaluate(
    config: RunConfig, model, heldout, target, layers, device, dtype, rank: int = 0, world: int = 1
) -> dict:
    """Held-out loss, top-1 accuracy per depth and simulated acceptance; a collective call.

    Every rank calls it: batch k goes to rank k % world, results are summed with one all-reduce, and
    every rank runs the same number of forwards (a rank short of a batch repeats its first one with
    weight 0), because under ZeRO-3 each forward gathers the partitioned heads from all ranks. The
    batches are the same for every world size, so the numbers do not depend on it.
    """
    rows = [heldout[i] for i in range(min(len(heldout), config.schedule.eval_examples))]
    if not rows:
        return {}
    size = config.train.micro_batch_size
    batches = [rows[at : at + size] for at in range(0, len(rows), size)]
    tree = resolve_tree(config.schedule.eval_tree)
    chain = TreeSpec.chain(EVAL_DEPTHS)
    depth = eval_depths(config, tree)
    # sums over batches: [weight, loss, tau_chain, tau_tree, top1 per depth..., batches per depth...]
    totals = torch.zeros(4 + 2 * depth, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for k in range(rank, math.ceil(len(batches) / world) * world, world):
        weight = 1.0 if k < len(batches) else 0.0
        batch = with_features(collate(batches[k if weight else 0]), target, layers, device, dtype)
        out = run_step(config, model, batch, target, ttt_steps=depth, exact_labels=True)
        accs, chain_tau = simulated_tau(out.depths, chain)
        tree_tau = simulated_tau(out.depths, tree)[1]
        totals[:4] += weight * torch.tensor(
            [1.0, out.metrics["loss"], chain_tau, tree_tau], dtype=torch.float64
        )
        totals[4 : 4 + len(accs)] += weight * torch.tensor(accs, dtype=torch.float64)
        totals[4 + depth : 4 + depth + len(accs)] += weight
    model.train(was_training)
    if world > 1:
        reduced = totals.to(device)
        dist.all_reduce(reduced)
        totals = reduced.cpu()
    n = float(totals[0])
    return {
        "eval_loss": float(totals[1]) / n,
        "eval_top1_by_depth": [
            float(totals[4 + j] / totals[4 + depth + j]) for j in range(depth) if totals[4 + depth + j] > 0
        ],
        "eval_simulated_tau_chain": float(totals[2]) / n,
        "eval_simulated_tau_tree": float(totals[3]) / n,
        "eval_tree": config.schedule.eval_tree,
    }


def heldout_examples(config: RunConfig, heldout, layers: list[int], dtype: torch.dtype):
    """The held-out rows evaluation reads: their cached features when `selfdraft prepare` wrote them
    (see `prepare.heldout_cache_dir`), else the rows themselves (features computed online)."""
    folder = heldout_cache_dir(config)
    if folder is None or len(heldout) == 0:
        return heldout
    try:
        cache = HiddenStateCache(folder, dtype=dtype)
    except (FileNotFoundError, ValueError):
        return heldout
    return cache if cache.holds(heldout) and cache.layers == layers else heldout


class RunLog:
    """JSONL log (rank 0), plus TensorBoard when it is installed."""

    def __init__(self, output_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = output_dir / "log.jsonl"
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, "time": record.get("time", time.time())}  # a stopped run's wall time ends here
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self.tb.add_scalar(key, value, record["step"])
                elif isinstance(value, list):
                    for i, v in enumerate(value):
                        self.tb.add_scalar(f"{key}/{i}", v, record["step"])


class DivergedError(UserError):
    """The loss stopped being a finite number: training diverged."""


def check_finite(loss: torch.Tensor, step: int, output_dir: Path, device, world: int) -> None:
    """Stop every rank together, before the optimizer step, when any rank's loss is NaN or infinite:
    a diverged run must not overwrite the last good checkpoint or heads/ with NaN weights."""
    bad = torch.tensor([0.0 if torch.isfinite(loss.detach()).all() else 1.0], device=device)
    if world > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        last = ckpt.latest_tag(output_dir)
        kept = f"the last good checkpoint ({last}) and heads/ are kept" if last else "nothing was saved"
        raise DivergedError(
            f"training diverged at step {step}: the loss is {float(loss.detach())}; {kept}; "
            "lower train.lr (or raise warmup_steps) and resume or restart"
        )


def main(argv=None) -> int:
    import deepspeed

    args = parse_args(argv)
    overrides: dict = {}
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    train_overrides = {"max_steps": args.max_steps, "precision": args.precision}
    overrides["train"] = {k: v for k, v in train_overrides.items() if v is not None}
    config = load_run_config(args.config, overrides)
    rank, world, device = init_distributed()
    if device.type == "cpu":
        keep_freed_memory()
    output_dir = Path(config.output_dir)
    dtype = resolve_precision(config.train.precision, device)  # target, features and heads' compute
    target, tokenizer = load_target(config.target, dtype=dtype, device=device)
    resolve_for_target(config, target.config)  # eagle3: default layers / draft vocab, checked on the target
    layers = feature_layers(config, target)

    precision = dtype_name(dtype)
    lock = ckpt.hold_run_lock(output_dir) if rank == 0 else None  # noqa: F841 - held until exit
    meta = ckpt.run_meta(config.fingerprint(), world, precision)
    ckpt.check_meta(output_dir, meta, args.resume)
    dist.barrier()
    if rank == 0:
        ckpt.write_meta(output_dir, meta)
        train, heldout = prepare_splits(config, tokenizer)
        if (
            config.data.feature_cache
            and not config.data.partial_cache
            and not cache_ready(config)
            and world == 1
        ):
            prepare_features(config, target, train, heldout=heldout)
    dist.barrier()
    if rank != 0:
        train, heldout = prepare_splits(config, tokenizer)
    if config.data.feature_cache and not config.data.partial_cache and not cache_ready(config):
        raise RuntimeError(
            f"feature cache {config.data.feature_cache} is incomplete; run `selfdraft prepare --config "
            f"{args.config}` first (it resumes where it stopped)"
        )
    examples = (
        HiddenStateCache(config.data.feature_cache, allow_partial=config.data.partial_cache, dtype=dtype)
        if config.data.feature_cache
        else train
    )
    if isinstance(examples, HiddenStateCache) and not set(layers) <= set(examples.layers):
        raise UserError(
            f"feature cache {config.data.feature_cache} holds target layers {examples.layers}, but this run "
            f"reads {layers} (heads.feature_layers / heads.layout); set data.feature_cache to a new folder"
        )
    heldout = heldout_examples(config, heldout, layers, dtype)

    heads = build_run_heads(config, target, train).to(device)
    stream = SampleStream(
        len(examples),
        config.train.seed,
        world,
        rank,
        config.train.micro_batch_size,
        grouping_lengths(config, train, examples),
        config.train.length_grouping,
    )
    accum = config.train.gradient_accumulation_steps
    total = config.train.max_steps or max(1, int(config.train.epochs * stream.steps_per_epoch(accum)))
    optimizer = torch.optim.AdamW(
        [p for p in heads.parameters() if p.requires_grad],
        lr=config.train.lr,
        weight_decay=config.train.weight_decay,
    )
    budget = TimeBudget(None if config.train.max_minutes is None else 60.0 * config.train.max_minutes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(config.train.warmup_steps, total, config.train.lr_schedule, budget.fraction)
    )
    ds_config = deepspeed_config(config, world, dtype)
    engine, _, _, _ = deepspeed.initialize(
        model=DraftObjective(heads), optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)

    step = 0
    tokens_before = 0
    tag = ckpt.latest_tag(output_dir) if args.resume else None
    if tag:
        _, client = engine.load_checkpoint(str(output_dir / "checkpoints"), tag=tag)
        step = int(client["step"])
        tokens_before = int(client.get("tokens_fed", 0))  # 0: a checkpoint written before it was kept
        budget.before = budget.elapsed = float(client.get("train_seconds", 0.0))
    log = RunLog(output_dir, rank == 0)
    log.write(
        {
            "step": step,
            "event": "start" if not tag else "resume",
            "world_size": world,
            "total_steps": total,
            "examples": len(examples),
            "precision": precision,
            "device": str(device),
            "eval_features": "cached" if isinstance(heldout, HiddenStateCache) else "online",
            "time": time.time(),
        }
    )
    bar = tqdm(total=total, initial=step, desc="train", disable=rank != 0, unit="step")
    tokens_seen = 0
    snapshots = sorted(set(config.schedule.snapshot_tokens))
    fed_last = tokens_before
    t_start = budget.start = time.perf_counter()
    last = step >= total or budget.spent
    while not last:
        metrics: dict[str, float] = {}
        for micro in range(accum):
            batch = with_features(
                collate([examples[i] for i in stream.micro_batch(step * accum + micro)]),
                target,
                layers,
                device,
                dtype,
            )
            out = run_step(config, engine, batch, target)  # through the engine: ZeRO hooks, accumulation
            check_finite(out.loss, step + 1, output_dir, device, world)
            engine.backward(out.loss)
            engine.step()
            tokens_seen += int(batch["attention_mask"].sum())
            metrics = out.metrics
        step += 1
        budget.sync(device, world)
        last = step >= total or budget.spent
        accs, _ = simulated_tau(out.depths, TreeSpec.chain(len(out.depths)))
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{accs[0] if accs else 0:.2f}")
        bar.update(1)
        log_now = step % config.schedule.log_every == 0 or last
        save_now = step % config.schedule.save_every == 0 or last
        # a collective when world > 1: only on the steps that use the count (same on every rank)
        fed = fed_tokens(tokens_before, tokens_seen, device, world) if snapshots or log_now or save_now else fed_last
        if log_now:
            elapsed = time.perf_counter() - t_start
            log.write(
                {
                    "step": step,
                    "loss": metrics["loss"],
                    "top1_by_depth": accs,
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s_rank": tokens_seen / elapsed,
                    "tokens_fed": fed,
                    "world_size": world,
                }
            )
        reached = [n for n in snapshots if fed_last < n <= fed]
        scores = evaluate(config, engine, heldout, target, layers, device, dtype, rank, world) if reached else {}
        for n in reached:  # each with its held-out scores: `selfdraft compare` draws the curve from them
            dest = output_dir / "snapshots" / f"tokens-{n}"
            dest.parent.mkdir(exist_ok=True)
            ckpt.export_heads(engine, engine.module.heads, output_dir, rank, zero_stage, dest=dest)
            log.write({"step": step, "event": "snapshot", "path": str(dest), "tokens_fed": fed, **scores})
        fed_last = fed
        # evaluation and saving are collective (every rank, same order): under ZeRO-3 both gather the
        # heads' partitioned parameters from all ranks
        if step % config.schedule.eval_every == 0 or last:
            scores = evaluate(config, engine, heldout, target, layers, device, dtype, rank, world)
            log.write({"step": step, **scores})
        if save_now:
            save_tag = f"step-{step:07d}"

            def save(save_tag: str = save_tag, step: int = step, fed: int = fed) -> None:
                engine.save_checkpoint(
                    str(output_dir / "checkpoints"),
                    tag=save_tag,
                    client_state={
                        "step": step,
                        "fingerprint": config.fingerprint(),
                        "tokens_fed": fed,
                        "train_seconds": budget.elapsed,  # train.max_minutes counts resumed runs' too
                    },
                )
                ckpt.export_heads(engine, engine.module.heads, output_dir, rank, zero_stage)

            # every rank checks the same folder, so all of them stop or all of them save (collective)
            ckpt.save_with_space_check(save, output_dir, save_tag, ckpt.checkpoint_bytes(engine.module.heads))
            if rank == 0:
                ckpt.prune_checkpoints(output_dir, config.schedule.keep_checkpoints)
                log.write({"step": step, "event": "checkpoint"})
            dist.barrier()
    bar.close()
    stop = {"stopped": "max_minutes"} if step < total else {}
    log.write({"step": step, "event": "done", "train_seconds": time.perf_counter() - t_start, **stop})
    ckpt.write_rank_report(output_dir, rank, world, step, engine.module.heads, zero_stage)
    dist.barrier()
    return 0


def fed_tokens(before: int, local: int, device: torch.device, world: int) -> int:
    """Tokens (attention-mask ones) every rank has fed the heads since the run began: `before` came
    from the checkpoint resumed, `local` is this rank's count since then (collective when world > 1)."""
    if world == 1:
        return before + local
    count = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    return before + int(count.item())


def run_worker(argv=None) -> int:
    """The worker's entry: a user error is one line on stderr and exit status 2, as in the CLI."""
    try:
        return main(argv)
    except UserError as err:
        rank = os.environ.get("RANK", "0")
        print(f"selfdraft train (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(run_worker())
