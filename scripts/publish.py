"""`selfdraft publish`: a training run -> a Hub-shaped heads folder (config.json, model.safetensors,
tree.yaml, training_config.yaml, README.md card); optionally upload it."""

from __future__ import annotations

import argparse

import torch

from selfdraft.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", required=True, help="training output_dir (holds heads/, log.jsonl, run.json)"
    )
    parser.add_argument("--config", required=True, help="the run config used to train")
    parser.add_argument("--dest", required=True, help="folder to write, e.g. checkpoints/<target>-<kind>")
    parser.add_argument(
        "--target",
        default=None,
        help="the target the card names (base_model); default: the run config's target. Only a run "
        "trained on a local folder may name it differently (its hub id)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the heads-folder files (config, weights, card, tree, stages) of a non-empty --dest; "
        "other files there stay",
    )
    parser.add_argument(
        "--earlier",
        nargs=2,
        action="append",
        default=[],
        metavar=("RUN", "CONFIG"),
        help="an earlier stage this run continued from (heads.init_from), oldest first: the card sums "
        "it with this run; repeatable",
    )
    parser.add_argument(
        "--bench",
        nargs=2,
        action="append",
        default=[],
        metavar=("JSON", "COMMAND"),
        help="a bench.json measured for these heads and the command that wrote it; repeatable",
    )
    parser.add_argument(
        "--selection-bench",
        nargs=2,
        action="append",
        default=[],
        metavar=("JSON", "COMMAND"),
        help="a bench.json whose prompts chose these heads or their tree, and its command: the card "
        "gives its tau and identity but no speedup; repeatable",
    )
    parser.add_argument("--tree", default=None, help="tree.yaml chosen by `selfdraft tune`")
    parser.add_argument("--tokens", type=int, default=None, help="training tokens (default: from the cache)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--push-to", default=None, help="Hugging Face repo id to upload to (needs network)")


def run(args: argparse.Namespace) -> int:
    from selfdraft.training.config import load_run_config
    from selfdraft.training.data.feature_cache import HiddenStateCache
    from selfdraft.training.release.publish import publish, upload

    if args.tokens is not None and args.tokens < 1:
        raise UserError(f"--tokens {args.tokens}: pass the number of training tokens (>= 1), or leave it out")
    config = load_run_config(args.config)
    tokens = args.tokens
    if tokens is None and config.data.feature_cache:
        tokens = HiddenStateCache(
            config.data.feature_cache, allow_partial=config.data.partial_cache
        ).num_tokens
    dest = publish(
        args.run,
        args.dest,
        target=args.target,
        config_path=args.config,
        benches=[tuple(pair) for pair in args.bench],
        selection_benches=[tuple(pair) for pair in args.selection_bench],
        tree_file=args.tree,
        dtype=getattr(torch, args.dtype),
        tokens=tokens,
        earlier=[tuple(pair) for pair in args.earlier],
        overwrite=args.overwrite,
    )
    print(f"wrote {dest}")
    if args.push_to:
        print(upload(dest, args.push_to))
    return 0
