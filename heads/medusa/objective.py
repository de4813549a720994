"""How Medusa heads train: head k at position t learns the target's distribution at t+k+1, the token
x_{t+k+2} (soft labels by default, Medusa-1's hard per-head cross entropy on request).

Shapes as in `heads/objective.py`; K the number of heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfdraft.heads.objective import (
    DepthRanks,
    Objective,
    StepOutput,
    TargetOutput,
    forward_kl,
    greedy_target_ids,
    label_ranks,
    masked_mean,
    target_logits,
)


def medusa_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of Medusa heads. input_ids, loss_mask: [B, T] -> (labels [K, B, T], valid [K, B, T] bool).

    Head k (0-based) at position t predicts x_{t+k+2}: the target's own lm_head at t predicts x_{t+1},
    so Medusa head k+1 looks k+1 tokens further. valid[k, b, t] is False where t+k+2 >= T (no label) or
    loss_mask[b, t+k+2] == 0 (the label is not a token we train on); labels there are 0.
    """
    B, T = input_ids.shape
    labels = torch.zeros(num_heads, B, T, dtype=torch.long, device=input_ids.device)
    valid = torch.zeros(num_heads, B, T, dtype=torch.bool, device=input_ids.device)
    for k in range(num_heads):
        shift = k + 2
        if shift >= T:
            break
        labels[k, :, : T - shift] = input_ids[:, shift:]
        valid[k, :, : T - shift] = loss_mask[:, shift:].bool()
    return labels, valid


def medusa_loss(
    head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, decay: float = 0.8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa-1 loss: sum_k decay**k * CE_k. head_logits: [K, B, T, V]; input_ids, loss_mask: [B, T].

    Returns (loss scalar, per_head_ce [K]); CE_k is the mean cross entropy of head k over its valid
    positions (see `medusa_targets` for the label shift). Heads are looped so only one [B*T, V] float32
    copy of the logits exists at a time.
    """
    K = head_logits.shape[0]
    labels, valid = medusa_targets(input_ids, loss_mask, K)
    per_head = []
    for k in range(K):
        ce = F.cross_entropy(
            head_logits[k].float().flatten(0, 1), labels[k].flatten(), reduction="none"
        )  # [B*T]
        per_head.append(masked_mean(ce, valid[k].flatten()))
    per_head_ce = torch.stack(per_head)
    weights = torch.tensor([decay**k for k in range(K)], device=per_head_ce.device)
    return (weights * per_head_ce).sum(), per_head_ce


def medusa_step(
    heads: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: list[torch.Tensor | None],
    head: TargetOutput,
    *,
    decay: float,
    hard_labels: bool = False,
    exact_labels: bool = False,
) -> StepOutput:
    """Head k at position t is trained towards the target's distribution at t+k+1 (predicting x_{t+k+2}),
    or with hard_labels towards the text token x_{t+k+2} itself (Medusa-1's per-head CE)."""
    last = hidden[-1]
    B, T = input_ids.shape
    K = heads.num_heads
    with torch.no_grad():
        labels = target_logits(last, heads, head)  # [B, T, V']
    loss = torch.zeros((), device=input_ids.device)
    metrics: dict[str, float] = {}
    hits = []
    feats = last
    if hard_labels:
        if heads.draft_vocab is not None:
            raise ValueError(
                "hard-label Medusa training needs heads over the full vocabulary (no draft vocab)"
            )
        loss, per_head = medusa_loss(heads.logits(last), input_ids, loss_mask, decay)
        metrics.update({f"ce_{k}": float(c) for k, c in enumerate(per_head)})
    for k in range(K):
        shift = k + 1
        if shift + 1 >= T:
            break
        logits = heads.logits(feats[:, : T - shift], slice(k, k + 1))[0]  # [B, T-shift, V']
        target = labels[:, shift:]
        v = torch.zeros(B, T - shift, dtype=torch.bool, device=input_ids.device)
        v[:, : T - shift - 1] = loss_mask[:, shift + 1 :].bool()
        if not hard_labels:
            kl = forward_kl(logits, target, v)
            loss = loss + decay**k * kl
            metrics[f"kl_{k}"] = float(kl.detach())
        with torch.no_grad():
            greedy = greedy_target_ids(target, last[:, shift:], heads, head, exact_labels)
            hits.append(DepthRanks(label_ranks(logits, greedy, heads.draft_vocab), v, offset=0))
    metrics["loss"] = float(loss.detach())
    return StepOutput(loss=loss, metrics=metrics, depths=hits)


class MedusaObjective(Objective):
    """Medusa heads: head k drafts depth k+1 from the target's last feature (`medusa_step`)."""

    layout = "selfdraft"

    def step(self, heads, *args, **kwargs) -> StepOutput:
        return medusa_step(heads, *args, **kwargs)

    def step_options(self, train_section, depth: int | None = None) -> dict:
        return {"decay": train_section.medusa_decay, "hard_labels": train_section.medusa_hard_labels}

    def eval_depths(self, config, tree) -> int:
        return config.heads.medusa_num_heads
