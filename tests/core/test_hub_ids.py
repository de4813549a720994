"""A hub id while the Hub cannot be reached: one line at once (no 30 s of retries), or the local hub
cache when it holds the model."""

from __future__ import annotations

import time

import pytest

from selfdraft import target as target_module
from selfdraft.errors import UserError
from selfdraft.target import hub_kwargs, load_target


def test_an_unreachable_hub_id_is_one_line_at_once(monkeypatch):
    monkeypatch.setattr(target_module, "hub_reachable", lambda timeout=3.0: False)
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        load_target("someorg/some-model")
    assert time.perf_counter() - start < 5
    text = str(err.value)
    assert "\n" not in text and "cannot be reached" in text and "not in the local hub cache" in text


def test_offline_mode_is_named(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        hub_kwargs("someorg/some-model")


def test_a_cached_hub_id_loads_from_the_cache_when_offline(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(target_module, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    assert hub_kwargs("someorg/some-model") == {"local_files_only": True}
    assert hub_kwargs("smollm2-135m-instruct") == {}  # embedded names and folders never ask the Hub
