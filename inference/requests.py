"""What a generate call is asked, checked before anything runs: the acceptance rule, the budget, the
prompts against the target's context, and one seed per row. Each mistake is one line naming the fix."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from selfdraft.errors import UserError
from selfdraft.target import max_context

ACCEPTANCE_MODES = ("rejection", "typical")


def check_request(
    target, prompts: Sequence[torch.Tensor], acceptance: str, max_new_tokens: int, streamer
) -> int | None:
    """Everything `speculative_generate` is asked, before anything runs; returns the target's context
    length (None: unbounded)."""
    check_options(acceptance, max_new_tokens)
    limit = max_context(target)
    check_prompts(prompts, limit)
    if streamer is not None and len(prompts) > 1:
        raise UserError("streamer= works with one prompt only; generate a batch without it")
    return limit


def check_options(acceptance: str, max_new_tokens: int) -> None:
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
