"""`selfdraft convert`: a Medusa-1 / EAGLE-1 / EAGLE-3 / SGLang / vLLM heads folder -> selfdraft's format."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="folder of published heads (config.json + weights)")
    parser.add_argument("dst", help="output folder (config.json + model.safetensors)")
    parser.add_argument(
        "--target",
        default=None,
        help="the target the heads are for (embedded name, folder or hub id): checks they fit it and "
        "supplies EAGLE-3's default fused layers when the checkpoint does not name them",
    )


def run(args: argparse.Namespace) -> int:
    from selfdraft.heads.folder import read_heads_config
    from selfdraft.heads.foreign.convert import convert_heads
    from selfdraft.target import load_target

    target = load_target(args.target)[0] if args.target else None
    out = convert_heads(args.src, args.dst, target)
    config = read_heads_config(out)
    layout = (config.converted_from or {}).get("layout")
    print(f"converted {args.src} ({layout}) -> {out} [{config.head_kind}, layout {config.eagle_layout}]")
    return 0
