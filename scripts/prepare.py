"""`selfdraft prepare`: render the data splits and fill the feature cache of a run (resumable)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")


def prepare_from_config(
    config_path: str, output_dir: str | None = None, batch_size: int = 8, fill_cache: bool = True
) -> None:
    """Data splits, then the feature cache (unless `fill_cache` is False, e.g. a partial-cache run)."""
    from selfdraft.target import load_target
    from selfdraft.training.config import load_run_config
    from selfdraft.training.prepare import cache_ready, prepare_features, prepare_splits

    config = load_run_config(config_path, {"output_dir": output_dir} if output_dir else None)
    target, tokenizer = load_target(config.target)
    train, _ = prepare_splits(config, tokenizer)
    if fill_cache and config.data.feature_cache and not cache_ready(config):
        prepare_features(config, target, train, batch_size=batch_size)


def run(args: argparse.Namespace) -> int:
    prepare_from_config(args.config, args.output_dir, args.batch_size)
    return 0
