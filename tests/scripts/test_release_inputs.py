"""publish, export and demo with bad inputs: one line naming the input and the fix (exit 2), and nothing
written; values that used to be silently published or exported are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfdraft.heads import save_heads
from selfdraft.scripts import cli
from selfdraft.training import checkpoint as ckpt
from selfdraft.training.config import load_run_config

from tiny_models import random_heads, tiny_target

CONFIG = "target: smollm2-135m-instruct\nheads:\n  layout: selfdraft\ntrain:\n  lr: {lr}\n"


def _run(root: Path, lr: float = 0.001) -> tuple[Path, Path]:
    """A finished run whose run.json keeps its config's settings, as the worker writes it."""
    run, config = root / "run", root / "run.yaml"
    save_heads(random_heads(tiny_target("llama"), "eagle", 0), run / "heads")
    config.write_text(CONFIG.format(lr=lr))
    settings = load_run_config(config).settings()
    ckpt.write_meta(run, ckpt.run_meta(load_run_config(config).fingerprint(), 1, "float32", settings))
    log = [{"step": 0, "event": "start", "examples": 4}, {"step": 2, "event": "done", "train_seconds": 1.0}]
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in log))
    return run, config


def _publish(run: Path, config: Path, dest: Path, *extra: str) -> list[str]:
    return ["publish", "--run", str(run), "--config", str(config), "--dest", str(dest), *extra]


def _other_config(t: Path) -> Path:
    other = t / "other.yaml"
    other.write_text(CONFIG.format(lr=0.5))
    return other


def _bad_json(t: Path) -> Path:
    path = t / "bench.json"
    path.write_text("{not json")
    return path


CASES = {
    "publish with another run's config": lambda t: (
        _publish(_run(t)[0], _other_config(t), t / "out"),
        ["was not trained with", "train.lr: 0.001 -> 0.5", "pass the config that run used"],
    ),
    "publish --bench missing": lambda t: (
        _publish(*_run(t), t / "out", "--bench", str(t / "none.json"), "selfdraft bench"),
        ["--bench", "does not exist"],
    ),
    "publish --bench not JSON": lambda t: (
        _publish(*_run(t), t / "out", "--bench", str(_bad_json(t)), "selfdraft bench"),
        ["--bench", "is not a bench report"],
    ),
    "publish --earlier a missing run": lambda t: (
        _publish(*_run(t), t / "out", "--earlier", str(t / "gone"), str(t / "run.yaml")),
        ["--earlier", "is not a training run"],
    ),
    "publish --tree a binary file": lambda t: (
        _publish(*_run(t), t / "out", "--tree", str(_binary(t / "tree.yaml"))),
        ["cannot read the tree file"],
    ),
    "publish --tokens -5": lambda t: (
        _publish(*_run(t), t / "out", "--tokens", "-5"),
        ["--tokens -5", ">= 1"],
    ),
    "export --speculative-tokens 0": lambda t: (
        ["export", "--to", "vllm", str(_run(t)[0] / "heads"), str(t / "out"), "--speculative-tokens", "0"],
        ["--speculative-tokens 0", "at least 1"],
    ),
    "demo --repeats 0": lambda t: (["demo", "--repeats", "0"], ["--repeats 0", "at least 1"]),
    "demo --max-new-tokens 0": lambda t: (["demo", "--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1"]),
}


def _binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)))
    return path


@pytest.mark.parametrize("make", CASES.values(), ids=CASES.keys())
def test_a_bad_release_input_is_one_line_and_writes_nothing(tmp_path, capsys, make):
    argv, words = make(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_publish_with_its_own_config_passes_the_check(tmp_path):
    from selfdraft.training.release.publish import check_run

    run, config = _run(tmp_path)
    check_run(run, config, "--run")  # nothing raised


def test_export_for_another_target_is_refused(tmp_path):
    from selfdraft.errors import UserError
    from selfdraft.heads.eagle3.export import export_heads

    run, _ = _run(tmp_path)  # heads of the tiny Llama (hidden 32)
    with pytest.raises(UserError, match="hidden size"):
        export_heads(run / "heads", tmp_path / "out", "sglang", target="smollm2-135m-instruct")
    assert not (tmp_path / "out").exists()


def test_push_to_offline_is_one_line_after_the_folder_is_written(tmp_path, monkeypatch):
    from selfdraft.errors import UserError
    from selfdraft.training.release.publish import upload

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "heads"
    folder.mkdir()
    with pytest.raises(UserError) as err:
        upload(folder, "someone/heads")
    assert "--push-to someone/heads" in str(err.value) and "push it later" in str(err.value)
    assert "\n" not in str(err.value)
