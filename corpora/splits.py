"""The data-split rule: which records are held out, decided by content so every tool agrees."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from selfdraft.corpora.neardup import groups


def split_key(record: dict) -> str:
    """What decides a record's split: its prompts (system/user turns) or its text, never its answers.

    Keyed on content, not ids, so an exact duplicate under another id and a self-distilled copy (same
    prompts, regenerated answers) always land on the same side as the original.
    """
    if "messages" in record:
        prompts = [[m["role"], m["content"]] for m in record["messages"] if m["role"] != "assistant"]
        payload = json.dumps(prompts, ensure_ascii=False)
    else:
        payload = record["text"]
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def is_heldout(record: dict, heldout_fraction: float) -> bool:
    """Deterministic, seed-independent membership: the first 8 bytes of the key as a uniform in [0, 1)."""
    return int(split_key(record)[:16], 16) / 2**64 < heldout_fraction


def first_exchange(record: dict) -> dict | None:
    """The chat record cut after its first assistant turn, or None for plain text and single exchanges."""
    messages = record.get("messages")
    if not messages:
        return None
    end = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return None if end >= len(messages) - 1 else {**record, "messages": messages[: end + 1]}


def opens_heldout(record: dict, heldout_fraction: float) -> bool:
    """True when a record outside the held-out split opens with an exchange that is held out on its own.

    Self-distillation copies only a conversation's first exchange, whose key differs from the whole
    conversation's; training on the whole one would then train on the prompts of a held-out row.
    """
    first = first_exchange(record)
    return first is not None and is_heldout(first, heldout_fraction)


def prompt_of(record: dict) -> str:
    """What near-duplicates are judged on: a chat record's first user turn (the prompt a benchmark
    asks, and what a self-distilled copy shares with its original), else the plain text."""
    if "messages" in record and record["messages"] is not None:
        return next((m["content"] for m in record["messages"] if m["role"] == "user"), "")
    return record.get("text") or ""


def heldout_flags(records: Sequence[dict], heldout_fraction: float) -> list[bool]:
    """The near-duplicate-free split: a record is held out when `is_heldout` picks it and no record of
    its near-duplicate group (`neardup.groups` over `prompt_of`) is trained on.

    ShareGPT repeats conversations under new ids with small edits; keyed per record, one copy lands on
    each side and the "held-out" score is partly a training score. A group with any trained member
    goes to training whole, so held-out records are a subset of `is_heldout`'s: heads trained on the
    per-record split never saw one of them either. Trained = not `is_heldout` and not `opens_heldout`
    (records opening with a held-out exchange are skipped, never trained).
    """
    if heldout_fraction <= 0:
        return [False] * len(records)
    candidate = [is_heldout(r, heldout_fraction) for r in records]
    group = groups([prompt_of(r) for r in records])
    trained_groups = {
        group[i] for i, r in enumerate(records) if not candidate[i] and not opens_heldout(r, heldout_fraction)
    }
    return [c and g not in trained_groups for c, g in zip(candidate, group, strict=True)]
