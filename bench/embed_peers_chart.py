"""The chart of ``python -m bench.embed_peers --docs``: three panels sharing the systems, texts/s
with 32 one-text callers, texts/s in requests of 32, and p99 at 70% of each system's own max.
Needs matplotlib (the ``peers`` extra, which scripts/bench-embed-peers installs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = (
    ("callers_s", "texts/s, 32 callers x 1 text\n(more is better)"),
    ("chunks_s", "texts/s, requests of 32 texts\n(more is better)"),
    ("open_p99_ms", "p99 ms at 70% of its own max\n(less is better)"),
)


def color(name: str) -> str:
    if name.startswith("queueserve"):
        return "#1b7f79"
    if name.startswith("model"):
        return "#8c8c8c"
    return "#d9822b"


def render(rows: list[tuple[str, dict[str, float]]], path: Path, meta: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "matplotlib is missing: pip install -c constraints.txt -e '.[peers]' "
            "(scripts/bench-embed-peers does)"
        ) from None
    if not rows:
        raise ValueError("no system has figures to chart")
    names = [name.split(" (")[0] for name, _ in rows]
    ys = list(range(len(rows)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.5 * len(rows) + 2.2), sharey=True)
    for ax, (figure, title) in zip(axes, PANELS, strict=True):
        have = [(y, f[figure]) for y, (_, f) in zip(ys, rows, strict=True) if figure in f]
        ax.barh(
            [y for y, _ in have], [v for _, v in have], color=[color(names[y]) for y, _ in have]
        )
        top = max((v for _, v in have), default=1.0)
        for y, v in have:
            ax.text(
                v + top * 0.02, y, f"{v:.0f}" if v >= 100 else f"{v:.1f}", va="center", fontsize=9
            )
        ax.set_xlim(0, top * 1.25)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_yticks(ys, names)
    axes[0].invert_yaxis()
    fig.suptitle(
        "all-MiniLM-L6-v2 on the CPU: one replica, 1 torch thread, batches ≤ 32", fontsize=12
    )
    fig.text(
        0.5,
        0.01,
        f"{meta['date'][:10]}, {meta['cores']} shared cores (load average {meta['loadavg']}); "
        f"median of {meta['rounds']} rounds; regenerate: {meta['command']}",
        ha="center",
        fontsize=8,
        color="#444444",
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
