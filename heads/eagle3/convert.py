"""EAGLE-3 checkpoints (yuhuili/EAGLE3-*, SGLang's LlamaForCausalLMEagle3, vLLM speculators) as our
EAGLE-3 heads (`PublishedEagleHead`, layout "eagle3"), read as vLLM computes their options."""

from __future__ import annotations

import logging

import torch
from torch import nn

from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.eagle3.module import eagle3_default_layers
from selfdraft.heads.folder import CorruptCheckpointError
from selfdraft.heads.published import (
    Checkpoint,
    UnsupportedVariantError,
    base_fields,
    check_target,
    keeps_own_embedding,
    layer_config,
    rename_layer,
    text_config,
)

logger = logging.getLogger(__name__)


def _aux_layers(ckpt: Checkpoint, layout: str, target: nn.Module | None) -> tuple[list[int] | None, str]:
    """The fused target layers as `output_hidden_states` indices, and where they were read."""
    cfg = ckpt.config
    eagle_config = cfg.get("eagle_config") or {}
    if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        # SGLang's ids name the layer whose OUTPUT is captured: the input of layer id + 1.
        return [i + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]], "eagle_config (SGLang, +1)"
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        # vLLM / speculators ids name the layer whose INPUT is captured: already our indices.
        return list(cfg["eagle_aux_hidden_state_layer_ids"]), "eagle_aux_hidden_state_layer_ids (vLLM)"
    if target is not None:
        return eagle3_default_layers(text_config(target).num_hidden_layers), "EAGLE-3 default {2, L//2, L-3}"
    return None, ""


def from_eagle3(ckpt: Checkpoint, target: nn.Module | None, layout: str) -> tuple[HeadsConfig, dict]:
    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    extra = [n for n in ckpt.tensors if n.startswith(("layers.", "midlayer")) and not n.startswith(prefix)]
    if extra:
        raise CorruptCheckpointError(f"{ckpt.path}: only one-layer EAGLE-3 heads run here; found {extra[:3]}")
    cfg = ckpt.config
    src = cfg.get("transformer_layer_config", cfg) if layout == "speculators" else cfg
    # What vLLM computes from this config.json. A speculators config (`speculators_model_type`) goes
    # through vLLM's speculators loader, whose `update_eagle3` (vllm/transformers_utils/configs/
    # speculators/algos.py) sets `norm_before_residual = config_dict.get("norm_before_residual", True)`
    # and passes `norm_output` (default False) on. Any other config is read as is by vLLM's
    # llama_eagle3.py: `getattr(config, "norm_before_residual", False)`, `getattr(config, "norm_output",
    # False)` (SGLang implements neither and has no such keys).
    default_nbr = bool(cfg.get("speculators_model_type"))
    src = {
        **src,
        "norm_before_residual": bool(cfg.get("norm_before_residual", default_nbr)),
        "norm_output": bool(cfg.get("norm_output", False)),
    }
    _refuse_fc_norms(ckpt)
    fc = ckpt.tensors["fc.weight"]
    hidden, fused = fc.shape
    if ckpt.tensors[prefix + "self_attn.q_proj.weight"].shape[1] != 2 * hidden:
        raise CorruptCheckpointError(f"{ckpt.path}: EAGLE-3 q_proj must read 2 x {hidden} inputs")
    layers, layers_from = _aux_layers(ckpt, layout, target)
    n = len(layers) if layers else 3
    if fused % n:
        raise CorruptCheckpointError(f"{ckpt.path}: fc.weight reads {fused} inputs, not {n} layers' worth")
    target_hidden = fused // n
    if cfg.get("target_hidden_size") not in (None, target_hidden):
        logger.warning(
            "%s: config target_hidden_size=%s, fc.weight implies %d; using the tensors",
            ckpt.path,
            cfg["target_hidden_size"],
            target_hidden,
        )
    state = rename_layer(ckpt.tensors, prefix)
    lm_head, t2d = state.get("lm_head.weight"), state.get("draft_vocab.t2d")
    vocab = t2d.shape[0] if t2d is not None else src.get("vocab_size")
    if vocab is None:
        raise CorruptCheckpointError(f"{ckpt.path}: neither t2d nor config.json vocab_size gives the vocab")
    if lm_head is not None and "draft_vocab.d2t" not in state:  # a full-vocabulary head: identity maps
        state["draft_vocab.d2t"] = torch.zeros(lm_head.shape[0], dtype=torch.long)
        state["draft_vocab.t2d"] = torch.arange(vocab) < lm_head.shape[0]
    if "draft_vocab.t2d" in state:
        state["draft_vocab.t2d"] = state["draft_vocab.t2d"].bool()
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    check_target(
        ckpt,
        layout,
        {
            "hidden size": (target_hidden, "tensor fc.weight"),
            "vocab size": (vocab, "t2d / config vocab_size"),
            "architecture": (verifier.get("architectures"), "speculators_config.verifier.architectures"),
        },
        target,
    )
    if layers is None:
        raise ValueError(
            f"{ckpt.path} does not say which target layers its head fuses (no "
            "eagle_aux_hidden_state_layer_ids); convert it with its target (`selfdraft convert SRC DST "
            "--target NAME`) to use EAGLE-3's default layers {2, L//2, L-3}"
        )
    own_embedding = keeps_own_embedding(state, target)
    if hidden != target_hidden and not own_embedding:
        raise CorruptCheckpointError(
            f"{ckpt.path}: the head is {hidden} wide but the target {target_hidden}; it needs its own "
            "embed_tokens.weight, which the checkpoint lacks"
        )
    proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    config = HeadsConfig(
        head_kind="eagle",
        eagle_layout="eagle3",
        target_hidden_size=target_hidden,
        target_vocab_size=vocab,
        feature_layers=layers,
        draft_vocab_size=lm_head.shape[0] if lm_head is not None else None,
        eagle_fc_bias="fc.bias" in state,
        eagle_own_embedding=own_embedding,
        eagle_layer_config=layer_config(src, ckpt.tensors, prefix, hidden),
        **base_fields(
            ckpt,
            layout,
            target,
            variant=_variant(cfg, layout),
            feature_layers_from=layers_from,
            verifier=verifier or None,
            speculative_tokens=proposals[0].get("speculative_tokens"),
        ),
    )
    return config, state


def _refuse_fc_norms(ckpt: Checkpoint) -> None:
    """speculators / vLLM `norm_before_fc` (one RMSNorm over the concatenated fused layers, tensor
    input_norm.weight) and `fc_norm` (one RMSNorm per fused layer, fc_norm.{i}.weight) change the
    fusion; selfdraft's EAGLE-3 head does not implement them, so such heads are refused, never run
    without their norms."""
    cfg = ckpt.config
    eagle_config = cfg.get("eagle_config") or {}
    for key, prefix in (("norm_before_fc", "input_norm."), ("fc_norm", "fc_norm.")):
        tensors = sorted(n for n in ckpt.tensors if n.startswith(prefix))
        if cfg.get(key) or eagle_config.get(key) or tensors:
            raise UnsupportedVariantError(
                f"{ckpt.path}: an EAGLE-3 head with `{key}` (RMSNorm on the fused target layers before "
                f"fc{', tensors ' + ', '.join(tensors[:3]) if tensors else ''}), which selfdraft's EAGLE-3 "
                "head does not implement; serve it with vLLM, or use a head trained without it"
            )


def _variant(cfg: dict, layout: str) -> str:
    if layout == "speculators":
        return "vllm-speculators"
    return "sglang" if "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []) else "eagle3"
