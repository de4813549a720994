"""Prompts the target writes itself: the "pre-query template" technique (Magpie, Xu et al. 2024).

An instruct model given its chat template up to where a user's words begin writes what a user would
ask. Sampled (T ~ 1, top_p ~ 0.95), de-duplicated (exact and near-duplicate, `neardup`), filtered
(empty, unfinished or overlong, not a request, MT-bench) and then answered by the same target
(`distill`), this gives in-distribution training data with no dataset at all.

Resumable and never duplicating: prompts are synthesised in numbered chunks; each chunk's kept prompts
and a marker saying the chunk is done go to a prompts file in one append (`rowlog`), so a resumed build
re-reads finished chunks instead of sampling them again; the answers file is resumed by id.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from selfdraft.corpora.mtbench import mtbench_texts
from selfdraft.corpora.neardup import BANDS, NUM_PERM, THRESHOLD, jaccard, normalize, shingles, signature
from selfdraft.errors import UserError
from selfdraft.training.data.distill import answer_fn, answer_seed, regenerate_assistant_turns, stop_ids
from selfdraft.training.data.rowlog import append_rows, read_rows

_SENTINEL = "\u2063SELFDRAFT-USER-TURN\u2063"  # invisible separator: no template escapes or trims it
# the first word of a request that has no question mark ("Write ...", "Explain ...", "I need ...")
_REQUEST_WORDS = """
what how why when where who whom whose which can could would should will shall is are was were do does
did have has may might must write explain describe give list create generate tell help make summarize
summarise translate compare suggest provide show find calculate compute solve design draft compose
rewrite implement plan outline recommend name define convert classify identify analyze analyse
evaluate fix debug improve edit correct please i my we imagine pretend act let
"""
REQUEST_WORDS = frozenset(_REQUEST_WORDS.split())
# openings of an assistant's reply, not a user's message: the model slipped into answering
ANSWER_OPENINGS = re.compile(r"^(sure|certainly|of course|absolutely|as an ai|i'm sorry|i am sorry|hello!? i)\b")


def pre_query_ids(tokenizer, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to where the first user message's text begins (with the
    template's default system turn, or `system`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("prompt synthesis needs an instruct target with a chat template")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if _SENTINEL not in text:
        raise UserError("the chat template drops the user's text; prompt synthesis cannot find where it begins")
    return list(tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"])


def rejection(text: str, finished: bool, max_chars: int) -> str | None:
    """Why a sampled prompt is not kept, or None: empty, unfinished (no end of turn within the token
    budget), overlong, an assistant-style reply, or not a question or request."""
    words = normalize(text)
    if not words:
        return "empty"
    if not finished:
        return "unfinished"
    if len(text) > max_chars:
        return "overlong"
    if ANSWER_OPENINGS.match(text.strip().lower()):
        return "answer"
    if "?" not in text and words[0] not in REQUEST_WORDS:
        return "not a request"
    return None


@dataclass
class Deduper:
    """Exact (normalized words) and near-duplicate (word 3-gram Jaccard >= threshold) detection against
    every text added so far, plus a fixed set of texts never to keep (MT-bench)."""

    threshold: float = THRESHOLD
    _exact: set[str] = field(default_factory=set)
    _sets: list[np.ndarray] = field(default_factory=list)
    _buckets: dict[tuple[int, bytes], list[int]] = field(default_factory=dict)
    _banned: list[np.ndarray] = field(default_factory=list)

    def ban(self, texts: Sequence[str]) -> None:
        self._banned.extend(s for s in (shingles(t) for t in texts) if len(s))
        self._exact.update(" ".join(normalize(t)) for t in texts)

    def _keys(self, s: np.ndarray) -> list[tuple[int, bytes]]:
        if not len(s):
            return []
        sig, rows = signature(s), NUM_PERM // BANDS
        return [(band, sig[band * rows : (band + 1) * rows].tobytes()) for band in range(BANDS)]

    def duplicate(self, text: str) -> str | None:
        """"duplicate" / "near-duplicate" / "mtbench" when `text` repeats a kept or banned text."""
        if " ".join(normalize(text)) in self._exact:
            return "duplicate"
        s = shingles(text)
        if any(jaccard(s, b) >= self.threshold for b in self._banned):
            return "mtbench"
        candidates = {i for key in self._keys(s) for i in self._buckets.get(key, ())}
        if any(jaccard(s, self._sets[i]) >= self.threshold for i in sorted(candidates)):
            return "near-duplicate"
        return None

    def add(self, text: str) -> None:
        self._exact.add(" ".join(normalize(text)))
        s = shingles(text)
        self._sets.append(s)
        for key in self._keys(s):
            self._buckets.setdefault(key, []).append(len(self._sets) - 1)


@dataclass(frozen=True)
class SynthesisConfig:
    prompts: int  # kept prompts to reach (the build stops once that many are kept)
    chunk: int = 32  # prompts sampled per chunk: the unit of resuming
    temperature: float = 1.0
    top_p: float = 0.95
    max_prompt_tokens: int = 128  # a prompt with no end of turn within this many tokens is unfinished
    max_prompt_chars: int = 2000
    answer_temperatures: tuple[float, ...] = (0.0, 1.0)  # greedy and sampled answers to each prompt
    max_new_tokens: int = 256
    batch_size: int = 8
    seed: int = 0
    system: str | None = None
    max_chunks: int | None = None  # stop after this many chunks even if fewer prompts were kept
    heldout_fraction: float = 0.02  # prompts in the runs' held-out split are not answered (never trained)


# a target that keeps writing nothing usable (no chat tuning, a broken template) stops the build
MAX_BARREN_CHUNKS = 20


PROMPTS_LOG = "synthesis prompts log"


def prompts_path(out_path: str | Path) -> Path:
    """The prompts file beside an answers file: a.jsonl.gz -> a.prompts.jsonl.gz."""
    out_path = Path(out_path)
    name = out_path.name
    for ext in (".jsonl.gz", ".jsonl"):
        if name.endswith(ext):
            return out_path.with_name(name[: -len(ext)] + ".prompts" + ext)
    return out_path.with_name(name + ".prompts.jsonl")


def _chunks_done(rows: list[dict]) -> dict[int, list[dict]]:
    """Finished chunks' kept prompt records, by chunk number."""
    done = {r["chunk"]: [] for r in rows if r.get("done")}
    for r in rows:
        if "messages" in r and r["chunk"] in done:
            done[r["chunk"]].append({"id": r["id"], "messages": r["messages"]})
    return done


def _sample_chunk(generate, tokenizer, prefix: list[int], k: int, config: SynthesisConfig, stops: set[int]):
    seeds = [answer_seed(config.seed, f"synth-prompt:{k}", j) for j in range(config.chunk)]
    outs = generate([prefix] * config.chunk, config.max_prompt_tokens, seeds)
    texts = []
    for tokens in outs:
        finished = any(t in stops for t in tokens)
        cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        texts.append((tokenizer.decode(tokens[:cut], skip_special_tokens=True).strip(), finished))
    return texts


def _id_prefix(config: SynthesisConfig) -> str:
    """synth:s{seed}, plus a digest of the system turn when one steers the prompts, so builds with
    different system turns never share a record id."""
    if config.system is None:
        return f"synth:s{config.seed}"
    return f"synth:s{config.seed}:{hashlib.sha256(config.system.encode()).hexdigest()[:8]}"


def _answer_id(prompt_id: str, temperature: float) -> str:
    return prompt_id if temperature == 0 else f"{prompt_id}:t{temperature:g}"


def synthesize(model, tokenizer, out_path: str | Path, config: SynthesisConfig) -> dict:
    """Synthesise prompts chunk by chunk and answer each chunk at every `answer_temperatures` entry,
    appending to `out_path` (conversation rows, a training source as is) and to `prompts_path(out_path)`.

    model: the target or a `SelfDraftModel` (its batched generation drafts with the heads). Returns
    counts: chunks, sampled, kept, and each rejection reason."""
    if config.prompts < 1 or config.chunk < 1:
        raise UserError("--synthesize and the chunk size must be at least 1")
    out_path, ppath = Path(out_path), prompts_path(out_path)
    rows = read_rows(ppath, key="chunk", what=PROMPTS_LOG)
    done = _chunks_done(rows)
    dedup = Deduper()
    dedup.ban(mtbench_texts())
    stats: dict = {"chunks": 0, "sampled": 0, "kept": 0}
    for r in rows:  # the kept prompts of finished chunks, in order: the de-duplication state
        if r.get("done"):
            for key in ("sampled", "kept"):
                stats[key] += r[key]
            for reason, n in r["rejected"].items():
                stats[reason] = stats.get(reason, 0) + n
        elif "messages" in r and r["chunk"] in done:
            dedup.add(r["messages"][0]["content"])
    target, generate = answer_fn(model, tokenizer, config.temperature, config.top_p)
    prefix = pre_query_ids(tokenizer, config.system)
    stops = set(stop_ids(target, tokenizer))
    k, barren = 0, 0
    while stats["kept"] < config.prompts or k in done:
        if config.max_chunks is not None and k >= config.max_chunks:
            break
        if barren == MAX_BARREN_CHUNKS:
            raise UserError(
                f"{barren} chunks in a row kept no prompt ({stats}); is the target an instruct model "
                "with its chat template?"
            )
        if k not in done:
            kept, rejected = [], {}
            for j, (text, finished) in enumerate(_sample_chunk(generate, tokenizer, prefix, k, config, stops)):
                why = rejection(text, finished, config.max_prompt_chars) or dedup.duplicate(text)
                if why:
                    rejected[why] = rejected.get(why, 0) + 1
                    continue
                dedup.add(text)
                record_id = f"{_id_prefix(config)}:c{k}:{j}"
                kept.append({"id": record_id, "chunk": k, "messages": [{"role": "user", "content": text}]})
            marker = {"chunk": k, "done": True, "sampled": config.chunk, "kept": len(kept), "rejected": rejected}
            append_rows(ppath, [*kept, marker])  # prompts and the marker in one append
            done[k] = [{"id": r["id"], "messages": r["messages"]} for r in kept]
            stats["sampled"] += config.chunk
            stats["kept"] += len(kept)
            for reason, n in rejected.items():
                stats[reason] = stats.get(reason, 0) + n
            barren = 0 if kept else barren + 1
        for t in config.answer_temperatures if done[k] else ():
            # an empty assistant turn after each prompt: the turn the target's answer replaces
            records = [
                {"id": _answer_id(r["id"], t), "messages": [*r["messages"], {"role": "assistant", "content": ""}]}
                for r in done[k]
            ]
            regenerate_assistant_turns(
                model, tokenizer, records, out_path, config.max_new_tokens, config.batch_size,
                heldout_fraction=config.heldout_fraction, temperature=t, seed=config.seed,
            )
        k += 1
        stats["chunks"] = k
    return stats
