"""`load_heads`: a heads folder in our format or in any foreign layout selfdraft reads."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from selfdraft.errors import MissingFileError, UserError
from selfdraft.heads.convert import load_foreign_heads
from selfdraft.heads.folder import Heads, is_selfdraft_folder, load_own_heads


def load_heads(
    directory: str | Path, target: nn.Module | None = None, dtype: torch.dtype = torch.float32
) -> Heads:
    """Load heads saved by `save_heads`; with `target`, check compatibility and attach to it.

    A folder in another project's layout (Medusa-1, EAGLE-1, EAGLE-3, SGLang, vLLM speculators) is
    converted in memory (`selfdraft.heads.convert`); our own format is the fast path.
    """
    directory = Path(directory)
    if directory.is_file():
        raise UserError(
            f"heads checkpoint {directory} is a file; pass the folder that holds it (config.json + "
            f"model.safetensors), e.g. {directory.parent}"
        )
    if not directory.is_dir():
        raise MissingFileError(f"heads checkpoint folder {directory} does not exist; pass a folder with config.json")
    if is_selfdraft_folder(directory):
        heads = load_own_heads(directory, target, dtype)
    else:
        heads = load_foreign_heads(directory, target, dtype)
    if target is not None:
        heads.attach(target)
    return heads.eval()
