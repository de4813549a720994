"""`selfdraft prepare`: render the data splits and fill the feature cache of a run (resumable)."""

from __future__ import annotations

import argparse

from selfdraft.scripts.options import add_device_argument, add_num_proc_argument, check_counts, resolve_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    parser.add_argument(
        "--precision", choices=("auto", "bf16", "fp32"), default=None, help="override train.precision"
    )
    add_num_proc_argument(parser)
    add_device_argument(parser)


def prepare_from_config(
    config_path: str,
    output_dir: str | None = None,
    batch_size: int = 8,
    fill_cache: bool = True,
    precision: str | None = None,
    device: str = "cpu",
    num_proc: int | None = None,
) -> None:
    """Data splits, then the feature cache of both splits (unless `fill_cache` is False, e.g. a
    partial-cache run). The target runs on `device` in the run's train.precision there (auto: bf16 on
    bf16 GPUs and on CPUs that multiply bf16 natively), in batches of `batch_size`."""
    from transformers import AutoTokenizer

    from selfdraft.target import load_target, resolve_target_path
    from selfdraft.training.config import check_paths, load_run_config, resolve_precision
    from selfdraft.training.data.prepare import features_ready, prepare_features, prepare_splits

    overrides: dict = {"output_dir": output_dir} if output_dir else {}
    if precision:
        overrides["train"] = {"precision": precision}
    config = load_run_config(config_path, overrides)
    check_paths(config, reads_cache=False)
    # the splits need the tokenizer only; the target loads only if it has features to compute
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_folder(resolve_target_path(config.target)))
    train, heldout = prepare_splits(config, tokenizer, num_proc)
    if not (fill_cache and config.data.feature_cache) or features_ready(config, train, heldout):
        return
    dtype = resolve_precision(config.train.precision, device)
    target, _ = load_target(config.target, dtype=dtype, device=device)
    prepare_features(config, target, train, batch_size=batch_size, heldout=heldout)  # resumable


def _tokenizer_folder(path: str) -> str:
    """Where the target's tokenizer is: its folder, or a PEFT adapter's base model when the adapter
    has none (as `load_target` reads it)."""
    import json
    from pathlib import Path

    from selfdraft.target import resolve_target_path

    adapter = Path(path) / "adapter_config.json"
    if adapter.is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        return resolve_target_path(json.loads(adapter.read_text())["base_model_name_or_path"])
    return path


def run(args: argparse.Namespace) -> int:
    check_counts({"--batch-size": args.batch_size, "--num-proc": args.num_proc})
    prepare_from_config(
        args.config,
        args.output_dir,
        args.batch_size,
        precision=args.precision,
        device=resolve_device(args.device),
        num_proc=args.num_proc,
    )
    return 0
