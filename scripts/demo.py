"""`make demo`: the embedded SmolLM2 target with its shipped heads, answering chat and code prompts.

For each prompt it streams the speculative answer, then reports tokens, tau, tokens/s and the speedup
over the target's own greedy `generate` of the same prompt, measured in this run (interleaved).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from transformers import TextStreamer

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
    parser.add_argument("--repeats", type=int, default=2, help="interleaved timing repeats per prompt")


def run(args: argparse.Namespace) -> int:
    from selfdraft.inference import SelfDraftModel
    from selfdraft.inference.benchmark import compare
    from selfdraft.inference.model import SHIPPED

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    kwargs = {"tree": args.tree} if args.tree else {}
    model = SelfDraftModel.from_pretrained(args.target, heads=args.heads or SHIPPED, **kwargs)
    print(
        f"target {args.target} | heads {model.heads.config.head_kind} | tree {model.tree} | "
        f"{torch.get_num_threads()} CPU threads\n"
    )
    # warm-up: first calls pay one-off allocation costs that would distort the first ratio
    warm = model.chat_ids("Hi")
    compare(model, warm, 8)
    speedups, identical = [], True
    for prompt in PROMPTS:
        code = prompt.startswith("def ")
        ids = model.tokenizer(prompt, return_tensors="pt").input_ids if code else model.chat_ids(prompt)
        print(f">>> {prompt}")
        streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
        result = compare(model, ids, args.max_new_tokens, repeats=args.repeats, streamer=streamer)
        identical &= result.identical
        speedups.append(result.speedup)
        print(
            f"\n[{len(result.speculative[0].tokens)} tokens | tau {result.tau:.2f} (tokens per target pass, "
            f"bonus counted) | {result.tokens_per_second('speculative'):.1f} tok/s vs "
            f"{result.tokens_per_second('baseline'):.1f} tok/s plain | speedup {result.speedup:.2f}x | "
            f"identical to plain decoding: {'yes' if result.identical else 'NO'}]\n"
        )
    print(
        f"median speedup {statistics.median(speedups):.2f}x over {len(PROMPTS)} prompts (same run, interleaved)"
    )
    print(
        "all texts identical to the target's own greedy decoding" if identical else "MISMATCH: outputs differ"
    )
    return 0 if identical else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
