"""`heads.layout: eagle3`, the default for EAGLE heads: heads trained by `selfdraft train` (with no layout
in the config) export to vLLM and SGLang and load back.

The end-to-end test trains a few steps on a tiny random 8-layer Llama (deep enough for EAGLE-3's default
fused layers {2, L//2, L-3} = [2, 4, 5] to be three distinct layer inputs), exports the heads with
`selfdraft export --to vllm|sglang`, reads each exported folder back with `load_heads` and checks that it
drafts exactly what the trained heads draft, and that decoding with it stays lossless.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from selfdraft.training.config import ConfigError, load_run_config
from selfdraft.training.data.prepare import prepare_from_config

from tiny_models import COMMON, greedy_reference

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
DEPTH = 8  # EAGLE-3's default layers {2, L//2, L-3} = [2, 4, 5]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _write(tmp_path: Path, target, heads: dict | None = None, train: dict | None = None) -> Path:
    config = {
        "target": str(target),
        "output_dir": str(tmp_path / "run"),
        "deepspeed": str(ROOT / "configs/deepspeed/zero1.json"),
        "heads": {"kind": "eagle", **(heads or {})},  # no layout: the default is what is tested
        "data": {"sources": ["sharegpt"], "limit_records": 16, "max_length": 64, "heldout_fraction": 0.1},
        "train": {
            "max_steps": 4,
            "micro_batch_size": 2,
            "lr": 0.01,
            "warmup_steps": 1,
            "ttt_steps": 2,
            "precision": "fp32",
            **(train or {}),
        },
        "schedule": {"save_every": 4, "eval_every": 4, "log_every": 1, "eval_examples": 2},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _llama_config(vocab_size: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(**{**COMMON, "vocab_size": vocab_size, "num_hidden_layers": DEPTH}, **extra)


@pytest.fixture
def config_only_target(tmp_path):
    """A target folder holding only config.json: enough for the run config to read the target's depth."""
    path = tmp_path / "target"
    _llama_config(96).save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------ fast config tests


def test_eagle3_layout_defaults(tmp_path, config_only_target):
    config = load_run_config(_write(tmp_path, config_only_target))
    h = config.heads
    assert h.layout == "eagle3" and h.feature_layers == [2, 4, 5]  # output_hidden_states indices
    assert h.fc_bias is False and config.train.feature_weight == 0.0
    assert h.draft_vocab_size == 96  # min(32000, the target's vocabulary)
    explicit = load_run_config(
        _write(tmp_path, config_only_target, heads={"feature_layers": [1, 3, 7], "draft_vocab_size": 64})
    )
    assert explicit.heads.feature_layers == [1, 3, 7] and explicit.heads.draft_vocab_size == 64
    # the selfdraft layout, by name: our own head, fc bias, feature loss, last layer
    plain = load_run_config(_write(tmp_path, config_only_target, heads={"layout": "selfdraft"}))
    assert (plain.heads.feature_layers, plain.heads.fc_bias, plain.train.feature_weight) == ([-1], True, 0.1)
    # Medusa heads have no EAGLE layout: an unset one is no error
    medusa = load_run_config(_write(tmp_path, config_only_target, heads={"kind": "medusa"}))
    assert medusa.heads.layout == "selfdraft" and medusa.heads.feature_layers == [-1]


@pytest.mark.parametrize(
    "heads, train, match",
    [
        ({"layout": "eagle-3"}, {}, r"heads.layout: 'eagle-3' is not one of selfdraft, eagle3"),
        ({"fc_bias": True}, {}, r"heads.fc_bias: true cannot be exported"),
        ({"kind": "medusa", "layout": "eagle3"}, {}, r"heads.kind is 'medusa'"),
        ({}, {"feature_weight": 0.1}, r"train.feature_weight: 0.1 with heads.layout: eagle3"),
        ({"feature_layers": [-1]}, {}, r"three distinct target layers"),
        ({"feature_layers": [4, 2, 5]}, {}, r"ascending"),
        ({"feature_layers": [2, 4, 8]}, {}, r"engines capture the inputs of layers 0..7"),
        ({"draft_vocab_size": 97}, {}, r"exceeds the target's vocabulary of 96"),
    ],
)
def test_eagle3_layout_refusals(tmp_path, config_only_target, heads, train, match):
    from transformers import AutoConfig

    from selfdraft.errors import UserError
    from selfdraft.training.config import resolve_for_target

    path = _write(tmp_path, config_only_target, heads=heads, train=train)
    with pytest.raises(UserError, match=match) as err:
        config = load_run_config(path)
        resolve_for_target(config, AutoConfig.from_pretrained(config_only_target))  # what train.py does
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)


def test_eagle3_may_fuse_the_embeddings(tmp_path, config_only_target):
    """Index 0 (the embeddings, the input of layer 0) is a layer vLLM and SGLang capture as well."""
    from transformers import AutoConfig

    from selfdraft.training.config import resolve_for_target

    config = load_run_config(_write(tmp_path, config_only_target, heads={"feature_layers": [0, 2, 5]}))
    resolve_for_target(config, AutoConfig.from_pretrained(config_only_target))
    assert config.heads.feature_layers == [0, 2, 5]


def test_eagle3_default_layers_need_a_deep_enough_target(tmp_path):
    from transformers import LlamaConfig

    shallow = tmp_path / "shallow"
    LlamaConfig(**COMMON).save_pretrained(shallow)  # 2 layers: {2, 1, -1} is no set of layer inputs
    with pytest.raises(ConfigError, match=r"set heads.feature_layers to three of 0..1"):
        load_run_config(_write(tmp_path, shallow))


# ------------------------------------------------------------------------------------------ train -> export


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory):
    """A tiny random 8-layer Llama saved with the real SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfdraft.target import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    cfg = _llama_config(
        len(tok), tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    path = tmp_path_factory.mktemp("deep-target")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _draft_logits(heads, target, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Draft logits of two unrolled steps (the second fed the head's own features), as at inference."""
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
        positions = torch.arange(input_ids.shape[1])[None]
        features = heads.fuse_features(hidden)
        out = []
        for _ in range(2):
            features = heads(input_ids, features, position_ids=positions)
            out.append(heads.logits(features))
        return out


@pytest.mark.slow
def test_trained_eagle3_heads_export_and_load_back(tmp_path, deep_target_dir):
    from selfdraft.heads import load_heads
    from selfdraft.heads.eagle3.module import PublishedEagleHead
    from selfdraft.inference import SelfDraftModel
    from selfdraft.scripts.cli import main as cli
    from selfdraft.target import load_target

    config = _write(tmp_path, deep_target_dir, heads={"draft_vocab_size": 512})
    proc = subprocess.run(
        [PY, "-m", "selfdraft.training.train", "--config", str(prepare_from_config(config))],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]
    assert any("eval_top1_by_depth" in r for r in log)
    trained_dir = tmp_path / "run" / "heads"
    saved = json.loads((trained_dir / "config.json").read_text())
    assert saved["eagle_layout"] == "eagle3" and saved["feature_layers"] == [2, 4, 5]
    assert saved["eagle_fc_bias"] is False and saved["draft_vocab_size"] == 512

    target, tokenizer = load_target(str(deep_target_dir))
    trained = load_heads(trained_dir, target)
    assert isinstance(trained, PublishedEagleHead)
    prompt = torch.tensor([tokenizer.encode("Tell me about trains and how they run.")])
    expected = _draft_logits(trained, target, prompt)
    # the run's target is a local folder: vLLM's config must name a hub id, so the export asks for one
    assert cli(["export", "--to", "vllm", str(trained_dir), str(tmp_path / "refused")]) == 2
    assert not (tmp_path / "refused").exists()
    for engine in ("vllm", "sglang"):
        dst = tmp_path / engine
        assert cli(["export", "--to", engine, str(trained_dir), str(dst), "--verifier", "org/tiny"]) == 0
        exported = json.loads((dst / "config.json").read_text())
        layer_ids = (
            exported.get("eagle_aux_hidden_state_layer_ids")
            or exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        )
        assert layer_ids == ([2, 4, 5] if engine == "vllm" else [1, 3, 4])  # SGLang names layer outputs
        loaded = load_heads(dst, target)
        assert isinstance(loaded, PublishedEagleHead) and loaded.config.feature_layers == [2, 4, 5]
        # bit-identical heads: every tensor (the vLLM export's copy of the target's embedding is
        # recognised as the target's and borrowed again, as in the trained heads)
        mine, back = trained.state_dict(), loaded.state_dict()
        assert sorted(mine) == sorted(back)
        assert all(torch.equal(mine[k], back[k]) and mine[k].dtype == back[k].dtype for k in mine)
        assert torch.equal(loaded.draft_vocab.d2t, trained.draft_vocab.d2t)
        assert torch.equal(loaded.draft_vocab.t2d, trained.draft_vocab.t2d)
        # Exact: the export writes the float32 tensors unchanged and the reader rebuilds the same module
        # (same class, dimensions, RoPE, eps), so the same float32 ops run on the same values.
        for got, want in zip(_draft_logits(loaded, target, prompt), expected, strict=True):
            assert torch.equal(got, want), (engine, (got - want).abs().max())
        # lossless: greedy speculative decoding with the re-loaded heads is the target's own greedy output
        model = SelfDraftModel(target, None, loaded)
        out = model.generate(prompt, 24, stop_token_ids=[])
        assert out.tokens == greedy_reference(target, prompt, 24)
