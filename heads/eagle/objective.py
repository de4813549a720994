"""How EAGLE heads train (EAGLE-1/2 and our selfdraft layout; `eagle3/objective.py` narrows it for
the published EAGLE-3 layout): the head regresses the target's next feature and matches its next-token
distribution, unrolled on its own outputs (training-time test).

Alignment: pair i = (x_{i+1}, f_i) at position i; the head outputs f_hat_{i+1}, whose logits predict
x_{i+2}; its label is the target's distribution p(. | x_{<=i+1}) = softmax(lm_head(f_{i+1})).
Training-time test (EAGLE-3): unroll step j feeds the head its own step j-1 output; query (j, i)
drafts depth j+1 from base position b = i - j and sees the true context up to b plus its own j
predecessors on the diagonal, which is exactly what tree drafting shows the head at inference.
Shapes as in `heads/objective.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from selfdraft import kv
from selfdraft.errors import UserError
from selfdraft.heads.config import normalize_layers
from selfdraft.heads.objective import (
    EVAL_DEPTHS,
    MISS,
    DepthRanks,
    Objective,
    StepOutput,
    TargetOutput,
    greedy_target_ids,
    label_ranks,
    masked_mean,
    target_logits,
)
from selfdraft.heads.registry import head_type
from selfdraft.heads.vocab import build_draft_vocab, count_tokens


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
    feature_loss, ce = masked_mean(feature, mask), masked_mean(soft_ce, mask)
    return EagleLoss(feature_weight * feature_loss + ce_weight * ce, feature_loss, ce)


def ttt_weights(n_steps: int, decay: float = 0.8) -> torch.Tensor:
    """Weights of the EAGLE-3 training-time-test unroll steps i = 0..n_steps-1: decay**i. -> [n_steps]."""
    return torch.tensor([decay**i for i in range(n_steps)], dtype=torch.float32)


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


def ttt_bases(n: int, stride: int, salt: int, device="cpu") -> torch.Tensor:
    """Base positions b whose chains the unroll steps after the first continue: every `stride`-th of
    0..n-1 from offset salt % stride -> [m] long, m = ceil((n - offset) / stride). `salt` comes from
    the batch's tokens, so a resumed run replays the same chains and every offset gets its turn."""
    return torch.arange(salt % stride, n, stride, device=device)


def chain_mask(length: int, bases: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, m, T + step m] for unroll step `step` >= 1 of the m chains at `bases`.

    Keys are step 0's T positions, then one block of m chain entries per later step. Chain c's query
    (at position b_c + step) sees step 0 at positions <= b_c and, in each later block, its own entry
    only: the same keys `ttt_mask` gives position b_c + step, so the chains compute exactly what the
    full unroll computes there.
    """
    m = bases.shape[0]
    c = torch.arange(length, device=bases.device)[None, :]
    prefix = c <= bases[:, None]  # [m, T]
    own = torch.eye(m, dtype=torch.bool, device=bases.device).repeat(1, step)  # [m, step m]
    allowed = torch.cat([prefix, own], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=bases.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    return mask[None, None]


def eagle_step(
    heads: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: list[torch.Tensor | None],
    head: TargetOutput,
    *,
    ttt_steps: int,
    ttt_decay: float,
    feature_weight: float,
    ce_weight: float,
    exact_labels: bool = False,
    mask_out_of_vocab: bool = False,
    ttt_stride: int = 1,
) -> StepOutput:
    """input_ids, loss_mask: [B, T]; hidden: the target's output_hidden_states as a list of [B, T, h]
    (None for layers not needed); hidden[-1] (post-norm, the target's logits come from it) is required.

    mask_out_of_vocab (EAGLE-3): with a reduced draft vocabulary, positions whose target greedy token
    lies outside it get no loss; the renormalized label there would teach the head a token the target
    does not pick. It needs the greedy token over the full vocabulary, so it implies exact labels.

    ttt_stride k > 1: step 0 trains every position; the later unroll steps continue only the chains
    of every k-th base position (`ttt_bases`), about 1/k of their compute. A chain sees exactly what
    the full unroll shows that position (`chain_mask`), so its losses and ranks are the full unroll's
    at those positions; depths 2 and on then learn from 1/k of the positions per step."""
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
        greedy = greedy_target_ids(labels, feature_targets, heads, head, exact_labels or masking, where=valid)
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
    chains = ttt_bases(n, ttt_stride, int(input_ids.sum()), input_ids.device) if ttt_stride > 1 else None
    for j in range(ttt_steps):
        # the positions the chains query at step j (None: every position); past the end: see _spread
        at = None if chains is None or j == 0 else (chains + j).clamp(max=n - 1)
        mask = ttt_mask(n, j, f.dtype, input_ids.device) if at is None else chain_mask(n, chains, j, f.dtype)
        out = heads(_at(tokens, at), feats, position_ids=_at(positions, at), attention_mask=mask, cache=cache)
        logits = heads.logits(out)
        v, t = _at(valid, at).clone(), _at(trained, at).clone()
        if at is None:  # positions i < j have no base position
            v[:, :j] = False
            t[:, :j] = False
        terms = eagle_loss(
            out, _at(feature_targets, at), logits, _at(target_probs, at), t, feature_weight, ce_weight
        )
        loss = loss + weights[j] * terms.loss
        metrics[f"ce_{j}"] = float(terms.ce.detach())
        with torch.no_grad():
            ranks = label_ranks(logits, _at(greedy, at), heads.draft_vocab)
            hits.append(DepthRanks(*_spread(ranks, v, at, n), offset=j))
        if chains is None:  # next step reads this step's prediction at the previous position
            feats = torch.cat([f_in[:, :1], out[:, :-1]], dim=1)
        else:  # a chain's next step reads its own prediction
            feats = out[:, chains] if at is None else out
    metrics["loss"] = float(loss.detach())
    return StepOutput(loss=loss, metrics=metrics, depths=hits)


def _at(x: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """x: [B, n, ...] -> the chains' positions [B, m, ...] (all of x when at is None)."""
    return x if at is None else x[:, at]


def _spread(
    ranks: torch.Tensor, valid: torch.Tensor, at: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chains' ranks and validity [B, m] back at their positions in [B, n] (others invalid).
    Chains past the end were clamped onto position n - 1, which never has a label, so where several
    land on it all of them are invalid."""
    if at is None:
        return ranks, valid
    full = ranks.new_full((ranks.shape[0], n), MISS)
    seen = valid.new_zeros((valid.shape[0], n))
    full[:, at], seen[:, at] = ranks, valid
    return full, seen


class EagleObjective(Objective):
    """Our EAGLE head (layout selfdraft): feature regression + soft CE, unrolled `ttt_steps` times
    (`eagle_step`). Heads continued from one target layer can fuse more (`EagleHead.widened`)
    and change their draft vocabulary (`EagleHead.with_draft_vocab`)."""

    layout = "selfdraft"

    def step(self, heads, *args, **kwargs) -> StepOutput:
        return eagle_step(heads, *args, **kwargs)

    def step_options(self, train_section, depth: int | None = None) -> dict:
        return {
            "ttt_steps": depth or train_section.ttt_steps,
            "ttt_decay": train_section.ttt_decay,
            "feature_weight": train_section.feature_weight,
            "ce_weight": train_section.ce_weight,
            "mask_out_of_vocab": train_section.mask_out_of_vocab,
            # evaluation scores every position
            "ttt_stride": 1 if depth else train_section.ttt_stride,
        }

    def eval_depths(self, config, tree) -> int:
        return max(EVAL_DEPTHS, tree.max_depth, config.train.ttt_steps)

    def continue_from(self, config, heads: nn.Module, target, train) -> nn.Module:
        heads = self._widened(config, super().continue_from(config, heads, target, train), target)
        self._check_layout(config, heads)
        self._check_layers(config, heads, target)
        return self._revocabulary(config, heads, train)

    def _check_layout(self, config, heads: nn.Module) -> None:
        """Our layout continues heads of any EAGLE layout (published ones keep theirs)."""

    @staticmethod
    def _check_layers(config, heads: nn.Module, target) -> None:
        h, loaded = config.heads, heads.config
        if normalize_layers(target, h.feature_layers) != normalize_layers(target, loaded.feature_layers):
            raise UserError(
                f"heads.init_from {h.init_from} reads target layers {loaded.feature_layers}, but "
                f"heads.feature_layers is {h.feature_layers}; set heads.feature_layers: "
                f"{loaded.feature_layers}, or a list of several layers that includes it (the heads then "
                "learn to fuse them)"
            )

    @staticmethod
    def _widened(config, heads: nn.Module, target) -> nn.Module:
        """Heads continued from one target layer on a run that fuses several layers including it
        start as those heads with the fusion picking that layer; other heads as loaded."""
        h, loaded = config.heads, heads.config
        if not head_type(loaded).adapts or loaded.num_feature_layers != 1 or not h.feature_layers:
            return heads
        ours = [normalize_layers(target, [layer])[0] for layer in h.feature_layers]
        theirs = normalize_layers(target, loaded.feature_layers)
        if len(ours) < 2 or len(set(ours)) != len(ours) or theirs[0] not in ours:
            return heads
        return heads.widened(h.feature_layers, ours.index(theirs[0]))

    @staticmethod
    def _revocabulary(config, heads: nn.Module, train) -> nn.Module:
        """Heads continued on a run whose heads.draft_vocab_size differs from theirs get a vocabulary
        of that size rebuilt from the run's training tokens, keeping their trained rows for the tokens
        both hold; unset or equal sizes keep theirs. Only our layout can change its vocabulary."""
        h, loaded = config.heads, heads.config
        size = h.draft_vocab_size
        theirs = loaded.draft_vocab_size if getattr(heads, "draft_vocab", None) is not None else None
        if not size or size == theirs:
            return heads
        if not head_type(loaded).adapts:
            raise UserError(
                f"heads.init_from {h.init_from} holds {loaded.eagle_layout}-layout heads with draft "
                f"vocabulary {theirs}, and heads.draft_vocab_size is {size}; only selfdraft-layout EAGLE "
                f"heads can change their draft vocabulary: set heads.draft_vocab_size: {theirs}"
            )
        counts = count_tokens(train, loaded.target_vocab_size)
        return heads.with_draft_vocab(*build_draft_vocab(counts, size))
