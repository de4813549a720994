"""Batched speculative generation: many prompts, one target pass per step over every row's tree.

The loop is `decoding.speculative_generate` for B rows at once:

    prefill  one target pass over the right-padded prompts [B, P]; row b's pad slots (P > len_b) are
             masked for every real query, so they are never read again (the next compaction drops them)
    loop:
    draft    all rows' trees grow in lockstep (`tree.drive_rows`): an EAGLE head runs once per depth over
             every row's frontier, with one head KV cache holding every row (`drafting.EagleRows`)
    verify   ONE target pass over tokens [B, N], N = the step's largest tree; smaller trees are padded
             with dummy nodes that see only themselves and that no real node sees
    accept   per row, with its own generator: each row accepts its own prefix of its own tree
    compact  per row, in place: the accepted path moves to [len_b, len_b + k); the cache is cut at the longest row
    drop     rows that finished (stop token, budget, context) leave the batch and the cache

The shared passes are what a batch saves (the target's and the head's weights are read once per
step for all rows); acceptance still runs row by row.

Cache layout, an invariant between steps: row b's valid keys/values are the physical slots
[0, len_b) of every layer ([B, H, L, d], L = max len_b); slots [len_b, L) hold filler that no query
ever attends to. Tree node i of row b sits at physical slot L + i during verification and at
position_ids len_b + depth(i), so every row sees exactly what it would see alone.

Seeds: `seeds[i]` seeds row i's generator; a row's output depends only on its prompt, its seed and
its drafter, never on its neighbours (up to float rounding of the batched pass), and equals a
single-sequence `speculative_generate` of that prompt with that seed.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from selfdraft import kv
from selfdraft.errors import UserError
from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.decoding import (
    GenerationOutput,
    GenerationStats,
    TargetPass,
    accept_tree,
    check_prompt_fits,
    check_request,
    cut_at_stop,
    draws_children,
    first_token,
    tree_that_fits,
)
from selfdraft.inference.drafting import make_rows_drafter
from selfdraft.target import max_context
from selfdraft.tree import TreeShape, TreeSpec, ancestor_matrix, drive_rows, float_mask

PROTOCOL = ("observe", "begin", "children", "feed", "end")


def is_batch(input_ids) -> bool:
    """True for a list/tuple of prompts (each a 1-D list or tensor); False for one sequence (a tensor
    [T] or [1, T], or a flat list of ints)."""
    if not isinstance(input_ids, list | tuple):
        return False
    if not input_ids:
        raise UserError("generate got an empty list; pass token ids, or a list of prompts' token ids")
    nested = [not isinstance(x, int) and not (torch.is_tensor(x) and x.dim() == 0) for x in input_ids]
    if any(nested) and not all(nested):
        raise UserError(
            "generate got a list mixing token ids and sequences; pass one flat list of ids, "
            "or a list whose every item is one prompt's ids"
        )
    return all(nested)


def row_seeds(seed, n: int) -> list[int | None]:
    """One seed per row. seed: None (each row's generator is seeded from torch's global RNG, in row
    order), one int s (row i uses s + i, so row i reproduces `generate(prompt_i, seed=s + i)`), or a
    sequence of n ints/None."""
    if seed is None:
        return [None] * n
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(n)]
    if isinstance(seed, Sequence) and not isinstance(seed, str | bytes):
        seeds = list(seed)
        if len(seeds) != n:
            raise UserError(
                f"seed has {len(seeds)} entries for {n} prompts; pass one seed per prompt or one int"
            )
        for s in seeds:
            if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
                raise UserError(f"seed entries must be integers or None, got {s!r}")
        return seeds
    raise UserError(f"seed must be an int, a list of one int per prompt, or None; got {seed!r}")


@dataclass
class _Row:
    index: int  # position in the caller's list
    generator: torch.Generator | None
    stops: set[int]
    max_new_tokens: int
    context: list[int]  # prompt + output: what a prompt-lookup branch searches
    length: int  # valid cache entries, physical slots [0, length)
    root: int = 0
    out: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    done: bool = False

    def emit(self, new: list[int]) -> None:
        """Append tokens up to a stop token or the budget; sets `done` when generation is over."""
        new, reason = cut_at_stop(new, self.stops, len(self.out), self.max_new_tokens)
        if reason is not None:
            self.done, self.stats.finish_reason = True, reason
        self.out.extend(new)
        self.context.extend(new)


def _rows_drafter(heads, n: int):
    """The batch drafter: from a heads module, or from a list of one drafter object per prompt (tests).
    A single drafter object cannot serve several rows (it holds state)."""
    if isinstance(heads, list | tuple):
        if len(heads) != n:
            raise UserError(f"{len(heads)} drafters for {n} prompts; pass one drafter per prompt")
        return make_rows_drafter(list(heads), n)
    if all(callable(getattr(heads, name, None)) for name in PROTOCOL):
        if n > 1:
            raise UserError(
                "one drafter object cannot draft for several rows; pass a list of one drafter per prompt"
            )
        return make_rows_drafter([heads], 1)
    return make_rows_drafter(heads, n)


def _split(hidden_states: tuple[torch.Tensor, ...], b: int) -> tuple[torch.Tensor, ...]:
    """Row b's hidden states, each [1, n, h] (views, no copy)."""
    return tuple(h[b : b + 1] for h in hidden_states)


@torch.no_grad()
def _prefill(target, prompts: list[torch.Tensor], cache, pad_id: int) -> TargetPass:
    """One causal pass over the right-padded prompts. Real queries never see a pad slot; pad queries
    see plain causal context (any non-empty row keeps softmax finite; their outputs are unused).

    Returns logits [B, V] at each row's last prompt token (only those are projected onto the
    vocabulary when the target takes `logits_to_keep`) and hidden states [B, P, h] per layer."""
    lengths = torch.tensor([p.numel() for p in prompts])
    width = int(lengths.max())
    device = prompts[0].device
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : p.numel()] = p
    i = torch.arange(width)
    causal = i[None, :] <= i[:, None]  # [q, k]
    real_key = i[None, :] < lengths[:, None]  # [B, k]
    pad_query = i[None, :] >= lengths[:, None]  # [B, q]
    allowed = causal[None] & (real_key[:, None, :] | pad_query[:, :, None])
    dtype = target.get_input_embeddings().weight.dtype
    last = (lengths - 1).tolist()
    keep = sorted(set(last))
    extra = {}
    if _takes_logits_to_keep(type(target)):  # [B, P, V] logits of a long batch can take gigabytes
        extra["logits_to_keep"] = torch.tensor(keep, device=device)
    with kv.masked_gqa(device, width):
        out = target(
            input_ids=ids,
            attention_mask=float_mask(allowed.to(device), dtype)[:, None],
            position_ids=i.to(device)[None].expand(len(prompts), -1),
            output_hidden_states=True,
            **extra,
            **kv.cache_kwargs(target, cache),
        )
    column = [keep.index(n) for n in last] if extra else last
    logits = out.logits[torch.arange(len(prompts), device=device), torch.tensor(column, device=device)]
    return TargetPass(logits=logits, hidden_states=tuple(out.hidden_states))


@lru_cache(maxsize=64)
def _takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


@torch.no_grad()
def _verify_trees(
    target, cache, trees: list[tuple[TreeSpec, torch.Tensor]], lengths: list[int], pad_id: int, device
) -> TargetPass:
    """One target pass over every row's tree. logits [B, N, V]; row b's nodes are its first N_b."""
    physical = kv.cache_length(cache)
    width = max(spec.size for spec, _ in trees)
    rows = len(trees)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    positions = torch.empty((rows, width), dtype=torch.long)
    tree_part = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)  # dummies see only themselves
    for b, (spec, toks) in enumerate(trees):
        n = spec.size
        tokens[b, :n] = toks
        positions[b] = lengths[b]
        positions[b, :n] += torch.tensor(spec.depths)
        tree_part[b, :n, :n] = ancestor_matrix(spec)
    prefix = torch.arange(physical)[None, :] < torch.tensor(lengths)[:, None]  # [B, physical]
    allowed = torch.cat([prefix[:, None, :].expand(-1, width, -1), tree_part], dim=2)
    dtype = target.get_input_embeddings().weight.dtype
    with kv.masked_gqa(device, width):
        out = target(
            input_ids=tokens.to(device),
            attention_mask=float_mask(allowed.to(device), dtype)[:, None],
            position_ids=positions.to(device),
            output_hidden_states=True,
            **kv.cache_kwargs(target, cache),
        )
    return TargetPass(logits=out.logits, hidden_states=tuple(out.hidden_states))


def _compact_rows(
    cache, physical: int, keep_rows: list[int], lengths: list[int], paths: list[list[int]]
) -> list[int]:
    """Per-row compaction and row dropping, in place.

    For each kept batch row r (in order): slots [0, lengths[r]) stay, the tree slots physical +
    paths[r] move to lengths[r], lengths[r] + 1, ...; the cache is then cut at the longest row (a
    shorter row's slots past its length keep stale entries that no query attends). Rows not in
    keep_rows leave the cache. Returns the new lengths, in keep_rows order.
    """
    new_lengths = [lengths[r] + len(paths[r]) for r in keep_rows]
    if not keep_rows:
        return []
    batch, src, dst = [], [], []
    for i, r in enumerate(keep_rows):
        batch += [i] * len(paths[r])
        src += [physical + p for p in paths[r]]
        dst += range(lengths[r], new_lengths[i])
    rows = None if keep_rows == list(range(len(lengths))) else torch.tensor(keep_rows, dtype=torch.long)
    batch_t, src_t, dst_t = (torch.tensor(x, dtype=torch.long) for x in (batch, src, dst))
    kv.compact_rows(cache, rows, batch_t, src_t, dst_t, max(new_lengths))
    return new_lengths


@torch.no_grad()
def batched_speculative_generate(
    target,
    heads,
    prompts: list[torch.Tensor],
    *,
    spec: TreeShape,
    max_new_tokens: int,
    sampling: SamplingParams,
    seeds: list[int | None] | None = None,
    stop_token_ids: Iterable[int] = (),
    acceptance: str = "rejection",
) -> list[GenerationOutput]:
    """Generate up to `max_new_tokens` after each prompt (1-D long tensors of any lengths), all rows
    verified by one shared target pass per step; returns one GenerationOutput per prompt, in order.

    heads: a heads module (one drafter per row is made from it) or a list of one drafter per prompt.
    seeds: one per row (see `row_seeds`); sampling.seed is ignored. Each row's stats count the shared
    passes it took part in; draft_time / verify_time / compact_time / prefill_time are those shared
    passes' wall time, total_time is the wall time until that row finished.
    """
    check_request(acceptance, max_new_tokens)
    if not prompts:
        raise UserError("no prompts; pass at least one prompt")
    n = len(prompts)
    seeds = [None] * n if seeds is None else seeds
    limit = max_context(target)
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise UserError(
                f"prompt {i} has shape {tuple(p.shape)}; each prompt must be a non-empty 1-D id list"
            )
        check_prompt_fits(p.numel(), limit, f"prompt {i}")
    stops = set(int(t) for t in stop_token_ids)
    pad_id = 0  # any id in the vocabulary: pad slots and dummy nodes are masked
    device = prompts[0].device
    drafter = _rows_drafter(heads, n)
    rows = [
        _Row(
            index=i,
            generator=replace(sampling, seed=seeds[i]).make_generator(device),
            stops=stops,
            max_new_tokens=max_new_tokens,
            context=p.tolist(),
            length=p.numel(),
        )
        for i, p in enumerate(prompts)
    ]
    finished: dict[int, _Row] = {}
    cache = kv.new_cache()
    start = time.perf_counter()

    passed = _prefill(target, prompts, cache, pad_id)
    prefill_time = time.perf_counter() - start
    for b, row in enumerate(rows):
        p = prompts[b]
        row.stats.target_forwards += 1
        row.stats.prefill_time = prefill_time
        row.root = first_token(passed.logits[b], sampling, row.generator)
        row.emit([row.root])
        if not row.done:
            next_tokens = torch.cat([p[1:], torch.tensor([row.root], device=device)])
            t0 = time.perf_counter()
            drafter.observe(
                b, next_tokens, _split(passed.hidden_states, b), torch.arange(p.numel(), device=device)
            )
            row.stats.observe_time += time.perf_counter() - t0
    del passed
    drawing = draws_children(drafter, spec, sampling, acceptance)
    if drawing:
        drafter.draw_with(sampling.temperature, [row.generator for row in rows])
    # Drop rows done after the first token; the others keep [0, len_b) (pad slots go).
    rows = _retire(rows, cache, drafter, kv.cache_length(cache), [[] for _ in rows], finished, start)

    while rows:
        shapes = [tree_that_fits(spec, row.length, limit) for row in rows]
        if any(s is None for s in shapes):
            for row, s in zip(rows, shapes, strict=True):
                if s is None:
                    row.done, row.stats.finish_reason = True, "context"
            rows = _retire(rows, cache, drafter, kv.cache_length(cache), [[] for _ in rows], finished, start)
            continue
        t0 = time.perf_counter()
        trees = drive_rows([s.grow(row.root, row.context) for row, s in zip(rows, shapes, strict=True)], drafter)
        draft = time.perf_counter() - t0
        for row in rows:
            row.stats.draft_time += draft
        physical = kv.cache_length(cache)
        t0 = time.perf_counter()
        passed = _verify_trees(target, cache, trees, [row.length for row in rows], pad_id, device)
        verify = time.perf_counter() - t0
        paths = []
        for b, (row, (tree, tokens)) in enumerate(zip(rows, trees, strict=True)):
            t1 = time.perf_counter()
            hidden = _split(passed.hidden_states, b)
            result = accept_tree(
                TargetPass(passed.logits[b, : tree.size], hidden),
                tokens,
                tree,
                sampling,
                acceptance,
                row.generator,
                drafter.tree_dists(b, tree.size) if drawing else None,
            )
            t2 = time.perf_counter()
            path = [0, *result.accepted]
            paths.append(path)
            row.stats.verify_time += verify
            row.stats.accept_time += t2 - t1
            row.stats.record(len(result.accepted), tree.max_depth, tree.size)
            new = [int(tokens[a]) for a in result.accepted] + [result.next_token]
            row.emit(new)
            if not row.done:
                t3 = time.perf_counter()
                drafter.observe(b, torch.tensor(new), hidden, torch.tensor(path, device=device))
                row.stats.observe_time += time.perf_counter() - t3
            row.root = result.next_token
        del passed
        t0 = time.perf_counter()
        rows = _retire(rows, cache, drafter, physical, paths, finished, start)
        compact = time.perf_counter() - t0
        for row in rows:
            row.stats.compact_time += compact
    return [GenerationOutput(tokens=finished[i].out, stats=finished[i].stats) for i in range(n)]


def _retire(
    rows: list[_Row], cache, drafter, physical: int, paths: list[list[int]], finished: dict[int, _Row], start: float
) -> list[_Row]:
    """Move done rows to `finished`; compact the target's cache and the drafter to the rows still going."""
    keep = []
    for b, row in enumerate(rows):
        if row.done:
            row.stats.total_time = time.perf_counter() - start
            finished[row.index] = row
        else:
            keep.append(b)
    new_lengths = _compact_rows(cache, physical, keep, [row.length for row in rows], paths)
    drafter.retire(keep)
    alive = [rows[b] for b in keep]
    for row, length in zip(alive, new_lengths, strict=True):
        row.length = length
    return alive
