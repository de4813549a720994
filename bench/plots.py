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
    return paths

