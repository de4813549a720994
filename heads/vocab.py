"""How heads see the target's vocabulary: the target's embeddings and lm_head, borrowed, a reduced
draft vocabulary with its maps to the target's (EAGLE-3's `d2t` / `t2d`: target_id = draft_id +
d2t[draft_id]), which an own projection of the heads ranks and which a training run builds from its
tokens (`count_tokens`, `build_draft_vocab`), and the children a drafter takes from the heads' logits
(ranked or drawn) as target ids.

The borrowed modules are held in a plain dataclass, not as submodules, so they never enter the heads'
`state_dict`, their parameters, or an optimizer: nothing is copied and nothing of the target is ever
saved with heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Borrowed:
    embed: nn.Module
    lm_head: nn.Module

    @classmethod
    def from_target(cls, target: nn.Module) -> Borrowed:
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or lm_head is None:
            raise ValueError(f"{type(target).__name__} exposes no input embeddings or lm_head to borrow")
        return cls(embed=embed, lm_head=lm_head)


class BorrowingModule(nn.Module):
    """Base for heads: `attach(target)` borrows its embeddings and lm_head."""

    borrowed: Borrowed | None = None

    def attach(self, target: nn.Module) -> BorrowingModule:
        self.borrowed = Borrowed.from_target(target)
        return self

    def _need(self) -> Borrowed:
        if self.borrowed is None:
            raise RuntimeError("heads are not attached to a target: call heads.attach(target) first")
        return self.borrowed

    # EAGLE-style heads set `self.lm_head`: their own projection over a draft vocabulary (with
    # `self.draft_vocab` mapping draft ids to target ids), or None to use the target's. No class-level
    # default: it would shadow the submodule nn.Module registers under that name.

    def init_projection_from_target(self) -> None:
        """An own draft projection starts as the target's lm_head rows of the draft vocabulary."""
        if self.lm_head is None:
            return
        weight = self._need().lm_head.weight[self.draft_vocab.target_ids()]
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., h] -> logits [..., V'] by the own projection, or the target's lm_head
        (which may hold another dtype than the heads)."""
        if self.lm_head is None:
            lm_head = self._need().lm_head
            return lm_head(features.to(lm_head.weight.dtype))
        return self.lm_head(features)


class DraftVocab(nn.Module):
    """Maps between a reduced draft vocabulary [Vd] and the target vocabulary [V]."""

    def __init__(self, draft_vocab_size: int, target_vocab_size: int) -> None:
        super().__init__()
        # Identity maps until trained maps are loaded (the first Vd target ids).
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"map shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not match the draft vocab")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft_ids: [...] -> target ids [...]."""
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id: [Vd]."""
        return self.to_target(torch.arange(self.d2t.numel(), device=self.d2t.device))

    def scatter_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: [..., Vd] over the draft vocab -> [..., V] over the target vocab (zeros elsewhere)."""
        out = probs.new_zeros(*probs.shape[:-1], self.t2d.numel())
        return out.index_copy_(-1, self.target_ids(), probs)


def ranked_children(logits: torch.Tensor, k: int, heads) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V'] -> (k best target ids [n, k], their draft log-probabilities [n, k]), best first."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logq, k, dim=-1)
    vocab = getattr(heads, "draft_vocab", None)
    ids = vocab.to_target(top.indices) if vocab is not None else top.indices
    return ids, top.values


# Mass spread uniformly over the draft vocabulary in a drawing drafter's q: every token keeps q > 0,
# so a row always has k distinct tokens to draw; q is ours to choose, and acceptance uses this exact q.
DRAW_FLOOR = 1e-6


def drawn_children(
    logits: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None, heads
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k children per node drawn without replacement from q = softmax(logits / T) (floored, see
    DRAW_FLOOR), in draw order: the Gumbel top-k of log q is exactly such a draw.

    logits: [n, V'] -> (target ids [n, k], log q of each draw [n, k], q [n, V'] float32)."""
    q = torch.softmax(logits.float() / temperature, dim=-1)
    q = q * (1.0 - DRAW_FLOOR) + DRAW_FLOOR / q.shape[-1]
    logq = q.log()
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(min=torch.finfo(torch.float32).tiny)
    draws = torch.topk(logq - torch.log(-torch.log(u)), k, dim=-1).indices
    vocab = getattr(heads, "draft_vocab", None)
    ids = vocab.to_target(draws) if vocab is not None else draws
    return ids, logq.gather(-1, draws), q


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
