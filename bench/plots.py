"""Plots of a bench report: verify cost by block size, acceptance by depth, speedup by tree size."""

from __future__ import annotations

from pathlib import Path


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
    paths += plot_groups(report, out_dir, plt)
    return paths


def plot_groups(report: dict, out_dir: Path, plt) -> list[Path]:
    """One figure per prompt set with categories: speedup and tau by category, a bar per speculative
    method and temperature."""
    rows = [r for r in report.get("group_summary", []) if "tau" in r]
    paths = []
    for spec in dict.fromkeys(r["prompts"].split(" / ")[0] for r in rows):
        mine = [r for r in rows if r["prompts"].startswith(spec + " / ")]
        groups = list(dict.fromkeys(r["prompts"].split(" / ", 1)[1] for r in mine))
        series = list(dict.fromkeys((r["method"], r["temperature"]) for r in mine))
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        width = 0.8 / max(1, len(series))
        for n, (method, t) in enumerate(series):
            by_group = {
                r["prompts"].split(" / ", 1)[1]: r for r in mine if (r["method"], r["temperature"]) == (method, t)
            }
            xs = [i + n * width for i, g in enumerate(groups) if g in by_group]
            for ax, key in zip(axes, ("speedup", "tau"), strict=True):
                ys = [by_group[g][key] or 0.0 for g in groups if g in by_group]
                ax.bar(xs, ys, width, label=f"{method} T={t:g}")
        for ax, key in zip(axes, ("speedup vs target generate", "tau (tokens per target pass)"), strict=True):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=45, ha="right")
            ax.set(ylabel=key, title=f"{spec}: {key.split(' ')[0]} by category")
        axes[0].axhline(1.0, color="gray", lw=0.8)
        axes[0].legend(fontsize=6)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in spec)
        paths.append(out_dir / f"by_category_{safe}.png")
        fig.tight_layout()
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths

