"""`selfdraft generate`: stream a speculative answer and report tau and tokens/s; or, with
--prompts-file, generate a JSONL file of prompts in batches (one shared target pass per step)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from transformers import TextStreamer

from selfdraft.destinations import check_destination, staged_file
from selfdraft.inference.model import SHIPPED
from selfdraft.scripts.options import add_precision_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct", help="embedded name, folder or hub id")
    parser.add_argument("--heads", default=SHIPPED, help="heads folder, 'none' for fresh heads, or 'shipped'")
    parser.add_argument(
        "--head-kind",
        default=None,
        choices=["eagle", "medusa"],
        help="kind of fresh heads (--heads none), or of the shipped ones; a heads folder says its own",
    )
    parser.add_argument(
        "--tree", default=None, help="tree name, chain-N, dynamic:..., or YAML file (default: the heads' tree.yaml)"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument(
        "--prompts-file",
        default=None,
        help='JSONL, one {"prompt": ..., "id"?: ..., "chat"?: bool} per line, generated in batches of '
        "--batch-size (one shared target pass per step); needs --out. With --seed S, line i uses seed S + i",
    )
    parser.add_argument("--out", default=None, help="JSONL output of --prompts-file: id, text, tokens, stats")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per batched generate call")
    parser.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    add_precision_arguments(parser)


def read_prompts_file(path: str) -> list[dict]:
    """Rows {"prompt", "id" (default: the line number), "chat" (default true)} of a JSONL file."""
    from selfdraft.bench.prompts import read_prompt_rows
    from selfdraft.errors import UserError

    rows = [
        {"id": r["line"] if r["id"] is None else r["id"], "prompt": r["prompt"], "chat": r["chat"]}
        for r in read_prompt_rows(path)
    ]
    if not rows:
        raise UserError(f"{path} holds no prompts; write one JSON object per line")
    counts = Counter(str(r["id"]) for r in rows)
    repeated = [i for i, n in counts.items() if n > 1]
    if repeated:  # legitimate (several samples of one prompt), but their answers share an id in --out
        shown = ", ".join(repeated[:5]) + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
        print(
            f"selfdraft generate: warning: {path} repeats the ids {shown}; their answers share those ids",
            file=sys.stderr,
        )
    return rows


def check_file_arguments(args: argparse.Namespace) -> list[dict]:
    """The rows of --prompts-file, checked with --out and --batch-size before the target loads."""
    from selfdraft.errors import UserError

    if not args.out:
        raise UserError("--prompts-file needs --out FILE.jsonl for the answers")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    rows = read_prompts_file(args.prompts_file)
    check_destination(args.out, [args.prompts_file], overwrite=args.overwrite, option="--out", is_file=True)
    return rows


def run_file(args: argparse.Namespace, model, rows: list[dict]) -> int:
    """Generate every prompt of --prompts-file in batches of --batch-size; write --out as JSONL (in a
    temporary file renamed at the end: an interrupted run leaves --out as it was)."""
    total, start = 0, time.perf_counter()
    with staged_file(args.out, option="--out") as fh:
        for first in range(0, len(rows), args.batch_size):
            batch = rows[first : first + args.batch_size]
            ids = [model.prompt_ids(r["prompt"], r["chat"])[0] for r in batch]
            seed = None if args.seed is None else args.seed + first  # row i of the file: seed + i
            outs = model.generate(
                ids,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=seed,
            )
            for r, out in zip(batch, outs, strict=True):
                s = out.stats
                record = {
                    "id": r["id"],
                    "text": model.tokenizer.decode(out.tokens, skip_special_tokens=True),
                    "tokens": out.tokens,
                    "stats": {
                        "tau": s.mean_accepted,
                        "tree_passes": s.tree_passes,
                        "finish_reason": s.finish_reason,
                    },
                }
                fh.write(json.dumps(record) + "\n")
                total += len(out.tokens)
    seconds = time.perf_counter() - start
    print(
        f"[{len(rows)} prompts, {total} tokens in {seconds:.1f} s ({total / seconds:.1f} tokens/s, "
        f"batches of {args.batch_size}) -> {args.out}]",
        file=sys.stderr,
    )
    return 0


def run(args: argparse.Namespace) -> int:
    from selfdraft.inference import SelfDraftModel
    from selfdraft.inference.requests import row_seeds

    if args.out and not args.prompts_file:
        from selfdraft.errors import UserError

        raise UserError("--out writes the answers of --prompts-file; pass --prompts-file, or drop --out")
    rows = check_file_arguments(args) if args.prompts_file else None
    row_seeds(args.seed, len(rows) if rows else 1)  # an out-of-range seed fails before the target loads
    heads = None if args.heads.lower() == "none" else args.heads
    model = SelfDraftModel.from_pretrained(
        args.target,
        heads=heads,
        tree=args.tree,
        head_kind=args.head_kind,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
    )
    if rows is not None:
        return run_file(args, model, rows)
    ids = model.prompt_ids(args.prompt, chat=not args.raw)
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
