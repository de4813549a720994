"""Token-level training data: chat rendering with the target's own template, splits, self-distillation.

Rows of the returned `datasets.Dataset`s: {"id": str, "input_ids": list[int], "loss_mask": list[int]}.
loss_mask[t] == 1 means token t is a label the heads learn to predict (an assistant token, or any token
of plain text). The mask is on the *label* token; objectives shift it together with the labels.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm

from selfdraft.corpora import load_source
from selfdraft.splits import is_heldout

logger = logging.getLogger(__name__)

HELDOUT_FILE = "heldout_ids.json"


# ----------------------------------------------------------------------------------------------- rendering


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
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
    full = _render(tokenizer, messages)
    specials = _special_tokens(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a conversation cannot start with an assistant turn (nothing to answer)")
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
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


# ------------------------------------------------------------------------------------------------- splits


def _load_sources(sources: Sequence[str | Iterable[dict]]) -> list[dict]:
    records = []
    for source in sources:
        records.extend(load_source(source) if isinstance(source, str) else source)
    return records


def _to_dataset(rows: list[dict]) -> datasets.Dataset:
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    columns = {name: [row[name] for row in rows] for name in features}
    return datasets.Dataset.from_dict(columns, features=features)


def build_dataset(
    sources: Sequence[str | Iterable[dict]],
    tokenizer,
    max_length: int,
    seed: int,
    heldout_fraction: float,
    run_dir: str | Path,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Render every source record and split it into (train, heldout) datasets.

    sources: source spec strings (see `load_source`) or iterables of records. The held-out ids go to
    run_dir/heldout_ids.json so evaluation can check it never scores text the heads trained on. Rows
    with no loss token (e.g. an answer truncated away) are dropped; records the template cannot render
    are skipped with a warning.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    records = _load_sources(sources)
    train_rows, heldout_rows, heldout_ids = [], [], set()
    skipped: dict[str, int] = {}
    chunk = 256
    with tqdm(total=len(records), desc="render", unit="rec", mininterval=2.0) as bar:
        for at in range(0, len(records), chunk):
            batch = records[at : at + chunk]
            for record, rows in zip(batch, render_records(tokenizer, batch, max_length), strict=True):
                if isinstance(rows, str):
                    skipped[rows[:100]] = skipped.get(rows[:100], 0) + 1
                    continue
                heldout = is_heldout(record, heldout_fraction)
                if heldout:
                    heldout_ids.add(record["id"])
                # the first token is never a label, so a row needs a masked token after it
                kept = [{"id": record["id"], **row} for row in rows if any(row["loss_mask"][1:])]
                (heldout_rows if heldout else train_rows).extend(kept)
            bar.update(len(batch))
    for reason, count in skipped.items():
        logger.warning("skipped %d records: %s", count, reason)
    if not train_rows:
        raise ValueError(f"no trainable rows out of {len(records)} records")
    clash = heldout_ids & {row["id"] for row in train_rows}
    if clash:  # the id list would then name training text as held-out
        raise ValueError(
            f"{len(clash)} ids name records with different prompts, e.g. {sorted(clash)[:3]}; "
            "record ids must be unique across sources"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"heldout_fraction": heldout_fraction, "rule": "sha256(split_key) < fraction"}
    payload["ids"] = sorted(heldout_ids)
    tmp = run_dir / (HELDOUT_FILE + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    tmp.replace(run_dir / HELDOUT_FILE)  # atomic: a reader never sees a half-written id list
    train = _to_dataset(train_rows).shuffle(seed=seed).flatten_indices()
    return train, _to_dataset(heldout_rows)


# ----------------------------------------------------------------------------------------- self-distillation


def _finished_ids(out_path: Path) -> set[str]:
    """Ids already written; a half-written last line (killed mid-write) is cut off so appends stay valid."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with out_path.open("r+b") as fh:
            fh.truncate(keep)
    return {json.loads(line)["id"] for line in data[:keep].splitlines() if line.strip()}


@torch.no_grad()
def _generate_greedy(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[str]:
    """Greedy continuations of token prompts, batched with left padding."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    eos = model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)  # the template's end-of-turn must stop generation
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad_id,
    )
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


def _regenerate_batch(
    model, tokenizer, batch: list[dict], max_new_tokens: int, max_prompt: int
) -> list[dict]:
    """Replace every assistant turn of each conversation, turn by turn, feeding back the new answers."""
    histories: list[list[dict]] = [[] for _ in batch]
    alive = [True] * len(batch)
    for pos in range(max(len(r["messages"]) for r in batch)):
        asking = []
        for j, record in enumerate(batch):
            if not alive[j] or pos >= len(record["messages"]):
                continue
            message = record["messages"][pos]
            if message["role"] == "assistant":
                asking.append(j)
            else:
                histories[j].append({"role": message["role"], "content": message["content"]})
        prompts = {}
        for j in asking:
            if not histories[j]:
                alive[j] = False  # an answer with no question: nothing to regenerate it from
                continue
            text = _render(tokenizer, histories[j], add_generation_prompt=True)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) > max_prompt:
                alive[j] = False  # the context is full: the conversation ends before this turn
            else:
                prompts[j] = ids
        if prompts:
            replies = _generate_greedy(model, tokenizer, list(prompts.values()), max_new_tokens)
            for j, reply in zip(prompts, replies, strict=True):
                histories[j].append({"role": "assistant", "content": reply})
    out = []
    for record, history in zip(batch, histories, strict=True):
        last = max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=-1)
        row = {"id": record["id"], "messages": history[: last + 1] if last >= 0 else history}
        if last < 0:
            row["skipped"] = "prompt longer than the context"
        out.append(row)
    return out


def regenerate_assistant_turns(
    model,
    tokenizer,
    conversations: Sequence[dict],
    out_path: str | Path,
    max_new_tokens: int = 512,
    batch_size: int = 8,
) -> Path:
    """Self-distillation: rewrite each assistant turn with the target's own greedy answer (Medusa-2).

    conversations: records {"id", "messages"}; only system/user turns are kept, every assistant turn is
    regenerated given the regenerated history. Finished records are appended to a JSONL file (readable
    by `load_user_dataset`) and flushed per batch; ids already in the file are skipped, so a killed run
    resumes where it stopped.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _finished_ids(out_path)
    todo, seen = [], set(done)
    for record in conversations:
        if record["id"] not in seen:
            seen.add(record["id"])
            todo.append(record)
    context = getattr(model.config, "max_position_embeddings", None) or 4096
    max_prompt = max(1, context - max_new_tokens)
    with (
        out_path.open("a", encoding="utf-8") as fh,
        tqdm(total=len(done) + len(todo), initial=len(done), desc="self-distill", unit="conv") as bar,
    ):
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            for row in _regenerate_batch(model, tokenizer, batch, max_new_tokens, max_prompt):
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            bar.update(len(batch))
    return out_path
