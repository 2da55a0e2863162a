"""PNG figures of simulator runs (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _label(run: dict[str, Any]) -> str:
    disaggregated = f" + P/D {run['disaggregated']}" if "disaggregated" in run else ""
    return run["policy"] + (" + kv sharing" if run["kv_sharing"] else "") + disaggregated


def plot_runs(runs: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """One cluster size: hit ratios against the ideal cache, TTFT CDFs, per-replica balance."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0][0]
    labels = [_label(r) for r in runs]
    x = np.arange(len(runs))
    ax.bar(x - 0.2, [r["hit_ratio"] for r in runs], 0.4, label="simulated")
    ax.bar(x + 0.2, [r["ideal_hit_ratio"] for r in runs], 0.4, label="ideal single cache")
    ax.set_xticks(x, labels, rotation=10)
    ax.set_ylabel("prefix cache hit ratio")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("hit ratio")

    ax = axes[0][1]
    for run, label in zip(runs, labels, strict=True):
        values = np.sort(np.asarray(run["_ttfts"]) * 1000.0)
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    ax.set_title("TTFT CDF")

    for ax, key, ylabel in (
        (axes[1][0], "requests", "requests routed"),
        (axes[1][1], "busy_s", "busy seconds"),
    ):
        width = 0.8 / max(1, len(runs))
        for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
            series = run["_per_replica"][key]
            ax.bar(np.arange(len(series)) + i * width, series, width, label=label)
        ax.set_xlabel("replica")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel} per replica")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(runs: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Several cluster sizes: one line per policy for each metric."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(_label(run), []).append(run)
    ideal_drawn = False
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, group) in enumerate(groups.items()):
        group = sorted(group, key=lambda r: r["replicas"])
        n = [r["replicas"] for r in group]
        c = colors[i % len(colors)]
        axes[0][0].plot(n, [r["hit_ratio"] for r in group], "o-", color=c, label=label)
        if not ideal_drawn:
            axes[0][0].plot(
                n, [r["ideal_hit_ratio"] for r in group], "k:", lw=2, label="ideal cache"
            )
            ideal_drawn = True
        # One colour per policy: p50 solid, p99 dashed.
        axes[0][1].plot(n, [r["ttft_ms"]["p50"] for r in group], "o-", color=c, label=label)
        axes[0][1].plot(n, [r["ttft_ms"]["p99"] for r in group], "s--", color=c)
        axes[1][0].plot(n, [r["token_throughput"] for r in group], "o-", color=c, label=label)
        axes[1][1].plot(
            n,
            [r["busy_s_per_replica"]["max_over_mean"] for r in group],
            "o-",
            color=c,
            label=label,
        )
    for ax, ylabel in (
        (axes[0][0], "prefix cache hit ratio"),
        (axes[0][1], "TTFT (ms): p50 solid, p99 dashed"),
        (axes[1][0], "tokens/s (prompt + output)"),
        (axes[1][1], "busy time max / mean"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[0][1].set_yscale("log")
    axes[0][0].set_ylim(0, 1)
    top = max((r["token_throughput"] for r in runs), default=1.0)
    axes[1][0].set_ylim(0, 1.2 * top)
    axes[1][1].set_ylim(bottom=1)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
