"""`selfdraft generate`: stream a speculative answer and report tau and tokens/s."""

from __future__ import annotations

import argparse
import sys

from transformers import TextStreamer

from selfdraft.inference.model import SHIPPED
from selfdraft.scripts.options import add_precision_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct", help="embedded name, folder or hub id")
    parser.add_argument("--heads", default=SHIPPED, help="heads folder, 'none' for fresh heads, or 'shipped'")
    parser.add_argument(
        "--head-kind", default="eagle", choices=["eagle", "medusa"], help="kind of fresh heads"
    )
    parser.add_argument(
        "--tree", default=None, help="tree name, chain-N, dynamic:..., or YAML file (default: the heads' tree.yaml)"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    add_precision_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from selfdraft.inference import SelfDraftModel
    from selfdraft.inference.model import prompt_text

    heads = None if args.heads.lower() == "none" else args.heads
    model = SelfDraftModel.from_pretrained(
        args.target,
        heads=heads,
        tree=args.tree,
        head_kind=args.head_kind,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
    )
    ids = (
        model.tokenizer(prompt_text(args.prompt), return_tensors="pt").input_ids
        if args.raw
        else model.chat_ids(args.prompt)
    )
    streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        streamer=streamer,
    )
    s = out.stats
    print(
        f"\n[{len(out.tokens)} tokens | tau {s.mean_accepted:.2f} (accepted per target pass, bonus counted) | "
        f"{out.tokens_per_second:.1f} tokens/s | {s.finish_reason}]",
        file=sys.stderr,
    )
    return 0
