"""What every head kind's training step shares: its output, the loss both kinds use, the target's labels,
the ranks that evaluation turns into acceptance, and the `Objective` interface each kind's package
fills in (`medusa/objective.py`, `eagle/objective.py`, `eagle3/objective.py`).

Conventions: B batch, T sequence length, V target vocabulary, V' the heads' vocabulary (V, or Vd with a
draft vocabulary), h hidden size. Losses are float32 whatever the input dtype and averaged over counted
positions; a batch with no counted position gives 0 (not NaN), so a fully masked micro-batch cannot
poison training. Nothing here imports the trainer: the run config comes in as an argument.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from selfdraft.errors import UserError

EVAL_DEPTHS = 4  # draft depths evaluation scores at least (a chain of this length is simulated)
MISS = 1 << 30  # rank of a token the draft cannot propose (outside its vocabulary)
# elements of one chunk's [rows, V] logits in `projected_argmax`: 64 MiB in bfloat16, 128 in float32
PROJECTION_CHUNK_ELEMENTS = 1 << 25


class TargetOutput(Protocol):
    """The target's output head as training reads it (`training/output_head.py:OutputHead`)."""

    weight: torch.Tensor  # [V, h]

    def logits(self, features: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """features: [..., h] post-norm last hidden states -> [..., V] (or [..., len(rows)])."""


class DepthRanks(NamedTuple):  # a tuple: DeepSpeed's ZeRO-3 hooks walk a forward's outputs
    ranks: torch.Tensor  # [B, T] long: rank of the target's greedy token among the draft logits
    valid: torch.Tensor  # [B, T] bool
    offset: int  # depth j's logits for base position b sit at index b + offset


class StepOutput(NamedTuple):
    """A tuple, so DeepSpeed's engine finds the loss in a forward's output and hooks its backward."""

    loss: torch.Tensor  # float32 scalar
    metrics: dict[str, float]
    # per depth: rank of the target's greedy token among the draft logits (training/simulate.py)
    depths: list[DepthRanks]


class Objective:
    """What one kind of heads trains towards; each kind's package subclasses it.

    `config` below is the run's `RunConfig` (training/config.py) and `train` its training split."""

    layout: ClassVar[str]  # HeadsConfig.eagle_layout of the heads the run builds

    def step(self, heads: nn.Module, *args, **kwargs) -> StepOutput:
        """One forward of the heads' loss (the kind's `*_step` function and its arguments)."""
        raise NotImplementedError

    def step_options(self, train_section, depth: int | None = None) -> dict:
        """The step's keyword options from the run's train section; `depth`: score this many draft
        depths (evaluation) instead of the training unroll, where the kind unrolls at all."""
        raise NotImplementedError

    def eval_depths(self, config, tree) -> int:
        """How many draft depths evaluation scores (tree: the run's evaluation TreeSpec)."""
        raise NotImplementedError

    def continue_from(self, config, heads: nn.Module, target, train) -> nn.Module:
        """Heads loaded from heads.init_from, checked against the run config and adapted to it."""
        loaded, h = heads.config, config.heads
        if loaded.head_kind != h.kind:
            raise UserError(
                f"heads.init_from {h.init_from} holds {loaded.head_kind} heads, but heads.kind is {h.kind!r}; "
                "make them match"
            )
        return heads


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p || q) with p the target distribution on the heads' vocabulary (renormalized there).

    draft_logits, target_logits: [B, T, V'] (the target's logits already restricted to the heads'
    vocabulary, see `target_logits`); mask: [B, T]. p = softmax(target_logits), q =
    softmax(draft_logits); KL = sum_v p (log p - log q), averaged over masked positions.
    """
    mask = mask.bool()
    if target_logits.shape[-1] != draft_logits.shape[-1]:
        raise ValueError(f"target vocab {target_logits.shape[-1]} != draft vocab {draft_logits.shape[-1]}")
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return masked_mean(kl, mask)


def target_logits(features_last: torch.Tensor, heads, head: TargetOutput) -> torch.Tensor:
    """The target's logits restricted to the heads' vocab: [B, T, V'] from post-norm features [B, T, h],
    through the target's own output head (its softcap or logit scale included)."""
    vocab = getattr(heads, "draft_vocab", None)
    return head.logits(features_last, None if vocab is None else vocab.target_ids())


def greedy_target_ids(
    labels, features_last, heads, head: TargetOutput, exact: bool, where: torch.Tensor | None = None
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


def projected_argmax(
    features: torch.Tensor, head: TargetOutput, chunk_elements: int = PROJECTION_CHUNK_ELEMENTS
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


def label_ranks(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab=None) -> torch.Tensor:
    """draft_logits: [B, T, V']; target_ids: [B, T] target-vocabulary ids -> ranks [B, T] (0 = top-1,
    strictly above every other logit).

    vocab: the heads' DraftVocab (None when the draft speaks the target vocabulary)."""
    if vocab is None:
        ids = target_ids
        outside = torch.zeros_like(target_ids, dtype=torch.bool)
    else:
        to_draft = torch.full((vocab.t2d.numel(),), -1, dtype=torch.long, device=target_ids.device)
        to_draft[vocab.target_ids()] = torch.arange(vocab.d2t.numel(), device=target_ids.device)
        ids = to_draft[target_ids]
        outside = ids < 0
        ids = ids.clamp(min=0)
    chosen = draft_logits.gather(-1, ids[..., None])
    # Ties count against the label (top-k may pick the other token first), and NaN logits are a miss:
    # diverged heads must never score as accurate.
    ranks = (draft_logits > chosen).sum(-1) + (draft_logits == chosen).sum(-1) - 1
    broken = torch.isnan(draft_logits).any(-1)
    return ranks.clamp(min=0).masked_fill(outside | broken, MISS)
