"""`HeadsConfig`: the draft heads' architecture, saved as `config.json` next to their weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from selfdraft.errors import UserError

HEAD_KINDS = ("eagle", "medusa")  # the default first
# "eagle3": the published EAGLE-3 head (selfdraft.heads.eagle3.module), the one selfdraft trains by default;
# "eagle1": the published EAGLE-1 head, for converted checkpoints; "selfdraft": our older EAGLE head (a
# 1-layer body of the target's own class, selfdraft.heads.eagle.module), still trainable by name.
EAGLE_LAYOUTS = ("selfdraft", "eagle1", "eagle3")
DEFAULT_LAYOUT = "eagle3"  # what engines serve, and what `selfdraft train` builds
LEGACY_LAYOUT = "selfdraft"  # the layout of a heads folder whose config.json names none


class HeadsConfig(PretrainedConfig):
    """Architecture of a set of draft heads attached to a frozen target.

    head_kind: "eagle" (one decoder layer run autoregressively on its own features; the default) or
        "medusa" (K parallel heads on the last feature).
    target_*: what the heads were built for; loading onto a different target is refused.
    feature_layers: indices into the target's `output_hidden_states` tuple fed to the heads
        (-1 = last, post-norm). Several indices = EAGLE-3 style fusion through fc(n*h -> h).
    draft_vocab_size: None borrows the target's lm_head; an int gives the heads their own projection
        onto a reduced draft vocabulary with `d2t` / `t2d` maps (EAGLE-3 convention).
    target_config: the target's config as a dict (EAGLE builds a 1-layer decoder from it).
    eagle_layout: which EAGLE head architecture (see EAGLE_LAYOUTS; default DEFAULT_LAYOUT); None for
        Medusa heads.
    eagle_layer_config: for "eagle1"/"eagle3", the published decoder layer's own dimensions (hidden,
        heads, RoPE, biases, ...) and EAGLE-3 options (norm_before_residual; norm_output, EAGLE-3.1's
        post-norm feedback); see selfdraft.heads.eagle3.module.LAYER_KEYS. None derives them from
        target_config (options off). A missing option reads as off.
    eagle_own_embedding: the head carries its own token embedding (a converted checkpoint whose
        embedding is not the target's) instead of borrowing the target's.
    converted_from: provenance of a converted checkpoint (layout, source config facts), or None.
    """

    model_type = "selfdraft_heads"

    def __init__(
        self,
        head_kind: str = "eagle",
        target_model_type: str | None = None,
        target_hidden_size: int | None = None,
        target_vocab_size: int | None = None,
        target_num_layers: int | None = None,
        feature_layers: list[int] | None = None,
        draft_vocab_size: int | None = None,
        medusa_num_heads: int = 4,
        medusa_num_layers: int = 1,
        medusa_own_lm_head: bool = False,
        eagle_fc_bias: bool = True,
        target_config: dict[str, Any] | None = None,
        eagle_layout: str | None = None,
        eagle_layer_config: dict[str, Any] | None = None,
        eagle_own_embedding: bool = False,
        converted_from: dict[str, Any] | None = None,
        **kwargs,
    ) -> None:
        if head_kind not in HEAD_KINDS:
            raise UserError(f"head_kind={head_kind!r}; expected one of {HEAD_KINDS}")
        if medusa_num_heads < 1 or medusa_num_layers < 0:
            raise UserError("medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
        if (
            draft_vocab_size is not None
            and target_vocab_size
            and not 0 < draft_vocab_size <= target_vocab_size
        ):
            raise UserError(f"draft_vocab_size={draft_vocab_size} must be in 1..target_vocab_size")
        if head_kind != "eagle":
            # Medusa heads have no EAGLE layout; folders written before it was optional say "selfdraft"
            if eagle_layout not in (None, LEGACY_LAYOUT):
                raise UserError(f"eagle_layout={eagle_layout!r} needs head_kind='eagle', not {head_kind!r}")
            eagle_layout = None
        elif eagle_layout is None:
            eagle_layout = DEFAULT_LAYOUT
        elif eagle_layout not in EAGLE_LAYOUTS:
            raise UserError(f"eagle_layout={eagle_layout!r}; expected one of {EAGLE_LAYOUTS}")
        self.head_kind = head_kind
        self.target_model_type = target_model_type
        self.target_hidden_size = target_hidden_size
        self.target_vocab_size = target_vocab_size
        self.target_num_layers = target_num_layers
        self.feature_layers = list(feature_layers) if feature_layers else [-1]
        self.draft_vocab_size = draft_vocab_size
        self.medusa_num_heads = medusa_num_heads
        self.medusa_num_layers = medusa_num_layers
        self.medusa_own_lm_head = medusa_own_lm_head
        self.eagle_fc_bias = eagle_fc_bias
        self.target_config = target_config
        self.eagle_layout = eagle_layout
        self.eagle_layer_config = dict(eagle_layer_config) if eagle_layer_config else None
        self.eagle_own_embedding = eagle_own_embedding
        self.converted_from = dict(converted_from) if converted_from else None
        super().__init__(**kwargs)

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, head_kind: str = "eagle", **kwargs) -> HeadsConfig:
        """Heads sized for `target_config` (the target model's `.config`)."""
        text_config = getattr(target_config, "get_text_config", lambda: target_config)()
        return cls(
            head_kind=head_kind,
            target_model_type=text_config.model_type,
            target_hidden_size=text_config.hidden_size,
            target_vocab_size=text_config.vocab_size,
            target_num_layers=text_config.num_hidden_layers,
            target_config=text_config.to_dict() if head_kind == "eagle" else None,
            **kwargs,
        )

    @property
    def num_feature_layers(self) -> int:
        return len(self.feature_layers)


AutoConfig.register(HeadsConfig.model_type, HeadsConfig)


def normalize_layers(model, layers: Sequence[int]) -> list[int]:
    """Layer indices into output_hidden_states (negative counts from the end) -> sorted non-negative."""
    count = model.config.num_hidden_layers + 1
    out = sorted({layer % count if -count <= layer < count else layer for layer in layers})
    if not out or out[0] < 0 or out[-1] >= count:
        raise UserError(
            f"heads.feature_layers: {list(layers)} on a target of {count - 1} layers; output_hidden_states "
            f"indices run from {-count} to {count - 1} (0 the embeddings, -1 the last, post-norm): fix them"
        )
    return out
