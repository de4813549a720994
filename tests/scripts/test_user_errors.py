"""Bad inputs and awkward settings: each gets a clear UserError (one CLI line, exit 2) or just works."""

import logging

import pytest
import torch

from selfdraft.bench import report as bench_report
from selfdraft.bench.tune import score_trees
from selfdraft.errors import UserError
from selfdraft.heads import HeadsConfig, build_heads
from selfdraft.inference import SelfDraftModel
from selfdraft.inference.model import prompt_text
from selfdraft.scripts import cli
from selfdraft.tree import TreeSpec
from selfdraft.tree_syntax import read_tree_file, resolve_tree
from selfdraft.typed_config import ConfigError, build_dataclass

from tiny_models import greedy_reference, tiny_target


def medusa(target, heads: int):
    torch.manual_seed(0)
    config = HeadsConfig.for_target(target.config, head_kind="medusa", medusa_num_heads=heads)
    module = build_heads(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def test_default_tree_fits_medusa_heads_fewer_than_its_depth():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 3))  # the default tree is 4 deep
    assert model.tree.max_depth == 3
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    assert model.generate(prompt, 12, stop_token_ids=[]).tokens == greedy_reference(target, prompt, 12)
    with pytest.raises(UserError, match="at most 3 levels"):
        SelfDraftModel(target, None, medusa(target, 3), tree="chain-4")
    with pytest.raises(UserError, match="at most 3 levels"):
        model.generate(prompt, 4, tree="dynamic:depth=5")


def test_medusa_lookup_tree_near_the_context_end():
    """The shorter chain used near the context end never asks the heads for more levels than they have."""
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 2), tree="chain-2+lookup=6")
    prompt = torch.randint(0, 96, (1, 245), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, 40, stop_token_ids=[])
    assert out.stats.finish_reason == "context"
    assert out.tokens == greedy_reference(target, prompt, len(out.tokens))


def test_prompt_of_exactly_the_context_yields_one_token():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 4))
    prompt = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 5, stop_token_ids=[])
    assert out.tokens == [int(target(prompt).logits[0, -1].argmax())]
    assert out.stats.finish_reason == "context"


def test_bad_prompt_ids_and_text():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 4))
    with pytest.raises(UserError, match="outside the target's vocabulary"):
        model.generate(torch.tensor([[1, 2, 96]]), 2)
    with pytest.raises(UserError, match="token ids, not text"):
        model.generate("hello", 2)
    assert prompt_text(b"caf\xc3\xa9") == "café"
    with pytest.raises(UserError, match="not valid UTF-8"):
        prompt_text(b"caf\xe9")
    with pytest.raises(UserError, match="not valid UTF-8"):
        prompt_text("caf\udce9")  # how argv carries undecodable bytes


def test_stop_ids_are_the_targets_own():
    target = tiny_target("llama")
    target.generation_config.eos_token_id = [5, 7]
    model = SelfDraftModel(target, None, medusa(target, 4))
    assert model.default_stop_ids() == [5, 7]


def test_unapplied_generation_config_is_named(caplog):
    target = tiny_target("llama")
    target.generation_config.repetition_penalty = 1.3
    with caplog.at_level(logging.WARNING, logger="selfdraft.inference.model"):
        SelfDraftModel(target, None, medusa(target, 4))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "repetition_penalty=1.3" in line and "1.0" in line and "\n" not in line


def test_malformed_tree_file_names_the_file(tmp_path):
    bad = tmp_path / "tree.yaml"
    bad.write_text("paths: [[0, 1], [0, -1]]\n")
    with pytest.raises(UserError, match=str(bad)):
        read_tree_file(bad)
    bad.write_text("paths: [[0, 1]\n")  # not YAML
    with pytest.raises(UserError, match=str(bad)):
        read_tree_file(bad)
    with pytest.raises(UserError, match="unknown tree"):
        resolve_tree("tiny")


def test_config_numbers():
    from dataclasses import dataclass

    @dataclass
    class Train:
        lr: float = 1.0

    assert build_dataclass(Train, {"lr": "1e-3"}).lr == 1e-3  # YAML 1.1 reads 1e-3 as a string
    with pytest.raises(ConfigError, match="expected a number"):
        build_dataclass(Train, {"lr": "fast"})
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="not a finite number"):
            build_dataclass(Train, {"lr": bad})


def test_cli_user_error_and_interrupt_are_one_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "tree.yaml"
    bad.write_text("dynamic: {depth: 0}\n")
    code = cli.main(["generate", "--prompt", "hi", "--tree", str(bad)])  # refused before the target loads
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("selfdraft generate: ")

    from selfdraft.scripts import generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "selfdraft generate: interrupted"


def test_bench_report_without_matplotlib(tmp_path, monkeypatch):
    def no_matplotlib(report, out_dir):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(bench_report, "plot", no_matplotlib)
    report = {"config": {}, "machine": {}, "summary": [], "runs": [], "verify_cost_seconds": {"1": 1.0}}
    paths = bench_report.write_report(report, tmp_path)
    assert paths["json"].is_file() and paths["markdown"].is_file() and set(paths) == {"json", "markdown"}


def test_tune_skips_trees_deeper_than_the_heads():
    target = tiny_target("llama")
    model = SelfDraftModel(target, None, medusa(target, 2), tree=TreeSpec.chain(1))
    prompts = [torch.tensor([[3, 1, 4, 1, 5]])]
    scores = score_trees(model, prompts, ["chain-2", "chain-4", "small"], 6, curve={1: 1.0, 64: 2.0})
    assert [s.tree for s in scores] == ["chain-2"]
    with pytest.raises(UserError, match="no candidate tree fits"):
        score_trees(model, prompts, ["chain-4"], 6, curve={1: 1.0, 64: 2.0})
