"""The run config parsed once: the launcher's resolved copy in the run folder, which the workers read.

`selfdraft train` and `selfdraft prepare` are the only readers of a user's YAML recipe
(`load_run_config`: defaults, command-line overrides, paths and layout checks). They write the result
to OUTPUT_DIR/resolved.yaml, and every training worker reads that file: no worker re-parses the recipe,
so every rank of every node trains on the one config the launcher checked (and a recipe edited while a
job runs changes nothing until the next launch).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from selfdraft.destinations import staged_file
from selfdraft.training.config import RunConfig
from selfdraft.typed_config import ConfigError, build_dataclass, read_yaml

RESOLVED_FILE = "resolved.yaml"
# the top-level keys of a resolved file: a recipe (whose keys are RunConfig's) is told apart from it
SOURCE_KEY, CONFIG_KEY = "resolved_from", "config"


def resolved_path(config: RunConfig) -> Path:
    return Path(config.output_dir) / RESOLVED_FILE


def write_resolved(config: RunConfig, source: str | Path) -> Path:
    """Write `config` (resolved from the recipe `source`) to OUTPUT_DIR/resolved.yaml, atomically: a
    worker never reads half a file. Returns its path."""
    path = resolved_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# written by selfdraft from {source}: the run config the training workers read.\n"
        "# Edit the recipe and launch again rather than this file.\n"
    )
    body = {SOURCE_KEY: str(source), CONFIG_KEY: dataclasses.asdict(config)}
    with staged_file(path, option="output_dir") as fh:
        fh.write(header + yaml.safe_dump(body, sort_keys=False))
    return path


def read_resolved(path: str | Path) -> RunConfig:
    """The run config of a resolved file (`write_resolved`). A recipe given instead is refused in one
    line that says how to get the resolved file."""
    raw = read_yaml(path, "resolved run config")
    if not isinstance(raw, dict) or set(raw) != {SOURCE_KEY, CONFIG_KEY}:
        raise ConfigError(
            f"{path} is not a resolved run config: the worker reads the file that `selfdraft prepare --config "
            f"{path}` (or `selfdraft train`) writes into the run folder, OUTPUT_DIR/{RESOLVED_FILE}; pass that"
        )
    return build_dataclass(RunConfig, raw[CONFIG_KEY])
