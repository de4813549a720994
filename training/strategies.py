"""One training objective per head kind, behind one interface, chosen by a table from the run config.

The trainer (`training/train.py`) builds, continues, steps and evaluates heads through an `Objective`
and never asks which kind it holds; what differs between Medusa heads, our EAGLE head and the
exportable EAGLE-3 head lives here, one class each:

- which head architecture the run builds (`layout`);
- what heads continued from `heads.init_from` must match and how they are adapted (`continue_from`);
- the step's math (`step`: `steps.medusa_step` or `steps.eagle_step`) and its options from the run
  config (`step_options`);
- how many draft depths evaluation scores (`eval_depths`).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from selfdraft.errors import UserError
from selfdraft.heads.registry import head_type
from selfdraft.training.config import RunConfig, TrainSection
from selfdraft.training.data.feature_cache import normalize_layers
from selfdraft.training.objectives import build_draft_vocab, count_tokens
from selfdraft.training.steps import StepOutput, eagle_step, medusa_step
from selfdraft.tree import TreeSpec

EVAL_DEPTHS = 4  # draft depths evaluation scores at least (a chain of this length is simulated)


class Objective:
    """What a head kind trains towards; subclasses fill in the parts that differ."""

    kind: ClassVar[str]  # heads.kind
    layout: ClassVar[str]  # HeadsConfig.eagle_layout of the heads the run builds

    def step(self, heads: nn.Module, *args, **kwargs) -> StepOutput:
        """One forward of the heads' loss: `steps.eagle_step` / `steps.medusa_step`'s arguments."""
        raise NotImplementedError

    def step_options(self, train: TrainSection, depth: int | None = None) -> dict:
        """The step's keyword options from the run's train section; `depth`: score this many draft
        depths (evaluation) instead of the training unroll, where the kind unrolls at all."""
        raise NotImplementedError

    def eval_depths(self, config: RunConfig, tree: TreeSpec) -> int:
        """How many draft depths evaluation scores."""
        raise NotImplementedError

    def continue_from(self, config: RunConfig, heads: nn.Module, target, train) -> nn.Module:
        """Heads loaded from heads.init_from, checked against the run config and adapted to it."""
        loaded, h = heads.config, config.heads
        if loaded.head_kind != h.kind:
            raise UserError(
                f"heads.init_from {h.init_from} holds {loaded.head_kind} heads, but heads.kind is {h.kind!r}; "
                "make them match"
            )
        return heads


class MedusaObjective(Objective):
    """Medusa heads: head k drafts depth k+1 from the target's last feature (`steps.medusa_step`)."""

    kind = "medusa"
    layout = "selfdraft"

    def step(self, heads, *args, **kwargs) -> StepOutput:
        return medusa_step(heads, *args, **kwargs)

    def step_options(self, train: TrainSection, depth: int | None = None) -> dict:
        return {"decay": train.medusa_decay, "hard_labels": train.medusa_hard_labels}

    def eval_depths(self, config: RunConfig, tree: TreeSpec) -> int:
        return config.heads.medusa_num_heads


class EagleObjective(Objective):
    """Our EAGLE head (layout selfdraft): feature regression + soft CE, unrolled `ttt_steps` times
    (`steps.eagle_step`). Heads continued from one target layer can fuse more (`EagleHead.widened`)
    and change their draft vocabulary (`EagleHead.with_draft_vocab`)."""

    kind = "eagle"
    layout = "selfdraft"

    def step(self, heads, *args, **kwargs) -> StepOutput:
        return eagle_step(heads, *args, **kwargs)

    def step_options(self, train: TrainSection, depth: int | None = None) -> dict:
        return {
            "ttt_steps": depth or train.ttt_steps,
            "ttt_decay": train.ttt_decay,
            "feature_weight": train.feature_weight,
            "ce_weight": train.ce_weight,
            "mask_out_of_vocab": train.mask_out_of_vocab,
        }

    def eval_depths(self, config: RunConfig, tree: TreeSpec) -> int:
        return max(EVAL_DEPTHS, tree.max_depth, config.train.ttt_steps)

    def continue_from(self, config: RunConfig, heads: nn.Module, target, train) -> nn.Module:
        heads = self._widened(config, super().continue_from(config, heads, target, train), target)
        self._check_layout(config, heads)
        self._check_layers(config, heads, target)
        return self._revocabulary(config, heads, train)

    def _check_layout(self, config: RunConfig, heads: nn.Module) -> None:
        """Our layout continues heads of any EAGLE layout (foreign ones keep theirs)."""

    @staticmethod
    def _check_layers(config: RunConfig, heads: nn.Module, target) -> None:
        h, loaded = config.heads, heads.config
        if normalize_layers(target, h.feature_layers) != normalize_layers(target, loaded.feature_layers):
            raise UserError(
                f"heads.init_from {h.init_from} reads target layers {loaded.feature_layers}, but "
                f"heads.feature_layers is {h.feature_layers}; set heads.feature_layers: "
                f"{loaded.feature_layers}, or a list of several layers that includes it (the heads then "
                "learn to fuse them)"
            )

    @staticmethod
    def _widened(config: RunConfig, heads: nn.Module, target) -> nn.Module:
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
    def _revocabulary(config: RunConfig, heads: nn.Module, train) -> nn.Module:
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


class Eagle3Objective(EagleObjective):
    """The published EAGLE-3 head (layout eagle3, servable by vLLM and SGLang): EAGLE's step without
    the feature loss (`config.py` sets feature_weight 0); it continues only EAGLE-3 heads without an
    fc bias, which the engines can serve."""

    layout = "eagle3"

    @staticmethod
    def _widened(config: RunConfig, heads: nn.Module, target) -> nn.Module:
        return heads  # EAGLE-3 heads fuse their three layers already

    def _check_layout(self, config: RunConfig, heads: nn.Module) -> None:
        h, loaded = config.heads, heads.config
        if not head_type(loaded).servable:
            raise UserError(
                f"heads.init_from {h.init_from} holds eagle_layout {loaded.eagle_layout!r} heads, which vLLM "
                "and SGLang cannot serve, but heads.layout is eagle3 (the default for EAGLE heads); continue "
                "from EAGLE-3 heads or set heads.layout: selfdraft"
            )
        if loaded.eagle_fc_bias:
            raise UserError(
                f"heads.init_from {h.init_from} has an fc bias, which vLLM and SGLang cannot serve; continue "
                "from heads without one"
            )


# "kind" or "kind/layout" (a kind whose heads come in several layouts) -> the objective that trains them
OBJECTIVES: dict[str, Objective] = {
    "medusa": MedusaObjective(),
    "eagle/selfdraft": EagleObjective(),
    "eagle/eagle3": Eagle3Objective(),
}


def objective_for(config: RunConfig) -> Objective:
    """The objective of the run's heads.kind (and heads.layout, for a kind with several)."""
    h = config.heads
    name = h.kind if h.kind in OBJECTIVES else f"{h.kind}/{h.layout}"
    if name not in OBJECTIVES:
        raise UserError(
            f"heads.kind {h.kind!r} with heads.layout {h.layout!r} has no training objective; use one of "
            f"{', '.join(OBJECTIVES)}"
        )
    return OBJECTIVES[name]
