"""The Qwen2.5-Coder-0.5B recipe configs: they parse without the target installed (the 630 MB
packages are opt-in), and the CPU and GPU variants train the same heads on the same split."""

import dataclasses
from pathlib import Path

import pytest

from selfdraft import target as target_mod
from selfdraft.training.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
CPU, GPU = ROOT / "configs/train/qwen2.5-coder-0.5b.yaml", ROOT / "configs/train/gpu/qwen2.5-coder-0.5b.yaml"


@pytest.fixture
def no_target(monkeypatch):
    """Reading the target (resolving, and on first use converting, the embedded Qwen) is an error."""

    def refuse(name):
        raise AssertionError(f"parsing a config read the target {name}")

    monkeypatch.setattr(target_mod, "resolve_target_path", refuse)


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_qwen_recipe_parses_without_the_target(path, no_target):
    config = load_run_config(path)
    assert config.target == "qwen2.5-coder-0.5b-instruct"
    h, t = config.heads, config.train
    assert (h.kind, h.layout, h.fc_bias, h.feature_layers) == ("eagle", "eagle3", False, [2, 12, 21])
    assert h.draft_vocab_size == 32768 and t.ttt_steps == 7 and t.precision == "auto" and t.feature_weight == 0
    assert "data/distill/qwen2.5-coder-0.5b-humaneval-train.jsonl.gz" in config.data.sources


def test_cpu_and_gpu_recipes_share_heads_data_and_split(no_target):
    cpu, gpu = load_run_config(CPU), load_run_config(GPU)
    assert cpu.heads == gpu.heads
    same = ("sources", "max_length", "heldout_fraction", "seed", "cut_repeats")
    assert [getattr(cpu.data, k) for k in same] == [getattr(gpu.data, k) for k in same]
    assert dataclasses.replace(cpu.train, **{k: getattr(gpu.train, k) for k in (
        "max_minutes", "micro_batch_size", "gradient_accumulation_steps", "warmup_steps"
    )}) == gpu.train


def test_distill_generator_auto_speculates_only_with_shipped_heads():
    """The recipe's data build: `selfdraft distill` on a target without shipped heads (Qwen) uses the
    target's own generate by default, the shipped SmolLM2 heads where they exist."""
    from selfdraft.training.data.distill import resolve_generator

    assert resolve_generator("auto", "qwen2.5-coder-0.5b-instruct") == "target"
    assert resolve_generator("auto", "SmolLM2-135M-Instruct") == "selfdraft"
    assert resolve_generator("selfdraft", "qwen2.5-coder-0.5b-instruct") == "selfdraft"
    assert resolve_generator("target", "smollm2-135m-instruct") == "target"
