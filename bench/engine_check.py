"""The real-engine check: exported EAGLE-3 heads served by vLLM, against vLLM alone and selfdraft.

On the same prompts (chat-templated token ids), greedy, for each chain depth K:
    vLLM plain           the reference output (and its tok/s);
    vLLM + the heads     speculative_config {"method": "eagle3", "num_speculative_tokens": K}: its output
                         must be vLLM's plain output token for token (fp32), its mean acceptance length
                         comes from vLLM's own spec-decode counters;
    selfdraft chain-K    the same heads as selfdraft runs them (tree `chain-K`, heads in the target's
                         dtype): its tau is the same quantity (tokens per verification, bonus counted).
They run interleaved per prompt (A B C A B C ...), vLLM plain in the first K's round only (its greedy
output does not depend on K; its tok/s are that round's); tok/s are medians over the prompts. selfdraft
runs transformers' forward and vLLM its own kernels, so their greedy texts may part at near-ties; that
is reported (`selfdraft_same_as_vllm`), not asserted.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from selfdraft.bench.prompts import load_prompt_set
from selfdraft.bench.vllm_engine import VllmEngine, require_vllm
from selfdraft.heads.eagle3.export import export_heads
from selfdraft.inference.model import SelfDraftModel
from selfdraft.precision import parse_dtype
from selfdraft.target import load_target, resolve_target_path


@dataclass
class DepthResult:
    k: int
    prompts: int
    identical: int  # prompts whose speculative vLLM output equals plain vLLM's
    vllm_acceptance_length: float | None  # 1 + accepted / drafts over all prompts
    selfdraft_tau: float  # tokens per verification over all prompts
    selfdraft_same_as_vllm: int  # prompts where selfdraft's greedy output equals vLLM's
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # median over prompts, per method


def _rate(runs: list[tuple[int, float]]) -> float:
    return statistics.median(n / s for n, s in runs if s > 0)


def run_check(
    heads: str | Path,
    target: str,
    out_dir: str | Path,
    prompts: str = "sharegpt:8",
    ks: list[int] | tuple[int, ...] = (1, 2, 3, 4, 5),
    max_new_tokens: int = 64,
    dtype: str = "float32",
) -> list[DepthResult]:
    """Export `heads`, then per K run vLLM plain, vLLM + heads and selfdraft chain-K (see module doc)."""
    require_vllm("the vLLM check")
    # export_heads refuses heads of another layout (ExportError, one line) before vLLM starts
    draft_dir = export_heads(heads, Path(out_dir) / "vllm-export", "vllm", target=target)
    model, tokenizer = load_target(target, dtype=parse_dtype(dtype))
    base = SelfDraftModel.with_heads(model, tokenizer, None, tree="chain-0")  # prompt and stop ids only
    stop = base.default_stop_ids()
    ids = [base.prompt_ids(p.text, p.chat) for p in load_prompt_set(prompts)]
    target_dir = resolve_target_path(target)
    plain = VllmEngine(target_dir, dtype)
    plain.generate(ids[0][0].tolist(), 8, stop_token_ids=stop)  # warm-up, not measured
    results, plain_runs = [], {}
    for k in ks:
        spec = VllmEngine(target_dir, dtype, draft_dir, k)
        ours = SelfDraftModel.with_heads(model, tokenizer, str(heads), tree=f"chain-{k}", draft_dtype=dtype)
        spec.generate(ids[0][0].tolist(), 8, stop_token_ids=stop)
        rows = []
        for i, prompt in enumerate(ids):
            if i not in plain_runs:  # greedy and deterministic: one plain run per prompt serves every K
                plain_runs[i] = plain.generate(prompt[0].tolist(), max_new_tokens, stop_token_ids=stop)
            a = plain_runs[i]
            b = spec.generate(prompt[0].tolist(), max_new_tokens, stop_token_ids=stop)
            with torch.no_grad():
                start = time.perf_counter()
                c = ours.generate(prompt, max_new_tokens, stop_token_ids=stop)
                c_seconds = time.perf_counter() - start
            rows.append((a, b, c, c_seconds))
        drafts = sum(b.drafts for _, b, _, _ in rows)
        accepted = sum(b.accepted for _, b, _, _ in rows)
        passes = sum(c.stats.tree_passes for _, _, c, _ in rows)
        produced = sum(c.stats.mean_accepted * c.stats.tree_passes for _, _, c, _ in rows)
        results.append(
            DepthResult(
                k=k,
                prompts=len(rows),
                identical=sum(a.tokens == b.tokens for a, b, _, _ in rows),
                vllm_acceptance_length=1 + accepted / drafts if drafts else None,
                selfdraft_tau=produced / passes if passes else 0.0,
                selfdraft_same_as_vllm=sum(list(c.tokens) == a.tokens for a, _, c, _ in rows),
                tokens_per_s={
                    "vllm": _rate([(len(a.tokens), a.seconds) for a, _, _, _ in rows]),
                    f"vllm+eagle3 K={k}": _rate([(len(b.tokens), b.seconds) for _, b, _, _ in rows]),
                    f"selfdraft chain-{k}": _rate([(len(c.tokens), s) for _, _, c, s in rows]),
                },
            )
        )
        print("check-vllm: " + report_lines(results[-1:])[-1], file=sys.stderr, flush=True)  # progress
        del spec, ours
        gc.collect()
    return results


def report_lines(results: list[DepthResult]) -> list[str]:
    lines = [
        "| K | identical to vLLM (fp32) | vLLM mean acceptance length | selfdraft tau (chain-K) | "
        "selfdraft = vLLM text | tok/s vLLM | tok/s vLLM+eagle3 | tok/s selfdraft |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rates = list(r.tokens_per_s.values())
        mal = f"{r.vllm_acceptance_length:.3f}" if r.vllm_acceptance_length is not None else "-"
        lines.append(
            f"| {r.k} | {r.identical}/{r.prompts} | {mal} | {r.selfdraft_tau:.3f} | "
            f"{r.selfdraft_same_as_vllm}/{r.prompts} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} |"
        )
    return lines


def as_dicts(results: list[DepthResult]) -> list[dict]:
    return [asdict(r) for r in results]
