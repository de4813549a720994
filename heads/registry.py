"""Every kind of draft heads selfdraft builds, by layout: the one place that maps a config to a module.

Nothing outside `heads/` asks which kind or layout it holds: it asks the registry what a layout can do
(`head_type(config)`) or the heads themselves (`heads.drafter(rows)`, the `DraftHeads` interface).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from selfdraft.errors import UserError
from selfdraft.heads.config import DEFAULT_LAYOUT, LEGACY_LAYOUT, HeadsConfig
from selfdraft.heads.eagle.module import EagleHead
from selfdraft.heads.eagle3.module import PublishedEagleHead
from selfdraft.heads.medusa.module import MedusaHeads
from selfdraft.heads.objective import Objective

Heads = MedusaHeads | EagleHead | PublishedEagleHead


class DraftHeads(Protocol):
    """What every heads module offers the rest of selfdraft."""

    config: HeadsConfig

    def attach(self, target: nn.Module) -> DraftHeads:
        """Borrow the target's embeddings and lm_head (nothing copied)."""

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V'] of the heads' features."""

    def drafter(self, rows: int):
        """A fresh drafter for `rows` rows of one generate call (see `inference/drafting.py`)."""


@dataclass(frozen=True)
class HeadType:
    kind: str  # HeadsConfig.head_kind
    layout: str  # medusa | selfdraft | eagle1 | eagle3
    module: type[nn.Module]
    servable: bool  # `selfdraft export --to vllm|sglang` writes it for engines
    # what a training run of these heads defaults to, and what it may change when it continues them
    fc_bias: bool = True  # the EAGLE fc's bias (the engines' EAGLE-3 fc has none)
    feature_weight: float = 0.1  # the feature-regression loss (EAGLE-3 feeds back a pre-norm state instead)
    fuses_layers: bool = False  # reads three target layers, chosen from the target's depth by default
    adapts: bool = False  # a continued run may widen its fusion or change its draft vocabulary
    # "module:Class" of its training objective under selfdraft.heads (imported on use: generating never
    # loads the training steps); None: selfdraft loads and serves these heads but does not train them
    trains_with: str | None = None

    def objective(self) -> Objective | None:
        if self.trains_with is None:
            return None
        module, name = self.trains_with.split(":")
        return getattr(importlib.import_module(f".{module}", __package__), name)()


HEAD_TYPES: dict[str, HeadType] = {
    t.layout: t
    for t in (
        HeadType("medusa", "medusa", MedusaHeads, servable=False, trains_with="medusa.objective:MedusaObjective"),
        HeadType(
            "eagle", "selfdraft", EagleHead, servable=False, adapts=True, trains_with="eagle.objective:EagleObjective"
        ),
        HeadType("eagle", "eagle1", PublishedEagleHead, servable=False),
        HeadType(
            "eagle", "eagle3", PublishedEagleHead, servable=True, fc_bias=False, feature_weight=0.0, fuses_layers=True,
            trains_with="eagle3.objective:Eagle3Objective",
        ),
    )
}


def layout_of(config: HeadsConfig) -> str:
    return "medusa" if config.head_kind == "medusa" else config.eagle_layout


def head_type(config: HeadsConfig) -> HeadType:
    return HEAD_TYPES[layout_of(config)]


def head_type_named(kind: str, layout: str | None) -> HeadType | None:
    """The heads a run config names (heads.kind, heads.layout; Medusa ignores the layout); None for an
    unknown pair, which the config's own checks report."""
    if kind == "medusa":
        return HEAD_TYPES["medusa"]
    found = HEAD_TYPES.get(layout or DEFAULT_LAYOUT)
    return found if found is not None and found.kind == kind else None


def training_objective(kind: str, layout: str | None) -> Objective:
    """The objective a run config's heads.kind and heads.layout train with; a one-line error naming the
    trainable ones for heads selfdraft only loads."""
    found = head_type_named(kind, layout)
    objective = found.objective() if found is not None else None
    if objective is None:
        names = [t.kind if t.kind == t.layout else f"{t.kind}/{t.layout}" for t in HEAD_TYPES.values() if t.trains_with]
        raise UserError(
            f"heads.kind {kind!r} with heads.layout {layout!r} cannot be trained; use one of {', '.join(names)} "
            "(kind/layout)"
        )
    return objective


def default_layout(kind: str) -> str:
    """heads.layout when a run config names none: EAGLE-3 for EAGLE heads; Medusa runs have always
    recorded the legacy name (their fingerprints keep it)."""
    return DEFAULT_LAYOUT if kind == "eagle" else LEGACY_LAYOUT


def build_heads(config: HeadsConfig) -> Heads:
    return head_type(config).module(config)


def check_kind(config: HeadsConfig, head_kind: str | None, source: object) -> None:
    """Refuse heads of another kind than the one asked for (`--head-kind`)."""
    if head_kind is not None and config.head_kind != head_kind:
        raise UserError(
            f"head_kind {head_kind!r} (--head-kind), but {source} holds {config.head_kind} heads; "
            "drop it (a heads folder says its own kind) or pass heads of that kind"
        )
