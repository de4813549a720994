"""Degenerate loops in generated answers: a small target's greedy decoding often repeats one phrase
until the token budget runs out. Self-distilled data keeps the target's own text, loops included, but
past the first repeats a loop teaches the heads nothing that prompt lookup does not already draft, and
it fills training steps (42% of the SmolLM2-135M distilled answers repeat an 8-word phrase 3+ times).
"""

from __future__ import annotations

import re

PHRASE_WORDS = 8  # a loop is a phrase of this many whitespace-separated words that keeps recurring
_WORD = re.compile(r"\S+")


def cut_repeats(text: str, keep: int, words: int = PHRASE_WORDS) -> str:
    """`text` cut right before the first `words`-word phrase that starts for the (keep + 1)-th time.

    The first `keep` occurrences stay, so the heads still see a loop begin. Text without such a phrase
    comes back unchanged. keep: >= 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    spans = list(_WORD.finditer(text))
    tokens = [m.group() for m in spans]
    seen: dict[tuple[str, ...], int] = {}
    for i in range(len(tokens) - words + 1):
        phrase = tuple(tokens[i : i + words])
        seen[phrase] = seen.get(phrase, 0) + 1
        if seen[phrase] > keep:
            return text[: spans[i].start()].rstrip()
    return text


def cut_record_repeats(record: dict, keep: int) -> dict:
    """A chat record with each assistant turn passed through `cut_repeats` (prompts never change, so a
    record's held-out side does not either); plain-text records come back as they are."""
    messages = record.get("messages")
    if messages is None:
        return record
    cut = [
        {**m, "content": cut_repeats(m["content"], keep)} if m["role"] == "assistant" else m for m in messages
    ]
    return {**record, "messages": cut}
