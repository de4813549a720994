"""The speculative generate loop: prefill, then draft -> verify (one target pass over the tree) ->
accept -> compact, until a stop token, the budget or the context ends it."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

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
from selfdraft.target import max_context
from selfdraft.tree import TreeShape, TreeSpec, tree_attention_mask, tree_position_ids

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


@dataclass(frozen=True)
class TargetPass:
    """logits: [N, V] next-token logits at each node; hidden_states: tuple of [1, N, h] per layer."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]


@torch.no_grad()
def prefill(target, input_ids: torch.Tensor, cache) -> TargetPass:
    """Plain causal forward over the prompt input_ids: [1, T] (fills `cache`)."""
    out = target(input_ids=input_ids, output_hidden_states=True, **kv.cache_kwargs(target, cache))
    return TargetPass(logits=out.logits[0], hidden_states=tuple(out.hidden_states))


@torch.no_grad()
def verify_tree(target, cache, tokens: torch.Tensor, spec: TreeSpec) -> TargetPass:
    """Run the target once on the tree: tokens [N] at positions prefix + depth, ancestor-only mask.

    The tree's N keys/values are appended to `cache`; the caller compacts it to the accepted path.
    """
    prefix = kv.cache_length(cache)
    dtype = target.get_input_embeddings().weight.dtype
    device = tokens.device
    with kv.masked_gqa(device, spec.size):
        out = target(
            input_ids=tokens[None],
            attention_mask=tree_attention_mask(spec, prefix, dtype=dtype, device=device),
            position_ids=tree_position_ids(spec, prefix, device=device),
            output_hidden_states=True,
            **kv.cache_kwargs(target, cache),
        )
    return TargetPass(logits=out.logits[0], hidden_states=tuple(out.hidden_states))


def accept_tree(
    passed: TargetPass,
    tokens: torch.Tensor,
    spec: TreeSpec,
    sampling: SamplingParams,
    mode: str,
    generator,
    q: torch.Tensor | None = None,
) -> AcceptResult:
    """q: [N, V] when the children were drawn without replacement from q[u] (see `draws_children`)."""
    if sampling.is_greedy:
        return accept_greedy(tokens, greedy_ids(passed.logits), spec)
    p = warp_probs(passed.logits, sampling)
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


@torch.no_grad()
def speculative_generate(
    target,
    heads,
    input_ids: torch.Tensor,
    *,
    spec: TreeShape,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: Iterable[int] = (),
    acceptance: str = "rejection",
    streamer=None,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` after input_ids [1, T]; the output distribution is the target's.

    streamer: anything with transformers' streamer interface (`put(tensor)`, `end()`).
    """
    check_request(acceptance, max_new_tokens)
    limit = max_context(target)
    prompt_len = input_ids.shape[1]
    check_prompt_fits(prompt_len, limit)
    stops = set(int(t) for t in stop_token_ids)
    stats = GenerationStats()
    generator = sampling.make_generator(input_ids.device)
    drafter = make_drafter(heads)
    cache = kv.new_cache()
    start = time.perf_counter()

    passed = prefill(target, input_ids, cache)
    stats.target_forwards += 1
    root = first_token(passed.logits[-1], sampling, generator)
    stats.prefill_time = time.perf_counter() - start
    out: list[int] = []
    context = input_ids[0].tolist()  # prompt + output: what a prompt-lookup branch searches

    def emit(new: list[int]) -> bool:
        """Append tokens up to a stop token or the budget; True when generation is over."""
        chunk, reason = cut_at_stop(new, stops, len(out), max_new_tokens)
        done = reason is not None
        if done:
            stats.finish_reason = reason
        out.extend(chunk)
        context.extend(chunk)
        if streamer is not None:
            streamer.put(torch.tensor(chunk))
        return done

    if streamer is not None:
        streamer.put(input_ids[0].cpu())
    done = emit([root])
    next_tokens = torch.cat([input_ids[0, 1:], torch.tensor([root], device=input_ids.device)])
    drafter.observe(next_tokens, passed.hidden_states, torch.arange(prompt_len, device=input_ids.device))
    drawing = draws_children(drafter, spec, sampling, acceptance)
    if drawing:
        drafter.draw_with(sampling.temperature, generator)

    while not done:
        prefix = kv.cache_length(cache)
        shape = tree_that_fits(spec, prefix, limit)
        if shape is None:
            stats.finish_reason = "context"
            break
        t0 = time.perf_counter()
        tree, tokens = shape.draft(drafter, root, context)  # a concrete TreeSpec, whatever the shape
        t1 = time.perf_counter()
        passed = verify_tree(target, cache, tokens.to(input_ids.device), tree)
        t2 = time.perf_counter()
        q = drafter.tree_dists(tree.size) if drawing else None
        result = accept_tree(passed, tokens, tree, sampling, acceptance, generator, q)
        t3 = time.perf_counter()
        path = torch.tensor([0, *result.accepted], dtype=torch.long, device=input_ids.device)
        kv.keep_positions(cache, prefix, prefix + path)
        t4 = time.perf_counter()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.accept_time += t3 - t2
        stats.compact_time += t4 - t3
        stats.record(len(result.accepted), tree.max_depth, tree.size)

        new = [int(tokens[a]) for a in result.accepted] + [result.next_token]
        done = emit(new)
        if not done:
            t5 = time.perf_counter()
            drafter.observe(torch.tensor(new), passed.hidden_states, path)
            stats.observe_time += time.perf_counter() - t5
        root = result.next_token

    stats.total_time = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    return GenerationOutput(tokens=out, stats=stats)
