"""How much of a target's output a reduced draft vocabulary covers: the measurement behind a run
config's `heads.draft_vocab_size`.

The k most frequent tokens of a fitting sample are the draft vocabulary (`build_draft_vocab`); the
share of an evaluation sample's tokens inside it is the most a head of that vocabulary can ever
draft correctly. Measured out of sample (fit and evaluation records split by content hash), since
in-sample coverage flatters large k, whose rarest tokens are fitted to the sample itself.

    python -m selfdraft.training.data.vocab_coverage --target qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from selfdraft.corpora.splits import is_heldout


def top_k_coverage(fit_counts: torch.Tensor, eval_counts: torch.Tensor, sizes: Sequence[int]) -> dict[int, float]:
    """Share of `eval_counts`' tokens among the k most frequent of `fit_counts`, for each k in sizes.

    fit_counts, eval_counts: [V] token frequencies. Ties in fit_counts go to the lower token id, as
    in `build_draft_vocab`, so the vocabulary measured is the one a run builds. -> {k: coverage}."""
    order = torch.sort(-fit_counts.to(torch.long), stable=True).indices
    cumulative = torch.cumsum(eval_counts.to(torch.float64)[order], dim=0)
    total = float(eval_counts.sum())
    return {k: float(cumulative[min(k, len(order)) - 1]) / total if total else 0.0 for k in sizes}


def token_counts(tokenizer, texts: Iterable[str], vocab_size: int) -> torch.Tensor:
    """Frequency of each token id in the texts, tokenized without special tokens. -> [V]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if ids:
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def answer_texts(records: Iterable[dict], limit: int) -> list[tuple[dict, str]]:
    """(record, first assistant turn) of the first `limit` chat records that have one."""
    out = []
    for record in records:
        answer = next((m["content"] for m in record.get("messages", []) if m["role"] == "assistant"), "")
        if answer.strip():
            out.append((record, answer))
        if len(out) == limit:
            break
    return out


def spread(items: Sequence, limit: int) -> list:
    """`limit` items evenly spaced over a sorted list (the stdlib's first files are one package)."""
    if len(items) <= limit:
        return list(items)
    step = len(items) / limit
    return [items[int(i * step)] for i in range(limit)]


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from selfdraft.corpora.sources import load_python_source, load_sharegpt
    from selfdraft.target import resolve_target_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--sharegpt", type=int, default=3000, help="ShareGPT first answers")
    parser.add_argument("--stdlib", type=int, default=300, help="stdlib files, evenly spread")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--eval-fraction", type=float, default=0.25, help="records measured, not fitted")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(args.target))
    vocab = len(tokenizer)
    chats = answer_texts(load_sharegpt(), args.sharegpt)
    code = [(r, r["text"]) for r in spread(load_python_source(), args.stdlib)]
    print(f"target {args.target}: vocabulary {vocab}; {len(chats)} ShareGPT answers, {len(code)} stdlib files")
    for name, rows in (("sharegpt", chats), ("stdlib", code), ("both", chats + code)):
        fit = [text for record, text in rows if not is_heldout(record, args.eval_fraction)]
        held = [text for record, text in rows if is_heldout(record, args.eval_fraction)]
        fit_counts, eval_counts = token_counts(tokenizer, fit, vocab), token_counts(tokenizer, held, vocab)
        out_of_sample = top_k_coverage(fit_counts, eval_counts, args.sizes)
        in_sample = top_k_coverage(fit_counts + eval_counts, fit_counts + eval_counts, args.sizes)
        cells = "  ".join(f"{k}: {out_of_sample[k]:.4f} ({in_sample[k]:.4f})" for k in args.sizes)
        print(f"{name:8s} tokens fit {int(fit_counts.sum())} eval {int(eval_counts.sum())}  {cells}")
    print("coverage: out of sample (in sample)")


if __name__ == "__main__":
    main()
