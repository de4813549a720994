"""The `selfdraft` console entry: one subcommand per module in `selfdraft.scripts`."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from selfdraft.errors import UserError
from selfdraft.interrupts import was_interrupted

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "generate": ("selfdraft.scripts.generate", "generate text with a target and draft heads"),
    "bench": ("selfdraft.scripts.bench", "benchmark selfdraft against target generate and other methods"),
    "demo": ("selfdraft.scripts.demo", "stream answers with the shipped heads and measure the speedup"),
    "distill": (
        "selfdraft.scripts.distill",
        "regenerate assistant turns with the target (self-distillation)",
    ),
    "prepare": ("selfdraft.scripts.prepare", "render training data and cache target features"),
    "train": ("selfdraft.scripts.train", "train heads on a frozen target (DeepSpeed, via torchrun)"),
    "tune": ("selfdraft.scripts.tune", "choose the tree that maximizes expected tokens/s for given heads"),
    "publish": ("selfdraft.scripts.publish", "turn a training run into a heads folder with a model card"),
    "compare": ("selfdraft.scripts.compare", "compare training runs (ablations) on their held-out evaluation"),
    "convert": ("selfdraft.scripts.convert", "convert Medusa / EAGLE / EAGLE-3 / SGLang / vLLM heads"),
    "export": ("selfdraft.scripts.export", "export EAGLE-3-layout heads for vLLM or SGLang"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfdraft", description="Lossless speculative decoding with draft heads."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        import_module(module).add_arguments(cmd)
        cmd.add_argument("--debug", action="store_true", help="show the traceback of a user error")
        cmd.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. A `UserError` prints one line (`selfdraft CMD: problem; fix`) and exits 2;
    `--debug` shows its traceback instead. Any other exception is a bug and keeps its traceback."""
    try:  # building the parser imports every command (torch, transformers): seconds to Ctrl-C in
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        print("selfdraft: interrupted", file=sys.stderr)
        if argv is None:
            # From a command line nothing has run yet, so end here: returning instead made the
            # interpreter die by SIGINT (status -2, not 130) after this line for about 1 in 10
            # interrupts landing in torch's imports (a 40-delay sweep: 4 of 40; 0 of 40 with this)
            sys.stderr.flush()
            os._exit(130)
        return 130
    try:
        return int(import_module(args._module).run(args) or 0)
    except UserError as err:
        if args.debug:
            raise
        print(f"selfdraft {args.command}: {err}", file=sys.stderr)
        return 2
    except BaseException as err:
        if args.debug or not was_interrupted(err):
            raise
        print(f"selfdraft {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
