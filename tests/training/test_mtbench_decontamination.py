"""MT-bench is a report set: no training source of the project may contain one of its questions.

Training sources: the data parts under data/ (self-distilled and synthesised conversations), every
source a run config under configs/ names (ShareGPT, the stdlib, files), and the distill inputs
(`selfdraft distill --source`, ShareGPT by default).
"""

import gzip
import json
from pathlib import Path

import pytest
import yaml

from selfdraft.corpora.mtbench import mtbench_matches, mtbench_questions
from selfdraft.corpora.sources import load_source

ROOT = Path(__file__).resolve().parents[2]
DISTILL_DEFAULT_SOURCE = "sharegpt"  # `selfdraft distill --source` reads ShareGPT (a prefix of it)


def user_turns_of_part(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            texts += [m["content"] for m in row.get("messages") or [] if m["role"] == "user"]
            if isinstance(row.get("text"), str):
                texts.append(row["text"])
    return texts


def data_parts() -> list[Path]:
    return sorted(p for p in (ROOT / "data").rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")))


def config_sources() -> set[str]:
    sources = set()
    for path in (ROOT / "configs").rglob("*.yaml"):
        data = (yaml.safe_load(path.read_text()) or {}).get("data") if path.parent.name != "bench" else None
        if isinstance(data, dict):
            sources |= {str(s) for s in data.get("sources") or []}
    return sources


def source_texts(spec: str) -> list[str]:
    """Every user turn (or plain text) of a run-config source: a builtin corpus read whole."""
    name = spec.split(":", 1)[0]
    if name in ("sharegpt", "python-stdlib"):
        spec = name  # the whole corpus covers any prefix of it
    elif not (ROOT / spec).exists():
        return []  # a path of a run that was not committed (e.g. a GPU run's files): nothing to read
    else:
        spec = str(ROOT / spec)
    texts = []
    for record in load_source(spec):
        texts += [m["content"] for m in record.get("messages") or [] if m["role"] == "user"]
        if record.get("text"):
            texts.append(record["text"])
    return texts


def test_the_check_finds_a_planted_question(tmp_path):
    """The detector itself: an MT-bench turn pasted inside a longer prompt, re-cased and re-spaced, and
    a lightly edited copy are found; ordinary prompts are not."""
    q = mtbench_questions()[33]["turns"][0]
    texts = [
        "How do I sort a list in Python?",
        "Please help: " + q.upper().replace(" ", "  ") + " Thanks!",
        q.replace(".", "!").replace(",", ""),
        "Write a haiku about autumn.",
        "Some notes. " * 200 + q + " More notes." * 200,  # inside a long paste: found verbatim
    ]
    assert mtbench_matches(texts) == [1, 2, 4]
    part = tmp_path / "part.jsonl.gz"
    with gzip.open(part, "wt") as fh:
        fh.write(json.dumps({"id": "x", "messages": [{"role": "user", "content": q}]}) + "\n")
    assert mtbench_matches(user_turns_of_part(part)) == [0]


@pytest.mark.slow
def test_no_training_source_contains_an_mtbench_question():
    parts = data_parts()
    assert parts, "the data parts moved: point this test at them"
    found = {}
    for path in parts:
        texts = user_turns_of_part(path)
        found |= {f"{path.relative_to(ROOT)}: {texts[i][:80]!r}": 1 for i in mtbench_matches(texts)}
    sources = config_sources() | {DISTILL_DEFAULT_SOURCE}
    assert "sharegpt" in {s.split(":")[0] for s in sources}
    for spec in sorted(sources):
        if spec.split(":")[0] == "python-stdlib" or spec.endswith((".jsonl", ".jsonl.gz")):
            continue  # the stdlib is code; files are the data parts checked above
        texts = source_texts(spec)
        found |= {f"{spec}: {texts[i][:80]!r}": 1 for i in mtbench_matches(texts)}
    assert not found, "MT-bench questions in training sources:\n" + "\n".join(found)
