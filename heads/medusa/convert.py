"""Medusa-1 checkpoints (FasterDecoding/medusa-*) as our MedusaHeads: one own vocabulary projection per
head, on the target's last, post-norm hidden state, exactly as Medusa feeds them."""

from __future__ import annotations

import logging

import torch
from torch import nn

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.folder import CorruptCheckpointError
from selfdraft.heads.published import (
    MEDUSA_KEY,
    Checkpoint,
    base_fields,
    check_target,
)

logger = logging.getLogger(__name__)


def from_medusa1(ckpt: Checkpoint, target: nn.Module | None) -> tuple[HeadsConfig, dict]:
    parsed: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in ckpt.tensors.items():
        i, j, linear, kind = MEDUSA_KEY.match(name).groups()
        parsed.setdefault(int(i), {}).setdefault(int(j), {})[("linear." if linear else "") + kind] = tensor
    num_heads = len(parsed)
    if sorted(parsed) != list(range(num_heads)):
        raise CorruptCheckpointError(f"{ckpt.path}: Medusa head indices {sorted(parsed)} are not 0..K-1")
    depths = {max(blocks) for blocks in parsed.values()}
    if len(depths) != 1:
        raise CorruptCheckpointError(f"{ckpt.path}: Medusa heads differ in ResBlock count {sorted(depths)}")
    num_layers = depths.pop()
    state = {}
    for i, blocks in parsed.items():
        for j in range(num_layers):
            for kind in ("weight", "bias"):
                state[f"blocks.{i}.{j}.linear.{kind}"] = blocks.get(j, {}).get(f"linear.{kind}")
        state[f"lm_heads.{i}.weight"] = blocks[num_layers].get("weight")
    missing = sorted(k for k, v in state.items() if v is None)
    if missing:
        raise CorruptCheckpointError(f"{ckpt.path}: Medusa checkpoint lacks {missing[:5]}")
    vocab, hidden = state["lm_heads.0.weight"].shape
    stated = ckpt.config.get("medusa_num_heads")
    if stated is not None and stated != num_heads:
        logger.warning(
            "%s: config.json says medusa_num_heads=%s, the tensors hold %d heads; using %d",
            ckpt.path,
            stated,
            num_heads,
            num_heads,
        )
    check_target(
        ckpt,
        "medusa",
        {"hidden size": (hidden, "lm head tensors"), "vocab size": (vocab, "lm head tensors")},
        target,
    )
    config = HeadsConfig(
        head_kind="medusa",
        target_hidden_size=hidden,
        target_vocab_size=vocab,
        feature_layers=[-1],
        medusa_num_heads=num_heads,
        medusa_num_layers=num_layers,
        medusa_own_lm_head=True,
        **base_fields(ckpt, "medusa", target, base_model=ckpt.config.get("base_model_name_or_path")),
    )
    return config, state
