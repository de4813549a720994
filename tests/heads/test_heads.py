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


def test_widened_heads_start_as_the_one_layer_heads_and_learn_the_others():
    """EAGLE heads reading the last layer, widened to fuse layers 1, 2 and -1, compute exactly what
    they did (the fusion picks the last layer's block), and the other blocks still get gradients."""
    target = tiny_target("llama")
    heads = _heads(target, "eagle", draft_vocab_size=40, eagle_layout="selfdraft")
    wide = heads.widened([1, 2, -1], keep=2)
    assert wide.config.feature_layers == [1, 2, -1] and heads.config.feature_layers == [-1]
    torch.manual_seed(1)
    hidden = [torch.randn(1, 5, 32) for _ in range(3)]
    ids, pos = torch.randint(0, 96, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        f, f_wide = heads.fuse_features(hidden), wide.fuse_features(hidden)
        assert torch.equal(f_wide, hidden[-1])
        torch.testing.assert_close(
            wide.logits(wide(ids, f_wide, position_ids=pos)), heads.logits(heads(ids, f, position_ids=pos))
        )
    wide.logits(wide(ids, wide.fuse_features(hidden), position_ids=pos)).square().sum().backward()
    assert wide.fuse.weight.grad[:, :32].abs().sum() > 0  # layer 1's block learns from the start
    with pytest.raises(ValueError, match="already fuse"):
        wide.widened([1, 2, -1], keep=0)
    with pytest.raises(ValueError, match="must index"):
        heads.widened([1, -1], keep=2)


def test_run_fusing_more_layers_continues_one_layer_heads(tmp_path, tiny_target_dir):
    """heads.init_from with one-layer heads and heads.feature_layers naming it among others: the run
    starts from those heads, widened; a list without their layer is refused, naming both fixes."""
    from selfdraft.errors import UserError
    from selfdraft.target import load_target
    from selfdraft.training.config import load_run_config
    from selfdraft.training.train import build_run_heads

    target, _ = load_target(str(tiny_target_dir))
    heads = _heads(target, "eagle", draft_vocab_size=40, eagle_layout="selfdraft")
    save_heads(heads, tmp_path / "one")

    def run_heads(layers):
        path = tmp_path / "run.yaml"
        path.write_text(
            f"target: {tiny_target_dir}\nheads:\n  kind: eagle\n  layout: selfdraft\n  draft_vocab_size: 40\n"
            f"  feature_layers: {layers}\n  init_from: {tmp_path / 'one'}\n"
        )
        return build_run_heads(load_run_config(path), target, None)

    wide = run_heads([1, -1])
    assert wide.config.feature_layers == [1, -1]
    assert torch.equal(wide.fuse.weight[:, 32:], torch.eye(32)) and not wide.fuse.weight[:, :32].any()
    assert torch.equal(wide.fc.weight, heads.fc.weight)
    with pytest.raises(UserError, match=r"reads target layers \[-1\].*includes it"):
        run_heads([0, 1])  # the tiny target has 2 layers: index 2 is its last (-1)


def test_run_with_another_draft_vocab_size_keeps_trained_rows(tmp_path, tiny_target_dir):
    """heads.init_from with a 40-token draft vocabulary and heads.draft_vocab_size 60: the run's heads
    draft over the 60 most frequent training tokens; tokens both vocabularies hold keep their trained
    rows (the same logits for the same feature), new ones start as the target's lm_head rows, and every
    other weight is the loaded heads'. An unset size keeps theirs."""
    from selfdraft.target import load_target
    from selfdraft.training.config import load_run_config
    from selfdraft.training.train import build_run_heads

    target, _ = load_target(str(tiny_target_dir))
    # draft ids 0..39 are target ids 0..39
    heads = _heads(target, "eagle", draft_vocab_size=40, eagle_layout="selfdraft")
    save_heads(heads, tmp_path / "one")
    # tokens 20..79 are the 60 most frequent labels: 20..39 are kept, 40..79 are new; 0..19 leave
    ids = list(range(20, 80)) * 3 + list(range(0, 20)) + list(range(100, 110))
    train = [{"input_ids": ids, "loss_mask": [1] * 200 + [0] * 10}]  # 100..109 are not labels

    def run_heads(size_line):
        path = tmp_path / "run.yaml"
        path.write_text(
            f"target: {tiny_target_dir}\nheads:\n  kind: eagle\n  layout: selfdraft\n{size_line}"
            f"  init_from: {tmp_path / 'one'}\n"
        )
        return build_run_heads(load_run_config(path), target, train)

    new = run_heads("  draft_vocab_size: 60\n")
    assert new.config.draft_vocab_size == 60
    assert torch.equal(new.draft_vocab.target_ids(), torch.arange(20, 80))
    assert new.draft_vocab.t2d.nonzero().flatten().tolist() == list(range(20, 80))
    assert torch.equal(new.lm_head.weight[:20], heads.lm_head.weight[20:40])
    assert torch.equal(new.lm_head.weight[20:], target.get_output_embeddings().weight[40:80])
    old_state = {k: v for k, v in heads.state_dict().items() if not k.startswith(("lm_head", "draft_vocab"))}
    assert all(torch.equal(new.state_dict()[k], v) for k, v in old_state.items())
    torch.manual_seed(1)
    f, tok, pos = torch.randn(1, 4, 32), torch.randint(0, 96, (1, 4)), torch.arange(4)[None]
    with torch.no_grad():
        torch.testing.assert_close(
            new.logits(new(tok, f, position_ids=pos))[..., :20],
            heads.logits(heads(tok, f, position_ids=pos))[..., 20:],
        )
    assert run_heads("").config.draft_vocab_size == 40
