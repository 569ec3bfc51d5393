"""Steps 03-04 - pictures of a run: who held which row at each step, KV use, latencies.

Reads only what the engines record: a `Trace` (engine.py) and the Results / Stats.summary()
they return. Matplotlib only; every function draws on an Axes it is given or makes one.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap


def _axes(ax, size=(9, 3)):
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    return ax


def timeline(trace, ax=None, title: str = "", n_requests: int | None = None):
    """Rows (or slots) against decode steps, each cell coloured by the request it serves;
    white cells are rows computed for nobody (wasted)."""
    ax = _axes(ax)
    rows = trace.rows
    n_rows = max((len(r) for r in rows), default=0)
    grid = np.full((n_rows, len(rows)), np.nan)
    for step, holders in enumerate(rows):
        for row, rid in enumerate(holders):
            if rid is not None:
                grid[row, step] = rid
    if n_requests is None:
        n_requests = int(np.nanmax(grid)) + 1 if np.isfinite(grid).any() else 1
    n = n_requests
    colours = plt.get_cmap("tab20")(np.arange(20) % 20)
    cmap = ListedColormap(colours[np.arange(n) % 20]).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap,
              vmin=-0.5, vmax=n - 0.5)
    wasted = np.isnan(grid).sum()
    ax.set(xlabel="decode step", ylabel="row / slot",
           title=title or f"{len(rows)} decode steps, {wasted / max(1, grid.size):.0%} of rows wasted")
    ax.set_yticks(range(n_rows))
    return ax


def kv_usage(traces: dict, ax=None):
    """Fraction of the reserved KV cache in use at each decode step, one line per traced run."""
    ax = _axes(ax)
    for name, trace in traces.items():
        ax.plot(trace.kv_used, label=name)
    ax.set(xlabel="decode step", ylabel="KV used / reserved", ylim=(0, 1.02))
    ax.legend()
    return ax


def latencies(runs: dict[str, list], ax=None, what: str = "latency_s"):
    """Cumulative per-request latency (or TTFT, what="ttft_s") of each run: the fraction of
    requests that had their answer (their first token) by each time."""
    ax = _axes(ax, (6, 3.5))
    for name, results in runs.items():
        xs = sorted(getattr(r, what) for r in results)
        ax.plot([0.0] + xs, np.arange(len(xs) + 1) / len(xs), drawstyle="steps-post", label=name)
    label = "TTFT" if what == "ttft_s" else "latency"
    got = "a first token" if what == "ttft_s" else "their last token"
    ax.set(xlabel=f"{label} (s)", ylabel=f"fraction of requests with {got}", ylim=(0, 1.02))
    ax.legend()
    return ax
