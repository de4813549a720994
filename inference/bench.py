"""`selfdraft bench`: every method side by side, interleaved per prompt, in one run.

Methods: the target's own `generate` (the baseline), transformers prompt-lookup decoding,
transformers assisted generation with a draft model sharing the tokenizer, and selfdraft with any
heads and tree. Speedups are ratios of medians against the baseline of the same run; greedy outputs
are cross-checked for identity with the baseline.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfdraft.inference.benchmark import Timed, run_baseline, run_speculative
from selfdraft.inference.drafting import heads_dtype
from selfdraft.inference.model import SHIPPED, SelfDraftModel, describe_tree
from selfdraft.inference.precision import first_divergence, float32_reference, parse_dtype
from selfdraft.inference.prompts import Prompt, load_prompt_set
from selfdraft.inference.target import load_target


@dataclass
class BenchConfig:
    target: str = "smollm2-135m-instruct"
    prompts: list[str] = field(default_factory=lambda: ["sharegpt:10", "humaneval:10"])
    methods: list[str] = field(default_factory=lambda: ["baseline", "prompt-lookup", "selfdraft:shipped"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = 128
    repeats: int = 1
    threads: int = 2
    dtype: str = "float32"  # the target's (and the baseline's): float32 keeps greedy output identical
    draft_dtype: str = "auto"  # the heads'; see SelfDraftModel.from_pretrained
    seed: int = 0
    verify_curve: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    output_dir: str = "runs/bench"


@dataclass(frozen=True)
class Method:
    label: str
    kind: str  # baseline | prompt-lookup | assisted | selfdraft
    arg: str | None = None  # heads (selfdraft) or draft model (assisted)
    tree: str | None = None


def parse_method(spec: str) -> Method:
    """`baseline`, `prompt-lookup`, `assisted:DRAFT`, `selfdraft:HEADS[:TREE]` (HEADS = shipped|none|DIR)."""
    kind, _, rest = spec.partition(":")
    if kind in ("baseline", "prompt-lookup") and not rest:
        return Method(spec, kind)
    if kind == "assisted" and rest:
        return Method(spec, kind, rest)
    if kind == "selfdraft":
        heads, _, tree = rest.partition(":")
        return Method(spec, kind, heads or SHIPPED, tree or None)
    raise ValueError(
        f"unknown method {spec!r}: baseline, prompt-lookup, assisted:DRAFT, selfdraft:HEADS[:TREE]"
    )


class Runner:
    """Builds each method once over a shared target, then runs it on a prompt."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        # One target serves every method, so they all run the very same weights in the same memory.
        self.target, self.tokenizer = load_target(config.target, dtype=parse_dtype(config.dtype))
        self.base = SelfDraftModel.with_heads(self.target, self.tokenizer, None)  # stop ids, chat template
        self.methods = [parse_method(m) for m in config.methods]
        if not self.methods or self.methods[0].kind != "baseline":
            self.methods.insert(0, Method("baseline", "baseline"))
        self.models: dict[str, SelfDraftModel] = {}
        self.assistants: dict[str, torch.nn.Module] = {}
        for m in self.methods:
            if m.kind == "selfdraft":
                heads = None if m.arg == "none" else m.arg
                self.models[m.label] = SelfDraftModel.with_heads(
                    self.target,
                    self.tokenizer,
                    heads,
                    target_name=config.target,
                    tree=m.tree,
                    draft_dtype=config.draft_dtype,
                )
            elif m.kind == "assisted":
                draft, draft_tok = load_target(m.arg, dtype=parse_dtype(config.dtype))
                if draft_tok.get_vocab() != self.tokenizer.get_vocab():
                    raise ValueError(
                        f"assisted:{m.arg}: the draft model's tokenizer differs from the target's"
                    )
                self.assistants[m.label] = draft

    def ids(self, prompt: Prompt) -> torch.Tensor:
        if prompt.chat:
            return self.base.chat_ids(prompt.text)
        return self.tokenizer(prompt.text, return_tensors="pt").input_ids

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
                "draft_ms_per_step": 1000 * s.draft_time / max(1, s.tree_passes),
                "verify_ms_per_step": 1000 * s.verify_time / max(1, s.tree_passes),
            }
        extra = {}
        if method.kind == "prompt-lookup":
            extra["prompt_lookup_num_tokens"] = 10
        elif method.kind == "assisted":
            extra["assistant_model"] = self.assistants[method.label]
        timed: Timed = run_baseline(self.base, ids, n, generate_kwargs=extra, temperature=temperature)
        return {"tokens": timed.tokens, "seconds": timed.seconds}


def verify_cost_curve(target, sizes: list[int], prefix_len: int = 128, repeats: int = 3) -> dict[int, float]:
    """Median seconds of one target pass over a block of b tokens after a cached prefix, per b."""
    from selfdraft.inference import kv
    from selfdraft.inference.tree import causal_mask

    prefix = torch.randint(100, 1000, (1, prefix_len), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache()
    with torch.no_grad():
        target(input_ids=prefix, **kv.cache_kwargs(target, cache))
        times: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(repeats):
            for b in sizes:  # sizes interleaved within each repeat, so drift hits them all alike
                block = torch.randint(100, 1000, (1, b))
                start = time.perf_counter()
                target(
                    input_ids=block,
                    attention_mask=causal_mask(b, prefix_len),
                    position_ids=torch.arange(prefix_len, prefix_len + b)[None],
                    **kv.cache_kwargs(target, cache),
                )
                times[b].append(time.perf_counter() - start)
                kv.crop(cache, prefix_len)
    return {b: statistics.median(t) for b, t in times.items()}


def run_bench(config: BenchConfig) -> dict:
    torch.set_num_threads(config.threads)
    runner = Runner(config)
    prompts = [p for spec in config.prompts for p in load_prompt_set(spec)]
    sets = {spec: [p.id for p in load_prompt_set(spec)] for spec in config.prompts}
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
        "trees": {label: describe_tree(model.tree) for label, model in runner.models.items()},
        "dtypes": {
            "target": str(runner.target.dtype).removeprefix("torch."),
            **{
                label: str(heads_dtype(model.heads)).removeprefix("torch.")
                for label, model in runner.models.items()
            },
        },
        "runs": rows,
        "verify_cost_seconds": {str(b): t for b, t in curve.items()},
        "summary": summarize(rows, sets),
    }


def mark_divergences(target, rows: list[dict], prompt_ids: dict[str, torch.Tensor]) -> None:
    """Greedy rows whose tokens differ from the baseline's get a "divergence" entry: where they part
    and how far apart the target's logits for the two tokens are there (see precision.Divergence)."""
    base = {
        (r["prompt"], r["repeat"]): r["tokens"]
        for r in rows
        if r["method"] == "baseline" and r["temperature"] == 0.0
    }
    reference = None  # a float32 copy of a low-precision target, made only if something diverged
    for r in rows:
        key = (r["prompt"], r["repeat"])
        if r["temperature"] != 0.0 or r["method"] == "baseline" or key not in base:
            continue
        if base[key] == r["tokens"]:
            continue
        if reference is None:
            reference = float32_reference(target)
        found = first_divergence(target, prompt_ids[r["prompt"]], base[key], r["tokens"], reference)
        if found is not None:
            r["divergence"] = {**asdict(found), "near_tie": found.near_tie}


def summarize(rows: list[dict], sets: dict[str, list[str]]) -> list[dict]:
    """Per (prompt set, method, temperature): medians over prompts of per-prompt medians."""
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    for set_name, ids in sets.items():
        for t in temps:
            base = _per_prompt(rows, "baseline", t, ids)
            for m in methods:
                mine = _per_prompt(rows, m, t, ids)
                if not mine:
                    continue
                speedups = [
                    base[p]["seconds"]
                    / mine[p]["seconds"]
                    * len(mine[p]["tokens"])
                    / max(1, len(base[p]["tokens"]))
                    for p in mine
                    if p in base
                ]
                record = {
                    "prompts": set_name,
                    "method": m,
                    "temperature": t,
                    "n": len(mine),
                    "tokens_per_s": statistics.median(len(v["tokens"]) / v["seconds"] for v in mine.values()),
                    "speedup": statistics.median(speedups) if speedups else None,
                }
                if t == 0.0:
                    same = [p for p in mine if mine[p]["tokens"] == base[p]["tokens"]]
                    record["identical_to_baseline"] = len(same) == len(mine)
                    record["identical_prompts"] = len(same)
                    record["near_tie_prompts"] = sum(
                        1 for p in mine if mine[p].get("divergence", {}).get("near_tie", False)
                    )
                if "tau" in next(iter(mine.values())):
                    vals = list(mine.values())
                    record["tau"] = statistics.mean(v["tau"] for v in vals)
                    depth = max(len(v["per_depth_acceptance"]) for v in vals)
                    record["per_depth_acceptance"] = [
                        statistics.mean(
                            v["per_depth_acceptance"][d] for v in vals if d < len(v["per_depth_acceptance"])
                        )
                        for d in range(depth)
                    ]
                    record["draft_ms_per_step"] = statistics.median(v["draft_ms_per_step"] for v in vals)
                    record["verify_ms_per_step"] = statistics.median(v["verify_ms_per_step"] for v in vals)
                    record["tree_tokens"] = statistics.median(v["tree_tokens"] for v in vals)
                out.append(record)
    return out


def _per_prompt(rows, method, temperature, ids) -> dict[str, dict]:
    """Median-time run of each prompt for one method and temperature."""
    grouped: dict[str, list[dict]] = {}
    for r in rows:
        if r["method"] == method and r["temperature"] == temperature and r["prompt"] in ids:
            grouped.setdefault(r["prompt"], []).append(r)
    return {p: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2] for p, rs in grouped.items()}


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(report: dict) -> str:
    lines = [
        "| prompts | method | T | n | tau | tree tokens | tok/s | speedup | identical | draft ms/step "
        "| verify ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["summary"]:
        cells = [
            r["prompts"],
            r["method"],
            f"{r['temperature']:g}",
            str(r["n"]),
            _fmt(r.get("tau"), ".2f"),
            _fmt(r.get("tree_tokens"), ".1f"),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["speedup"], ".2f", "x"),
            identical_cell(r),
            _fmt(r.get("draft_ms_per_step"), ".0f"),
            _fmt(r.get("verify_ms_per_step"), ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += trees_lines(report)
    curve = report["verify_cost_seconds"]
    one = curve["1"]
    lines += [
        "",
        "Verify cost (one target pass over b tokens, relative to b = 1): "
        + ", ".join(f"{b}: {t / one:.2f}x" for b, t in curve.items()),
    ]
    lines += [
        "",
        "tau = tokens per target pass, bonus/correction token counted. speedup = tokens/s of the "
        "method / tokens/s of the baseline on the same prompt (median over prompts), same run, "
        "methods interleaved per prompt.",
    ]
    lines += dtypes_lines(report)
    lines += ["", NEAR_TIE_NOTE]
    return "\n".join(lines) + "\n"


def dtypes_lines(report: dict) -> list[str]:
    """Markdown lines naming the target's and each method's heads' dtype (empty when not recorded)."""
    dtypes = report.get("dtypes", {})
    if not dtypes:
        return []
    return ["", "dtypes: " + ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items()) + "."]


def trees_lines(report: dict) -> list[str]:
    """Markdown lines naming the tree each selfdraft method used (empty when the report has none)."""
    trees = report.get("trees", {})
    if not trees:
        return []
    return ["", "Trees: " + "; ".join(f"`{label}`: {text}" for label, text in trees.items()) + "."]


NEAR_TIE_NOTE = (
    "identical = greedy tokens equal to the baseline's. k/n (m near-tie): k of n prompts identical; m of "
    "the others part where the target's two logits, computed in float32, are within 2 ulps of its own "
    "dtype: a tie its rounding breaks differently in a 1-token and a many-token forward (bf16). "
    "NO marks a divergence that is not such a tie."
)


def identical_cell(record: dict) -> str:
    """yes | k/n, with how many of the others parted at a near-tie of the target's own logits."""
    if record.get("identical_to_baseline") is None:
        return "-"
    if record["identical_to_baseline"]:
        return "yes"
    if "identical_prompts" not in record:  # a report written before counts were kept
        return "NO"
    cell = f"{record['identical_prompts']}/{record['n']}"
    ties = record.get("near_tie_prompts", 0)
    return (
        cell
        + (f" ({ties} near-tie)" if ties else "")
        + (" NO" if record["identical_prompts"] + ties < record["n"] else "")
    )


def plot(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = report["verify_cost_seconds"]
    one = curve["1"]
    ax.plot([int(b) for b in curve], [t / one for t in curve.values()], marker="o")
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="block size (tokens verified in one pass)",
        ylabel="time / one decode step",
        title="Verify cost on this machine",
    )
    paths.append(out_dir / "verify_cost.png")
    fig.tight_layout()
    fig.savefig(paths[-1])
    plt.close(fig)

    spec = [r for r in report["summary"] if "per_depth_acceptance" in r]
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in spec:
            acc = r["per_depth_acceptance"]
            ax.plot(
                range(1, len(acc) + 1),
                acc,
                marker="o",
                label=f"{r['method']} {r['prompts']} T={r['temperature']:g}",
            )
        ax.set(
            xlabel="depth",
            ylabel="fraction of passes reaching depth",
            title="Acceptance by depth",
            ylim=(0, 1),
        )
        ax.legend(fontsize=6)
        paths.append(out_dir / "acceptance_by_depth.png")
        fig.tight_layout()
        fig.savefig(paths[-1])
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in spec:
            ax.scatter(
                r["tree_tokens"], r["speedup"], label=f"{r['method']} {r['prompts']} T={r['temperature']:g}"
            )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(
            xlabel="tokens verified per pass (tree size)",
            ylabel="speedup vs target generate",
            title="Speedup by tree size",
        )
        ax.legend(fontsize=6)
        paths.append(out_dir / "speedup_by_tree_size.png")
        fig.tight_layout()
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench.md").write_text(markdown_table(report))
    pngs = plot(report, out_dir)
    return {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md", **{p.stem: p for p in pngs}}
