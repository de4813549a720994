"""EAGLE head: fc(concat(embedding(x_{t+1}), f_t)) -> one decoder layer of the target's own class.

The decoder layer is built with `AutoModel.from_config` from the target's config reduced to one layer,
so every architecture transformers supports works without a copied modeling file.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.eagle.drafter import EagleRows
from selfdraft.heads.vocab import BorrowingModule, DraftVocab
from selfdraft.kv import cache_kwargs

# Keys of a target config that make no sense (or break construction) for a 1-layer body fed embeddings.
_DROP_KEYS = (
    "layer_types",
    "architectures",
    "_name_or_path",
    "auto_map",
    "quantization_config",
    "transformers_version",
    "use_cache",
)


def one_layer_config(target_config: dict, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """The target's config with one decoder layer and a 1-token vocabulary (the body gets embeddings)."""
    values = {k: v for k, v in target_config.items() if k not in _DROP_KEYS}
    model_type = values.pop("model_type")
    values.update(
        num_hidden_layers=1,
        vocab_size=1,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    config = AutoConfig.for_model(model_type, **values)
    config._attn_implementation = attn_implementation
    return config


class EagleHead(BorrowingModule):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if not config.target_config:
            raise ValueError("an EAGLE head needs HeadsConfig.target_config (use HeadsConfig.for_target)")
        self.config = config
        h = config.target_hidden_size
        n = config.num_feature_layers
        self.fuse = nn.Linear(n * h, h, bias=False) if n > 1 else None
        self.fc = nn.Linear(2 * h, h, bias=config.eagle_fc_bias)
        self.body = AutoModel.from_config(one_layer_config(config.target_config))
        if config.draft_vocab_size:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.draft_vocab = DraftVocab(config.draft_vocab_size, config.target_vocab_size)
        else:
            self.lm_head = None
            self.draft_vocab = None

    def drafter(self, rows: int) -> EagleRows:
        return EagleRows(self, rows)

    def widened(self, feature_layers: Sequence[int], keep: int) -> EagleHead:
        """These heads (reading one target layer) rebuilt to fuse `feature_layers`, whose entry `keep`
        names the layer they read: every weight is copied and the fusion starts as the identity on that
        layer's block and zero on the others, so the new heads compute exactly what these do; training
        then learns what the other layers add (EAGLE-3's fusion, warm-started from EAGLE-1 heads)."""
        if self.fuse is not None:
            raise ValueError("these heads already fuse several target layers")
        if not 0 <= keep < len(feature_layers) or len(feature_layers) < 2:
            raise ValueError(f"keep={keep} must index feature_layers {list(feature_layers)} (2 or more layers)")
        wide = self._rebuilt(feature_layers=list(feature_layers))
        state = wide.state_dict()
        state.update(self.state_dict())
        h = self.config.target_hidden_size
        fuse = torch.zeros_like(state["fuse.weight"])
        fuse[:, keep * h : (keep + 1) * h] = torch.eye(h, dtype=fuse.dtype, device=fuse.device)
        state["fuse.weight"] = fuse
        wide.load_state_dict(state, strict=True)
        return wide

    def _rebuilt(self, **changes) -> EagleHead:
        """Fresh heads of this config with `changes`, on these heads' device and dtype, borrowing from
        the same target (their weights are the caller's to fill)."""
        config = copy.deepcopy(self.config)
        for name, value in changes.items():
            setattr(config, name, value)
        new = EagleHead(config)
        weight = self.fc.weight
        new.to(device=weight.device, dtype=weight.dtype)
        new.borrowed = self.borrowed
        return new

    def with_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> EagleHead:
        """These heads rebuilt over another draft vocabulary (d2t [Vd], t2d [V], the maps
        `DraftVocab.set_maps` takes): every other weight is copied; a token the old vocabulary held
        keeps its trained projection row, a new one starts as the target's lm_head row (as a fresh
        draft projection does). Kept tokens' logits are unchanged; training learns the new ones.
        The heads must be attached to their target: the new rows come from its lm_head."""
        self._need()
        new = self._rebuilt(draft_vocab_size=d2t.numel())
        weight = self.fc.weight
        new.draft_vocab.set_maps(d2t.to(weight.device), t2d.to(weight.device))
        state = {k: v for k, v in self.state_dict().items() if not k.startswith(("lm_head.", "draft_vocab."))}
        new.load_state_dict({**new.state_dict(), **state}, strict=True)
        new.init_projection_from_target()
        if self.lm_head is not None:
            # where[t]: token t's row in the old projection, -1 if the old vocabulary lacks it
            where = torch.full((t2d.numel(),), -1, dtype=torch.long, device=weight.device)
            old_ids = self.draft_vocab.target_ids()
            where[old_ids] = torch.arange(old_ids.numel(), device=weight.device)
            rows = where[new.draft_vocab.target_ids()]
            kept = rows >= 0
            with torch.no_grad():
                new.lm_head.weight[kept] = self.lm_head.weight[rows[kept]]
        return new

    def fuse_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's `output_hidden_states` tuple -> the head's input feature f: [B, T, h]."""
        chosen = [hidden_states[i] for i in self.config.feature_layers]
        if self.fuse is None:
            return chosen[0]
        return self.fuse(torch.cat(chosen, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Predict the next feature.

        input_ids: [B, T] tokens x_{t+1}; features: [B, T, h] features f_t (target's or the head's own);
        position_ids: [B, T]; attention_mask: additive float [B, 1, T, past + T] or None (causal).
        Returns f_hat_{t+1}: [B, T, h], whose logits predict x_{t+2}.
        """
        embeds = self._need().embed(input_ids).to(features.dtype)
        x = self.fc(torch.cat([embeds, features], dim=-1))
        kwargs = cache_kwargs(self.body, cache) if cache is not None else {"use_cache": False}
        out = self.body(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return out.last_hidden_state

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., h] -> logits [..., V'] (V' = draft vocab size when one is used)."""
        return self.project(features)
