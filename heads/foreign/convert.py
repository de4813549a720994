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
`selfdraft.heads.foreign.modules.ForeignEagleHead`, which computes the published forward (see that
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
from selfdraft.heads.folder import (
    CorruptCheckpointError,
    Heads,
    HeadsMismatchError,
    build_heads,
    check_compatible,
    is_selfdraft_folder,
    load_state_strict,
    save_heads,
)
from selfdraft.heads.foreign.modules import eagle3_default_layers, rope_kwargs
from selfdraft.heads.foreign.read import (
    MEDUSA_KEY,
    Checkpoint,
    UnknownLayoutError,
    UnsupportedVariantError,
    detect_layout,
    read_checkpoint,
)

logger = logging.getLogger(__name__)

__all__ = ["UnknownLayoutError", "convert_checkpoint", "convert_heads", "read_checkpoint"]


def _text_config(target: nn.Module):
    config = target.config
    return getattr(config, "get_text_config", lambda: config)()


def _target_architectures(target: nn.Module) -> list[str]:
    return list(getattr(target.config, "architectures", None) or [type(target).__name__])


def _check_target(ckpt: Checkpoint, layout: str, found: dict, target: nn.Module | None) -> None:
    """found: what -> (value, where it was read). Raise HeadsMismatchError naming both values."""
    if target is None:
        return
    text = _text_config(target)
    actual = {
        "hidden size": text.hidden_size,
        "vocab size": text.vocab_size,
        "architecture": _target_architectures(target),
    }
    for what, (value, source) in found.items():
        if value is None:
            continue
        if what == "architecture":
            if not set(value) & set(actual[what]):
                raise HeadsMismatchError(
                    f"{ckpt.path} ({layout}) was made for a {value} target ({source}), but this target is "
                    f"{actual[what]}; use heads made for this target"
                )
        elif value != actual[what]:
            raise HeadsMismatchError(
                f"{ckpt.path} ({layout}) was made for a target with {what} {value} ({source}), but this "
                f"target has {actual[what]}; use heads made for this target"
            )


def _base_fields(ckpt: Checkpoint, layout: str, target: nn.Module | None, **provenance) -> dict:
    text = _text_config(target) if target is not None else None
    target_config = None
    if text is not None and layout != "medusa":
        target_config = text.to_dict()
        target_config["architectures"] = _target_architectures(target)
    return {
        "target_model_type": text.model_type if text is not None else None,
        "target_num_layers": text.num_hidden_layers if text is not None else None,
        "target_config": target_config,
        "converted_from": {
            "layout": layout,
            "source": str(ckpt.path),
            "weights_file": ckpt.weights_file,
            **{k: v for k, v in provenance.items() if v is not None},
        },
    }


def _medusa(ckpt: Checkpoint, target: nn.Module | None) -> tuple[HeadsConfig, dict]:
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
    _check_target(
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
        **_base_fields(ckpt, "medusa", target, base_model=ckpt.config.get("base_model_name_or_path")),
    )
    return config, state


def _layer_config(src: dict, tensors: dict[str, torch.Tensor], prefix: str, hidden: int) -> dict:
    """The published layer's dimensions: widths from the tensors, the rest (eps, RoPE) from `src`."""
    q, k = tensors[prefix + "self_attn.q_proj.weight"], tensors[prefix + "self_attn.k_proj.weight"]
    num_heads = src.get("num_attention_heads")
    if not num_heads or q.shape[0] % num_heads:
        raise CorruptCheckpointError(
            f"config num_attention_heads={num_heads} does not divide q_proj's {q.shape[0]} output rows"
        )
    head_dim = q.shape[0] // num_heads
    if k.shape[0] % head_dim:
        raise CorruptCheckpointError(f"k_proj rows {k.shape[0]} are not a multiple of head_dim {head_dim}")
    return {
        "hidden_size": hidden,
        "intermediate_size": tensors[prefix + "mlp.gate_proj.weight"].shape[0],
        "num_attention_heads": num_heads,
        "num_key_value_heads": k.shape[0] // head_dim,
        "head_dim": head_dim,
        "rms_norm_eps": src.get("rms_norm_eps", 1e-6),
        "hidden_act": src.get("hidden_act", "silu"),
        "max_position_embeddings": src.get("max_position_embeddings", 2048),
        "rope": rope_kwargs(src),
        "qkv_bias": prefix + "self_attn.q_proj.bias" in tensors,
        "o_bias": prefix + "self_attn.o_proj.bias" in tensors,
        "mlp_bias": prefix + "mlp.gate_proj.bias" in tensors,
        "input_layernorm": prefix + "input_layernorm.weight" in tensors,
        "norm_before_residual": bool(src.get("norm_before_residual", False)),
        "norm_output": bool(src.get("norm_output", False)),
    }


def _rename_layer(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Published names -> ForeignEagleHead names (layer prefix, d2t/t2d under draft_vocab)."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            name = "layer." + name[len(prefix) :]
        elif name in ("d2t", "t2d"):
            name = "draft_vocab." + name
        out[name] = tensor
    return out


def _embedding(state: dict, target: nn.Module | None) -> bool:
    """Drop an embedded copy of the target's embedding; True when the head keeps its own."""
    embed = state.get("embed_tokens.weight")
    if embed is None:
        return False
    if target is not None:
        mine = target.get_input_embeddings().weight.detach().cpu()
        if mine.shape == embed.shape and torch.equal(mine.to(embed.dtype), embed):
            del state["embed_tokens.weight"]
            return False
    return True


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


def _eagle1(ckpt: Checkpoint, target: nn.Module | None, layout: str = "eagle1") -> tuple[HeadsConfig, dict]:
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
    state = _rename_layer(tensors, "layers.0.")
    embed = state.get("embed_tokens.weight")
    vocab = embed.shape[0] if embed is not None else cfg.get("vocab_size")
    _check_target(
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
        eagle_layer_config=_layer_config(cfg, tensors, "layers.0.", hidden),
        eagle_own_embedding=_embedding(state, target),
        **_base_fields(ckpt, layout, target, verifier=verifier or None),
    )
    return config, state


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
        return eagle3_default_layers(_text_config(target).num_hidden_layers), "EAGLE-3 default {2, L//2, L-3}"
    return None, ""


def _eagle3(ckpt: Checkpoint, target: nn.Module | None, layout: str) -> tuple[HeadsConfig, dict]:
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
    state = _rename_layer(ckpt.tensors, prefix)
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
    _check_target(
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
    own_embedding = _embedding(state, target)
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
        eagle_layer_config=_layer_config(src, ckpt.tensors, prefix, hidden),
        **_base_fields(
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


def convert_checkpoint(ckpt: Checkpoint, target: nn.Module | None = None) -> tuple[HeadsConfig, dict]:
    """(HeadsConfig, state dict in our names) for a checkpoint in any known layout."""
    layout = detect_layout(ckpt)
    if ckpt.config.get("speculators_model_type") and not layout.startswith("speculators"):
        logger.warning(
            "%s: config.json says speculators, tensors say %s; using the tensors", ckpt.path, layout
        )
    if layout == "medusa":
        return _medusa(ckpt, target)
    if layout in ("eagle1", "speculators-eagle1"):
        return _eagle1(ckpt, target, layout)
    return _eagle3(ckpt, target, layout)


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
