"""Heads: save/load round trip, nothing of the target saved, mismatch and corrupt-file errors."""

import json

import pytest
import torch

from selfdraft.heads import HeadsConfig, HeadsMismatchError, build_heads, load_heads, save_heads
from selfdraft.heads.folder import CorruptCheckpointError

from tiny_models import tiny_target


def _heads(target, kind, **kw):
    torch.manual_seed(0)
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind=kind, **kw)).attach(target)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    return heads


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("medusa", {}),
        ("medusa", {"medusa_own_lm_head": True}),
        ("medusa", {"draft_vocab_size": 40}),
        ("eagle", {}),
        ("eagle", {"draft_vocab_size": 40}),
        ("eagle", {"feature_layers": [1, 2, -1]}),
    ],
)
def test_round_trip_same_logits(tmp_path, kind, kw):
    target = tiny_target("llama")
    heads = _heads(target, kind, **kw)
    if heads.draft_vocab is not None:
        d2t = torch.arange(40) * 2 - torch.arange(40)  # draft id i -> target id 2i
        t2d = torch.zeros(96, dtype=torch.bool)
        t2d[torch.arange(40) * 2] = True
        heads.draft_vocab.set_maps(d2t, t2d)
    save_heads(heads, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_heads(tmp_path, target)
    for (n1, a), (n2, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(heads.logits(x), loaded.logits(x))
    # the borrowed embeddings / lm_head are never part of the heads' state
    names = set(loaded.state_dict())
    assert not any("lm_head" in n and loaded.lm_head is None for n in names if kind == "eagle")
    n_params = sum(p.numel() for p in loaded.parameters())
    assert n_params < sum(p.numel() for p in target.parameters())


def test_fp16_storage_loads_as_fp32(tmp_path):
    target = tiny_target("llama")
    heads = _heads(target, "eagle")
    save_heads(heads, tmp_path, dtype=torch.float16)
    loaded = load_heads(tmp_path, target)
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, heads.fc.weight.half().float())


def test_target_weights_never_saved(tmp_path):
    target = tiny_target("llama")
    save_heads(_heads(target, "medusa"), tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    assert all(t.shape != target.lm_head.weight.shape for t in state.values())


@pytest.mark.parametrize(
    "other,field",
    [("qwen2", "model type"), ("llama-wide", "hidden size"), ("llama-vocab", "vocab size")],
)
def test_mismatch_is_a_clear_error(tmp_path, other, field):
    from transformers import AutoModelForCausalLM, LlamaConfig

    target = tiny_target("llama")
    save_heads(_heads(target, "eagle"), tmp_path)
    if other == "qwen2":
        wrong = tiny_target("qwen2")
    else:
        cfg = LlamaConfig(
            vocab_size=200 if other == "llama-vocab" else 96,
            hidden_size=64 if other == "llama-wide" else 32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        wrong = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(HeadsMismatchError, match=field) as err:
        load_heads(tmp_path, wrong)
    assert "this target has" in str(err.value)


def test_truncated_weights_file(tmp_path):
    target = tiny_target("llama")
    save_heads(_heads(target, "eagle"), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="corrupt or truncated"):
        load_heads(tmp_path, target)


def test_garbage_weights_and_config(tmp_path):
    target = tiny_target("llama")
    save_heads(_heads(target, "medusa"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptCheckpointError):
        load_heads(tmp_path, target)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load_heads(tmp_path, target)


def test_weights_not_matching_config(tmp_path):
    target = tiny_target("llama")
    save_heads(_heads(target, "medusa"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["medusa_num_heads"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load_heads(tmp_path, target)


def test_foreign_config_and_missing_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CorruptCheckpointError, match="selfdraft convert"):
        load_heads(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_heads(tmp_path / "nope")


def test_bad_head_config_values():
    with pytest.raises(ValueError, match="head_kind"):
        HeadsConfig(head_kind="hydra")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        HeadsConfig(target_vocab_size=10, draft_vocab_size=11)
