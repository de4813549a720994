"""Command-line options several subcommands share."""

from __future__ import annotations

import argparse


def check_counts(flags: dict[str, int | None]) -> None:
    """Each flag given (not None) is a count >= 1, or a UserError naming it (before any work)."""
    from selfdraft.errors import UserError

    for flag, value in flags.items():
        if value is not None and value < 1:
            raise UserError(f"{flag} {value}: pass a count of at least 1")


def add_precision_arguments(
    parser: argparse.ArgumentParser, with_defaults: bool = True, dtype: str = "float32"
) -> None:
    """--dtype (default `dtype`) and --draft-dtype; without defaults (None) a config file's values stand."""
    parser.add_argument(
        "--dtype",
        default=dtype if with_defaults else None,
        help="the target's dtype: float32 (greedy output token-identical to its own generate), "
        "bfloat16/float16 (faster on CPUs with native bf16; the target's own argmax then depends on "
        "the block size, so outputs can part at near-ties), or auto (bfloat16 where the machine "
        f"computes it natively, else float32); default {dtype}",
    )
    parser.add_argument(
        "--draft-dtype",
        default="auto" if with_defaults else None,
        help="the heads' dtype: auto (bfloat16 with int8 weights on CPUs with native bf16, else the "
        "target's), int8 "
        "(int8 weights computing in auto's dtype: fewer bytes per draft step), or a dtype name; heads "
        "only change speed, never the output",
    )


def add_num_proc_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-proc",
        type=int,
        default=None,
        help="processes that render the data splits (default: $SELFDRAFT_NUM_PROC, else one per 2,000 "
        "records up to 8); the splits do not depend on it",
    )


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="where the target runs: auto (cuda when available, else cpu), cpu, cuda, cuda:N",
    )


def resolve_device(name: str) -> str:
    """--device -> a torch device string; one that this machine lacks or torch does not know is a
    UserError naming what there is."""
    import torch

    from selfdraft.errors import UserError
    from selfdraft.target import check_device

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_device(name)
    except UserError as err:
        raise UserError(f"--{err}; or auto") from None
    return name
