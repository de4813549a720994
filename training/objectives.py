"""Training objectives of draft heads, as pure functions on tensors.

Conventions: B batch, T sequence length, V target vocabulary, Vd draft vocabulary, h hidden size,
K Medusa heads. `loss_mask` / `mask` is 1 on positions that count (see each docstring for which token it
refers to). Losses are computed in float32 whatever the input dtype, and averaged over counted positions;
a batch with no counted position gives 0 (not NaN), so a fully masked micro-batch cannot poison training.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# --------------------------------------------------------------------------------------------------- Medusa


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
        per_head.append(_masked_mean(ce, valid[k].flatten()))
    per_head_ce = torch.stack(per_head)
    weights = torch.tensor([decay**k for k in range(K)], device=per_head_ce.device)
    return (weights * per_head_ce).sum(), per_head_ce


# ---------------------------------------------------------------------------------------------------- EAGLE


class EagleLoss(NamedTuple):
    loss: torch.Tensor  # feature_weight * feature + ce_weight * ce
    feature: torch.Tensor  # SmoothL1 regression of the next feature
    ce: torch.Tensor  # soft cross entropy against the target's distribution


def eagle_loss(
    pred_features: torch.Tensor,
    target_features: torch.Tensor,
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
) -> EagleLoss:
    """EAGLE-1/2 loss: feature_weight * SmoothL1(f_hat, f) + ce_weight * CE(p, softmax(draft_logits)).

    All inputs are aligned position by position; the caller does the shift. In EAGLE the head at
    position t reads (f_t, e(x_{t+1})) and outputs f_hat_{t+1}; so pred_features[:, t] = f_hat_{t+1}
    pairs with target_features[:, t] = f_{t+1} (the target's last hidden state one step later),
    draft_logits[:, t] = lm_head(f_hat_{t+1}) and target_probs[:, t] = p(x_{t+2} | x_{<=t+1}) =
    softmax(lm_head(f_{t+1})).

    pred_features, target_features: [B, T, h]; draft_logits, target_probs: [B, T, Vd]; mask: [B, T]
    (1 where x_{t+2} is a trained-on token). SmoothL1 is averaged over h, CE summed over Vd, both then
    averaged over masked positions, as in the reference implementation.
    """
    feature = F.smooth_l1_loss(pred_features.float(), target_features.float(), reduction="none").mean(-1)
    soft_ce = -(target_probs.float() * torch.log_softmax(draft_logits.float(), dim=-1)).sum(-1)
    feature_loss, ce = _masked_mean(feature, mask), _masked_mean(soft_ce, mask)
    return EagleLoss(feature_weight * feature_loss + ce_weight * ce, feature_loss, ce)


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p || q) with p the target distribution on the heads' vocabulary (renormalized there).

    draft_logits, target_logits: [B, T, V'] (the target's logits already restricted to the heads'
    vocabulary, see `steps.target_logits`); mask: [B, T]. p = softmax(target_logits), q =
    softmax(draft_logits); KL = sum_v p (log p - log q), averaged over masked positions.
    """
    mask = mask.bool()
    if target_logits.shape[-1] != draft_logits.shape[-1]:
        raise ValueError(f"target vocab {target_logits.shape[-1]} != draft vocab {draft_logits.shape[-1]}")
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return _masked_mean(kl, mask)


def ttt_weights(n_steps: int, decay: float = 0.8) -> torch.Tensor:
    """Weights of the EAGLE-3 training-time-test unroll steps i = 0..n_steps-1: decay**i. -> [n_steps]."""
    return torch.tensor([decay**i for i in range(n_steps)], dtype=torch.float32)


# ------------------------------------------------------------------------------------------- draft vocab


def count_tokens(dataset: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """Frequency of each target token among loss-masked tokens (what the draft must propose). -> [V].

    dataset: rows with input_ids and loss_mask; a `datasets.Dataset` is read in numpy batches (row by
    row, converting Python lists, took ~90 s on ShareGPT instead of ~1 s).
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    if hasattr(dataset, "with_format"):
        batches = dataset.with_format("numpy").iter(batch_size=1024)
    else:
        batches = ({"input_ids": [row["input_ids"]], "loss_mask": [row["loss_mask"]]} for row in dataset)
    for batch in batches:
        if len(batch["input_ids"]) == 0:
            continue
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in batch["input_ids"]])
        keep = np.concatenate([np.asarray(x) for x in batch["loss_mask"]]).astype(bool)
        counts += np.bincount(ids[keep], minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3 draft vocabulary: the draft_vocab_size most frequent target tokens.

    token_counts: [V]. Returns d2t: LongTensor[Vd] with target_id = draft_id + d2t[draft_id], and
    t2d: BoolTensor[V], True iff the target token is in the draft vocab. Draft ids are sorted by target
    id (so t2d selects logits in draft order). Ties, including never-seen tokens used to fill the
    vocab, go to the lower target id: the result is always exactly Vd tokens and deterministic.
    """
    V = token_counts.shape[0]
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V}, got {draft_vocab_size}")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-token_counts.to(torch.long), stable=True).indices
    target_ids = torch.sort(order[:draft_vocab_size]).values
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d
