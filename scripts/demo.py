"""`make demo`: the embedded SmolLM2 target with its shipped heads, answering chat and code prompts.

For each prompt it streams the speculative answer, then reports tokens, tau, tokens/s and the speedup
over the target's own greedy `generate` of the same prompt in the same dtype: the median of at least
3 interleaved repetitions, measured in this run. The dtype defaults to `auto`, the fastest lossless
setting of this machine: bfloat16 where it computes bf16 natively (AMX / AVX512-BF16, a recent
GPU), else float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from transformers import TextStreamer

from selfdraft.bench.divergence import first_divergence, float32_reference
from selfdraft.scripts.options import add_precision_arguments, check_counts

PROMPTS = [
    "What are three good habits for staying healthy?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in two short paragraphs.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--heads", default=None, help="heads folder (default: the shipped checkpoint)")
    parser.add_argument("--tree", default=None, help="tree shape (default: the checkpoint's tuned tree)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats per prompt")
    add_precision_arguments(parser, dtype="auto")


def run(args: argparse.Namespace) -> int:
    from selfdraft.bench.timing import compare
    from selfdraft.heads.int8 import heads_precision
    from selfdraft.inference import SelfDraftModel
    from selfdraft.inference.model import SHIPPED
    from selfdraft.precision import machine_kind

    check_counts({"--repeats": args.repeats, "--max-new-tokens": args.max_new_tokens})
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    kwargs = {"tree": args.tree} if args.tree else {}
    model = SelfDraftModel.from_pretrained(
        args.target, heads=args.heads or SHIPPED, dtype=args.dtype, draft_dtype=args.draft_dtype, **kwargs
    )
    print(
        f"target {args.target} ({model.target.dtype}) | heads {model.heads.config.head_kind} "
        f"({heads_precision(model.heads)}) | tree {model.tree.describe()} | "
        f"{torch.get_num_threads()} CPU threads, {machine_kind(model.target.device)}\n"
    )
    # warm-up: first calls pay one-off allocation costs that would distort the first ratio
    warm = model.chat_ids("Hi")
    compare(model, warm, 8)
    speedups, identical, unexplained = [], 0, 0
    reference = None  # float32 copy of a low-precision target, to tell near-ties from errors
    for prompt in PROMPTS:
        code = prompt.startswith("def ")
        ids = model.prompt_ids(prompt, chat=not code)
        print(f">>> {prompt}")
        streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        progress = TimingProgress(args.repeats, sys.stderr)
        result = compare(
            model, ids, args.max_new_tokens, repeats=args.repeats, streamer=streamer, progress=progress
        )
        progress.done()
        identical += result.identical
        speedups.append(result.speedup)
        print(
            f"\n[{len(result.speculative[0].tokens)} tokens | tau {result.tau:.2f} (tokens per target pass, "
            f"bonus counted) | {result.tokens_per_second('speculative'):.1f} tok/s vs "
            f"{result.tokens_per_second('baseline'):.1f} tok/s plain | speedup {result.speedup:.2f}x | "
            f"identical to plain decoding: {'yes' if result.identical else 'NO'}]"
        )
        if not result.identical:
            if reference is None:
                reference = float32_reference(model.target)
            unexplained += not _explain_divergence(model, ids, result, reference)
        print()
    print(
        f"median speedup {statistics.median(speedups):.2f}x over {len(PROMPTS)} prompts (same run, interleaved)"
    )
    if identical == len(PROMPTS):
        print("all texts identical to the target's own greedy decoding")
    else:
        print(
            f"{identical} of {len(PROMPTS)} texts identical to the target's own greedy decoding; "
            + (
                f"{unexplained} part where the target's own choice is clear: MISMATCH"
                if unexplained
                else f"the others part at near-ties within {model.target.dtype} rounding"
            )
        )
    return 1 if unexplained else 0


class TimingProgress:
    """What the demo is timing, on stderr, so the repeats after the streamed answer are never silent:
    one line overwritten in place in a terminal, one line per run elsewhere (logs)."""

    def __init__(self, repeats: int, stream) -> None:
        self.repeats = repeats
        self.stream = stream
        self.live = stream.isatty()
        self.shown = False

    def __call__(self, r: int, method: str) -> None:
        self.done()
        if r == 0 and method == "speculative":
            return  # this run streams its answer: that is the progress
        what = "target's own generate" if method == "baseline" else "speculative decoding"
        line = f"[timing {r + 1}/{self.repeats}: {what}...]"
        print(line, end="" if self.live else "\n", file=self.stream, flush=True)
        self.shown = self.live

    def done(self) -> None:
        """Clear the live line before other output."""
        if self.shown:
            print("\r\033[K", end="", file=self.stream, flush=True)
            self.shown = False


def _explain_divergence(model, ids, result, reference) -> bool:
    """Print where the speculative text parts from plain decoding; True when it is a near-tie."""
    found = first_divergence(
        model.target, ids, result.baseline[0].tokens, result.speculative[0].tokens, reference
    )
    if found is None:
        return False
    print(
        f"[parts from plain decoding at token {found.position}: in float32 the target's logits for the "
        f"two tokens differ by {found.gap:.4g} ({found.gap_ulps:.2f} ulps of {model.target.dtype})"
        + (", a near-tie]" if found.near_tie else "]")
    )
    return found.near_tie


def main() -> int:
    """`python -m selfdraft.scripts.demo` (`make demo`): the `selfdraft demo` command, so a user error
    or Ctrl-C prints one line, not a traceback."""
    from selfdraft.scripts.cli import main as cli_main

    return cli_main(["demo", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
