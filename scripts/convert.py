"""`selfdraft convert`: a Medusa-1 / EAGLE-1 / EAGLE-3 / SGLang / vLLM heads folder -> selfdraft's format."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="folder of published heads (config.json + weights)")
    parser.add_argument("dst", help="output folder (config.json + model.safetensors)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the heads-folder files (config, weights, card, tree, stages) of a non-empty dst",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the target the heads are for (embedded name, folder or hub id): checks they fit it and "
        "supplies EAGLE-3's default fused layers when the checkpoint does not name them",
    )


def run(args: argparse.Namespace) -> int:
    from selfdraft.destinations import check_destination, staged_folder
    from selfdraft.heads.convert import convert_heads
    from selfdraft.heads.folder import read_heads_config
    from selfdraft.target import load_target

    check_destination(args.dst, [args.src], overwrite=args.overwrite, option="dst")  # before the target loads
    target = load_target(args.target)[0] if args.target else None
    with staged_folder(args.dst, option="dst") as tmp:
        config = read_heads_config(convert_heads(args.src, tmp, target))
    out = args.dst
    layout = (config.converted_from or {}).get("layout")
    print(f"converted {args.src} ({layout}) -> {out} [{config.head_kind}, layout {config.eagle_layout}]")
    return 0
