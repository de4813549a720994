"""Our heads folder: `config.json` + `model.safetensors` (heads' own tensors only); build, check, save, read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from selfdraft.errors import MissingFileError, UserError
from selfdraft.heads.config import LEGACY_LAYOUT, HeadsConfig
from selfdraft.heads.int8 import has_int8_weights
from selfdraft.heads.registry import Heads, build_heads

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class HeadsMismatchError(UserError):
    """Heads built for a different target."""


class CorruptCheckpointError(UserError):
    """A heads checkpoint that cannot be read or does not match its own config."""


def check_compatible(config: HeadsConfig, target_config) -> None:
    """Raise HeadsMismatchError naming both values when heads were made for another target."""
    text = getattr(target_config, "get_text_config", lambda: target_config)()
    checks = [
        ("hidden size", config.target_hidden_size, text.hidden_size),
        ("vocab size", config.target_vocab_size, text.vocab_size),
        ("model type", config.target_model_type, text.model_type),
    ]
    for what, heads_value, target_value in checks:
        if heads_value is not None and heads_value != target_value:
            raise HeadsMismatchError(
                f"heads were built for a target with {what} {heads_value!r}, but this target has "
                f"{target_value!r}; train or load heads made for this target"
            )
    bad = [i for i in config.feature_layers if not -text.num_hidden_layers - 1 <= i <= text.num_hidden_layers]
    if bad:
        raise HeadsMismatchError(
            f"heads read target layers {bad}, but this target has {text.num_hidden_layers} layers"
        )


def save_heads(heads: Heads, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (optionally cast floats to `dtype`, e.g. bf16).
    Heads holding int8 drafting weights (`selfdraft.heads.int8`) are refused: rounding is for drafting,
    and a checkpoint keeps the trained float weights."""
    if has_int8_weights(heads):
        raise UserError(
            "these heads hold int8 drafting weights (draft_dtype 'int8', or 'auto' on a CPU with native "
            "bf16); save the float heads: load them with draft_dtype=None or 'float32'"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in heads.state_dict().items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    tmp = directory / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "library": "selfdraft"})
    tmp.replace(directory / WEIGHTS_NAME)  # never leave a half-written weights file under the real name
    heads.config.save_pretrained(directory)
    return directory


def read_heads_config(directory: Path) -> HeadsConfig:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise MissingFileError(f"no {CONFIG_NAME} in {directory}: not a heads checkpoint folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({err}); the checkpoint is corrupt") from err
    if raw.get("model_type") != HeadsConfig.model_type:
        raise CorruptCheckpointError(
            f"{path} has model_type {raw.get('model_type')!r}, not {HeadsConfig.model_type!r}; "
            "for Medusa/EAGLE checkpoints from other projects use `selfdraft convert`"
        )
    if raw.get("head_kind", "eagle") == "eagle" and "eagle_layout" not in raw:  # written before the key
        return HeadsConfig.from_pretrained(directory, eagle_layout=LEGACY_LAYOUT)
    return HeadsConfig.from_pretrained(directory)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise MissingFileError(f"missing weights file {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CorruptCheckpointError(
            f"{path} is corrupt or truncated ({err}); re-download or re-export it"
        ) from err


def load_state_strict(module: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CorruptCheckpointError(
            f"{source} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CorruptCheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, config implies "
                f"{tuple(expected[name].shape)}"
            )
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def is_selfdraft_folder(directory: Path) -> bool:
    """True when `directory/config.json` declares our format (or cannot be read: reported as corrupt)."""
    try:
        return json.loads((directory / CONFIG_NAME).read_text()).get("model_type") == HeadsConfig.model_type
    except (OSError, json.JSONDecodeError, AttributeError):
        return (directory / CONFIG_NAME).is_file()


def load_own_heads(directory: Path, target: nn.Module | None, dtype: torch.dtype) -> Heads:
    """Heads from a folder in our own format (see `selfdraft.heads.load.load_heads`)."""
    config = read_heads_config(directory)
    if target is not None:
        check_compatible(config, target.config)
    heads = build_heads(config).to(dtype)
    load_state_strict(heads, read_safetensors(directory / WEIGHTS_NAME), directory / WEIGHTS_NAME)
    return heads
