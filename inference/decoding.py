"""The speculative generate loop, for a batch of prompts (a single prompt is a batch of one):

    prefill  ONE target pass over the right-padded prompts [B, P]; each row's first token
    loop:
    draft    every row's tree (`drafting.draft_trees`: an EAGLE head runs once per depth for all rows)
    verify   ONE target pass over every row's tree
    accept   per row, with its own generator: each row accepts its own prefix of its own tree
    commit   per row: emit the accepted tokens, show the drafter their features
    retire   rows that finished (stop token, budget, context) leave the batch; the cache keeps each
             row's accepted path (moved in place to [len_b, len_b + k)), cut at the longest row

The target's two passes live here too (`prefill`, `verify`). Cache layout, an invariant between
steps: row b's valid keys/values are the physical slots [0, len_b) of every layer ([B, H, L, d], L =
max len_b); slots [len_b, L) hold filler that no query ever attends to. Tree node i of row b sits at
physical slot L + i during verification and at position_ids len_b + depth(i), so every row sees
exactly what it would see alone.

The shared passes are what a batch saves (the target's and the head's weights are read once per
step for all rows); acceptance runs row by row. The output distribution of every row is the
target's, and greedy rows equal the target's own greedy decoding.

Seeds: `seeds[i]` seeds row i's generator; what a row's generator draws depends only on its prompt,
its seed and its drafts, so a row equals a single-prompt run with that seed whenever its drafts are
the same (see `SelfDraftModel.generate` for when they are).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from selfdraft import kv
from selfdraft.inference.acceptance import (
    AcceptResult,
    SamplingParams,
    accept_greedy,
    accept_rejection,
    accept_typical,
    sample,
    warp_probs,
)
from selfdraft.inference.drafting import make_drafter
from selfdraft.inference.requests import check_request, row_seeds
from selfdraft.tree import Draft, TreeShape, TreeSpec, ancestor_matrix, float_mask


@dataclass
class GenerationStats:
    """target_forwards counts the prefill and every tree pass.

    mean_accepted (tau) = tokens produced by tree passes / tree passes, bonus or correction token
    counted; the first token (from the prefill) is not part of it.
    """

    target_forwards: int = 0
    tree_passes: int = 0
    tree_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    depth_offered: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    # seconds per phase, summed over tree passes, measured only when generate is asked to `profile`
    # (`selfdraft bench` reports them per step); a phase runs for all rows at once, and each row that
    # goes on after it counts its whole time
    prefill_time: float = 0.0
    draft_time: float = 0.0  # the heads propose the tree (the shape's growth loop included)
    verify_time: float = 0.0  # the target's pass over the tree, mask and positions included
    accept_time: float = 0.0  # acceptance: argmax or warped p and rejection sampling
    compact_time: float = 0.0  # KV compaction to the accepted path
    observe_time: float = 0.0  # the accepted tokens are emitted and the drafter takes their features
    total_time: float = 0.0  # always measured: wall time from the call's start until the row finished
    finish_reason: str = ""

    @property
    def mean_accepted(self) -> float:
        if not self.tree_passes:
            return 0.0
        return sum(n + 1 for n in self.accepted_lengths) / self.tree_passes

    @property
    def other_time(self) -> float:
        """Seconds of the loop outside the measured phases (Python bookkeeping, streaming)."""
        phases = self.prefill_time + self.draft_time + self.verify_time + self.accept_time
        return max(0.0, self.total_time - phases - self.compact_time - self.observe_time)

    @property
    def per_depth_acceptance(self) -> list[float]:
        """Fraction of tree passes offering depth d whose accepted path reached depth d (d = 1..D)."""
        return [a / o if o else 0.0 for a, o in zip(self.depth_accepted, self.depth_offered, strict=True)]

    def record(self, accepted: int, depth: int, tree_size: int) -> None:
        self.tree_passes += 1
        self.target_forwards += 1
        self.tree_tokens += tree_size
        self.accepted_lengths.append(accepted)
        while len(self.depth_offered) < depth:
            self.depth_offered.append(0)
            self.depth_accepted.append(0)
        for d in range(depth):
            self.depth_offered[d] += 1
            self.depth_accepted[d] += int(accepted > d)


@dataclass
class GenerationOutput:
    tokens: list[int]
    stats: GenerationStats

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.stats.total_time if self.stats.total_time else 0.0



# ---- the loop ---------------------------------------------------------------------------------------
@torch.no_grad()
def speculative_generate(
    target,
    heads,
    prompts: Sequence[torch.Tensor],
    *,
    spec: TreeShape,
    max_new_tokens: int,
    sampling: SamplingParams,
    seeds: Sequence[int | None] | None = None,
    stop_token_ids: Iterable[int] = (),
    acceptance: str = "rejection",
    streamer=None,
    profile: bool = False,
) -> list[GenerationOutput]:
    """Generate up to `max_new_tokens` after each prompt (1-D long tensors of any lengths), all rows
    verified by one shared target pass per step; returns one GenerationOutput per prompt, in order.

    heads: heads (one drafter serves all rows), a drafter object (one prompt only) or a list of one
    drafter per prompt (see `drafting.make_drafter`). seeds: one per row (None: `row_seeds` of
    sampling.seed). streamer: one prompt only. profile: time each phase into the rows' stats.
    """
    limit = check_request(target, prompts, acceptance, max_new_tokens, streamer)
    rows = start_rows(prompts, sampling, seeds, stop_token_ids, max_new_tokens, streamer)
    drafter = make_drafter(heads, len(rows))
    if draws_children(drafter, spec, sampling, acceptance):
        drafter.draw_with(sampling.temperature, [row.generator for row in rows])
    timer = PhaseTimer() if profile else NO_TIMER
    finished: dict[int, Row] = {}
    cache = kv.new_cache()
    with timer.phase("prefill", rows):
        passed = prefill(target, list(prompts), cache)
    with timer.phase("observe", rows):
        emit_first_tokens(rows, prompts, passed, drafter, sampling)
    rows = retire(rows, cache, drafter, kv.cache_length(cache), [[] for _ in rows], finished)
    while rows:
        physical, paths = kv.cache_length(cache), [[] for _ in rows]
        shapes = [tree_that_fits(spec, row.length, limit) for row in rows]
        if None in shapes:  # rows at the context's end stop; the others step on the next round
            end_at_context(rows, shapes)
        else:
            with timer.phase("draft", rows):
                drafts = draft_trees(drafter, shapes, [row.root for row in rows], [row.context for row in rows])
            with timer.phase("verify", rows):
                passed = verify(target, cache, drafts, [row.length for row in rows])
            with timer.phase("accept", rows):
                results = [
                    accept_tree(passed.logits[b, : d.spec.size], d, sampling, acceptance, row.generator)
                    for b, (row, d) in enumerate(zip(rows, drafts, strict=True))
                ]
            with timer.phase("observe", rows):
                paths = commit(rows, drafts, results, passed, drafter)
        with timer.phase("compact", rows):
            rows = retire(rows, cache, drafter, physical, paths, finished)
    if streamer is not None:
        streamer.end()
    return [GenerationOutput(tokens=finished[i].out, stats=finished[i].stats) for i in range(len(prompts))]


# ---- rows: one prompt's generation each -------------------------------------------------------------
@dataclass
class Row:
    """One prompt's generation: its output, its generator, and its valid cache entries [0, length)."""

    index: int  # position in the caller's list
    generator: torch.Generator | None
    stops: set[int]
    max_new_tokens: int
    context: list[int]  # prompt + output: what a prompt-lookup branch searches
    length: int
    streamer: object | None = None  # transformers' streamer interface: `put(tensor)`, `end()`
    root: int = 0  # the last chosen token, not yet in the cache: the next tree's root
    out: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    done: bool = False
    started: float = field(default_factory=time.perf_counter)

    def emit(self, new: list[int]) -> None:
        """Append tokens up to a stop token or the budget; sets `done` when generation is over."""
        new, reason = cut_at_stop(new, self.stops, len(self.out), self.max_new_tokens)
        if reason is not None:
            self.done, self.stats.finish_reason = True, reason
        self.out.extend(new)
        self.context.extend(new)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new))


def start_rows(
    prompts: Sequence[torch.Tensor],
    sampling: SamplingParams,
    seeds: Sequence[int | None] | None,
    stop_token_ids: Iterable[int],
    max_new_tokens: int,
    streamer,
) -> list[Row]:
    """One row per prompt, each with its own generator (seeds: one per row, None: from sampling.seed)."""
    seeds = row_seeds(sampling.seed, len(prompts)) if seeds is None else seeds
    stops = set(int(t) for t in stop_token_ids)
    device = prompts[0].device
    if streamer is not None:
        streamer.put(prompts[0].cpu())
    generators = [replace(sampling, seed=seed).make_generator(device) for seed in seeds]
    return [
        Row(i, generator, stops, max_new_tokens, p.tolist(), p.numel(), streamer)
        for i, (p, generator) in enumerate(zip(prompts, generators, strict=True))
    ]


def _split(hidden_states: tuple[torch.Tensor, ...], b: int) -> tuple[torch.Tensor, ...]:
    """Row b's hidden states, each [1, n, h] (views, no copy)."""
    return tuple(h[b : b + 1] for h in hidden_states)


def emit_first_tokens(rows: list[Row], prompts: Sequence[torch.Tensor], passed: TargetPass, drafter, sampling) -> None:
    """Each row's first token from the prefill; the drafter sees the prompts' features."""
    for b, (row, p) in enumerate(zip(rows, prompts, strict=True)):
        row.stats.target_forwards += 1
        row.root = first_token(passed.logits[b], sampling, row.generator)
        row.emit([row.root])
        if not row.done:
            next_tokens = torch.cat([p[1:], torch.tensor([row.root], device=p.device)])
            drafter.observe(b, next_tokens, _split(passed.hidden_states, b), torch.arange(p.numel(), device=p.device))


def draft_trees(
    drafter, shapes: Sequence[TreeShape], roots: Sequence[int], contexts: Sequence[list[int]]
) -> list[Draft]:
    """Row b's tree: the drafter's part of shapes[b] under roots[b], completed with what the shape adds
    from contexts[b] alone (a looked-up branch; drawn children come only from static trees, which add
    nothing, so q stays aligned)."""
    drafts = drafter.propose(shapes, roots)
    return [
        Draft(*shape.complete(d.spec, d.tokens, context), d.q)
        for shape, d, context in zip(shapes, drafts, contexts, strict=True)
    ]


def end_at_context(rows: list[Row], shapes: list[TreeShape | None]) -> None:
    for row, shape in zip(rows, shapes, strict=True):
        if shape is None:
            row.done, row.stats.finish_reason = True, "context"


def commit(
    rows: list[Row], drafts: list[Draft], results: list[AcceptResult], passed: TargetPass, drafter
) -> list[list[int]]:
    """Emit each row's accepted tokens and the token after them, and show the drafter the accepted
    path's features. Returns each row's kept tree nodes (root first, then its accepted path)."""
    paths = []
    for b, (row, draft, result) in enumerate(zip(rows, drafts, results, strict=True)):
        path = [0, *result.accepted]
        paths.append(path)
        row.stats.record(len(result.accepted), draft.spec.max_depth, draft.spec.size)
        new = torch.cat([draft.tokens[list(result.accepted)], torch.tensor([result.next_token])])  # path successors
        row.emit(new.tolist())
        if not row.done:
            drafter.observe(b, new, _split(passed.hidden_states, b), torch.tensor(path, device=draft.tokens.device))
        row.root = result.next_token
    return paths


def compact_rows(
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


def retire(
    rows: list[Row], cache, drafter, physical: int, paths: list[list[int]], finished: dict[int, Row]
) -> list[Row]:
    """Move done rows to `finished`; compact the target's cache and the drafter to the rows still going."""
    keep = []
    for b, row in enumerate(rows):
        if row.done:
            row.stats.total_time = time.perf_counter() - row.started
            finished[row.index] = row
        else:
            keep.append(b)
    new_lengths = compact_rows(cache, physical, keep, [row.length for row in rows], paths)
    drafter.retire(keep)
    alive = [rows[b] for b in keep]
    for row, length in zip(alive, new_lengths, strict=True):
        row.length = length
    return alive


def cut_at_stop(
    new: list[int], stops: set[int], produced: int, max_new_tokens: int
) -> tuple[list[int], str | None]:
    """The part of `new` to emit after `produced` tokens, and why generation ends there ("stop" at a
    stop token, "length" at the budget) or None when it goes on."""
    for i, tok in enumerate(new):
        if tok in stops or produced + i + 1 >= max_new_tokens:
            return new[: i + 1], "stop" if tok in stops else "length"
    return new, None


def tree_that_fits(spec: TreeShape, prefix_len: int, limit: int | None) -> TreeShape | None:
    """The tree if its deepest node still has a position inside the context; else a shorter chain,
    never deeper than what the drafter proposes for this shape (Medusa has one head per depth)."""
    if limit is None or prefix_len + spec.max_depth < limit:
        return spec
    room = min(limit - prefix_len - 1, spec.draft_depth)
    return TreeSpec.chain(room) if room >= 0 else None


def accept_tree(
    logits: torch.Tensor, draft: Draft, sampling: SamplingParams, mode: str, generator
) -> AcceptResult:
    """logits: [N, V] the target's at each node of `draft`; its q [N, V] is there when the children
    were drawn without replacement from q[u] (see `draws_children`)."""
    tokens, spec, q = draft.tokens, draft.spec, draft.q
    if sampling.is_greedy:
        return accept_greedy(tokens, greedy_ids(logits), spec)
    p = warp_probs(logits, sampling)
    if mode == "typical":
        return accept_typical(p, tokens, spec, generator=generator)
    if q is not None:
        return accept_rejection(p, tokens, spec, variant="without_replacement", q=q, generator=generator)
    # Children are deterministic picks (heads' top-k, a looked-up branch): the exact rule for them.
    return accept_rejection(p, tokens, spec, variant="deterministic", q=None, generator=generator)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, ties to the lowest index as `torch.argmax`: [..., V] -> [...]. Through
    `max`, which on CPU reduces bf16 rows about 4x faster than `argmax` (~1 ms a step over 16 nodes)."""
    return logits.max(dim=-1).indices


def draws_children(drafter, shape: TreeShape, sampling: SamplingParams, acceptance: str) -> bool:
    """Whether children are drawn from the head's own q (then verified by the without-replacement rule)
    instead of taken as its top-k: at T > 0 under lossless acceptance, for a static tree whose ranks
    are in draw order, with a drafter that can draw (EAGLE). Dynamic trees and lookup branches pick
    children by value, which only the deterministic rule verifies exactly, so they keep top-k."""
    return (
        not sampling.is_greedy
        and acceptance == "rejection"
        and isinstance(shape, TreeSpec)
        and shape.ranks_in_order
        and callable(getattr(drafter, "draw_with", None))
    )


def first_token(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
    if sampling.is_greedy:
        return int(greedy_ids(logits))
    return sample(warp_probs(logits, sampling), generator)


# ---- the opt-in profiler ----------------------------------------------------------------------------
class PhaseTimer:
    """Times each phase of the loop into the stats of the rows it ran for (`profile=True`)."""

    @contextmanager
    def phase(self, name: str, rows: list[Row]) -> Iterator[None]:
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        for row in rows:
            if not row.done or name == "prefill":  # a row that finished in a phase stops counting there
                setattr(row.stats, f"{name}_time", getattr(row.stats, f"{name}_time") + seconds)


class _NoTimer:
    def phase(self, name: str, rows: list[Row]):
        return nullcontext()


NO_TIMER = _NoTimer()


# ---- the target's two passes, each ONE forward over every row of the batch ---------------------------
PAD_ID = 0  # any id in the vocabulary: pad slots and dummy nodes are masked


@dataclass(frozen=True)
class TargetPass:
    """logits: [B, V] (prefill: at each row's last prompt token) or [B, N, V] (verify: at each node);
    hidden_states: tuple of [B, n, h] per layer."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


@lru_cache(maxsize=64)
def takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


@torch.no_grad()
def prefill(target, prompts: list[torch.Tensor], cache) -> TargetPass:
    """One causal pass over the prompts (1-D, any lengths), right-padded to the longest. Real queries
    never see a pad slot; pad queries see plain causal context (any non-empty row keeps softmax finite;
    their outputs are unused). Prompts of one length (a single prompt among them) need no mask at all.

    Returns logits [B, V] at each row's last prompt token (only those are projected onto the
    vocabulary when the target takes `logits_to_keep`) and hidden states [B, P, h] per layer."""
    lengths = [p.numel() for p in prompts]
    width, rows = max(lengths), len(prompts)
    device = prompts[0].device
    last = [n - 1 for n in lengths]
    keep = sorted(set(last))
    extra = {}
    if takes_logits_to_keep(type(target)):  # [B, P, V] logits of a long batch can take gigabytes
        extra["logits_to_keep"] = torch.tensor(keep, device=device)
    if len(keep) == 1:  # no padding: the target's own causal attention, as in its `generate`
        ids = torch.stack(prompts)
        out = target(input_ids=ids, output_hidden_states=True, **extra, **kv.cache_kwargs(target, cache))
    else:
        ids = torch.full((rows, width), PAD_ID, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, : p.numel()] = p
        i = torch.arange(width)
        length = torch.tensor(lengths)
        causal = i[None, :] <= i[:, None]  # [q, k]
        real_key = i[None, :] < length[:, None]  # [B, k]
        pad_query = i[None, :] >= length[:, None]  # [B, q]
        allowed = causal[None] & (real_key[:, None, :] | pad_query[:, :, None])
        dtype = target.get_input_embeddings().weight.dtype
        with kv.masked_gqa(device, width):
            out = target(
                input_ids=ids,
                attention_mask=float_mask(allowed.to(device), dtype)[:, None],
                position_ids=i.to(device)[None].expand(rows, -1),
                output_hidden_states=True,
                **extra,
                **kv.cache_kwargs(target, cache),
            )
    column = [keep.index(n) for n in last] if extra else last
    logits = out.logits[torch.arange(rows, device=device), torch.tensor(column, device=device)]
    return TargetPass(logits=logits, hidden_states=tuple(out.hidden_states))


@torch.no_grad()
def verify(target, cache, drafts: list[Draft], lengths: list[int]) -> TargetPass:
    """One target pass over every row's drafted tree (spec, tokens [N_b]) after its lengths[b] cached entries.
    Smaller trees are padded with dummy nodes that see only themselves and that no real node sees.
    Returns logits [B, N, V], N = the largest tree; row b's nodes are its first N_b. The trees' keys
    and values are appended to `cache` (the caller compacts it to the accepted paths)."""
    physical = kv.cache_length(cache)
    width = max(d.spec.size for d in drafts)
    rows = len(drafts)
    tokens = torch.full((rows, width), PAD_ID, dtype=torch.long)
    positions = torch.empty((rows, width), dtype=torch.long)
    tree_part = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)  # dummies see only themselves
    for b, draft in enumerate(drafts):
        spec, n = draft.spec, draft.spec.size
        tokens[b, :n] = draft.tokens
        positions[b] = lengths[b]
        positions[b, :n] += torch.tensor(spec.depths)
        tree_part[b, :n, :n] = ancestor_matrix(spec)
    prefix = torch.arange(physical)[None, :] < torch.tensor(lengths)[:, None]  # [B, physical]
    allowed = torch.cat([prefix[:, None, :].expand(-1, width, -1), tree_part], dim=2)
    dtype = target.get_input_embeddings().weight.dtype
    device = target.get_input_embeddings().weight.device
    with kv.masked_gqa(device, width):
        out = target(
            input_ids=tokens.to(device),
            attention_mask=float_mask(allowed.to(device), dtype)[:, None],
            position_ids=positions.to(device),
            output_hidden_states=True,
            **kv.cache_kwargs(target, cache),
        )
    return TargetPass(logits=out.logits, hidden_states=tuple(out.hidden_states))
