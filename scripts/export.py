"""`selfdraft export`: selfdraft EAGLE-3-layout heads -> the draft-model folder vLLM or SGLang loads."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--to", dest="engine", required=True, choices=["vllm", "sglang"], help="serving engine"
    )
    parser.add_argument("src", help="selfdraft heads folder (config.json + model.safetensors)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--verifier", default=None, help="target name or path written into vLLM's config")
    parser.add_argument("--overwrite", action="store_true", help="replace config.json and weights in a non-empty dst")
    parser.add_argument("--speculative-tokens", type=int, default=None, help="vLLM's default draft length")


def run(args: argparse.Namespace) -> int:
    from selfdraft.destinations import ENGINE_FOLDER_NAMES, check_destination, staged_folder
    from selfdraft.heads.foreign.export import export_heads

    owned = {"owned": ENGINE_FOLDER_NAMES, "option": "dst"}
    check_destination(args.dst, [args.src], overwrite=args.overwrite, **owned)
    with staged_folder(args.dst, **owned) as tmp:  # the dst is replaced only once the export is whole
        export_heads(args.src, tmp, args.engine, args.verifier, args.speculative_tokens)
    print(f"exported {args.src} -> {args.dst} for {args.engine}")
    return 0
