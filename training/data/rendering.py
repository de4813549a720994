"""Chat and text records -> token rows with the target's own chat template, and which tokens are labels.

Rows: {"input_ids": list[int], "loss_mask": list[int]}. loss_mask[t] == 1 means token t is a label the
heads learn to predict (an assistant token, or any token of plain text). The mask is on the *label*
token; objectives shift it together with the labels.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _special_tokens(tokenizer) -> set[str]:
    specials = {tok for tok in tokenizer.all_special_tokens if tok}
    if tokenizer.eos_token:
        specials.add(tokenizer.eos_token)
    return specials


def _end_of_turn(specials: set[str], added: str, content: str) -> int:
    """Length of the part of `added` (what one assistant turn adds to the text) that the model must emit.

    That is the content plus the template's end-of-turn marker: the first special token after the
    content. Separators after it (SmolLM2's "\\n") are template glue the model never generates.
    """
    body = content.strip()  # templates may trim the content; the stripped body is still inside
    at = added.find(body) if body else -1
    search_from = at + len(body) if at >= 0 else 0
    ends = [j + len(tok) for tok in specials if (j := added.find(tok, search_from)) >= 0]
    return min(ends) if ends else len(added.rstrip())


def assistant_char_spans(
    tokenizer, messages: list[dict], max_chars: int | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render `messages` and return (text, [(start, end) character span of each assistant turn]).

    The spans come from the template itself: the text a turn adds is render(messages[:i+1]) minus
    render(messages[:i], add_generation_prompt=True). Nothing about the template (role markers, default
    system prompt) is assumed, so any chat template that renders prefixes consistently works.

    max_chars: stop at the first assistant turn ending at or past max_chars and cut the text right
    after its end-of-turn token. Only a cut after a special token is made: tokenizers split special
    tokens out before anything else, so the tokens before such a cut are exactly the full text's.
    """
    full = chat_text(tokenizer, messages)
    specials = _special_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a conversation cannot start with an assistant turn (nothing to answer)")
        before = chat_text(tokenizer, messages[:i], add_generation_prompt=True)
        through = chat_text(tokenizer, messages[: i + 1])
        if not through.startswith(before) or not full.startswith(through):
            raise ValueError(
                f"chat template does not render turn {i} as an extension of the earlier turns; "
                "cannot locate assistant tokens (does the template rewrite earlier turns?)"
            )
        start = len(before)
        end = start + _end_of_turn(specials, through[start:], message["content"])
        spans.append((start, end))
        if max_chars is not None and end >= max_chars and any(full[:end].endswith(t) for t in specials):
            return full[:end], spans
    return full, spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies inside an assistant span (spans sorted, disjoint)."""
    if not offsets:
        return []
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1)  # [s0, e0, s1, e1, ...], non-decreasing
    # a start inside [s_i, e_i) has an odd number of bounds <= it
    return (np.searchsorted(bounds, starts, side="right") % 2).tolist()


Rendered = tuple[str, list[tuple[int, int]]]  # (chat text, assistant character spans)


def _tokenize_chats(tokenizer, rendered: list[Rendered], max_length: int) -> list[dict]:
    # One batched call: the Rust tokenizer spreads a batch over all cores. apply_chat_template(tokenize=True)
    # also tokenizes the rendered text with add_special_tokens=False, so the ids are the same.
    if not rendered:
        return []  # tokenizers reject an empty batch
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    rows = []
    for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered, strict=True):
        mask = _mask_from_offsets(offsets[:max_length], spans)
        rows.append({"input_ids": list(ids[:max_length]), "loss_mask": mask})
    return rows


def render_chat(tokenizer, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """Chat messages -> {"input_ids": [T], "loss_mask": [T]}, T <= max_length (truncated).

    loss_mask is 1 exactly on tokens that start inside an assistant span (content + end-of-turn token).
    Needs a fast tokenizer (character offsets).
    """
    row = _render_chats(tokenizer, [messages], max_length)[0]
    if isinstance(row, str):
        raise ValueError(row)
    return row


# A token rarely spans more than 6 characters, so a text cut there still holds max_length tokens; when it
# does not, the conversation is rendered again in full.
CHARS_PER_TOKEN_BOUND = 6


def _render_chats(tokenizer, conversations: list[list[dict]], max_length: int) -> list[dict | str]:
    """Batched render_chat: a row per conversation, or the reason it cannot be rendered.

    Long conversations are cut early (see `assistant_char_spans`) so tokenizing them stays cheap.
    """
    budget = CHARS_PER_TOKEN_BOUND * max_length
    out: list[dict | str] = []
    rendered: dict[int, Rendered] = {}
    for i, messages in enumerate(conversations):
        try:  # one odd conversation must not stop a 100k-record build
            rendered[i] = assistant_char_spans(tokenizer, messages, max_chars=budget)
            out.append({})
        except ValueError as err:
            out.append(str(err))
    for i, row in zip(rendered, _tokenize_chats(tokenizer, list(rendered.values()), max_length), strict=True):
        out[i] = row
    # A cut text that came out shorter than max_length tokens: tokens were unusually long, redo in full.
    redo = [i for i in rendered if len(out[i]["input_ids"]) < max_length and len(rendered[i][0]) >= budget]
    if redo:
        full = [assistant_char_spans(tokenizer, conversations[i]) for i in redo]
        for i, row in zip(redo, _tokenize_chats(tokenizer, full, max_length), strict=True):
            out[i] = row
    return out


def _text_windows(ids: list[int], max_length: int) -> list[dict[str, list[int]]]:
    windows = [ids[i : i + max_length] for i in range(0, len(ids), max_length)]
    return [{"input_ids": w, "loss_mask": [1] * len(w)} for w in windows if len(w) >= 2]


def render_records(tokenizer, records: Sequence[dict], max_length: int) -> list[list[dict] | str]:
    """Records ({"messages"} or {"text"}) -> per record its token rows, or the reason it cannot render.

    Plain text becomes consecutive windows of at most max_length tokens with loss on every token,
    rather than one truncated row: a stdlib module is often 10-50x max_length tokens.
    """
    out: list[list[dict] | str] = [[] for _ in records]
    chats = [i for i, record in enumerate(records) if "messages" in record]
    texts = [i for i, record in enumerate(records) if "messages" not in record]
    if chats:
        rows = _render_chats(tokenizer, [records[i]["messages"] for i in chats], max_length)
        for i, row in zip(chats, rows, strict=True):
            out[i] = row if isinstance(row, str) else [row]
    if texts:
        enc = tokenizer([records[i]["text"] for i in texts], add_special_tokens=True)
        for i, ids in zip(texts, enc["input_ids"], strict=True):
            out[i] = _text_windows(list(ids), max_length)
    return out
