"""The token embedding a target holds, read from its weight files without loading the model.

Exports in vLLM's speculators format carry the embedding the heads borrow (speculators loads a draft
without `embed_tokens.weight` with an all-zero embedding); this reads it from the target's folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from selfdraft.errors import MissingFileError, UserError

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def input_embedding_name(folder: str | Path) -> str:
    """The parameter name of the model's input embedding (e.g. `model.embed_tokens.weight`), found on
    a weightless (meta) instance of the folder's architecture, so no name is guessed per model."""
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    weight = model.get_input_embeddings().weight
    return next(name for name, param in model.named_parameters(remove_duplicate=False) if param is weight)


def read_input_embedding(folder: str | Path) -> torch.Tensor:
    """The input embedding [V, h] stored in a model folder's safetensors files (sharded or not)."""
    folder = Path(folder)
    name = input_embedding_name(folder)
    if (folder / _INDEX).is_file():
        weight_map = json.loads((folder / _INDEX).read_text())["weight_map"]
        if name not in weight_map:
            raise UserError(f"{folder / _INDEX} lists no {name}; pass the target's own model folder")
        file = folder / weight_map[name]
    elif (folder / _SINGLE).is_file():
        file = folder / _SINGLE
    else:
        raise MissingFileError(
            f"{folder} has no {_SINGLE} or {_INDEX}; pass a target folder with safetensors weights"
        )
    with safe_open(str(file), framework="pt") as fh:
        names = fh.keys()  # a safe_open handle has no `in`
        if name not in names:
            raise UserError(f"{file} holds no {name}; pass the target's own model folder")
        return fh.get_tensor(name)
