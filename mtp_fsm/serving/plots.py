"""Plots of a serving run (requests per lifecycle state over steps), drawn with matplotlib's Agg canvas."""

from __future__ import annotations

import os

from .metrics import STATE_COLUMNS, ServingMetrics

_COLORS = {
    "queued": "#9e9e9e", "waiting": "#ffb74d", "prefilling": "#4fc3f7",
    "decoding": "#1e88e5", "pending": "#3949ab", "starved": "#8e24aa", "preempted": "#e53935", "finished": "#66bb6a",
}


def plot_states(metrics: ServingMetrics, path: str | os.PathLike, title: str = "requests by state") -> None:
    """Stacked area of requests in each state after every retained step (the metrics keep the
    last `max_steps` steps; finished is cumulative over the whole run)."""
    # Figure + Agg canvas directly: no pyplot, so no global backend switch and no GUI.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    history = metrics.state_history()
    steps = [s.step for s in metrics.steps]
    if len(steps) < metrics.num_steps:
        title = f"{title} (last {len(steps)} of {metrics.num_steps} steps)"
    fig = Figure(figsize=(10, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if steps:
        ax.stackplot(
            steps, *[history[name] for name in STATE_COLUMNS],
            labels=list(STATE_COLUMNS), colors=[_COLORS[n] for n in STATE_COLUMNS], alpha=0.9,
        )
        ax.set_xlim(steps[0], max(steps[-1], steps[0] + 1))
    ax.set_xlabel("engine step")
    ax.set_ylabel("requests")
    ax.set_title(title)
    # Outside the axes: the stack fills the whole plot area, a legend inside would hide it.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
