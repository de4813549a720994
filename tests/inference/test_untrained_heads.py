"""Untrained heads never slow a user down: with no trained heads and no tree asked for, generate decodes
with no head (a prompt-lookup branch only), says so once, and reports it; a tree asked for still drafts
with them."""

from __future__ import annotations

import logging

import pytest
import torch

from selfdraft.inference import SelfDraftModel

from tiny_models import greedy_reference, tiny_target

PROMPT = torch.tensor([[4, 8, 15, 16, 23, 42]])


@pytest.fixture
def target():
    return tiny_target("llama")


def _forbid_heads(model, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a head ran during plain decoding")

    for module in model.heads.modules():
        monkeypatch.setattr(module, "forward", refuse)


def test_no_trained_heads_decode_plainly_and_say_so_once(target, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="selfdraft.inference.model"):
        model = SelfDraftModel.with_heads(target, None, None)
    assert model.plain and model.tree.draft_depth == 0  # the root and a prompt-lookup branch
    assert model.tree.describe().startswith("prompt lookup alone (no heads)")
    assert sum("no trained heads" in r.message for r in caplog.records) == 1
    _forbid_heads(model, monkeypatch)
    out = model.generate(PROMPT, 20, stop_token_ids=[])
    assert out.tokens == greedy_reference(target, PROMPT, 20)
    assert out.stats.mean_accepted >= 1.0 and out.stats.target_forwards == 1 + out.stats.tree_passes
    rows = model.generate([PROMPT[0], PROMPT[0, :3]], 8, stop_token_ids=[])
    assert rows[1].tokens == greedy_reference(target, PROMPT[:, :3], 8)
    sampled = model.generate(PROMPT, 8, temperature=1.0, seed=3, stop_token_ids=[])
    assert sampled.tokens == model.generate(PROMPT, 8, temperature=1.0, seed=3, stop_token_ids=[]).tokens


def test_a_tree_asked_for_drafts_with_the_fresh_heads(target):
    model = SelfDraftModel.with_heads(target, None, None, tree="chain-3")
    assert not model.plain
    out = model.generate(PROMPT, 12, stop_token_ids=[])
    assert out.tokens == greedy_reference(target, PROMPT, 12)
    assert out.stats.tree_tokens == 4 * out.stats.tree_passes  # root + 3 drafted every pass
    plain = SelfDraftModel.with_heads(target, None, None)
    per_call = plain.generate(PROMPT, 12, stop_token_ids=[], tree="chain-2")
    assert per_call.tokens == out.tokens and per_call.stats.tree_tokens == 3 * per_call.stats.tree_passes


def test_trained_heads_are_not_plain(tmp_path, target):
    from selfdraft.heads import save_heads

    from tiny_models import random_heads

    folder = save_heads(random_heads(target, "eagle", 0), tmp_path / "heads")
    assert not SelfDraftModel.with_heads(target, None, str(folder)).plain


def test_a_tree_without_drafted_nodes_never_runs_the_heads(target, monkeypatch):
    """chain-0 (+ a prompt-lookup branch) drafts nothing from the heads: no head runs, trained or not."""
    model = SelfDraftModel.with_heads(target, None, None, tree="chain-2")
    _forbid_heads(model, monkeypatch)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # repeats, so the lookup branch finds text
    for tree in ("chain-0", "chain-0+lookup=4"):
        out = model.generate(prompt, 16, stop_token_ids=[], tree=tree)
        assert out.tokens == greedy_reference(target, prompt, 16)
