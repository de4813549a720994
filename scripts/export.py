"""`selfdraft export`: selfdraft EAGLE-3-layout heads -> the draft-model folder vLLM or SGLang loads."""

from __future__ import annotations

import argparse

# vLLM also loads these folders with method "eagle" (EAGLE-1) without a word, and then drafts almost
# nothing (1 of 66 tokens accepted in a measured run): the method must be named.
VLLM_METHOD_NOTE = (
    'vLLM: pass speculative_config={{"method": "eagle3", "model": "{out}", "num_speculative_tokens": K}} '
    '(method "eagle3"; "eagle" loads these heads silently and accepts almost nothing)'
)
SGLANG_METHOD_NOTE = "SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path {out}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--to", dest="engine", required=True, choices=["vllm", "sglang"], help="serving engine"
    )
    parser.add_argument("src", help="selfdraft heads folder (config.json + model.safetensors)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument(
        "--verifier",
        default=None,
        help="the target's hub id written into vLLM's config (default: the embedded target's hub id)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="target name or folder to read the token embedding from (vLLM; default: the heads' target)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace config.json and weights in a non-empty dst")
    parser.add_argument("--speculative-tokens", type=int, default=None, help="vLLM's default draft length")


def run(args: argparse.Namespace) -> int:
    from selfdraft.destinations import ENGINE_FOLDER_NAMES, check_destination, staged_folder
    from selfdraft.heads.eagle3.export import export_heads

    owned = {"owned": ENGINE_FOLDER_NAMES, "option": "dst"}
    check_destination(args.dst, [args.src], overwrite=args.overwrite, **owned)
    with staged_folder(args.dst, **owned) as tmp:  # the dst is replaced only once the export is whole
        export_heads(args.src, tmp, args.engine, args.verifier, args.speculative_tokens, target=args.target)
    print(f"exported {args.src} -> {args.dst} for {args.engine}")
    note = VLLM_METHOD_NOTE if args.engine == "vllm" else SGLANG_METHOD_NOTE
    print(note.format(out=args.dst))
    return 0
