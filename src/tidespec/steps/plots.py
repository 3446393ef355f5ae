"""PNG plots logged with each cycle's MLflow run (matplotlib, Agg backend: no display needed).

Each function returns a matplotlib Figure; the caller logs it (`registry.log_figures`) and closes it.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator, ScalarFormatter


def tau_over_cycles(history: list[dict]):
    """Candidate τ per cycle (x: model version), promoted ones filled, with the champion's τ on
    the same holdout and 1.0 (no speculation). history rows: {version, acceptance_length,
    baseline_acceptance_length | None, decision}, oldest first (`registry.cycle_history`)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [int(h["version"]) for h in history]
    ax.plot(xs, [h["acceptance_length"] for h in history], "-", color="tab:blue", lw=1, label="candidate τ")
    prom = [h for h in history if h.get("decision") in ("promoted", "restored")]
    ax.scatter([int(h["version"]) for h in prom], [h["acceptance_length"] for h in prom], color="tab:blue",
               zorder=3, label="promoted")
    rej = [h for h in history if h not in prom]
    ax.scatter([int(h["version"]) for h in rej], [h["acceptance_length"] for h in rej], facecolors="none",
               edgecolors="tab:blue", zorder=3, label="not promoted")
    base = [(int(h["version"]), h["baseline_acceptance_length"]) for h in history
            if h.get("baseline_acceptance_length") is not None]
    if base:
        ax.plot(*zip(*base), "x--", color="tab:orange", lw=1, label="champion τ (same holdout)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="model version (cycle)", ylabel="acceptance length τ", title="τ over cycles")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def per_position(candidate: list[float], champion: list[float] | None = None):
    """Per-position acceptance (share of drafts whose i-th token was accepted), candidate vs
    champion, bars per draft position i = 1..k."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    w = 0.4 if champion else 0.8
    xs = list(range(1, len(candidate) + 1))
    ax.bar([x - (w / 2 if champion else 0) for x in xs], candidate, w, label="candidate")
    if champion:
        ax.bar([x + w / 2 for x in range(1, len(champion) + 1)], champion, w, label="champion")
    ax.set(xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1), title="per-position acceptance")
    ax.set_xticks(xs)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def loss(losses: list[float]):
    """Training loss per epoch (Σ_j decay^j · L_j over TTT steps)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, "o-")
    ax.set(xlabel="epoch", ylabel="train/loss", title="training loss")
    fig.tight_layout()
    return fig


def tokens_per_s_by_concurrency(data: dict):
    """Tokens/s by concurrency, one panel per workload, one line per method.
    data: {workload: {method: [(concurrency, tokens/s)]}} (`bench.engine.by_concurrency`)."""
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.6), squeeze=False)
    for ax, (w, per) in zip(axes[0], data.items()):
        for name, pts in per.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, "o-" if name != "tidespec_no_spec" else "k--", lw=1.2, ms=3,
                    label=name.replace("tidespec_", ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c for pts in per.values() for c, _ in pts}))
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
        ax.set(xlabel="concurrency (clients)", ylabel="tokens/s", title=w)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig
