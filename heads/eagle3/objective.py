"""How the published EAGLE-3 head trains: EAGLE's step and checks (`eagle/objective.py`), without the
feature loss, continuing only heads the engines can serve."""

from __future__ import annotations

from torch import nn

from selfdraft.errors import UserError
from selfdraft.heads.eagle.objective import EagleObjective
from selfdraft.heads.registry import head_type


class Eagle3Objective(EagleObjective):
    """The published EAGLE-3 head (layout eagle3, servable by vLLM and SGLang): EAGLE's step without
    the feature loss (`config.py` sets feature_weight 0); it continues only EAGLE-3 heads without an
    fc bias, which the engines can serve."""

    layout = "eagle3"

    def _check_layout(self, config, heads: nn.Module) -> None:
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
