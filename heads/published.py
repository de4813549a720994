"""Reading and recognising heads checkpoint folders published by other projects.

`read_checkpoint` loads a folder's config and weights (pickles only through
`torch.load(weights_only=True)`); `detect_layout` names its layout from the tensor names and shapes
alone; the helpers below read what every converter reads the same way (the target's facts, the
published layer's dimensions). Each kind converts its own layouts (`heads/<kind>/convert.py`);
`selfdraft.heads.convert` picks the converter.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from selfdraft.errors import MissingFileError, UserError
from selfdraft.heads.eagle3.module import rope_kwargs
from selfdraft.heads.folder import CONFIG_NAME, CorruptCheckpointError, HeadsMismatchError, read_safetensors

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
LAYOUTS = {
    "medusa": "Medusa-1: medusa_lm_head.{safetensors,pt} with {i}.{j}.linear.weight/bias and {i}.{L}.weight",
    "eagle1": "EAGLE-1: model.safetensors or pytorch_model.bin with fc.weight [h, 2h] and layers.0.*",
    "eagle3": "EAGLE-3 / SGLang: midlayer.*, fc.weight [h, 3h], norm.weight, lm_head.weight, d2t, t2d",
    "speculators": "vLLM speculators EAGLE-3: the EAGLE-3 tensors with midlayer.* named layers.0.*",
    "speculators-eagle1": (
        "vLLM speculators EAGLE-1 / HASS (speculators_model_type 'eagle', layernorms false): "
        "fusion_fc.weight [h, 2h] (+ fusion_fc.bias) and transformer.*"
    ),
    "selfdraft": "selfdraft: config.json with model_type selfdraft_heads + model.safetensors",
}
# Tensors some old checkpoints carry that are recomputed from the config.
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
MEDUSA_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.)?(weight|bias)$")


class UnknownLayoutError(CorruptCheckpointError):
    """A folder whose files and tensor names match no known heads layout."""


class UnsupportedVariantError(UserError):
    """A known layout with an architecture option selfdraft does not run (named with the fix)."""


@dataclass
class Checkpoint:
    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    weights_file: str


def load_pickled_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict, opened with weights_only=True: no code from the file ever runs."""
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        pattern = r"WeightsUnpickler error: (.*?)(?: was not an allowed|\. Please|$)"
        reason = re.search(pattern, str(err), re.M)
        raise CorruptCheckpointError(
            f"{path} is not a pickle of plain tensors ({reason.group(1) if reason else 'unreadable'}), or is "
            "corrupt. selfdraft opens pickles only with torch.load(weights_only=True), which never runs code "
            "from the file. Re-save the weights as tensors where you trust the file, e.g. "
            "`safetensors.torch.save_file(model.state_dict(), 'model.safetensors')`, and convert that folder"
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CorruptCheckpointError(f"{path} cannot be read ({err}); re-download it") from err
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise CorruptCheckpointError(f"{path} holds a {type(obj).__name__}, not a mapping name -> tensor")
    return dict(obj)


def read_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_file():
        raise MissingFileError(f"heads checkpoint {path} is a file; pass the folder that holds it")
    if not path.is_dir():
        raise MissingFileError(f"heads checkpoint folder {path} does not exist")
    if not any(path.iterdir()):
        raise MissingFileError(f"heads checkpoint folder {path} is empty; pass a folder with heads in it")
    config: dict = {}
    if (path / CONFIG_NAME).is_file():
        try:
            config = json.loads((path / CONFIG_NAME).read_text())
        except json.JSONDecodeError as err:
            raise CorruptCheckpointError(f"{path / CONFIG_NAME} is not valid JSON ({err})") from err
    for name in WEIGHT_FILES:
        file = path / name
        if file.is_file():
            tensors = read_safetensors(file) if name.endswith(".safetensors") else load_pickled_tensors(file)
            tensors = {k: v for k, v in tensors.items() if not _IGNORED.search(k)}
            return Checkpoint(path, config, tensors, name)
    raise _unknown(path, {}, f"no weights file ({', '.join(WEIGHT_FILES)})", config)


def _model_type(config: dict, tensors: dict) -> str | None:
    """The model type when the folder holds a whole language model rather than draft heads: a causal-LM
    config with several layers, or the tensors of one (embeddings and more than one decoder layer)."""
    causal = any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or [])
    if causal and (config.get("num_hidden_layers") or 0) > 1:
        return str(config.get("model_type", "a causal LM"))
    layered = any(n.startswith("model.layers.1.") for n in tensors)
    if layered and any(n.endswith("embed_tokens.weight") for n in tensors):
        return str(config.get("model_type", "a causal LM"))
    return None


def _unknown(path: Path, tensors: dict, why: str, config: dict | None = None) -> UnknownLayoutError:
    model = _model_type(config or {}, tensors)
    if model is not None:
        return UnknownLayoutError(
            f"{path} holds a model ({model}), not draft heads; pass it as the target (--target, target=) "
            "and heads trained for it as the heads"
        )
    files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if tensors and CONFIG_NAME not in files:
        return UnknownLayoutError(
            f"{path} holds weights but no {CONFIG_NAME}, and its tensor names match no other project's "
            f"layout; a selfdraft heads folder needs its {CONFIG_NAME}: restore it beside the weights"
        )
    names = sorted(tensors)
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    expected = "; ".join(LAYOUTS.values())
    return UnknownLayoutError(
        f"{path}: not a heads layout selfdraft can read ({why}). Files: {files}; tensors: [{shown}]. "
        f"Layouts `selfdraft convert` reads: {expected}"
    )


def detect_layout(ckpt: Checkpoint) -> str:
    """'medusa', 'eagle1', 'eagle3', 'speculators' or 'speculators-eagle1', from the tensor names and
    shapes only."""
    names = set(ckpt.tensors)
    if names and all(MEDUSA_KEY.match(n) for n in names):
        return "medusa"
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "layers.0.hidden_norm.weight" in names:
        return "speculators"
    fusion = ckpt.tensors.get("fusion_fc.weight")
    if (
        "transformer.self_attn.q_proj.weight" in names
        and fusion is not None
        and fusion.shape[1] == 2 * fusion.shape[0]
    ):
        return "speculators-eagle1"
    fc = ckpt.tensors.get("fc.weight")
    if "layers.0.self_attn.q_proj.weight" in names and fc is not None and fc.shape[1] == 2 * fc.shape[0]:
        return "eagle1"
    raise _unknown(ckpt.path, ckpt.tensors, "tensor names match none of the layouts", ckpt.config)


# ---- what every converter reads the same way -------------------------------------------------------
def text_config(target: nn.Module):
    config = target.config
    return getattr(config, "get_text_config", lambda: config)()


def target_architectures(target: nn.Module) -> list[str]:
    return list(getattr(target.config, "architectures", None) or [type(target).__name__])


def check_target(ckpt: Checkpoint, layout: str, found: dict, target: nn.Module | None) -> None:
    """found: what -> (value, where it was read). Raise HeadsMismatchError naming both values."""
    if target is None:
        return
    text = text_config(target)
    actual = {
        "hidden size": text.hidden_size,
        "vocab size": text.vocab_size,
        "architecture": target_architectures(target),
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


def base_fields(ckpt: Checkpoint, layout: str, target: nn.Module | None, **provenance) -> dict:
    text = text_config(target) if target is not None else None
    target_config = None
    if text is not None and layout != "medusa":
        target_config = text.to_dict()
        target_config["architectures"] = target_architectures(target)
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


def layer_config(src: dict, tensors: dict[str, torch.Tensor], prefix: str, hidden: int) -> dict:
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


def rename_layer(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Published names -> PublishedEagleHead names (layer prefix, d2t/t2d under draft_vocab)."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            name = "layer." + name[len(prefix) :]
        elif name in ("d2t", "t2d"):
            name = "draft_vocab." + name
        out[name] = tensor
    return out


def keeps_own_embedding(state: dict, target: nn.Module | None) -> bool:
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
