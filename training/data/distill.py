"""Self-distillation: the target's own answers replace the assistant turns of chat records, written
as resumable JSONL (a killed run continues where it stopped)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from selfdraft.bench.vllm_engine import VllmEngine, require_vllm
from selfdraft.corpora.splits import is_heldout
from selfdraft.inference.model import SelfDraftModel, shipped_heads_dir
from selfdraft.precision import dtype_name
from selfdraft.target import resolve_target_path
from selfdraft.training.data.rendering import chat_text
from selfdraft.training.data.rowlog import append_rows, read_rows

ROW_LOG = "distill row log"


def _finished_ids(out_path: Path) -> set[str]:
    """Ids already written; a half-written tail (killed mid-write) is cut off so appends stay valid."""
    return {row["id"] for row in read_rows(out_path, what=ROW_LOG)}


AnswerFn = Callable[[list[list[int]], int, list[int]], list[list[int]]]
"""(token prompts, max_new_tokens, one seed per prompt) -> each prompt's continuation, greedy or sampled
(a stop token ends it; padding after it, if any, is a special token that decoding drops). Greedy
answers ignore the seeds."""


def answer_seed(seed: int, record_id: str, turn: int) -> int:
    """The sampling seed of one answer: fixed by the run's seed, the record and the turn, so a resumed
    or re-batched build draws the same answer (with selfdraft's generator, whose rows draw alone)."""
    digest = hashlib.sha256(f"{seed}:{record_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def stop_ids(target, tokenizer) -> list[int]:
    """The target's stop ids plus the tokenizer's end-of-turn: a chat answer ends at either."""
    eos = target.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


def resolve_generator(generator: str, target_name: str) -> str:
    """"auto" -> "selfdraft" where heads are shipped for the target, else "target": fresh heads draft
    almost nothing, so speculative generation with them only adds drafting and tree passes (24 greedy
    tokens took 5-7x as long as `target.generate` on Qwen2.5-Coder-0.5B, which ships none)."""
    if generator != "auto":
        return generator
    return "selfdraft" if shipped_heads_dir(target_name) is not None else "target"


def target_answers(model, tokenizer, temperature: float = 0.0, top_p: float | None = None) -> AnswerFn:
    """The target's own batched `generate` (left padding). Every row runs until the batch's longest
    answer ends, so a batch with one long answer costs as much as all answers long. temperature > 0
    samples (seeded by the batch's first seed: the draws depend on the batch, unlike selfdraft's)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = stop_ids(model, tokenizer)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": top_p or 1.0}
        if temperature > 0
        else {"do_sample": False}
    )

    @torch.no_grad()
    def generate(prompts: list[list[int]], max_new_tokens: int, seeds: list[int]) -> list[list[int]]:
        if temperature > 0:
            torch.manual_seed(seeds[0])
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            **sampling,
            pad_token_id=pad_id,
        )
        return [row[width:].tolist() for row in out]

    return generate


def selfdraft_answers(
    model: SelfDraftModel, tokenizer, temperature: float = 0.0, top_p: float | None = None
) -> AnswerFn:
    """selfdraft's batched speculative `generate`: the same greedy answers (token-identical in float32;
    bf16 can part at near-ties of the target's logits), but a finished row leaves the batch, so short
    answers stop costing as soon as they end, and each step can accept several tokens. temperature > 0
    samples the target's own distribution (lossless), each row with its own seed."""
    eos = stop_ids(model.target, tokenizer)

    def generate(prompts: list[list[int]], max_new_tokens: int, seeds: list[int]) -> list[list[int]]:
        device = model.target.device
        outs = model.generate(
            [torch.tensor(p, device=device) for p in prompts],
            max_new_tokens,
            stop_token_ids=eos,
            temperature=temperature,
            top_p=top_p,
            seed=list(seeds) if temperature > 0 else None,
        )
        return [out.tokens for out in outs]

    return generate


@dataclass(frozen=True)
class VllmTarget:
    """The target served by vLLM (`selfdraft distill --generator vllm`): the engine, with the target's
    own config and generation config, which the distillation reads (context length, stop ids)."""

    engine: VllmEngine
    config: PretrainedConfig
    generation_config: GenerationConfig


VLLM_KV_CACHE_BYTES = 4 << 30  # ~180k bf16 tokens of SmolLM2's KV: hundreds of rows in flight


def load_vllm_target(name_or_path: str, dtype: torch.dtype) -> VllmTarget:
    """`name_or_path` (an embedded name, a folder or a hub id) in a vLLM engine of `dtype`, holding the
    target's whole context."""
    require_vllm("--generator vllm")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the progress bar
    path = resolve_target_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    context = getattr(config, "max_position_embeddings", None) or 4096
    engine = VllmEngine(
        path, dtype_name(dtype), max_model_len=context, kv_cache_bytes=VLLM_KV_CACHE_BYTES,
        log_stats=False,
        whole_prefills=True,  # seeded rows
    )
    return VllmTarget(engine, config, GenerationConfig.from_pretrained(path))


def vllm_answers(served: VllmTarget, tokenizer, temperature: float = 0.0, top_p: float | None = None) -> AnswerFn:
    """vLLM's batched generation: all prompts of a call in flight at once, each row sampled with its own
    seed (so a resumed or re-batched build draws the same answers). Greedy rows equal the target's own
    up to near-ties of its logits in low precision (vLLM's kernels round differently)."""
    eos = stop_ids(served, tokenizer)

    def generate(prompts: list[list[int]], max_new_tokens: int, seeds: list[int]) -> list[list[int]]:
        return served.engine.generate_many(prompts, max_new_tokens, seeds, temperature, top_p or 1.0, eos)

    return generate


def _regenerate_batch(
    generate: AnswerFn, tokenizer, batch: list[dict], max_new_tokens: int, max_prompt: int, seed: int
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
            asked = [m for m in histories[j] if m["role"] == "user"]
            if not asked or not asked[-1]["content"].strip():
                # an answer to no question (or to an empty one): the target's reply to nothing is one
                # canned text, and hundreds of copies of it would skew the heads
                alive[j] = False
                continue
            text = chat_text(tokenizer, histories[j], add_generation_prompt=True)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) > max_prompt:
                alive[j] = False  # the context is full: the conversation ends before this turn
            else:
                prompts[j] = ids
        if prompts:
            seeds = [answer_seed(seed, batch[j]["id"], pos) for j in prompts]
            replies = generate(list(prompts.values()), max_new_tokens, seeds)
            for j, reply in zip(prompts, replies, strict=True):
                text = tokenizer.decode(reply, skip_special_tokens=True).strip()
                histories[j].append({"role": "assistant", "content": text})
    out = []
    for record, history in zip(batch, histories, strict=True):
        last = max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=-1)
        row = {"id": record["id"], "messages": history[: last + 1] if last >= 0 else history}
        if last < 0:
            row["skipped"] = "empty question, or a prompt longer than the context or the prompt limit"
        out.append(row)
    return out


def first_turn(record: dict) -> dict:
    """The record cut after its first assistant turn (system and first user turn kept)."""
    messages = record["messages"]
    end = next((i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return {**record, "messages": messages[:end]}


def _prompt_chars(record: dict) -> int:
    return sum(len(m["content"]) for m in record["messages"] if m["role"] != "assistant")


def answer_fn(model, tokenizer, temperature: float = 0.0, top_p: float | None = None):
    """(the target, its AnswerFn): selfdraft's batched generation for a `SelfDraftModel`, vLLM's for a
    `VllmTarget`, else the target's own batched `generate`."""
    if isinstance(model, VllmTarget):
        return model, vllm_answers(model, tokenizer, temperature, top_p)
    if isinstance(model, SelfDraftModel):
        return model.target, selfdraft_answers(model, tokenizer, temperature, top_p)
    return model, target_answers(model, tokenizer, temperature, top_p)


def regenerate_assistant_turns(
    model,
    tokenizer,
    conversations: Sequence[dict],
    out_path: str | Path,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    heldout_fraction: float = 0.0,
    first_turns: bool = False,
    max_prompt_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> Path:
    """Self-distillation: rewrite each assistant turn with the target's own answer (Medusa-2): greedy,
    or sampled at `temperature` > 0 (seeded per record and turn by `answer_seed(seed, ...)`), so heads
    also see the text the target writes when it samples.

    model: the target (answers from its own batched `generate`) or a `SelfDraftModel` (answers from
    selfdraft's batched generation: finished rows leave the batch; see `selfdraft_answers`).

    conversations: records {"id", "messages"}; only system/user turns are kept, every assistant turn is
    regenerated given the regenerated history. Finished records are appended to a JSONL file (gzip when
    its name ends in .gz; readable by `load_user_dataset`), one durable append per batch (`rowlog`); ids
    already in the file are skipped, so a killed run resumes where it stopped. Records in the held-out
    split (`splits.is_heldout`, the benchmarks' prompts) are skipped: their regenerated copies would
    land in the held- out split anyway. With `first_turns`, each record keeps only its first exchange.
    Batches group prompts of similar length (less left padding); the file's order is therefore not the
    input's. A turn whose prompt exceeds `max_prompt_tokens` (default: the context minus
    `max_new_tokens`) ends its conversation there.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _finished_ids(out_path)
    todo, seen = [], set(done)
    for record in conversations:
        if record["id"] in seen or is_heldout(record, heldout_fraction):
            continue
        seen.add(record["id"])
        todo.append(first_turn(record) if first_turns else record)
    todo.sort(key=_prompt_chars)
    target, generate = answer_fn(model, tokenizer, temperature)
    context = getattr(target.config, "max_position_embeddings", None) or 4096
    max_prompt = max(1, context - max_new_tokens)
    if max_prompt_tokens is not None:
        max_prompt = min(max_prompt, max_prompt_tokens)
    with tqdm(total=len(done) + len(todo), initial=len(done), desc="self-distill", unit="conv") as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            append_rows(out_path, _regenerate_batch(generate, tokenizer, batch, max_new_tokens, max_prompt, seed))
            bar.update(len(batch))
    return out_path
