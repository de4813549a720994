"""The heads' forward on a batch (training and evaluation alike) and the held-out evaluation."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from selfdraft.heads.objective import EVAL_DEPTHS, Objective, StepOutput
from selfdraft.training.batches import collate
from selfdraft.training.config import RunConfig
from selfdraft.training.data.feature_cache import HiddenStateCache, compute_features
from selfdraft.training.data.prepare import heldout_cache_dir
from selfdraft.training.output_head import output_head
from selfdraft.training.simulate import simulated_tau
from selfdraft.tree import TreeSpec
from selfdraft.tree_syntax import resolve_tree


def hidden_list(features: dict[int, torch.Tensor], num_layers: int) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = [None] * (num_layers + 1)
    for layer, tensor in features.items():
        out[layer] = tensor
    return out


def run_step(
    config: RunConfig,
    objective: Objective,
    model,
    batch: dict,
    target,
    depth: int | None = None,
    exact_labels: bool = False,
) -> StepOutput:
    """One forward of the heads' objective. model: the DeepSpeed engine (training, evaluation) or a bare
    `DraftObjective`; both return a `StepOutput`. depth: draft depths to score (evaluation)."""
    hidden = hidden_list(batch["features"], target.config.num_hidden_layers)
    options = objective.step_options(config.train, depth)
    return model(
        batch["input_ids"],
        batch["loss_mask"],
        hidden,
        output_head(target),
        exact_labels=exact_labels,
        **options,
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


@torch.no_grad()
def evaluate(
    config: RunConfig,
    objective: Objective,
    model,
    heldout,
    target,
    layers,
    device,
    dtype,
    rank: int = 0,
    world: int = 1,
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
    depth = objective.eval_depths(config, tree)
    # sums over batches: [weight, loss, tau_chain, tau_tree, top1 per depth..., batches per depth...]
    totals = torch.zeros(4 + 2 * depth, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for k in range(rank, math.ceil(len(batches) / world) * world, world):
        weight = 1.0 if k < len(batches) else 0.0
        batch = with_features(collate(batches[k if weight else 0]), target, layers, device, dtype)
        out = run_step(config, objective, model, batch, target, depth=depth, exact_labels=True)
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
