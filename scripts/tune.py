"""`selfdraft tune`: pick the tree that maximizes expected tokens/s for given heads on this machine,
and save it as tree.yaml next to the heads (SelfDraftModel then uses it by default)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from selfdraft.errors import UserError
from selfdraft.scripts.options import add_precision_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--heads", required=True, help="heads folder; tree.yaml is written into it")
    parser.add_argument(
        "--prompts", default="sharegpt:6", help="held-out prompt set (sharegpt:N, humaneval:N, .jsonl)"
    )
    parser.add_argument("--candidates", nargs="+", default=None, help="tree names to compare")
    parser.add_argument(
        "--max-tree-tokens",
        type=int,
        default=None,
        help="drop candidates that may verify more tokens than this in one pass",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="score trees at this temperature; > 0 writes the tree file's `sampling:` tree (used at T > 0)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="tune the greedy tree for batches of this many prompts (scored by measured throughput); "
        "written as the entry's `batch:` tree, used by generate() with at least that many prompts",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="tree file to write this dtype's entry into (default HEADS/tree.yaml; other dtypes' entries stay)",
    )
    parser.add_argument(
        "--this-machine",
        action="store_true",
        help="write the entry for this kind of machine only (e.g. bfloat16@cpu-avx512bf16), which it "
        "uses instead of the dtype's entry; other kinds keep theirs",
    )
    add_precision_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from selfdraft.bench.prompts import load_prompt_set
    from selfdraft.bench.tune import CANDIDATES, score_trees, score_trees_batched, tree_description
    from selfdraft.corpora.mtbench import refuse_for_selection, refuse_mtbench_texts
    from selfdraft.inference.model import TREE_FILE, SelfDraftModel
    from selfdraft.precision import dtype_name, machine_kind
    from selfdraft.tree_syntax import check_tree_destination, entry_key, resolve_tree, write_tree_file

    refuse_for_selection(args.prompts, "selfdraft tune")
    # checked before the tuning run, which takes minutes: never replace a file that is not a tree file
    out = check_tree_destination(Path(args.out) if args.out else Path(args.heads) / TREE_FILE)
    if args.batch < 1:
        raise UserError(f"--batch {args.batch}: pass a batch size >= 1")
    if args.batch > 1 and args.temperature > 0:
        raise UserError("--batch tunes the greedy batch tree; drop --temperature (or --batch)")
    texts = load_prompt_set(args.prompts)  # a bad prompt set is refused before the model loads
    refuse_mtbench_texts([p.text for p in texts], f"selfdraft tune --prompts {args.prompts}")
    model = SelfDraftModel.from_pretrained(
        args.target, heads=args.heads, tree="chain-1", dtype=args.dtype, draft_dtype=args.draft_dtype
    )
    prompts = [model.prompt_ids(p.text, p.chat) for p in texts]
    candidates = args.candidates or CANDIDATES
    if args.max_tree_tokens is not None:
        candidates = [c for c in candidates if resolve_tree(c).max_tokens <= args.max_tree_tokens]
        if not candidates:
            raise UserError(f"no candidate tree fits in {args.max_tree_tokens} tokens")
    if args.batch > 1:
        ids = [p[0] for p in prompts]
        scores = score_trees_batched(model, ids, candidates, args.batch, args.max_new_tokens)
    else:
        scores = score_trees(model, prompts, candidates, args.max_new_tokens, temperature=args.temperature)
    print(
        f"{'tree':42s} {'tau':>5s} {'size':>5s} {'draft ms':>8s} {'verify ms':>9s} {'other ms':>8s} "
        f"{'expected':>8s} {'measured':>8s}"
    )
    for s in scores:
        print(
            f"{s.tree:42s} {s.tau:5.2f} {s.tree_tokens:5.1f} {1000 * s.draft_s:8.1f} {1000 * s.verify_s:9.1f} "
            f"{1000 * s.other_s:8.1f} "
            f"{s.expected_tokens_per_s:8.1f} {s.measured_tokens_per_s:8.1f}"
        )
    best = scores[0]
    dtype = dtype_name(model.target.dtype)
    machine = machine_kind(model.target.device) if args.this_machine else None
    sampling = args.temperature > 0
    description = tree_description(best, args.batch) + (f" at temperature {args.temperature:g}" if sampling else "")
    write_tree_file(
        out,
        resolve_tree(best.tree),
        description,
        dict(asdict(best)),
        dtype=dtype,
        sampling=sampling,
        batch=args.batch,
        machine=machine,
    )
    which = f"the T > 0 tree (tuned at {args.temperature:g})" if sampling else "the greedy tree"
    if args.batch > 1:
        which = f"the greedy tree for batches of {args.batch}+ prompts"
    print(f"chose {best.tree} as {which} for {entry_key(dtype, machine)} -> {out}")
    return 0
