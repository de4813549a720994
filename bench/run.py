"""`selfdraft bench`: every method side by side, interleaved per prompt, in one run.

Methods: the target's own `generate` (the baseline), transformers prompt-lookup decoding,
transformers assisted generation with a draft model sharing the tokenizer, selfdraft with any
heads and tree, and, where vLLM is installed, vLLM on the same target folder (`vllm`) and with
EAGLE-3-layout heads exported for it (`vllm:eagle3[:HEADS[:K]]`, K drafted tokens, default 3).
Speedups are ratios of medians against the baseline of the same run; greedy outputs are cross-checked
for identity with the baseline.

`batch_sizes` (`--batch 1 4 8 16`) adds a throughput section: at each batch size, total tokens/s of
selfdraft's batched `generate` against the target's own batched `generate` (left padding), the
methods interleaved per batch size in the same run.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfdraft.bench.divergence import first_divergence, float32_reference
from selfdraft.bench.prompts import Prompt, load_prompt_set
from selfdraft.bench.report import PHASES, summarize, summarize_batches
from selfdraft.bench.timing import Timed, run_baseline, run_baseline_batch, run_speculative, verify_cost_curve
from selfdraft.bench.vllm_engine import VllmEngine, engine_draft_dir, parse_vllm_method, require_vllm
from selfdraft.errors import UserError
from selfdraft.heads.int8 import heads_precision
from selfdraft.inference.model import SHIPPED, SelfDraftModel, shipped_heads_dir
from selfdraft.precision import AUTO, DTYPES, INT8, dtype_name, parse_dtype
from selfdraft.target import load_target, resolve_target_path
from selfdraft.typed_config import at_least, count


@dataclass
class BenchConfig:
    target: str = "smollm2-135m-instruct"
    prompts: list[str] = field(default_factory=lambda: ["sharegpt:10", "humaneval:10"])
    methods: list[str] = field(default_factory=lambda: ["baseline", "prompt-lookup", "selfdraft:shipped"])
    temperatures: list[float] = at_least(0, lambda: [0.0, 1.0], fix="0 (greedy) or positive temperatures")
    max_new_tokens: int = count(128)
    repeats: int = count(1, fix="N >= 1 timed runs of each prompt")
    threads: int = count(2, fix="N >= 1 threads")
    dtype: str = "float32"  # the target's (and the baseline's): float32 keeps greedy output identical
    draft_dtype: str = "auto"  # the heads'; see SelfDraftModel.from_pretrained
    seed: int = at_least(0, 0)
    verify_curve: list[int] = count(lambda: [1, 2, 4, 8, 16, 32, 64])
    batch_sizes: list[int] = count(list)  # e.g. [1, 4, 8, 16]: the batch section
    output_dir: str = "runs/bench"


@dataclass(frozen=True)
class Method:
    label: str
    kind: str  # baseline | prompt-lookup | assisted | selfdraft | vllm | vllm-eagle3
    arg: str | None = None  # heads (selfdraft, vllm-eagle3; None = shipped) or draft model (assisted)
    tree: str | None = None  # selfdraft's tree; vllm-eagle3: K, the draft length
    draft_dtype: str | None = None  # None: the bench's --draft-dtype


def parse_method(spec: str) -> Method:
    """`baseline`, `prompt-lookup`, `assisted:DRAFT`, `selfdraft:HEADS[:TREE][@DRAFT_DTYPE]` (HEADS =
    shipped|none|DIR; DRAFT_DTYPE as --draft-dtype, e.g. @int8, so two drafting precisions run
    interleaved in one bench)."""
    kind, _, rest = spec.partition(":")
    if kind in ("baseline", "prompt-lookup") and not rest:
        return Method(spec, kind)
    if kind == "assisted" and rest:
        return Method(spec, kind, rest)
    if kind == "selfdraft":
        body, at, draft_dtype = rest.rpartition("@")
        if not at or draft_dtype.lower() not in (AUTO, INT8, *DTYPES):
            body, draft_dtype = rest, None
        heads, _, tree = body.partition(":")
        return Method(spec, kind, heads or SHIPPED, tree or None, draft_dtype)
    if kind == "vllm":
        if not rest:
            return Method(spec, kind)
        heads, k = parse_vllm_method(rest)
        return Method(spec, "vllm-eagle3", heads or SHIPPED, str(k))
    raise UserError(
        f"unknown method {spec!r}: baseline, prompt-lookup, assisted:DRAFT, "
        "selfdraft:HEADS[:TREE][@DRAFT_DTYPE], vllm, vllm:eagle3[:HEADS[:K]]"
    )


class Runner:
    """Builds each method once over a shared target, then runs it on a prompt."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        engine_methods = [m for m in config.methods if m.split(":")[0] == "vllm"]
        if engine_methods:  # before loading anything: vLLM is an optional install
            require_vllm("--methods " + " ".join(engine_methods))
        # One target serves every method, so they all run the very same weights in the same memory.
        self.target, self.tokenizer = load_target(config.target, dtype=parse_dtype(config.dtype))
        # only its stop ids and chat template are used: a tree of the root alone, so no heads are asked for
        self.base = SelfDraftModel.with_heads(self.target, self.tokenizer, None, tree="chain-0")
        self.methods = [parse_method(m) for m in config.methods]
        if not self.methods or self.methods[0].kind != "baseline":
            self.methods.insert(0, Method("baseline", "baseline"))
        self.models: dict[str, SelfDraftModel] = {}
        self.assistants: dict[str, torch.nn.Module] = {}
        self._conversations: dict[tuple[str, ...], torch.Tensor] = {}  # multi-turn prompts, built once
        self.engines = self._vllm_engines()
        for m in self.methods:
            if m.kind == "selfdraft":
                heads = None if m.arg == "none" else m.arg
                self.models[m.label] = SelfDraftModel.with_heads(
                    self.target,
                    self.tokenizer,
                    heads,
                    target_name=config.target,
                    tree=m.tree,
                    draft_dtype=m.draft_dtype or config.draft_dtype,
                )
            elif m.kind == "assisted":
                draft, draft_tok = load_target(m.arg, dtype=parse_dtype(config.dtype))
                if draft_tok.get_vocab() != self.tokenizer.get_vocab():
                    raise UserError(
                        f"assisted:{m.arg}: the draft model's tokenizer differs from the target's"
                    )
                self.assistants[m.label] = draft

    def _vllm_engines(self) -> dict:
        """One vLLM engine per vllm method, over the target's folder (checked first: vLLM may be absent)."""
        wanted = [m for m in self.methods if m.kind.startswith("vllm")]
        if not wanted:
            return {}
        target_dir = resolve_target_path(self.config.target)
        engines = {}
        for m in wanted:
            draft = None
            if m.kind == "vllm-eagle3":
                heads = shipped_heads_dir(self.config.target) if m.arg == SHIPPED else m.arg
                if heads is None:
                    raise UserError(f"{m.label}: no heads are shipped for {self.config.target}; name HEADS")
                out = Path(self.config.output_dir) / "vllm-drafts" / str(len(engines))
                draft = engine_draft_dir(heads, self.config.target, out)
            engines[m.label] = VllmEngine(target_dir, self.config.dtype, draft, int(m.tree or 3))
        return engines

    def ids(self, prompt: Prompt) -> torch.Tensor:
        if not prompt.history:
            return self.base.prompt_ids(prompt.text, prompt.chat)
        key = (*prompt.history, prompt.text)
        if key not in self._conversations:
            self._conversations[key] = self.conversation_ids(prompt.history, prompt.text)
        return self._conversations[key]

    def conversation_ids(self, history: tuple[str, ...], question: str) -> torch.Tensor:
        """[1, T]: the chat so far, each earlier user turn answered by the target's own greedy
        `generate` (the same budget as the bench), then `question` as the next user turn (Spec-Bench's
        multi-turn MT-bench). Every method then gets the very same prompt."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.config.target} has no chat template: multi-turn prompts need one")
        messages: list[dict] = []
        for turn in history:
            messages.append({"role": "user", "content": turn})
            ids = self._template_ids(messages)
            answer = run_baseline(self.base, ids, self.config.max_new_tokens).tokens
            text = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
            messages.append({"role": "assistant", "content": text})
        return self._template_ids([*messages, {"role": "user", "content": question}])

    def _template_ids(self, messages: list[dict]) -> torch.Tensor:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    @torch.no_grad()
    def run(
        self,
        method: Method,
        ids: torch.Tensor,
        temperature: float,
        seed: int,
        max_new_tokens: int | None = None,
    ) -> dict:
        n = max_new_tokens or self.config.max_new_tokens
        torch.manual_seed(seed)
        if method.kind == "selfdraft":
            timed, out = run_speculative(
                self.models[method.label], ids, n, temperature=temperature, seed=seed
            )
            s = out.stats
            return {
                "tokens": timed.tokens,
                "seconds": timed.seconds,
                "tau": s.mean_accepted,
                "per_depth_acceptance": s.per_depth_acceptance,
                "tree_passes": s.tree_passes,
                "tree_tokens": s.tree_tokens / max(1, s.tree_passes),
                **{
                    f"{phase}_ms_per_step": 1000 * getattr(s, f"{phase}_time") / max(1, s.tree_passes)
                    for phase in PHASES
                },
            }
        if method.kind.startswith("vllm"):
            stop = self.base.default_stop_ids()
            r = self.engines[method.label].generate(ids[0].tolist(), n, temperature, seed, stop)
            if method.kind == "vllm":
                return {"tokens": r.tokens, "seconds": r.seconds}
            return {  # the columns selfdraft rows have: K drafted + 1 verified token per pass
                "tokens": r.tokens,
                "seconds": r.seconds,
                "tau": r.mean_acceptance_length or 1.0,
                "per_depth_acceptance": r.per_depth_acceptance,
                "tree_passes": r.drafts,
                "tree_tokens": int(method.tree or 3) + 1,
            }
        extra = {}
        if method.kind == "prompt-lookup":
            extra["prompt_lookup_num_tokens"] = 10
        elif method.kind == "assisted":
            extra["assistant_model"] = self.assistants[method.label]
        timed: Timed = run_baseline(self.base, ids, n, generate_kwargs=extra, temperature=temperature)
        return {"tokens": timed.tokens, "seconds": timed.seconds}


def tree_text(model: SelfDraftModel, temperatures: Sequence[float]) -> str:
    """The tree a model drafts in the runs at `temperatures`: a tree file gives T > 0 its own
    `sampling:` tree, and a report that named only the greedy one would misdescribe the T = 1 rows."""
    greedy, sampled = model.tree.describe(), model.sampling_tree.describe()
    if sampled == greedy or not any(t > 0 for t in temperatures):
        return greedy
    if not any(t == 0 for t in temperatures):
        return sampled
    return f"{greedy} at T = 0, {sampled} at T > 0"


def run_bench(config: BenchConfig) -> dict:
    torch.set_num_threads(config.threads)
    # the prompt sets first: a bad or empty one is refused before any model loads
    loaded = {spec: load_prompt_set(spec) for spec in config.prompts}
    prompts = [p for spec in config.prompts for p in loaded[spec]]
    sets = {spec: [p.id for p in ps] for spec, ps in loaded.items()}
    runner = Runner(config)
    warm = runner.ids(Prompt("warmup", "Hello!", True))
    for m in runner.methods:  # warm-up: one short run of every method, not measured
        runner.run(m, warm, 0.0, config.seed, max_new_tokens=min(16, config.max_new_tokens))
    rows = []
    total = len(prompts) * len(config.temperatures) * config.repeats * len(runner.methods)
    with tqdm(total=total, desc="bench", unit="run") as bar:
        for prompt in prompts:
            ids = runner.ids(prompt)
            for temperature in config.temperatures:
                for r in range(config.repeats):
                    for m in runner.methods:  # interleaved: A B C A B C ...
                        result = runner.run(m, ids, temperature, config.seed + r)
                        rows.append(
                            {
                                "prompt": prompt.id,
                                "method": m.label,
                                "temperature": temperature,
                                "repeat": r,
                                **result,
                            }
                        )
                        bar.update(1)
    mark_divergences(runner.target, rows, {p.id: runner.ids(p) for p in prompts})
    batch_rows = run_batches(runner, prompts, config) if config.batch_sizes else []
    curve = verify_cost_curve(runner.target, config.verify_curve)
    return {
        "config": asdict(config),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
        },
        "prompt_sets": sets,
        "trees": {label: tree_text(model, config.temperatures) for label, model in runner.models.items()},
        "dtypes": {
            "target": dtype_name(runner.target.dtype),
            **{label: heads_precision(model.heads) for label, model in runner.models.items()},
        },
        "runs": rows,
        "verify_cost_seconds": {str(b): t for b, t in curve.items()},
        "summary": summarize(rows, sets),
        **({"group_summary": summarize(rows, groups)} if (groups := prompt_groups(loaded)) else {}),
        **({"batch_runs": batch_rows, "batch_summary": summarize_batches(batch_rows)} if batch_rows else {}),
    }


def prompt_groups(loaded: dict[str, list[Prompt]]) -> dict[str, list[str]]:
    """The prompts of each category (and, in multi-turn sets, each turn) of every set that has them,
    named "SET / category" and "SET / turn N": the report's per-category rows."""
    out: dict[str, list[str]] = {}
    for spec, prompts in loaded.items():
        for p in prompts:
            if p.category is not None:
                out.setdefault(f"{spec} / {p.category}", []).append(p.id)
        if any(p.history for p in prompts):
            for p in prompts:
                out.setdefault(f"{spec} / turn {p.turn}", []).append(p.id)
    return out


BATCHED_KINDS = ("baseline", "selfdraft")  # transformers' prompt lookup / assisted generation take one row


def run_batches(runner: Runner, prompts: list[Prompt], config: BenchConfig) -> list[dict]:
    """Every batch size: baseline and selfdraft methods interleaved (B1: A B C, B4: A B C, ...).

    A batch of b takes the prompts in order, cycling when b exceeds their number."""
    if any(size < 1 for size in config.batch_sizes):
        raise UserError(f"batch sizes must be >= 1, got {config.batch_sizes}")
    ids = [runner.ids(p)[0] for p in prompts]
    methods = [m for m in runner.methods if m.kind in BATCHED_KINDS]

    def once(
        m: Method, batch: list[torch.Tensor], temperature: float, seed: int, n: int
    ) -> tuple[list, float]:
        torch.manual_seed(seed)
        if m.kind == "baseline":
            return run_baseline_batch(runner.base, batch, n, temperature=temperature)
        start = time.perf_counter()
        outs = runner.models[m.label].generate(batch, n, temperature=temperature, seed=seed)
        return [o.tokens for o in outs], time.perf_counter() - start

    for m in methods:  # warm-up at a small batch, not measured
        once(m, ids[:2], 0.0, config.seed, min(8, config.max_new_tokens))
    rows = []
    total = len(config.temperatures) * config.repeats * len(config.batch_sizes) * len(methods)
    with tqdm(total=total, desc="bench batches", unit="run") as bar:
        for temperature in config.temperatures:
            for r in range(config.repeats):
                for size in config.batch_sizes:
                    batch = [ids[i % len(ids)] for i in range(size)]
                    for m in methods:  # interleaved per batch size
                        tokens, seconds = once(m, batch, temperature, config.seed + r, config.max_new_tokens)
                        rows.append(
                            {
                                "method": m.label,
                                "batch": size,
                                "temperature": temperature,
                                "repeat": r,
                                "tokens": sum(len(t) for t in tokens),
                                "seconds": seconds,
                                "row_tokens": tokens,
                            }
                        )
                        bar.update(1)
    return rows


def mark_divergences(target, rows: list[dict], prompt_ids: dict[str, torch.Tensor]) -> None:
    """Greedy rows whose tokens differ from the baseline's get a "divergence" entry: where they part
    and how far apart the target's logits for the two tokens are there (see precision.Divergence)."""
    base = {
        (r["prompt"], r["repeat"]): r["tokens"]
        for r in rows
        if r["method"] == "baseline" and r["temperature"] == 0.0
    }
    parted = [
        r
        for r in rows
        if r["temperature"] == 0.0
        and r["method"] != "baseline"
        and (r["prompt"], r["repeat"]) in base
        and base[(r["prompt"], r["repeat"])] != r["tokens"]
    ]
    if not parted:
        return
    # a float32 copy of a low-precision target; each check runs forwards at a dozen block sizes, so
    # a bf16 run of 80 prompts spends minutes here
    reference = float32_reference(target)
    for r in tqdm(parted, desc="checking divergences", unit="run"):
        tokens = base[(r["prompt"], r["repeat"])]
        found = first_divergence(target, prompt_ids[r["prompt"]], tokens, r["tokens"], reference)
        if found is not None:
            r["divergence"] = {**asdict(found), "near_tie": found.near_tie}
