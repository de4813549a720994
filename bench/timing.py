"""Measuring speculative decoding against the target's own `generate`, side by side in one run.

Only ratios measured in the same run mean anything on a shared machine: every comparison here runs
the methods interleaved per prompt (A B A B ...) and reports medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfdraft import kv
from selfdraft.inference.decoding import GenerationOutput
from selfdraft.inference.model import SelfDraftModel
from selfdraft.tree import block_causal_mask


@dataclass
class Timed:
    tokens: list[int]
    seconds: float


@dataclass
class Comparison:
    """One prompt: baseline and speculative runs (repeats interleaved), and their outputs."""

    baseline: list[Timed] = field(default_factory=list)
    speculative: list[Timed] = field(default_factory=list)
    outputs: list[GenerationOutput] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(s.tokens == self.baseline[0].tokens for s in self.speculative + self.baseline)

    @property
    def speedup(self) -> float:
        """speculative tokens/s / baseline tokens/s, medians over the repeats (same prompt, same run).

        Per token, so it stays fair when a near-tie makes one text stop earlier than the other."""
        return self.tokens_per_second("speculative") / self.tokens_per_second("baseline")

    @property
    def tau(self) -> float:
        return statistics.mean(o.stats.mean_accepted for o in self.outputs)

    def tokens_per_second(self, which: str) -> float:
        runs = self.baseline if which == "baseline" else self.speculative
        return len(runs[0].tokens) / statistics.median(r.seconds for r in runs)


@torch.no_grad()
def run_baseline(
    model: SelfDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    generate_kwargs: dict | None = None,
    **sampling,
) -> Timed:
    """The target's own `generate` with the same stop tokens and budget (greedy unless told).

    generate_kwargs: extra `generate` options (prompt lookup, an assistant model)."""
    stop = model.default_stop_ids()
    start = time.perf_counter()
    out = model.target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=stop or None,
        pad_token_id=stop[0] if stop else 0,
        **_sampling_kwargs(sampling),
        **(generate_kwargs or {}),
    )
    seconds = time.perf_counter() - start
    return Timed(out[0, input_ids.shape[1] :].tolist(), seconds)


def _sampling_kwargs(sampling: dict) -> dict:
    """`generate` options for the same sampling as selfdraft's: greedy unless a temperature is given,
    and no top-k unless asked (transformers would default to 50)."""
    if sampling.get("temperature", 0.0) <= 0:
        return {"do_sample": False}
    kwargs = {"do_sample": True, "temperature": sampling["temperature"], "top_k": None}
    kwargs.update({k: sampling[k] for k in ("top_k", "top_p") if sampling.get(k) is not None})
    return kwargs


@torch.no_grad()
def run_baseline_batch(
    model: SelfDraftModel, prompts: list[torch.Tensor], max_new_tokens: int, **sampling
) -> tuple[list[list[int]], float]:
    """The target's own batched `generate`: prompts left-padded, same stop ids and budget.
    Returns (each row's tokens up to and including its first stop token, seconds)."""
    stop = model.default_stop_ids()
    pad = stop[0] if stop else 0
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel() :] = p
        mask[b, width - p.numel() :] = 1
    start = time.perf_counter()
    out = model.target.generate(
        ids.to(model.target.device),
        attention_mask=mask.to(model.target.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=stop or None,
        pad_token_id=pad,
        **_sampling_kwargs(sampling),
    )
    seconds = time.perf_counter() - start
    rows = []
    for new in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(new) if t in stop), len(new))
        rows.append(new[:end])
    return rows, seconds


def run_speculative(
    model: SelfDraftModel, input_ids: torch.Tensor, max_new_tokens: int, streamer=None, **sampling
) -> tuple[Timed, GenerationOutput]:
    start = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens, streamer=streamer, profile=True, **sampling)
    return Timed(out.tokens, time.perf_counter() - start), out


def compare(
    model: SelfDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    repeats: int = 1,
    streamer=None,
    progress: Callable[[int, str], None] | None = None,
) -> Comparison:
    """Greedy baseline and speculative decoding of one prompt, interleaved `repeats` times.
    progress(r, method) is called before each run ("baseline" / "speculative", r from 0); the
    speculative run of repeat 0 streams to `streamer`."""
    result = Comparison()
    for r in range(repeats):
        if progress is not None:
            progress(r, "baseline")
        result.baseline.append(run_baseline(model, input_ids, max_new_tokens))
        if progress is not None:
            progress(r, "speculative")
        timed, out = run_speculative(model, input_ids, max_new_tokens, streamer=streamer if r == 0 else None)
        result.speculative.append(timed)
        result.outputs.append(out)
    return result


def verify_cost_curve(target, sizes: list[int], prefix_len: int = 128, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one target pass over a block of b tokens after a cached prefix, per b."""
    prefix = torch.randint(100, 1000, (1, prefix_len), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache()
    with torch.no_grad():
        target(input_ids=prefix, **kv.cache_kwargs(target, cache))
        times: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(repeats):
            for b in sizes:  # sizes interleaved within each repeat, so drift hits them all alike
                block = torch.randint(100, 1000, (1, b))
                start = time.perf_counter()
                with kv.masked_gqa(target.device, b):  # as a tree pass runs
                    target(
                        input_ids=block,
                        attention_mask=block_causal_mask(b, prefix_len),
                        position_ids=torch.arange(prefix_len, prefix_len + b)[None],
                        **kv.cache_kwargs(target, cache),
                    )
                times[b].append(time.perf_counter() - start)
                kv.crop(cache, prefix_len)
    return {b: statistics.median(t) for b, t in times.items()}

