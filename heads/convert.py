"""Convert draft-head checkpoints published by other projects into selfdraft's format.

The layout of a folder is detected from its tensor names and shapes; a config field the tensors
contradict is never trusted (the official Medusa config states the wrong head count).

    medusa       Medusa-1 (FasterDecoding/medusa-*): config.json + medusa_lm_head.safetensors or .pt;
                 `{i}.{j}.linear.weight/bias` (ResBlock j of head i), `{i}.{L}.weight` (its vocab projection)
    eagle1       EAGLE-1/2 (yuhuili/EAGLE-*): Llama-style config.json + model.safetensors or
                 pytorch_model.bin; `fc.weight/bias` (2h -> h), `layers.0.*` (no input_layernorm),
                 optional `embed_tokens.weight`; the target's lm_head is used
    eagle3       EAGLE-3 (yuhuili/EAGLE3-*) and its SGLang variant (architectures LlamaForCausalLMEagle3):
                 `midlayer.*`, `fc.weight` (3h -> h), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`
    speculators  vLLM speculators EAGLE-3 (`speculators_model_type`, `transformer_layer_config`): the
                 same tensors with `midlayer.*` named `layers.0.*`; optional `norm_before_residual`
                 (absent reads as True, as vLLM's speculators config loader does) and `norm_output`
                 (EAGLE-3.1); `norm_before_fc` / `fc_norm` are refused (UnsupportedVariantError)
    speculators-eagle1  speculators EAGLE-1 / HASS (`speculators_model_type` "eagle"):
                 `fusion_fc.weight/bias` (2h -> h) and `transformer.*` (the layer, no input_layernorm);
                 read as eagle1. Its `layernorms: true` variant (embedding_layernorm,
                 pre_lm_head_layernorm) is refused

Exact vs approximate: Medusa-1 heads run as our MedusaHeads (own vocab projection per head) on the
target's last, post-norm hidden state, exactly as Medusa feeds them. EAGLE-1 and EAGLE-3 heads run in
`selfdraft.heads.eagle3.module.PublishedEagleHead`, which computes the published forward (see that
module); EAGLE-1 reads the post-norm last hidden state (what the EAGLE reference feeds its head: the
base model's output, which its lm_head reads) and EAGLE-3 the pre-norm inputs of its fused layers, both
available exactly in transformers' `output_hidden_states`. An embedded `embed_tokens.weight` equal to
the target's is dropped (the target's is borrowed); any other is kept as the head's own embedding.
Losslessness never depends on the head: only the number of accepted draft tokens does.

Pickled weights are opened only with `torch.load(weights_only=True)`; output is always safetensors.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from selfdraft.errors import UserError
from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.eagle.convert import from_eagle1
from selfdraft.heads.eagle3.convert import from_eagle3
from selfdraft.heads.folder import check_compatible, is_selfdraft_folder, load_state_strict, save_heads
from selfdraft.heads.medusa.convert import from_medusa1
from selfdraft.heads.published import Checkpoint, UnknownLayoutError, detect_layout, read_checkpoint
from selfdraft.heads.registry import Heads, build_heads

logger = logging.getLogger(__name__)

__all__ = ["UnknownLayoutError", "convert_checkpoint", "convert_heads", "read_checkpoint"]


def convert_checkpoint(ckpt: Checkpoint, target: nn.Module | None = None) -> tuple[HeadsConfig, dict]:
    """(HeadsConfig, state dict in our names) for a checkpoint in any known layout."""
    layout = detect_layout(ckpt)
    if ckpt.config.get("speculators_model_type") and not layout.startswith("speculators"):
        logger.warning(
            "%s: config.json says speculators, tensors say %s; using the tensors", ckpt.path, layout
        )
    if layout == "medusa":
        return from_medusa1(ckpt, target)
    if layout in ("eagle1", "speculators-eagle1"):
        return from_eagle1(ckpt, target, layout)
    return from_eagle3(ckpt, target, layout)


def _build(ckpt: Checkpoint, target: nn.Module | None, dtype: torch.dtype) -> Heads:
    config, state = convert_checkpoint(ckpt, target)
    if target is not None:
        check_compatible(config, target.config)
    heads = build_heads(config).to(dtype)
    load_state_strict(heads, state, ckpt.path / ckpt.weights_file)
    return heads


def load_foreign_heads(path: str | Path, target: nn.Module | None, dtype: torch.dtype) -> Heads:
    """Heads from a folder in a foreign layout, converted in memory (not yet attached)."""
    return _build(read_checkpoint(path), target, dtype)


def convert_heads(src: str | Path, dst: str | Path, target: nn.Module | None = None) -> Path:
    """Write `src` (any known layout) to `dst` in our format (config.json + model.safetensors).

    Floats keep the source's precision when it has one float dtype (else float32): no rounding.
    """
    if is_selfdraft_folder(Path(src)):
        raise UserError(f"{src} already holds selfdraft heads: load it as it is (heads={src}); nothing to convert")
    ckpt = read_checkpoint(src)
    dtypes = {t.dtype for t in ckpt.tensors.values() if t.is_floating_point()}
    heads = _build(ckpt, target, torch.float32)
    return save_heads(heads, dst, dtype=dtypes.pop() if len(dtypes) == 1 else None)
