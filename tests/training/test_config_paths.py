"""Paths of a run config: found beside the config file from any folder, checked before any work, each
missing one a line naming its key; a missing config file is one line too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from selfdraft.errors import MissingFileError
from selfdraft.scripts.cli import main
from selfdraft.training.config import PACKAGED_CONFIGS, check_paths, load_run_config

ROOT = Path(__file__).resolve().parents[2]


def _config(folder: Path, **values) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_relative_paths_are_found_beside_the_config(tmp_path, monkeypatch):
    folder = tmp_path / "recipe"
    folder.mkdir()
    shutil.copy(ROOT / "configs/deepspeed/zero2.json", folder / "zero2.json")
    (folder / "rows.jsonl").write_text('{"text": "a"}\n')
    path = _config(folder, deepspeed="zero2.json", data={"sources": ["rows.jsonl", "sharegpt"]})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_run_config(path)
    assert config.deepspeed == str(folder / "zero2.json")
    assert config.data.sources == [str(folder / "rows.jsonl"), "sharegpt"]
    assert config.output_dir == "runs/default"  # a folder still to be made: from the current one
    check_paths(config)
    # the shipped configs/... files from any folder: the default deepspeed JSON
    assert Path(load_run_config(_config(tmp_path / "bare")).deepspeed) == PACKAGED_CONFIGS / "deepspeed/zero1.json"


def test_a_path_that_exists_from_the_current_folder_is_unchanged(tmp_path, monkeypatch):
    """What every existing config relies on (configs/train files name paths from the repository)."""
    monkeypatch.chdir(ROOT)
    config = load_run_config(_config(tmp_path, deepspeed="configs/deepspeed/zero2.json"))
    assert config.deepspeed == "configs/deepspeed/zero2.json"


def test_every_missing_path_is_one_line_naming_its_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _config(
        tmp_path / "c",
        deepspeed="zero9.json",
        heads={"init_from": "old/heads"},
        data={"sources": ["typo.jsonl"], "feature_cache": "features", "partial_cache": True},
    )
    with pytest.raises(MissingFileError) as err:
        check_paths(load_run_config(path))
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "deepspeed", "heads.init_from", "data.sources", "data.feature_cache",
    ]  # fmt: skip
    assert "holds no cache yet" in lines[3] and "selfdraft prepare" in lines[3]


def test_train_refuses_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    assert err.strip() == f"selfdraft train: run config {missing} does not exist; pass the path of a YAML run config"

    path = _config(tmp_path, deepspeed="zero9.json", output_dir=str(tmp_path / "run"))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "deepspeed: zero9.json is not a file" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was built
