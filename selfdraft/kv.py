"""The one adapter over every transformers-version-sensitive call selfdraft makes.

transformers renamed the forward cache keyword (`past_key_values` -> `cache` in 5.24) and changed the
meaning of `DynamicCache.crop(n>0)` (absolute length before 5.15, an error after). Everything that
touches a cache goes through this module so a future rename is a one-line fix here.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import DynamicCache, PreTrainedModel

from selfdraft.errors import UserError


def new_cache() -> DynamicCache:
    """A plain dynamic cache with full-attention layers (selfdraft supplies its own 4D masks)."""
    return DynamicCache()


@lru_cache(maxsize=64)
def _cache_keyword(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache: DynamicCache) -> dict:
    """Keyword arguments that hand `cache` to `model.forward` under this transformers version."""
    return {_cache_keyword(type(model)): cache, "use_cache": True}


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def _layers(cache: DynamicCache):
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers < 4.56 kept key_cache / value_cache lists
        raise RuntimeError("this transformers version's DynamicCache has no .layers; upgrade to >= 4.57")
    return layers


def crop(cache: DynamicCache, length: int) -> None:
    """Truncate every layer of `cache` to its first `length` positions."""
    drop = cache_length(cache) - length
    if drop < 0:
        raise ValueError(f"cannot crop a cache of length {cache_length(cache)} to {length}")
    if drop > 0:
        cache.crop(-drop)  # negative = "remove this many": the one form every version accepts


def keep_positions(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Compact the cache to `[:prefix_len]` followed by the positions `keep` (absolute indices, sorted).

    keep: [m] long tensor of absolute cache positions >= prefix_len, in the order they are kept.
    Used after tree verification to retain only the accepted path's keys and values.
    """
    n = keep.numel()
    for layer in _layers(cache):
        _check_compactable(layer)
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            # only the kept tree entries move (indexing copies them first, so overlap is safe); the
            # prefix stays where it is, instead of a gather re-copying every cached position each step
            t[:, :, prefix_len : prefix_len + n] = t[:, :, keep.to(t.device)]
            setattr(layer, name, t[:, :, : prefix_len + n])


def _check_compactable(layer) -> None:
    if getattr(layer, "is_sliding", False):
        raise UserError(
            "tree KV compaction of sliding-window cache layers is not supported; "
            "load the target without a sliding window"
        )


def gather_rows(cache: DynamicCache, rows: torch.Tensor, index: torch.Tensor) -> None:
    """Keep batch rows `rows` and, in row i of the result, the positions `index[i]`, in that order.

    rows: [B'] long (batch rows kept, in order); index: [B', L'] long absolute cache positions per kept
    row (a batch's per-row compaction: each row's prefix and accepted path, re-padded to one length).
    """
    for layer in _layers(cache):
        _check_compactable(layer)
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if rows.numel() != t.shape[0] or bool((rows.cpu() != torch.arange(t.shape[0])).any()):
                t = t.index_select(0, rows.to(t.device))
            idx = index.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
            setattr(layer, name, t.gather(2, idx))


def check_model_takes_cache(model: PreTrainedModel) -> None:
    params = inspect.signature(type(model).forward).parameters
    if "cache" not in params and "past_key_values" not in params:
        raise TypeError(
            f"{type(model).__name__}.forward takes no KV cache argument; selfdraft cannot drive it"
        )
