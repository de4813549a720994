"""Run and bench config values: each bad value is one ConfigError naming the key, the value and the fix,
raised where the file is read (nothing silently ignored, nothing trained on a value that means nothing)."""

from __future__ import annotations

import pytest

from selfdraft.scripts import cli
from selfdraft.training.config import load_run_config
from selfdraft.typed_config import ConfigError

BASE = """\
target: smollm2-135m-instruct
output_dir: runs/x
heads:
  kind: eagle
  layout: selfdraft
data:
  sources: [sharegpt:4]
train:
  lr: 0.001
  ttt_steps: 2
schedule:
  save_every: 10
"""

# name -> (YAML text, words the error says)
BAD = {
    "two train: sections": (BASE + "train:\n  lr: 0.5\n", ["'train' appears twice", "lines 8 and 13", "merge"]),
    "a key twice in one section": (BASE.replace("  lr: 0.001\n", "  lr: 0.001\n  lr: 0.002\n"), ["'lr' appears twice"]),
    "a syntax error": (BASE.replace("  lr: 0.001\n", "  lr: [0.001\n"), ["not valid YAML", "line"]),
    "an empty file": ("", ["is empty", "target"]),
}
VALUES = {
    "train.max_steps": 0,
    "train.epochs": -1,
    "train.lr": -1,
    "train.micro_batch_size": 0,
    "train.gradient_accumulation_steps": 0,
    "train.ttt_steps": 0,
    "train.warmup_steps": -5,
    "schedule.save_every": 0,
    "schedule.eval_examples": 0,
    "data.heldout_fraction": 1.5,
    "data.max_length": 0,
    "data.seed": -1,
    "heads.draft_vocab_size": 0,
}


def _with(key: str, value) -> str:
    """BASE with `section.name: value`, replacing the line BASE already has for it."""
    section, name = key.split(".")
    lines = [line for line in BASE.splitlines() if not line.startswith(f"  {name}:")]
    at = lines.index(f"{section}:")
    return "\n".join([*lines[: at + 1], f"  {name}: {value}", *lines[at + 1 :]]) + "\n"


@pytest.mark.parametrize("text, words", BAD.values(), ids=BAD.keys())
def test_a_bad_file_is_one_error_naming_the_problem(tmp_path, text, words):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and all(w in message for w in words), message


@pytest.mark.parametrize("key, value", VALUES.items(), ids=[f"{k}: {v}" for k, v in VALUES.items()])
def test_a_value_out_of_range_names_its_key(tmp_path, key, value):
    path = tmp_path / "run.yaml"
    path.write_text(_with(key, value))
    with pytest.raises(ConfigError, match=rf"^{key}: {value}(\.0)? is out of range; use "):
        load_run_config(path)


def test_the_values_in_range_still_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(_with("train.max_steps", 1).replace("lr: 0.001", "lr: 1e-4"))
    config = load_run_config(path)
    assert config.train.max_steps == 1 and config.train.lr == 1e-4 and config.data.heldout_fraction == 0.02


BENCH = {
    "--repeats 0": (["--repeats", "0"], "repeats: 0 is out of range"),
    "--threads 0": (["--threads", "0"], "threads: 0 is out of range"),
    "--max-new-tokens 0": (["--max-new-tokens", "0"], "max_new_tokens: 0 is out of range"),
    "--temperatures -1": (["--temperatures", "-1"], "temperatures: [-1.0] is out of range"),
}


@pytest.mark.parametrize("flags, words", BENCH.values(), ids=BENCH.keys())
def test_bench_values_out_of_range_are_one_line(tmp_path, capsys, flags, words):
    argv = ["bench", "--prompts", "sharegpt:1", "--methods", "baseline", "--output-dir", str(tmp_path / "b")]
    assert cli.main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_a_bench_config_with_a_syntax_error_is_one_line(tmp_path, capsys):
    path = tmp_path / "bench.yaml"
    path.write_text("prompts: [sharegpt:2\nmethods: [baseline]\n")
    assert cli.main(["bench", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not valid YAML" in err and str(path) in err, err


def test_a_yaml_named_as_the_deepspeed_config_is_named_before_any_work(tmp_path):
    from selfdraft.errors import UserError
    from selfdraft.training.config import check_paths

    ds = tmp_path / "zero1.yaml"
    ds.write_text("zero_optimization:\n  stage: 1\n")
    path = tmp_path / "run.yaml"
    path.write_text(BASE.replace("output_dir: runs/x", f"output_dir: runs/x\ndeepspeed: {ds}"))
    with pytest.raises(UserError, match="is not a DeepSpeed JSON config"):
        check_paths(load_run_config(path))


def test_a_heads_folder_named_as_the_target_is_one_error(tmp_path):
    from selfdraft.errors import UserError
    from selfdraft.heads import save_heads

    from tiny_models import random_heads, tiny_target

    heads = save_heads(random_heads(tiny_target("llama"), "eagle", 0), tmp_path / "heads")
    path = tmp_path / "run.yaml"
    path.write_text(f"target: {heads}\noutput_dir: runs/x\n")  # eagle3: its layers come from the target
    with pytest.raises(UserError, match="is a folder of draft heads, not a model"):
        load_run_config(path)


def test_feature_layers_beyond_the_target_name_the_key():
    from selfdraft.errors import UserError
    from selfdraft.heads.config import normalize_layers

    from tiny_models import tiny_target

    with pytest.raises(UserError, match=r"heads.feature_layers: \[99\] on a target of 2 layers"):
        normalize_layers(tiny_target("llama"), [99])


def test_prepare_batch_size_zero_is_one_line(tmp_path, capsys):
    assert cli.main(["prepare", "--config", str(tmp_path / "no.yaml"), "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--batch-size 0" in err, err
