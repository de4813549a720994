"""A bench report: per-method medians, the Markdown table, the JSON file and the plots on disk."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from selfdraft.bench.divergence import NEAR_TIE_NOTE
from selfdraft.bench.plots import plot

logger = logging.getLogger(__name__)

# the phases of one speculative step, as GenerationStats times them
PHASES = ("draft", "verify", "accept", "compact", "observe", "other")


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
                    for phase in PHASES:
                        key = f"{phase}_ms_per_step"
                        if all(key in v for v in vals):  # reports written before a phase was timed lack it
                            record[key] = statistics.median(v[key] for v in vals)
                    # a plain decode step of the same run: the baseline's seconds per token on these prompts
                    decode = [base[p]["seconds"] / max(1, len(base[p]["tokens"])) for p in mine if p in base]
                    if decode:
                        record["decode_ms_per_token"] = 1000 * statistics.median(decode)
                    record["tree_tokens"] = statistics.median(v["tree_tokens"] for v in vals)
                out.append(record)
    return out


def summarize_batches(rows: list[dict]) -> list[dict]:
    """Per (method, temperature, batch size): median total tokens/s over repeats, the speedup over the
    baseline at the same batch size, and the scaling over the same method at the smallest batch."""
    out = []
    def key(r: dict) -> tuple:
        return r["method"], r["temperature"], r["batch"]

    keys = list(dict.fromkeys(key(r) for r in rows))
    rate = {k: statistics.median(r["tokens"] / r["seconds"] for r in rows if key(r) == k) for k in keys}
    smallest = min(r["batch"] for r in rows)
    for method, t, size in keys:
        base = rate.get(("baseline", t, size))
        first = rate.get((method, t, smallest))
        record = {
            "method": method,
            "temperature": t,
            "batch": size,
            "tokens_per_s": rate[(method, t, size)],
            "speedup": rate[(method, t, size)] / base if base else None,
            "scaling": rate[(method, t, size)] / first if first else None,
        }
        if t == 0.0 and method != "baseline":
            mine = [r for r in rows if key(r) == (method, t, size)]
            theirs = [r for r in rows if key(r) == ("baseline", t, size)]
            pairs = [
                (a, b)
                for m, base_run in zip(mine, theirs, strict=False)
                for a, b in zip(m["row_tokens"], base_run["row_tokens"], strict=True)
            ]
            record["identical_rows"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        out.append(record)
    return out


def batch_lines(report: dict) -> list[str]:
    """The batch section: a table, then one line per method saying where batching stops paying."""
    summary = report.get("batch_summary")
    if not summary:
        return []
    lines = [
        "",
        "Batched generation (total tokens/s of a batch; speedup = over the target's own batched "
        "`generate` with left padding at the same batch size; scaling = over the same method at the "
        "smallest batch; same run, methods interleaved per batch size):",
        "",
        "| method | T | batch | tok/s | speedup | scaling | identical rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        cells = [
            r["method"],
            f"{r['temperature']:g}",
            str(r["batch"]),
            f"{r['tokens_per_s']:.1f}",
            _fmt(r["speedup"], ".2f", "x"),
            _fmt(r["scaling"], ".2f", "x"),
            r.get("identical_rows", "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for method, t in dict.fromkeys((r["method"], r["temperature"]) for r in summary):
        mine = sorted(
            (r for r in summary if (r["method"], r["temperature"]) == (method, t)), key=lambda r: r["batch"]
        )
        lines.append(f"- {method}, T={t:g}: " + _where_batching_stops(method, mine))
    return lines


def _where_batching_stops(method: str, mine: list[dict]) -> str:
    """Where more rows stop adding throughput, and (selfdraft) where it stops beating the baseline."""
    best = max(mine, key=lambda r: r["tokens_per_s"])
    parts = [f"total tok/s peaks at batch {best['batch']} ({best['tokens_per_s']:.1f})"]
    after = [r for r in mine if r["batch"] > best["batch"]]
    if after:
        ratios = ", ".join(f"{r['batch']}: {r['tokens_per_s'] / best['tokens_per_s']:.2f}x of the peak" for r in after)
        parts[-1] += f"; larger batches do not pay ({ratios})"
    elif len(mine) > 1:
        parts[-1] += ", the largest batch measured: batching still pays there"
    if method != "baseline":
        ahead = [r["batch"] for r in mine if r["speedup"] is not None and r["speedup"] > 1.0]
        behind = [r["batch"] for r in mine if r["speedup"] is not None and r["speedup"] <= 1.0]
        if not behind:
            parts.append("faster than the batched baseline at every batch size measured")
        elif not ahead:
            parts.append("not faster than the batched baseline at any batch size measured")
        else:
            parts.append(
                f"faster than the batched baseline at batch {', '.join(map(str, ahead))}, "
                f"not at batch {', '.join(map(str, behind))}"
            )
    return "; ".join(parts) + "."


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
    lines += group_lines(report)
    lines += trees_lines(report)
    lines += phase_lines(report)
    lines += batch_lines(report)
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


def group_lines(report: dict) -> list[str]:
    """Per category (and per turn of a multi-turn set): tau and speedup of each speculative method."""
    rows = [r for r in report.get("group_summary", []) if r["method"] != "baseline"]
    if not rows:
        return []
    lines = [
        "",
        "By category (speedup and tau as above, over the prompts of each category; same runs):",
        "",
        "| prompts / category | method | T | n | tau | speedup | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["prompts"],
            r["method"],
            f"{r['temperature']:g}",
            str(r["n"]),
            _fmt(r.get("tau"), ".2f"),
            _fmt(r["speedup"], ".2f", "x"),
            identical_cell(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def phase_lines(report: dict) -> list[str]:
    """Where one speculative step's time goes, in ms and relative to a plain decode step of the run."""
    rows = [r for r in report["summary"] if "decode_ms_per_token" in r and "accept_ms_per_step" in r]
    if not rows:
        return []
    lines = [
        "",
        "Step phases (median ms per step; step / decode = the whole step over one plain decode step "
        "of the baseline, same run):",
        "",
        "| prompts | method | T | " + " | ".join(PHASES) + " | step / decode |",
        "|---|---|---|" + "---|" * (len(PHASES) + 1),
    ]
    for r in rows:
        phases = [r[f"{phase}_ms_per_step"] for phase in PHASES]
        cells = [r["prompts"], r["method"], f"{r['temperature']:g}", *(f"{v:.1f}" for v in phases)]
        cells.append(f"{sum(phases) / r['decode_ms_per_token']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


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


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench.md").write_text(markdown_table(report))
    try:  # the measurements are on disk already; plots are a view of them
        pngs = plot(report, out_dir)
    except ImportError:
        logger.warning("plots skipped: matplotlib is not installed (pip install 'selfdraft[bench]')")
        pngs = []
    return {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md", **{p.stem: p for p in pngs}}

