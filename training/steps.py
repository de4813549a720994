"""One training step's math: heads forward on target features, losses and held-out metrics.

Alignment (EAGLE): pair i = (x_{i+1}, f_i) at position i; the head outputs f_hat_{i+1}, whose logits
predict x_{i+2}; its label is the target's distribution p(. | x_{<=i+1}) = softmax(lm_head(f_{i+1})).
Training-time test (EAGLE-3): unroll step j feeds the head its own step j-1 output; query (j, i)
drafts depth j+1 from base position b = i - j and sees the true context up to b plus its own j
predecessors on the diagonal, which is exactly what tree drafting shows the head at inference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from selfdraft import kv
from selfdraft.training.objectives import eagle_loss, forward_kl, medusa_loss, ttt_weights
from selfdraft.training.output_head import OutputHead
from selfdraft.training.simulate import DepthRanks, label_ranks


class StepOutput(NamedTuple):
    """A tuple, so DeepSpeed's engine finds the loss in a forward's output and hooks its backward."""

    loss: torch.Tensor  # float32 scalar
    metrics: dict[str, float]
    # per depth: rank of the target's greedy token among the draft logits (see simulate.py)
    depths: list[DepthRanks]


class DraftObjective(nn.Module):
    """The heads and their training objective as one module whose forward returns the step's loss.

    DeepSpeed's engine wraps this module, so every micro-step runs through `engine(...)`: the engine's
    forward registers the backward hooks that tell ZeRO where a gradient-accumulation boundary is, and
    ZeRO-3 gathers the heads' partitioned parameters around it. The target is not a submodule: its
    output head (`OutputHead`, the lm_head weight) comes in as an argument and never enters the engine
    or its optimizer.
    step: the heads kind's step function (`eagle_step`, `medusa_step`; see `training/strategies.py`).
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


def ttt_mask(length: int, step: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Additive mask [1, 1, T, (step+1) T] for unroll step `step` over blocks 0..step of length T.

    Query i of block `step` sees block 0 at positions <= i - step and block k (1..step) at position
    i - step + k only. Rows with i < step have no valid base; they keep their diagonal to stay finite.
    """
    i = torch.arange(length, device=device)[:, None]
    c = torch.arange(length, device=device)[None, :]
    blocks = [c <= i - step]
    blocks += [c == i - step + k for k in range(1, step + 1)]
    allowed = torch.cat(blocks, dim=1)
    if step > 0:
        allowed[:, -length:] |= torch.eye(length, dtype=torch.bool, device=device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    return mask[None, None]


def target_logits(features_last: torch.Tensor, heads, head: OutputHead) -> torch.Tensor:
    """The target's logits restricted to the heads' vocab: [B, T, V'] from post-norm features [B, T, h],
    through the target's own output head (its softcap or logit scale included)."""
    vocab = getattr(heads, "draft_vocab", None)
    return head.logits(features_last, None if vocab is None else vocab.target_ids())


def eagle_step(
    heads: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: list[torch.Tensor | None],
    head: OutputHead,
    *,
    ttt_steps: int,
    ttt_decay: float,
    feature_weight: float,
    ce_weight: float,
    exact_labels: bool = False,
    mask_out_of_vocab: bool = False,
) -> StepOutput:
    """input_ids, loss_mask: [B, T]; hidden: the target's output_hidden_states as a list of [B, T, h]
    (None for layers not needed); hidden[-1] (post-norm, the target's logits come from it) is required.

    mask_out_of_vocab (EAGLE-3): with a reduced draft vocabulary, positions whose target greedy token
    lies outside it get no loss; the renormalized label there would teach the head a token the target
    does not pick. It needs the greedy token over the full vocabulary, so it implies exact labels."""
    f = heads.fuse_features(hidden)  # [B, T, h]
    last = hidden[-1]
    B, T = input_ids.shape
    n = T - 1
    tokens, f_in = input_ids[:, 1:], f[:, :-1]
    with torch.no_grad():
        labels = target_logits(last[:, 1:], heads, head)  # [B, n, V']
        feature_targets = last[:, 1:]
    # x_{i+2} must exist and be a trained-on token
    valid = torch.zeros(B, n, dtype=torch.bool, device=input_ids.device)
    valid[:, :-1] = loss_mask[:, 2:].bool()
    positions = torch.arange(n, device=input_ids.device)[None].expand(B, n)
    weights = ttt_weights(ttt_steps, ttt_decay)
    vocab = heads.draft_vocab
    masking = mask_out_of_vocab and vocab is not None
    with torch.no_grad():
        greedy = _greedy_target_ids(
            labels, feature_targets, heads, head, exact_labels or masking, where=valid
        )
        target_probs = torch.softmax(labels.float(), dim=-1)
        if masking:
            in_vocab = vocab.t2d[greedy]  # [B, n]
            metrics_oov = float((~in_vocab & valid).sum()) / max(1, int(valid.sum()))
    # the loss skips out-of-vocabulary positions; the accuracy metrics keep them, as misses
    trained = valid & in_vocab if masking else valid
    cache = kv.new_cache() if ttt_steps > 1 else None
    loss = torch.zeros((), device=input_ids.device)
    metrics: dict[str, float] = {"out_of_vocab": metrics_oov} if masking else {}
    hits = []
    feats = f_in
    for j in range(ttt_steps):
        mask = ttt_mask(n, j, f.dtype, input_ids.device)
        out = heads(tokens, feats, position_ids=positions, attention_mask=mask, cache=cache)
        logits = heads.logits(out)
        v, t = valid.clone(), trained.clone()
        v[:, :j] = False
        t[:, :j] = False
        terms = eagle_loss(out, feature_targets, logits, target_probs, t, feature_weight, ce_weight)
        loss = loss + weights[j] * terms.loss
        metrics[f"ce_{j}"] = float(terms.ce.detach())
        with torch.no_grad():
            hits.append(DepthRanks(label_ranks(logits, greedy, heads.draft_vocab), v, offset=j))
        # next step reads this step's prediction at the previous position
        feats = torch.cat([f_in[:, :1], out[:, :-1]], dim=1)
    metrics["loss"] = float(loss.detach())
    return StepOutput(loss=loss, metrics=metrics, depths=hits)


def medusa_step(
    heads: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: list[torch.Tensor | None],
    head: OutputHead,
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
            greedy = _greedy_target_ids(target, last[:, shift:], heads, head, exact_labels)
            hits.append(DepthRanks(label_ranks(logits, greedy, heads.draft_vocab), v, offset=0))
    metrics["loss"] = float(loss.detach())
    return StepOutput(loss=loss, metrics=metrics, depths=hits)


def _greedy_target_ids(
    labels, features_last, heads, head: OutputHead, exact: bool, where: torch.Tensor | None = None
) -> torch.Tensor:
    """The target's greedy next token as a target id [B, T'].

    exact=False takes the argmax over the heads' vocabulary (free: the labels are already there);
    exact=True recomputes it over the full target vocabulary (evaluation), so a greedy token that
    the draft vocabulary lacks counts as a miss instead of being silently replaced. where: [B, T'] bool,
    the positions that need the exact token (the others keep the free one): the full-vocabulary
    projection took 22% of a short run's py-spy samples, and prompt and padding positions never use it."""
    if exact and where is None:
        return projected_argmax(features_last, head)
    ids = labels.argmax(-1)
    vocab = getattr(heads, "draft_vocab", None)
    ids = vocab.to_target(ids) if vocab is not None else ids
    if not exact:
        return ids
    ids[where] = projected_argmax(features_last[where], head)
    return ids


# elements of one chunk's [rows, V] logits in `projected_argmax`: 64 MiB in bfloat16, 128 in float32
PROJECTION_CHUNK_ELEMENTS = 1 << 25


def projected_argmax(
    features: torch.Tensor, head: OutputHead, chunk_elements: int = PROJECTION_CHUNK_ELEMENTS
) -> torch.Tensor:
    """argmax(head.logits(features)) over the last dim, computed in row chunks. features: [..., h],
    head.weight: [V, h] -> LongTensor [...].

    The full-vocabulary logits of a whole micro-batch are never held at once: with a 151,936-token
    vocabulary, 32 x 1024 positions would take 20 GB in float32; a chunk keeps at most
    `chunk_elements` logits, whatever the vocabulary."""
    flat = features.reshape(-1, features.shape[-1])
    rows = max(1, chunk_elements // head.weight.shape[0])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=features.device)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = head.logits(flat[start : start + rows]).argmax(-1)
    return out.reshape(features.shape[:-1])
