"""Split preparation: built once, atomically, by one writer at a time, and never reused for another
data config; an empty held-out split reloads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from selfdraft.errors import UserError
from selfdraft.training.config import ConfigError, RunConfig, load_run_config
from selfdraft.training.data import prepare
from selfdraft.training.data.dataset import rows_within
from selfdraft.typed_config import build_dataclass


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def config_for(tmp_path, run: str = "run", **data) -> RunConfig:
    source = tmp_path / "chats.jsonl"
    if not source.exists():
        rows = [
            {"id": str(i), "messages": [{"role": "user", "content": f"Question {i}?"},
                                        {"role": "assistant", "content": f"Answer number {i}."}]}
            for i in range(30)
        ]  # fmt: skip
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    heads = {"layout": "selfdraft"}  # target x has no config: the layout that needs none
    raw = {"target": "x", "heads": heads, "output_dir": str(tmp_path / run), "data": {"sources": [str(source)], **data}}
    return build_dataclass(RunConfig, raw)


def test_empty_heldout_split_reloads(tmp_path, tokenizer):
    config = config_for(tmp_path, heldout_fraction=0.0)
    train, heldout = prepare.prepare_splits(config, tokenizer)
    assert len(heldout) == 0 and len(train) == 30
    again_train, again_heldout = prepare.prepare_splits(config, tokenizer)  # the reload used to crash
    assert len(again_heldout) == 0 and again_train["id"] == train["id"]


def test_changed_data_config_is_refused(tmp_path, tokenizer):
    prepare.prepare_splits(config_for(tmp_path, heldout_fraction=0.1), tokenizer)
    with pytest.raises(UserError, match="heldout_fraction"):
        prepare.prepare_splits(config_for(tmp_path, heldout_fraction=0.2), tokenizer)


def test_debris_of_a_killed_build_is_replaced(tmp_path, tokenizer):
    config = config_for(tmp_path)
    root = tmp_path / "run" / prepare.DATA_DIR
    (root / "train").mkdir(parents=True)  # a build killed between two writes (no fingerprint)
    (tmp_path / "run" / "data.tmp" / "train").mkdir(parents=True)
    train, heldout = prepare.prepare_splits(config, tokenizer)
    assert len(train) + len(heldout) == 30 and (root / prepare.SPLIT_FINGERPRINT).is_file()
    assert not (tmp_path / "run" / "data.tmp").exists()
    # the render's scratch Arrow files are gone; the returned splits read the saved ones
    assert sorted(p.name for p in root.iterdir()) == ["heldout", prepare.SPLIT_FINGERPRINT, "train"]
    assert {Path(f["filename"]).parent.name for f in train.cache_files} == {"train"}


def test_concurrent_builders_serialise(tmp_path, tokenizer):
    config = config_for(tmp_path)
    results, errors = [], []

    def build():
        try:
            results.append(prepare.prepare_splits(config, tokenizer))
        except Exception as err:  # noqa: BLE001 - the test reports any failure of either builder
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 2
    assert results[0][0]["id"] == results[1][0]["id"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["data", "data.lock", "heldout_ids.json"]


def test_rows_within_a_token_budget():
    assert rows_within([3, 4, 5], 7) == 2
    assert rows_within([3, 4, 5], 6) == 1
    assert rows_within([3, 4, 5], 100) == 3
    assert rows_within([3, 4, 5], 1) == 1  # a budget below the first row still keeps one row


def test_train_tokens_caps_training_rows_and_keeps_the_heldout_split(tmp_path, tokenizer):
    whole_train, whole_heldout = prepare.prepare_splits(
        config_for(tmp_path, "whole", heldout_fraction=0.2), tokenizer
    )
    budget = sum(len(ids) for ids in whole_train["input_ids"][:5])
    train, heldout = prepare.prepare_splits(
        config_for(tmp_path, "capped", heldout_fraction=0.2, train_tokens=budget), tokenizer
    )
    # the first rows of the same shuffled order, as many as fit the budget; held-out text unchanged
    assert train["id"] == whole_train["id"][:5]
    assert heldout["id"] == whole_heldout["id"] and len(heldout) > 0
    with pytest.raises(UserError, match="train_tokens"):  # another budget in that folder is another config
        prepare.prepare_splits(
            config_for(tmp_path, "capped", heldout_fraction=0.2, train_tokens=budget + 1), tokenizer
        )
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: x\nheads:\n  layout: selfdraft\ndata:\n  train_tokens: 0\n")
    with pytest.raises(ConfigError, match="train_tokens"):
        load_run_config(bad)
