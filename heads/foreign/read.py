"""Reading and recognising heads checkpoint folders published by other projects.

`read_checkpoint` loads a folder's config and weights (pickles only through
`torch.load(weights_only=True)`); `detect_layout` names its layout from the tensor names and shapes
alone. Conversion into selfdraft's own modules lives in `selfdraft.heads.foreign.convert`.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from selfdraft.errors import MissingFileError, UserError
from selfdraft.heads.folder import CONFIG_NAME, CorruptCheckpointError, read_safetensors

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
