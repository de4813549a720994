"""The training worker: frozen target + trainable heads under a DeepSpeed engine.

It reads the resolved run config that `selfdraft prepare` / `selfdraft train` wrote into the run folder
(never the recipe: the launcher parsed it once) and the data splits they prepared. One module for every
launch shape:
    selfdraft train --config configs/train/run.yaml [--nproc N]              (prepares, then torchrun)
    selfdraft prepare --config configs/train/run.yaml                        (then any of these:)
    python -m selfdraft.training.train --config runs/NAME/resolved.yaml       (one process)
    torchrun --nproc_per_node N -m selfdraft.training.train --config ...     (N processes / nodes)
    deepspeed --num_gpus N --module selfdraft.training.train --config ...    (DeepSpeed launcher)
The target never enters the optimizer and runs without grad; DeepSpeed holds only the heads. `main`
reads top to bottom in numbered stages: config, processes, target, run folder, data, heads and
engine, resume, the loop, finish.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from selfdraft.errors import UserError
from selfdraft.heads import HeadsConfig, build_heads, load_heads
from selfdraft.heads.objective import Objective, StepOutput
from selfdraft.heads.vocab import build_draft_vocab, count_tokens
from selfdraft.precision import dtype_name
from selfdraft.target import load_target
from selfdraft.training import checkpoint as ckpt
from selfdraft.training import warm_start
from selfdraft.training.allocator import keep_freed_memory
from selfdraft.training.batches import SampleStream, collate, split_lengths
from selfdraft.training.config import RunConfig, check_paths, resolve_for_target, resolve_precision
from selfdraft.training.data.feature_cache import HiddenStateCache
from selfdraft.training.data.prepare import (
    cache_ready,
    check_cache_matches,
    feature_layers,
    load_prepared_splits,
)
from selfdraft.training.distributed import init_distributed, shutdown_distributed
from selfdraft.training.engine import TimeBudget, build_engine, fed_tokens, objective_for
from selfdraft.training.evaluation import evaluate, heldout_examples, run_step, with_features
from selfdraft.training.output_head import check_output_head, output_head
from selfdraft.training.resolved import RESOLVED_FILE, read_resolved
from selfdraft.training.simulate import simulated_tau
from selfdraft.tree import TreeSpec


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train draft heads on a frozen target with DeepSpeed.")
    parser.add_argument(
        "--config",
        required=True,
        help=f"the run folder's resolved config (OUTPUT_DIR/{RESOLVED_FILE}, written by `selfdraft prepare`)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_run_heads(config: RunConfig, target, train, resuming: bool = False) -> torch.nn.Module:
    """The run's heads: on a resume, those of its own export (`ckpt.resumable_heads`; the checkpoint
    then loads their weights); else continued from heads.init_from (checked and adapted by the kind's
    objective; a run folder's heads export, which its optimizer state must still fit), or new ones of
    the run config's shape, their projection and draft vocabulary from the target and the training
    split."""
    h = config.heads
    objective = objective_for(config)
    resolve_for_target(config, target.config)  # idempotent: `main` resolved it already
    own = ckpt.resumable_heads(Path(config.output_dir)) if resuming else None
    if own:
        return load_heads(own, target)
    if h.init_from:
        run_dir = warm_start.source_run(h.init_from)
        loaded = load_heads(warm_start.source_heads(run_dir) if run_dir else h.init_from, target)
        before = warm_start.shapes(loaded)
        heads = objective.continue_from(config, loaded, target, train)
        if run_dir:
            warm_start.check_unadapted(before, heads, run_dir)
        return heads
    heads_config = HeadsConfig.for_target(
        target.config,
        head_kind=h.kind,
        draft_vocab_size=h.draft_vocab_size,
        feature_layers=h.feature_layers,
        medusa_num_heads=h.medusa_num_heads,
        medusa_num_layers=h.medusa_num_layers,
        medusa_own_lm_head=h.medusa_own_lm_head,
        eagle_fc_bias=h.fc_bias,
        eagle_layout=objective.layout,
    )
    torch.manual_seed(config.train.seed)  # identical initial heads on every rank
    heads = build_heads(heads_config).attach(target)
    if heads.draft_vocab is not None:
        counts = count_tokens(train, heads_config.target_vocab_size)
        heads.draft_vocab.set_maps(*build_draft_vocab(counts, h.draft_vocab_size))
    heads.init_projection_from_target()
    return heads


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


@dataclass
class Run:
    """What the training loop reads, fixed once the run has started (stages 1-6 of `main`)."""

    config: RunConfig
    objective: Objective
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    target: torch.nn.Module
    layers: list[int]
    examples: Any  # the training split, or its feature cache
    heldout: Any  # the held-out split, or its feature cache
    engine: Any  # DeepSpeed's engine around `DraftObjective(heads)`
    scheduler: torch.optim.lr_scheduler.LambdaLR
    stream: SampleStream
    total: int  # optimizer steps the run trains for (train.max_steps or epochs)
    budget: TimeBudget
    zero_stage: int
    log: RunLog | None = None
    lock: Any = None  # rank 0's writer lock on the run folder, held as long as the run

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)


@dataclass
class Progress:
    """What changes from step to step; `step` and `tokens_before` come back from a checkpoint."""

    step: int = 0
    tokens_before: int = 0  # tokens fed (every rank) before this process started
    tokens_seen: int = 0  # this rank's tokens since then
    fed_last: int = 0  # tokens fed at the last count
    started: float = 0.0  # perf_counter at the first step of this process
    lr: float = 0.0  # the learning rate the last step ran at


def claim_run_folder(config: RunConfig, resume: bool, rank: int, world: int, precision: str):
    """Refuse a folder of another run (or a fresh start over checkpoints) on every rank; returns
    (this run's meta, the stored one a resume continues or None, rank 0's writer lock held until exit).
    Rank 0 records the meta once the data is known (`record_run`)."""
    output_dir = Path(config.output_dir)
    lock = ckpt.hold_run_lock(output_dir) if rank == 0 else None
    meta = ckpt.run_meta(config.fingerprint(), world, precision, config.settings())
    ckpt.check_meta(output_dir, meta, resume)
    stored = ckpt.read_meta(output_dir) if resume and ckpt.latest_tag(output_dir) else None
    dist.barrier()  # every rank has read run.json before rank 0 rewrites it
    return meta, stored, lock


def load_splits(config: RunConfig, config_path: str, tokenizer):
    """(train, heldout) splits as the launcher prepared them (every rank reads them; none builds), and
    the feature cache checked complete unless the run trains on a partial one."""
    train, heldout = load_prepared_splits(config, tokenizer)
    if config.data.feature_cache and not config.data.partial_cache and not cache_ready(config):
        raise UserError(
            f"feature cache {config.data.feature_cache} is incomplete; run `selfdraft prepare --config "
            f"{config_path}` first (it resumes where it stopped)"
        )
    return train, heldout


def training_examples(config: RunConfig, train, layers: list[int], dtype: torch.dtype, stored: dict | None):
    """What the heads train on: the feature cache when the run names one, else the split itself. A
    partial cache serves the shards finished when the run started, also on resume (`stored`: the
    resumed run's meta), so the sample order stays the same while more shards finish."""
    if not config.data.feature_cache:
        return train
    only = (stored or {}).get("cache_shards") if config.data.partial_cache else None
    cache = HiddenStateCache(
        config.data.feature_cache, allow_partial=config.data.partial_cache, dtype=dtype, only=only
    )
    if not set(layers) <= set(cache.layers):
        raise UserError(
            f"feature cache {config.data.feature_cache} holds target layers {cache.layers}, but this run "
            f"reads {layers} (heads.feature_layers / heads.layout); set data.feature_cache to a new folder"
        )
    check_cache_matches(config, cache, train)
    return cache


def record_run(config: RunConfig, meta: dict, examples, rank: int) -> None:
    """Rank 0 writes run.json: the meta a resume checks, and the feature-cache shards the run reads."""
    if rank != 0:
        return
    if isinstance(examples, HiddenStateCache):
        meta = {**meta, "cache_shards": examples.shard_names}
    ckpt.write_meta(Path(config.output_dir), meta)


def sample_stream(config: RunConfig, train, examples, rank: int, world: int) -> tuple[SampleStream, int]:
    """This rank's sample order, and the optimizer steps the run trains for (train.max_steps, or
    train.epochs over the examples)."""
    t = config.train
    stream = SampleStream(
        len(examples),
        t.seed,
        world,
        rank,
        t.micro_batch_size,
        grouping_lengths(config, train, examples),
        t.length_grouping,
    )
    total = t.max_steps or max(1, int(t.epochs * stream.steps_per_epoch(t.gradient_accumulation_steps)))
    return stream, total


def resume(run: Run, resume: bool) -> Progress:
    """The progress of the newest whole checkpoint (`ckpt.latest_tag`, loaded into the engine), or a
    fresh start (from the optimizer state of the run heads.init_from names, if it names one)."""
    progress = Progress()
    continued = {}  # a run started from another run's checkpoint: which, and its optimizer's steps
    tag = ckpt.latest_tag(run.output_dir) if resume else None
    if tag:
        _, client = run.engine.load_checkpoint(str(run.output_dir / "checkpoints"), tag=tag)
        progress.step = int(client["step"])
        # 0: a checkpoint written before tokens_fed was kept
        progress.tokens_before = int(client.get("tokens_fed", 0))
        run.budget.before = run.budget.elapsed = float(client.get("train_seconds", 0.0))
    elif source := warm_start.source_run(run.config.heads.init_from):
        continued = warm_start.continue_optimizer(run.engine, source)
    progress.fed_last = progress.tokens_before
    run.log = RunLog(run.output_dir, run.rank == 0)
    run.log.write(
        {
            "step": progress.step,
            "event": "start" if not tag else "resume",
            "world_size": run.world,
            "total_steps": run.total,
            "examples": len(run.examples),
            "precision": dtype_name(run.dtype),
            "device": str(run.device),
            "eval_features": "cached" if isinstance(run.heldout, HiddenStateCache) else "online",
            "time": time.time(),
            **continued,
        }
    )
    return progress


def train_step(run: Run, progress: Progress) -> StepOutput:
    """One optimizer step: gradient_accumulation_steps micro-steps through the engine (ZeRO hooks,
    accumulation); returns the last micro-step's output."""
    accum = run.config.train.gradient_accumulation_steps
    progress.lr = run.engine.get_lr()[0]  # the param group's, which this step runs at (the schedule steps after it)
    for micro in range(accum):
        rows = [run.examples[i] for i in run.stream.micro_batch(progress.step * accum + micro)]
        batch = with_features(collate(rows), run.target, run.layers, run.device, run.dtype)
        out = run_step(run.config, run.objective, run.engine, batch, run.target)
        check_finite(out.loss, progress.step + 1, run.output_dir, run.device, run.world)
        run.engine.backward(out.loss)
        run.engine.step()
        progress.tokens_seen += int(batch["attention_mask"].sum())
    progress.step += 1
    return out


def scores(run: Run) -> dict:
    """Held-out scores of the heads now (collective: every rank, same order)."""
    c = run.config
    return evaluate(c, run.objective, run.engine, run.heldout, run.target, run.layers, run.device, run.dtype,
                    run.rank, run.world)  # fmt: skip


def keep_snapshots(run: Run, progress: Progress, fed: int) -> None:
    """Heads kept where the tokens fed first reach a schedule.snapshot_tokens count, each with its
    held-out scores: `selfdraft compare` draws the curve from them."""
    reached = [n for n in sorted(set(run.config.schedule.snapshot_tokens)) if progress.fed_last < n <= fed]
    held_out = scores(run) if reached else {}
    for n in reached:
        dest = run.output_dir / "snapshots" / f"tokens-{n}"
        dest.parent.mkdir(exist_ok=True)
        ckpt.export_heads(
            run.engine, run.engine.module.heads, run.output_dir, run.rank, run.zero_stage, dest=dest
        )
        run.log.write(
            {"step": progress.step, "event": "snapshot", "path": str(dest), "tokens_fed": fed, **held_out}
        )


def save(run: Run, step: int, fed: int) -> None:
    """A checkpoint of the engine and the heads/ export (collective: every rank checks the same folder,
    so all of them stop or all of them save)."""
    tag = f"step-{step:07d}"

    def write() -> None:
        run.engine.save_checkpoint(
            str(run.output_dir / "checkpoints"),
            tag=tag,
            save_latest=False,  # DeepSpeed writes it before every rank has finished: `mark_latest`
            client_state={
                "step": step,
                "fingerprint": run.config.fingerprint(),
                "tokens_fed": fed,
                "train_seconds": run.budget.elapsed,  # train.max_minutes counts resumed runs' too
            },
        )
        ckpt.export_heads(run.engine, run.engine.module.heads, run.output_dir, run.rank, run.zero_stage)

    ckpt.save_with_space_check(write, run.output_dir, tag, ckpt.checkpoint_bytes(run.engine.module.heads))
    dist.barrier()  # every rank's files are written: only now may `latest` name the tag
    if run.rank == 0:
        ckpt.mark_latest(run.output_dir, tag)
        ckpt.prune_checkpoints(run.output_dir, run.config.schedule.keep_checkpoints)
        run.log.write({"step": step, "event": "checkpoint"})
    dist.barrier()


def describe_scores(step: int, held_out: dict) -> str:
    """One progress line of held-out scores (`evaluate`'s dict)."""
    top1 = " ".join(f"{a:.3f}" for a in held_out["eval_top1_by_depth"])
    return (
        f"step {step} held-out: loss {held_out['eval_loss']:.4f}, top-1 by depth {top1}, simulated tau "
        f"chain {held_out['eval_simulated_tau_chain']:.2f} / tree {held_out['eval_tree']} "
        f"{held_out['eval_simulated_tau_tree']:.2f}"
    )


def after_step(run: Run, progress: Progress, out: StepOutput, last: bool) -> None:
    """Log, keep snapshots, evaluate and save as the schedule asks (collective calls in the same
    order on every rank: under ZeRO-3 evaluation and saving gather the heads' parameters)."""
    schedule, step = run.config.schedule, progress.step
    accs, _ = simulated_tau(out.depths, TreeSpec.chain(len(out.depths)))
    log_now = step % schedule.log_every == 0 or last
    save_now = step % schedule.save_every == 0 or last
    # a collective when world > 1: only on the steps that use the count (same on every rank)
    counted = schedule.snapshot_tokens or log_now or save_now
    fed = progress.fed_last
    if counted:
        fed = fed_tokens(progress.tokens_before, progress.tokens_seen, run.device, run.world)
    if log_now:
        run.log.write(
            {
                "step": step,
                "loss": out.metrics["loss"],
                "top1_by_depth": accs,
                "lr": progress.lr,
                "tokens_per_s_rank": progress.tokens_seen / (time.perf_counter() - progress.started),
                "tokens_fed": fed,
                "world_size": run.world,
            }
        )
    keep_snapshots(run, progress, fed)
    progress.fed_last = fed
    if step % schedule.eval_every == 0 or last:
        held_out = scores(run)
        run.log.write({"step": step, **held_out})
        if run.rank == 0 and held_out:
            tqdm.write(describe_scores(step, held_out), file=sys.stderr)
    if save_now:
        save(run, step, fed)


def train_loop(run: Run, progress: Progress) -> None:
    """Steps until train.max_steps / epochs or the time budget, whichever ends first."""
    bar = tqdm(total=run.total, initial=progress.step, desc="train", disable=run.rank != 0, unit="step")
    progress.started = run.budget.start = time.perf_counter()
    last = progress.step >= run.total or run.budget.spent
    while not last:
        out = train_step(run, progress)
        run.budget.sync(run.device, run.world)
        last = progress.step >= run.total or run.budget.spent
        accs, _ = simulated_tau(out.depths, TreeSpec.chain(len(out.depths)))
        bar.set_postfix(loss=f"{out.metrics['loss']:.3f}", acc0=f"{accs[0] if accs else 0:.2f}")
        bar.update(1)
        after_step(run, progress, out, last)
    bar.close()


def finish(run: Run, progress: Progress) -> None:
    stop = {"stopped": "max_minutes"} if progress.step < run.total else {}
    seconds = time.perf_counter() - progress.started
    run.log.write({"step": progress.step, "event": "done", "train_seconds": seconds, **stop})
    ckpt.write_rank_report(
        run.output_dir, run.rank, run.world, progress.step, run.engine.module.heads, run.zero_stage
    )
    dist.barrier()


def main(argv=None) -> int:
    """One run, in numbered stages (the shape of nanoGPT's train.py and SpecForge's train_eagle3.py)."""
    args = parse_args(argv)

    # 1. config: the launcher's resolved file; every path it names checked before the target loads
    config = read_resolved(args.config)
    check_paths(config)
    objective = objective_for(config)

    # 2. processes, device and precision (the target's, its features' and the heads' compute dtype)
    rank, world, device = init_distributed()
    if device.type == "cpu":
        keep_freed_memory()
    dtype = resolve_precision(config.train.precision, device)

    # 3. the frozen target; its output head gives the soft labels, its depth eagle3's default layers
    target, tokenizer = load_target(config.target, dtype=dtype, device=device)
    check_output_head(target, output_head(target))
    resolve_for_target(config, target.config)
    layers = feature_layers(config, target)

    # 4. the run folder: another run's refused, a resumed run's stored meta read
    meta, stored, lock = claim_run_folder(config, args.resume, rank, world, dtype_name(dtype))
    if stored is None and (source := warm_start.source_run(config.heads.init_from)):
        warm_start.check_compatible(source, world, dtype_name(dtype))

    # 5. data: the prepared splits, or their feature cache; run.json records what the run reads
    train, heldout = load_splits(config, args.config, tokenizer)
    examples = training_examples(config, train, layers, dtype, stored)
    record_run(config, meta, examples, rank)
    heldout = heldout_examples(config, heldout, layers, dtype)

    # 6. heads, sample order and the DeepSpeed engine (which holds only the heads)
    heads = build_run_heads(config, target, train, resuming=stored is not None).to(device)
    stream, total = sample_stream(config, train, examples, rank, world)
    engine, scheduler, budget, zero_stage = build_engine(config, objective, heads, total, world, dtype)
    run = Run(
        config, objective, rank, world, device, dtype, target, layers, examples, heldout, engine, scheduler,
        stream, total, budget, zero_stage, lock=lock,
    )  # fmt: skip

    # 7. resume from the newest whole checkpoint, or start fresh
    progress = resume(run, args.resume)

    # 8. the loop: step, then log / snapshot / evaluate / save as the schedule asks
    train_loop(run, progress)

    # 9. finish: the last log line and each rank's report, then the process group torn down
    finish(run, progress)
    shutdown_distributed()
    return 0


def lost_peer(err: BaseException) -> bool:
    """Whether an error is a collective failing because another rank stopped (killed or crashed)."""
    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        mark in text for mark in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    )


def run_worker(argv=None) -> int:
    """The worker's entry: a user error is one line on stderr and exit status 2, as in the CLI; a rank
    that loses another one (killed, crashed) says so in one line and exits 1, Ctrl-C exits 130 quietly
    (the launcher then says how to resume)."""
    rank = os.environ.get("RANK", "0")
    try:
        return main(argv)
    except UserError as err:
        print(f"selfdraft train (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except RuntimeError as err:
        if not lost_peer(err):
            raise
        print(f"selfdraft train (rank {rank}): another rank stopped; stopping too", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(run_worker())
