"""Prompt sets for benchmarks: held-out ShareGPT first turns, HumanEval, MT-bench (first turns or both
turns), or a user JSONL file."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from selfdraft.corpora.mtbench import mtbench_questions
from selfdraft.corpora.sources import humaneval_path, load_sharegpt
from selfdraft.corpora.splits import heldout_flags
from selfdraft.errors import MissingFileError, UserError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # wrap in the target's chat template (False: raw completion, e.g. code)
    category: str | None = None  # e.g. MT-bench's "writing": the report adds a per-category table
    # earlier user turns of the same conversation: each is answered by the target itself (greedy)
    # before `text` is asked, in the chat template, as Spec-Bench runs MT-bench's second turns
    history: tuple[str, ...] = field(default=())

    @property
    def turn(self) -> int:
        return len(self.history) + 1


def sharegpt_heldout(limit: int, heldout_fraction: float = 0.02) -> list[Prompt]:
    """First user turns of ShareGPT conversations in the training runs' held-out split: the
    near-duplicate-free one (`splits.heldout_flags`), so no prompt repeats one the heads trained on."""
    return list(_sharegpt_heldout_prompts(heldout_fraction)[:limit])


@lru_cache(maxsize=2)
def _sharegpt_heldout_prompts(heldout_fraction: float) -> tuple[Prompt, ...]:
    """Every held-out first turn, once per process: the near-duplicate grouping reads all of ShareGPT
    (tens of seconds), and a bench or tune run may name several sharegpt sets."""
    out = []
    records = load_sharegpt()
    for record, held in zip(records, heldout_flags(records, heldout_fraction), strict=True):
        if not held:
            continue
        first = next((m["content"] for m in record["messages"] if m["role"] == "user"), "")
        if 10 <= len(first) <= 2000:  # skip empty turns and pasted documents
            out.append(Prompt(record["id"], first, chat=True))
    return tuple(out)


def humaneval(limit: int) -> list[Prompt]:
    path = humaneval_path()
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    return [Prompt(r["task_id"], r["prompt"], chat=False) for r in rows[:limit]]


def _prompt_lines(path: Path) -> list[str]:
    """The lines of a prompts file; a folder, a missing file or bytes that are not UTF-8 are refused."""
    if path.is_dir():
        raise UserError(f"{path} is a folder; pass a JSONL file of prompts (one JSON object per line)")
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist; pass a JSONL file of prompts")
    data = path.read_bytes()
    if data.startswith(b"\x1f\x8b"):
        raise UserError(f"{path} is gzip-compressed, which prompt files are not read as; gunzip it and pass the JSONL")
    try:
        return data.decode("utf-8-sig").splitlines()  # a byte-order mark (some editors write one) is dropped
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: byte 0x{data[err.start]:02x} is not UTF-8 ({err.reason}); save the file as UTF-8"
        ) from err


def mtbench(limit: int, both_turns: bool = False, skip: int = 0) -> list[Prompt]:
    """MT-bench questions in file order: first turns, or (both_turns) turn 1 then turn 2 of each
    question, turn 2 asked after the target's own turn-1 answer. `limit` and `skip` count questions."""
    out = []
    for q in mtbench_questions()[skip : skip + limit]:
        qid, first = f"mtbench:{q['question_id']}", q["turns"][0]
        out.append(Prompt(qid if not both_turns else f"{qid}:1", first, True, q["category"]))
        if both_turns:
            out.extend(
                Prompt(f"{qid}:{n + 1}", text, True, q["category"], tuple(q["turns"][:n]))
                for n, text in enumerate(q["turns"][1:], start=1)
            )
    return out


def read_prompt_rows(path: str | Path) -> list[dict]:
    """Rows {"line" (1-based), "id" (None when absent), "prompt", "chat" (default true)} of a JSONL file
    of prompts; a missing file, a line that is not JSON, a row without a "prompt" string or with a
    "chat" that is not true/false is refused."""
    rows = []
    for n, line in enumerate(_prompt_lines(Path(path)), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{n}: not JSON ({err.msg}); write one JSON object per line") from err
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f'{path}:{n}: each row needs a "prompt" string (and optional "id", "chat")')
        chat = row.get("chat", True)
        if not isinstance(chat, bool):  # "no" would read as true
            raise UserError(f'{path}:{n}: "chat" must be true or false (JSON booleans), got {chat!r}')
        rows.append({"line": n, "id": row.get("id"), "prompt": row["prompt"], "chat": chat})
    return rows


def user_jsonl(path: str, limit: int) -> list[Prompt]:
    rows = read_prompt_rows(path)
    ids = [str(r["line"] - 1) if r["id"] is None else str(r["id"]) for r in rows]
    return [Prompt(i, r["prompt"], r["chat"]) for i, r in zip(ids, rows, strict=True)][:limit]


PROMPT_SETS = (
    "sharegpt:N, humaneval:N, mtbench[:N], mtbench-2turn[:N] or a file.jsonl[:N], optionally followed by :skip=K"
)


def _count(spec: str, text: str, what: str) -> int:
    if not text.isdigit():
        raise UserError(f"prompt set {spec!r}: {what} {text!r} is not a whole number; use {PROMPT_SETS}")
    return int(text)


def load_prompt_set(spec: str) -> list[Prompt]:
    """`sharegpt:N`, `humaneval:N`, `mtbench[:N]` (first turns of N questions), `mtbench-2turn[:N]`
    (both turns of N questions), `path/to/file.jsonl[:N]`; append `:skip=K` to drop the first K (e.g.
    tune on prompts a benchmark does not use; for MT-bench, K and N count questions). A set that names
    no prompts is refused."""
    parts = spec.split(":")
    skip = 0
    if parts[-1].startswith("skip="):
        skip = _count(spec, parts.pop()[5:], "skip")
    limit = int(parts.pop()) if len(parts) > 1 and parts[-1].isdigit() else 10**9
    name = ":".join(parts)
    if name == "sharegpt":
        prompts = sharegpt_heldout(limit + skip)
    elif name == "humaneval":
        prompts = humaneval(limit + skip)
    elif name in ("mtbench", "mtbench-2turn"):
        # skip and limit count whole questions: a turn 2 never runs without its own turn 1
        prompts, skip = mtbench(limit, both_turns=name == "mtbench-2turn", skip=skip), 0
    elif name.endswith(".jsonl"):
        prompts = user_jsonl(name, limit + skip)
    else:
        raise UserError(f"unknown prompt set {spec!r}; use {PROMPT_SETS}")
    if not prompts[skip:]:
        raise UserError(
            f"prompt set {spec!r} holds no prompts ({len(prompts)} before skip={skip}); "
            "name a set with at least one prompt"
        )
    return prompts[skip:]
