"""The run config is parsed once: `selfdraft train` reads the recipe a single time, prepares the splits
a single time and writes OUTPUT_DIR/resolved.yaml; the worker reads only that file (a recipe passed to
it is refused in one line) and loads the prepared splits without building them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from selfdraft.errors import UserError
from selfdraft.scripts import cli
from selfdraft.training import config as run_config
from selfdraft.training import launch, resolved
from selfdraft.training.data import prepare
from selfdraft.training.failures import Failure
from selfdraft.training.train import parse_args, run_worker


def test_a_launch_reads_the_recipe_once_and_the_worker_reads_what_it_resolved(tmp_path, text_run, monkeypatch):
    recipe = text_run(train={"max_steps": 2})
    reads: list[str] = []
    builds: list[int] = []
    commands: list[list[str]] = []

    def counted(read):
        return lambda path, what="config": reads.append(str(path)) or read(path, what)

    def build(*args, **kwargs):
        builds.append(1)
        return real_build(*args, **kwargs)

    real_build = prepare.build_dataset
    monkeypatch.setattr(run_config, "read_yaml", counted(run_config.read_yaml))
    monkeypatch.setattr(resolved, "read_yaml", counted(resolved.read_yaml))
    monkeypatch.setattr(prepare, "build_dataset", build)
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd: commands.append(cmd) or (0, Failure(), None))
    assert cli.main(["train", "--config", str(recipe), "--max-steps", "3", "--precision", "auto"]) == 0

    assert reads == [str(recipe)]  # one parse of the recipe, none of the resolved file by the launcher
    assert builds == [1]  # the splits, built once
    (cmd,) = commands
    written = tmp_path / "run" / resolved.RESOLVED_FILE
    assert cmd[cmd.index("--config") + 1] == str(written) and str(recipe) not in cmd
    assert not {"--max-steps", "--precision", "--output-dir"} & set(cmd)  # folded into the file

    # the worker's config is the file the launcher wrote: the recipe edited since changes nothing, and
    # nothing on the worker's side parses a recipe
    recipe.write_text(recipe.read_text().replace("lr: 0.001", "lr: 0.5"))
    monkeypatch.setattr(run_config, "load_run_config", lambda *a, **k: pytest.fail("the worker parsed a recipe"))
    config = resolved.read_resolved(parse_args(cmd[cmd.index("selfdraft.training.train") + 1 :]).config)
    assert config.train.max_steps == 3 and config.train.lr == 0.001 and config.train.precision == "auto"
    assert reads[-1] == str(written) and reads.count(str(recipe)) == 1


def test_the_worker_refuses_a_recipe_in_one_line(text_run, capsys):
    recipe = text_run()
    assert run_worker(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "is not a resolved run config" in err and resolved.RESOLVED_FILE in err
    assert "selfdraft prepare --config" in err


def test_the_worker_loads_prepared_splits_and_never_builds_them(tmp_path, text_run, monkeypatch):
    from transformers import AutoTokenizer

    config = run_config.load_run_config(text_run())
    tokenizer = AutoTokenizer.from_pretrained(config.target)
    monkeypatch.setattr(prepare, "build_dataset", lambda *a, **k: pytest.fail("the worker built the splits"))
    with pytest.raises(UserError, match=r"holds no prepared data splits; run `selfdraft prepare"):
        prepare.load_prepared_splits(config, tokenizer)
    monkeypatch.undo()
    train, heldout = prepare.prepare_splits(config, tokenizer)
    monkeypatch.setattr(prepare, "build_dataset", lambda *a, **k: pytest.fail("the worker built the splits"))
    again_train, again_heldout = prepare.load_prepared_splits(config, tokenizer)
    assert (len(again_train), len(again_heldout)) == (len(train), len(heldout)) and len(train) > 0
    # splits of another data config are refused, not silently trained on
    config.data.max_length = 30
    with pytest.raises(UserError, match=r"another data config \(max_length changed\)"):
        prepare.load_prepared_splits(config, tokenizer)


def test_the_resolved_file_round_trips_every_key(tmp_path, text_run):
    config = run_config.load_run_config(text_run(schedule={"snapshot_tokens": [100, 200]}))
    path = resolved.write_resolved(config, "recipe.yaml")
    assert path == Path(config.output_dir) / resolved.RESOLVED_FILE
    assert resolved.read_resolved(path) == config
    assert yaml.safe_load(path.read_text())[resolved.SOURCE_KEY] == "recipe.yaml"
    assert config.fingerprint() == resolved.read_resolved(path).fingerprint()
