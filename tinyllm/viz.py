"""Steps 03-05 - pictures of a run: who held which row at each step, KV use, latencies, and
the paged cache's block pool.

Reads only what the engines record: a `Trace` (stats.py) and the Results / Stats.summary()
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


def block_pool(cache, ax=None, holders: list | None = None, tables: bool = True,
               title: str = "", n_requests: int | None = None, cols: int | None = None):
    """The paged KV cache's pool (05), block by block: each block coloured by the request that
    holds it (holders[s] is slot s's request id, e.g. engine.holders(); default: the slot
    number), free blocks white, and within a block the positions no token fills yet paler.
    Small pools show each block's number; tables=True lists the block tables below."""
    ax = _axes(ax, (5, 3))
    bs, n_blocks = cache.block_size, cache.n_blocks
    cols = cols or min(n_blocks, 8 if n_blocks <= 64 else 32)          # blocks per picture row
    n_rows = -(-n_blocks // cols)
    owner = np.full((n_rows, cols * bs), np.nan)            # one cell per pool position
    filled = np.zeros(owner.shape, dtype=bool)
    keys = {s: holders[s] if holders is not None else s
            for s in range(cache.n_slots) if cache.tables[s]}
    for s, key in keys.items():
        for i, b in enumerate(cache.tables[s]):
            r, c = divmod(b, cols)
            owner[r, c * bs:(c + 1) * bs] = key
            filled[r, c * bs:(c + 1) * bs] = np.arange(i * bs, (i + 1) * bs) < cache.lens[s]
    if n_requests is None:
        n_requests = int(np.nanmax(owner)) + 1 if np.isfinite(owner).any() else 1
    colours = plt.get_cmap("tab20")(np.r_[0:20:2, 1:20:2])  # 10 strong colours, then pale
    cmap = ListedColormap(colours[np.arange(n_requests) % 20]).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(owner), aspect="auto", interpolation="nearest", cmap=cmap,
              vmin=-0.5, vmax=n_requests - 0.5)
    pale = np.zeros(owner.shape + (4,))
    pale[np.isfinite(owner) & ~filled] = (1, 1, 1, 0.6)     # allocated, no token there yet
    ax.imshow(pale, aspect="auto", interpolation="nearest")
    for r in range(n_rows):                                 # block borders
        width = min(cols, n_blocks - r * cols) * bs
        ax.hlines([r - 0.5, r + 0.5], -0.5, width - 0.5, color="0.4", lw=0.8)
        ax.vlines(np.arange(0, width + 1, bs) - 0.5, r - 0.5, r + 0.5, color="0.4", lw=0.8)
    if n_blocks <= 64:
        for b in range(n_blocks):
            ax.text(b % cols * bs + (bs - 1) / 2, b // cols, str(b), ha="center", va="center",
                    fontsize=8)
    ax.set_xticks([])
    ax.set_yticks(range(n_rows), [f"{r * cols}-{min(n_blocks, (r + 1) * cols) - 1}"
                                  for r in range(n_rows)])
    ax.set_ylabel("blocks")
    ax.set_frame_on(False)
    used = n_blocks - cache.allocator.n_free()
    ax.set_title(title or f"{used} of {n_blocks} blocks allocated")
    if tables:
        for i, (s, key) in enumerate(keys.items()):
            y = -0.04 - 0.1 * i
            ax.text(0, y, "■", color=cmap(key), transform=ax.transAxes, va="top", fontsize=11)
            label = f"r{key} (slot {s})" if holders is not None else f"slot {s}"
            ax.text(0.07, y, f"{label}: {cache.tables[s]}", transform=ax.transAxes, va="top",
                    fontsize=8, family="monospace")
    return ax
