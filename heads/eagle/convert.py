"""EAGLE-1/2 checkpoints (yuhuili/EAGLE-*, and speculators' EAGLE-1 / HASS layout) as published
EAGLE-1 heads (`heads/eagle3/module.py:PublishedEagleHead`, layout "eagle1")."""

from __future__ import annotations

import logging

import torch
from torch import nn

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.folder import CorruptCheckpointError
from selfdraft.heads.published import (
    Checkpoint,
    UnsupportedVariantError,
    base_fields,
    check_target,
    keeps_own_embedding,
    layer_config,
    rename_layer,
)

logger = logging.getLogger(__name__)


def _speculators_eagle1_tensors(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """speculators EAGLE-1 / HASS names -> the EAGLE-1 reference names (fusion_fc -> fc,
    transformer -> layers.0), as speculators' own EagleConverter mapped them the other way."""
    cfg = ckpt.config
    extra_norms = sorted(
        n
        for n in ckpt.tensors
        if n.startswith(("embedding_layernorm.", "pre_lm_head_layernorm.", "transformer.input_layernorm."))
    )
    if cfg.get("layernorms") or extra_norms:
        raise UnsupportedVariantError(
            f"{ckpt.path}: a speculators EAGLE-1 head with `layernorms: true` (HASS extra norms "
            f"{extra_norms or 'per config.json'}), which selfdraft does not run; use a `layernorms: false` "
            "checkpoint or serve this one with the engine it was made for"
        )
    out = {}
    for name, tensor in ckpt.tensors.items():
        if name.startswith("fusion_fc."):
            name = "fc." + name[len("fusion_fc.") :]
        elif name.startswith("transformer."):
            name = "layers.0." + name[len("transformer.") :]
        out[name] = tensor
    return out


def from_eagle1(ckpt: Checkpoint, target: nn.Module | None, layout: str = "eagle1") -> tuple[HeadsConfig, dict]:
    cfg, tensors = ckpt.config, ckpt.tensors
    verifier: dict = {}
    if layout == "speculators-eagle1":
        tensors = _speculators_eagle1_tensors(ckpt)
        cfg = cfg.get("transformer_layer_config") or {}
        verifier = (ckpt.config.get("speculators_config") or {}).get("verifier") or {}
    extra = [n for n in tensors if n.startswith("layers.") and not n.startswith("layers.0.")]
    if extra:
        raise CorruptCheckpointError(f"{ckpt.path}: EAGLE-1 heads have one layer; found {extra[:3]}")
    hidden = tensors["fc.weight"].shape[0]
    state = rename_layer(tensors, "layers.0.")
    embed = state.get("embed_tokens.weight")
    vocab = embed.shape[0] if embed is not None else cfg.get("vocab_size")
    check_target(
        ckpt,
        layout,
        {
            "hidden size": (hidden, "tensor fc.weight"),
            "vocab size": (vocab, "embed_tokens.weight" if embed is not None else "config.json vocab_size"),
            "architecture": (verifier.get("architectures"), "speculators_config.verifier.architectures"),
        },
        target,
    )
    config = HeadsConfig(
        head_kind="eagle",
        eagle_layout="eagle1",
        target_hidden_size=hidden,
        target_vocab_size=vocab,
        feature_layers=[-1],
        eagle_fc_bias="fc.bias" in state,
        eagle_layer_config=layer_config(cfg, tensors, "layers.0.", hidden),
        eagle_own_embedding=keeps_own_embedding(state, target),
        **base_fields(ckpt, layout, target, verifier=verifier or None),
    )
    return config, state
