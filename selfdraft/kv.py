"""The one adapter over every transformers-version-sensitive call selfdraft makes.

transformers renamed the forward cache keyword (`past_key_values` -> `cache` in 5.24) and changed the
meaning of `DynamicCache.crop(n>0)` (absolute length before 5.15, an error after). Everything that
touches a cache goes through this module so a future rename is a one-line fix here.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
from transformers import DynamicCache, PreTrainedModel

from selfdraft.errors import UserError


def new_cache() -> DynamicCache:
    """A plain dynamic cache with full-attention layers (selfdraft supplies its own 4D masks)."""
    return DynamicCache()


@lru_cache(maxsize=64)
def _forward_parameters(forward_cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(forward_cls.forward).parameters)


def cache_kwargs(model: torch.nn.Module, cache: DynamicCache) -> dict:
    """Keyword arguments that hand `cache` to `model.forward` under this transformers version."""
    keyword = "cache" if "cache" in _forward_parameters(type(model)) else "past_key_values"
    return {keyword: cache, "use_cache": True}


def last_logits_kwargs(model: torch.nn.Module) -> dict:
    """Keyword arguments asking `model.forward` for the last position's logits only, where it takes
    `logits_to_keep` (transformers >= 4.50); else none, and it computes all of them."""
    return {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(type(model)) else {}


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


def compact_rows(
    cache: DynamicCache,
    rows: torch.Tensor | None,
    batch: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    length: int,
) -> None:
    """A batch's per-row compaction in place: keep batch rows `rows` (None: all, no copy), move entry
    (batch[i], src[i]) to (batch[i], dst[i]) for every i, then cut every row at `length`.

    batch, src, dst: [n] long, batch indices counted after the row selection; dst[i] <= src[i] (an
    accepted tree entry moves down to its row's prefix end). Only the moved entries are copied (the
    indexing reads them all before writing, so overlaps are safe), unlike a gather, which
    would re-copy every cached position.
    """
    for layer in _layers(cache):
        _check_compactable(layer)
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if rows is not None:
                t = t.index_select(0, rows.to(t.device))
            if batch.numel():
                b = batch.to(t.device)
                t[b, :, dst.to(t.device)] = t[b, :, src.to(t.device)]
            setattr(layer, name, t[:, :, :length])


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextmanager
def masked_gqa(device: torch.device | str, queries: int) -> Iterator[None]:
    """Within: grouped-query attention under a custom mask without repeated keys/values, on CPU.

    Given a mask and more than one query, transformers' SDPA path repeats every key/value head
    `num_key_value_groups` times (a copy of the whole cache, per layer, per pass) because CUDA's fused
    kernels take no mask with `enable_gqa`; torch's CPU kernel takes both, with the same results
    (tree passes here: bit-identical logits). Single-query decoding already avoids the repeat, so
    this gives a tree pass what plain decoding has, and leaves single-query passes on decoding's own
    path (same rounding as `generate`). transformers reads the switch at every call; a version without
    it simply repeats as before. Not thread-safe (the process environment).
    """
    if queries <= 1 or torch.device(device).type != "cpu" or _FORCE_GQA in os.environ:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        del os.environ[_FORCE_GQA]


def check_model_takes_cache(model: PreTrainedModel) -> None:
    if not {"cache", "past_key_values"} & _forward_parameters(type(model)):
        raise TypeError(
            f"{type(model).__name__}.forward takes no KV cache argument; selfdraft cannot drive it"
        )
