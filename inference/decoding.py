"""The speculative generate loop, for a batch of prompts (a single prompt is a batch of one):

    prefill  one target pass over the right-padded prompts [B, P] (`passes.prefill`)
    loop:
    draft    all rows' trees grow in lockstep (`tree.drive_rows`): an EAGLE head runs once per depth over
             every row's frontier, with one head KV cache holding every row (`drafting.EagleRows`)
    verify   ONE target pass over every row's tree (`passes.verify`)
    accept   per row, with its own generator: each row accepts its own prefix of its own tree
    compact  per row, in place: the accepted path moves to [len_b, len_b + k); the cache is cut at the
             longest row
    drop     rows that finished (stop token, budget, context) leave the batch and the cache

The shared passes are what a batch saves (the target's and the head's weights are read once per
step for all rows); acceptance runs row by row. The output distribution of every row is the
target's, and greedy rows equal the target's own greedy decoding.

Seeds: `seeds[i]` seeds row i's generator; what a row's generator draws depends only on its prompt,
its seed and its drafts, so a row equals a single-prompt run with that seed whenever its drafts are
the same (see `SelfDraftModel.generate` for when they are).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from selfdraft import kv
from selfdraft.errors import UserError
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
from selfdraft.inference.passes import prefill, verify
from selfdraft.target import max_context
from selfdraft.tree import TreeShape, TreeSpec, drive_rows

ACCEPTANCE_MODES = ("rejection", "typical")


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
    # seconds per phase, summed over tree passes (`selfdraft bench` reports them per step)
    prefill_time: float = 0.0
    draft_time: float = 0.0  # the heads propose the tree (the shape's growth loop included)
    verify_time: float = 0.0  # the target's pass over the tree, mask and positions included
    accept_time: float = 0.0  # acceptance: argmax or warped p and rejection sampling
    compact_time: float = 0.0  # KV compaction to the accepted path
    observe_time: float = 0.0  # the drafter takes the accepted path's features
    total_time: float = 0.0
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


def accept_tree(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    spec: TreeSpec,
    sampling: SamplingParams,
    mode: str,
    generator,
    q: torch.Tensor | None = None,
) -> AcceptResult:
    """logits: [N, V] the target's at each node; q: [N, V] when the children were drawn without
    replacement from q[u] (see `draws_children`)."""
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


def check_request(acceptance: str, max_new_tokens: int) -> None:
    if acceptance not in ACCEPTANCE_MODES:
        raise UserError(f"acceptance={acceptance!r}; expected one of {ACCEPTANCE_MODES}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def check_prompt_fits(prompt_len: int, limit: int | None, which: str = "the prompt") -> None:
    """A prompt of exactly the context still yields one token (its last logits); a longer one cannot."""
    if limit is not None and prompt_len > limit:
        raise UserError(
            f"{which} has {prompt_len} tokens but the target's context holds {limit}; shorten it"
        )


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


SEED_LIMIT = 2**63  # torch generators take seeds below 2**64; a signed int64 keeps every consumer happy


def _seed_int(s) -> int | None:
    """An integer seed (Python or numpy) in [0, SEED_LIMIT), None when not an integer at all."""
    if isinstance(s, bool):
        return None
    try:
        value = operator.index(s)
    except TypeError:
        return None
    if not 0 <= value < SEED_LIMIT:
        raise UserError(f"seed {value} is out of range; pass an integer from 0 to 2**63 - 1")
    return value


def row_seeds(seed, n: int) -> list[int | None]:
    """One seed per row. seed: None (each row's generator is seeded from torch's global RNG, in row
    order), one int s (row i uses s + i, so row i reproduces `generate(prompt_i, seed=s + i)`), or a
    sequence of n ints/None. Integers may be numpy's; each must lie in [0, 2**63)."""
    if seed is None:
        return [None] * n
    if (first := _seed_int(seed)) is not None:
        _seed_int(first + n - 1)  # the last row's seed is in range too
        return [first + i for i in range(n)]
    if isinstance(seed, Sequence) and not isinstance(seed, str | bytes):
        seeds = list(seed)
        if len(seeds) != n:
            raise UserError(
                f"seed has {len(seeds)} entries for {n} prompts; pass one seed per prompt or one int"
            )
        out = [None if s is None else _seed_int(s) for s in seeds]
        for s, value in zip(seeds, out, strict=True):
            if s is not None and value is None:
                raise UserError(f"seed entries must be integers or None, got {s!r}")
        return out
    raise UserError(f"seed must be an int, a list of one int per prompt, or None; got {seed!r}")


def check_prompts(prompts: Sequence[torch.Tensor], limit: int | None) -> None:
    if not prompts:
        raise UserError("no prompts; pass at least one prompt")
    for i, p in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"  # 1-based, as files count lines
        if p.dim() != 1 or p.numel() == 0:
            raise UserError(f"{which} has shape {tuple(p.shape)}; each prompt must be a non-empty 1-D id list")
        check_prompt_fits(p.numel(), limit, which)


@dataclass
class _Row:
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

    def emit(self, new: list[int]) -> None:
        """Append tokens up to a stop token or the budget; sets `done` when generation is over."""
        new, reason = cut_at_stop(new, self.stops, len(self.out), self.max_new_tokens)
        if reason is not None:
            self.done, self.stats.finish_reason = True, reason
        self.out.extend(new)
        self.context.extend(new)
        if self.streamer is not None:
            self.streamer.put(torch.tensor(new))


def _split(hidden_states: tuple[torch.Tensor, ...], b: int) -> tuple[torch.Tensor, ...]:
    """Row b's hidden states, each [1, n, h] (views, no copy)."""
    return tuple(h[b : b + 1] for h in hidden_states)


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
) -> list[GenerationOutput]:
    """Generate up to `max_new_tokens` after each prompt (1-D long tensors of any lengths), all rows
    verified by one shared target pass per step; returns one GenerationOutput per prompt, in order.

    heads: heads (one drafter serves all rows), a drafter object (one prompt only) or a list of one
    drafter per prompt (see `drafting.make_drafter`). seeds: one per row (None: `row_seeds` of
    sampling.seed). streamer: one prompt only. Each row's stats count the shared passes it took part
    in; draft_time / verify_time / compact_time / prefill_time are those shared passes' wall time,
    total_time is the wall time until that row finished.
    """
    check_request(acceptance, max_new_tokens)
    limit = max_context(target)
    check_prompts(prompts, limit)
    n = len(prompts)
    if streamer is not None and n > 1:
        raise UserError("streamer= works with one prompt only; generate a batch without it")
    seeds = row_seeds(sampling.seed, n) if seeds is None else seeds
    stops = set(int(t) for t in stop_token_ids)
    device = prompts[0].device
    drafter = make_drafter(heads, n)
    generators = [replace(sampling, seed=seed).make_generator(device) for seed in seeds]
    rows = [
        _Row(i, generators[i], stops, max_new_tokens, p.tolist(), p.numel(), streamer) for i, p in enumerate(prompts)
    ]
    if streamer is not None:
        streamer.put(prompts[0].cpu())
    finished: dict[int, _Row] = {}
    cache = kv.new_cache()
    start = time.perf_counter()
    _first_tokens(target, drafter, prompts, rows, cache, sampling)
    drawing = draws_children(drafter, spec, sampling, acceptance)
    if drawing:
        drafter.draw_with(sampling.temperature, [row.generator for row in rows])
    # Drop rows done after the first token; the others keep [0, len_b) (pad slots go).
    rows = _retire(rows, cache, drafter, kv.cache_length(cache), [[] for _ in rows], finished, start)
    while rows:
        shapes = [tree_that_fits(spec, row.length, limit) for row in rows]
        paths = [[] for _ in rows]
        physical = kv.cache_length(cache)
        if any(s is None for s in shapes):
            for row, s in zip(rows, shapes, strict=True):
                if s is None:
                    row.done, row.stats.finish_reason = True, "context"
        else:
            paths = _step(target, drafter, rows, shapes, cache, sampling, acceptance, drawing)
        t0 = time.perf_counter()
        rows = _retire(rows, cache, drafter, physical, paths, finished, start)
        compact = time.perf_counter() - t0
        for row in rows:
            row.stats.compact_time += compact
    if streamer is not None:
        streamer.end()
    return [GenerationOutput(tokens=finished[i].out, stats=finished[i].stats) for i in range(n)]


def _first_tokens(target, drafter, prompts: Sequence[torch.Tensor], rows: list[_Row], cache, sampling) -> None:
    """Prefill every prompt, emit each row's first token, and show the drafter the prompts' features."""
    start = time.perf_counter()
    passed = prefill(target, list(prompts), cache)
    prefill_time = time.perf_counter() - start
    for b, (row, p) in enumerate(zip(rows, prompts, strict=True)):
        row.stats.target_forwards += 1
        row.stats.prefill_time = prefill_time
        row.root = first_token(passed.logits[b], sampling, row.generator)
        row.emit([row.root])
        if not row.done:
            next_tokens = torch.cat([p[1:], torch.tensor([row.root], device=p.device)])
            t0 = time.perf_counter()
            drafter.observe(b, next_tokens, _split(passed.hidden_states, b), torch.arange(p.numel(), device=p.device))
            row.stats.observe_time += time.perf_counter() - t0


def _step(
    target, drafter, rows: list[_Row], shapes: list[TreeShape], cache, sampling, acceptance: str, drawing: bool
) -> list[list[int]]:
    """One draft -> verify -> accept round for every row. Returns each row's kept tree nodes (root
    first, then its accepted path), which the caller compacts the cache to."""
    t0 = time.perf_counter()
    trees = drive_rows([s.grow(row.root, row.context) for row, s in zip(rows, shapes, strict=True)], drafter)
    t1 = time.perf_counter()
    passed = verify(target, cache, trees, [row.length for row in rows])
    draft, verified = t1 - t0, time.perf_counter() - t1
    paths = []
    for b, (row, (tree, tokens)) in enumerate(zip(rows, trees, strict=True)):
        t2 = time.perf_counter()
        q = drafter.tree_dists(b, tree.size) if drawing else None
        result = accept_tree(passed.logits[b, : tree.size], tokens, tree, sampling, acceptance, row.generator, q)
        t3 = time.perf_counter()
        path = [0, *result.accepted]
        paths.append(path)
        row.stats.draft_time += draft
        row.stats.verify_time += verified
        row.stats.accept_time += t3 - t2
        row.stats.record(len(result.accepted), tree.max_depth, tree.size)
        new = torch.cat([tokens[list(result.accepted)], torch.tensor([result.next_token])])  # path successors
        row.emit(new.tolist())
        if not row.done:
            drafter.observe(b, new, _split(passed.hidden_states, b), torch.tensor(path, device=tokens.device))
            row.stats.observe_time += time.perf_counter() - t3
        row.root = result.next_token
    return paths


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
