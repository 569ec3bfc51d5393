"""Steps 03-05 - pictures of a run: who held which row at each step, KV use, latencies (in
seconds and in steps), the scheduler's queue and slots, the paged cache's block pool and
a block table's slot mapping; step 14's split of a layer over ranks (`tp_layer`); and step 04's
interactive slot stepper.

Reads only what the engines record: a `Trace` (stats.py), the Results / Stats.summary() they
return, and the state a cache or scheduler shows (tp_layer: the shapes of a model's shards).
Every drawing function draws on an Axes it is given or makes one (matplotlib); `SlotStepper` is
the one widget (ipywidgets, imported when it is first shown).
"""

import html

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

# per request: 10 strong colours, then 10 pale ones (block_pool, queue_and_slots, table_map)
COLOURS = plt.get_cmap("tab20")(np.r_[0:20:2, 1:20:2])


def _axes(ax, size=(9, 3)):
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    return ax


def timeline(trace, ax=None, title: str = "", n_requests: int | None = None):
    """Rows (or slots) against the trace's steps (static batching's decode steps, the continuous
    engine's every step), each cell coloured by the request it serves; white cells are rows
    computed for nobody (wasted)."""
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
    ax.set(xlabel="step", ylabel="row / slot",
           title=title or f"{len(rows)} steps, {wasted / max(1, grid.size):.0%} of rows wasted")
    ax.set_yticks(range(n_rows))
    return ax


def kv_usage(traces: dict, ax=None):
    """Fraction of the reserved KV cache in use at each traced step, one line per traced run."""
    ax = _axes(ax)
    for name, trace in traces.items():
        ax.plot(trace.kv_used, label=name)
    ax.set(xlabel="step", ylabel="KV used / reserved", ylim=(0, 1.02))
    ax.legend()
    return ax


def step_times(trace, n_requests: int) -> tuple[list[int], list[int]]:
    """Each request's TTFT and latency in steps, a clock the machine does not change, read from
    the Trace of a run whose requests all arrived at its start (ids 0..n_requests-1): the steps
    run when it had its first token, and its last (from the last step it holds a row in). The
    continuous engine's trace holds every step (trace.computed says what each row computed): a
    request's first token comes from the step that prefills it, the first it holds a slot in.
    Static batching's holds only its decode steps: a request's first token comes from its
    batch's prefill, just before the first decode step it holds a row in, so its TTFT counts
    the steps before that one. None may be preempted (a preempted request's last token may come
    from the prefill that brings it back) or prefilled in chunks (07), and in static batching
    every request must decode at least once."""
    every_step = any(c is not None for c in trace.computed)        # the continuous engine's
    first, last = [None] * n_requests, [None] * n_requests
    for step, holders in enumerate(trace.rows):
        for row, rid in enumerate(holders):
            if rid is None:
                continue
            if last[rid] is not None and last[rid] != step:
                raise ValueError(f"request {rid} left its row at step {last[rid]} and came back at "
                                 f"step {step} (preempted): the trace cannot say when it ended")
            if every_step and first[rid] == step - 1 and trace.computed[step][row] != 1:
                raise ValueError(f"request {rid} computed {trace.computed[step][row]} tokens in "
                                 f"its second step (prefilled in chunks): the trace cannot say "
                                 f"when its first token came")
            first[rid] = step if first[rid] is None else first[rid]
            last[rid] = step + 1
    missing = [rid for rid in range(n_requests) if first[rid] is None]
    if missing:
        raise ValueError(f"requests {missing} never held a row: the trace cannot say when they ran")
    return [f + every_step for f in first], last


def latencies(runs: dict[str, list], ax=None, what: str = "latency_s"):
    """Cumulative per-request latency (or TTFT) of each run: the fraction of requests that had
    their last token (their first) by each time. runs maps a name to its Results, read in
    seconds (what: "latency_s" or "ttft_s"), or to one number per request in steps
    (what: "latency_steps" or "ttft_steps", e.g. from step_times)."""
    ax = _axes(ax, (6, 3.5))
    for name, values in runs.items():
        xs = sorted(v if isinstance(v, (int, float)) else getattr(v, what) for v in values)
        ax.plot([0] + xs, np.arange(len(xs) + 1) / len(xs), drawstyle="steps-post", label=name)
    label = "TTFT" if what.startswith("ttft") else "latency"
    got = "a first token" if what.startswith("ttft") else "their last token"
    unit = "steps" if what.endswith("_steps") else "s"
    ax.set(xlabel=f"{label} ({unit})", ylabel=f"fraction of requests with {got}", ylim=(0, 1.02))
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
    cmap = ListedColormap(COLOURS[np.arange(n_requests) % 20]).with_extremes(bad="white")
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


def _box(ax, x, y, text, colour, marked=False):
    ax.add_patch(Rectangle((x, y), 0.9, 0.8, facecolor=colour, edgecolor="k" if marked else "0.4",
                           lw=2.5 if marked else 0.8))
    ax.text(x + 0.45, y + 0.4, text, ha="center", va="center", fontsize=9)


def queue_and_slots(holders: list, waiting: list, ax=None, title: str = "", mark=()):
    """The scheduler's state (04, 05) as boxes: each slot with the request it holds (r3; white:
    free), then the waiting queue in order, first in line on the left. Requests in `mark` (those
    just admitted, or preempted) get a thick border. Colours per request as in block_pool."""
    ax = _axes(ax, (7, 1.3))
    S, q0 = len(holders), len(holders) + 1
    for s, rid in enumerate(holders):
        colour = "white" if rid is None else COLOURS[rid % 20]
        _box(ax, s, 0, "free" if rid is None else f"r{rid}", colour,
             rid is not None and rid in mark)
        ax.text(s + 0.45, -0.1, f"slot {s}", ha="center", va="top", fontsize=8)
    for i, rid in enumerate(waiting):
        _box(ax, q0 + i, 0, f"r{rid}", COLOURS[rid % 20], rid in mark)
    ax.text(q0, -0.1, "waiting, first in line on the left" if waiting else "nobody waiting",
            ha="left", va="top", fontsize=8)
    ax.axvline(S + 0.45, color="0.6", ls=":")
    ax.set(xlim=(-0.1, q0 + max(len(waiting), 5)), ylim=(-0.5, 0.9))
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    return ax


def table_map(table: list[int], n_tokens: int, block_size: int, n_blocks: int, ax=None):
    """Step 05's slot mapping as a picture: a sequence's positions 0..n_tokens-1 (top), in
    blocks of block_size, each joined to the pool row it lives in (bottom: the pool's n_blocks
    blocks of block_size rows), through the block table: position p lives in row
    table[p // block_size] * block_size + p % block_size. One colour per entry of the table."""
    ax = _axes(ax, (max(6.0, 0.22 * n_blocks * block_size), 2.6))
    small = 7 if n_blocks * block_size <= 64 else 5
    for p in range(n_tokens):
        i = p // block_size
        row = table[i] * block_size + p % block_size
        ax.add_patch(Rectangle((p, 2), 1, 0.6, facecolor=COLOURS[i % 20], edgecolor="0.4", lw=0.6))
        ax.text(p + 0.5, 2.3, str(p), ha="center", va="center", fontsize=small)
        ax.plot([p + 0.5, row + 0.5], [2, 0.6], color=COLOURS[i % 20], lw=1)
    for i, b in enumerate(table):
        if i * block_size < n_tokens:
            ax.text(i * block_size + block_size / 2, 2.7, f"table[{i}] = {b}", ha="center",
                    va="bottom", fontsize=8)
    owner = {b: i for i, b in enumerate(table)}
    for r in range(n_blocks * block_size):
        b = r // block_size
        colour = COLOURS[owner[b] % 20] if b in owner else "white"
        ax.add_patch(Rectangle((r, 0), 1, 0.6, facecolor=colour, edgecolor="0.75", lw=0.4))
        ax.text(r + 0.5, 0.3, str(r), ha="center", va="center", fontsize=small - 1)
    for b in range(n_blocks):
        ax.add_patch(Rectangle((b * block_size, 0), block_size, 0.6, fill=False, edgecolor="0.3",
                               lw=1))
        ax.text(b * block_size + block_size / 2, -0.1, f"block {b}", ha="center", va="top",
                fontsize=7)
    ax.text(-0.5, 2.3, "position", ha="right", va="center", fontsize=9)
    ax.text(-0.5, 0.3, "pool row", ha="right", va="center", fontsize=9)
    ax.set(xlim=(-0.2, max(n_tokens, n_blocks * block_size) + 0.2), ylim=(-0.6, 3.1))
    ax.axis("off")
    return ax


class SlotStepper:
    """Step 04's interactive view of a ContinuousEngine: buttons that run it one step, 10 steps
    or to the end, and add a request; under them, which request each slot holds with its text
    so far, the queue, and the last requests to finish. new_request(i) makes the i-th request to
    add; decode turns token ids into text. run(n) and add() drive it from code too.

    The last expression of a cell, it shows as one live widget; a frontend without widgets (a
    saved notebook read as text) shows the same view as text, as it was when the cell ran.
    While the engine works, the buttons are disabled and the view updates after every step."""

    def __init__(self, engine, new_request, decode, width: int = 90):
        self.engine, self.new_request, self.decode, self.width = engine, new_request, decode, width
        self.texts: dict[int, list[int]] = {}          # request id -> prompt + tokens so far
        self.finished: list[int] = []                  # request ids, in the order they finished
        self.steps = 0
        self._ui = None

    def add(self) -> int:
        """Queue one more request (new_request(i)); returns its id."""
        req = self.new_request(len(self.texts))
        rid = self.engine.add_request(req)
        self.texts[rid] = list(req.prompt)
        self._show()
        return rid

    def run(self, n: int) -> None:
        """Run n steps, or until the engine has no work left."""
        for _ in range(n):
            if not self.engine.has_work():
                break
            self.steps += 1
            for ev in self.engine.step():              # Event(rid, token, done)
                self.texts[ev.rid].append(ev.token)
                if ev.done:
                    self.finished.append(ev.rid)
            self._show()

    def text(self) -> str:
        waiting, active = self.engine.request_counts()
        lines = [f"step {self.steps}: {waiting} waiting, {active} of {self.engine.config.n_slots} "
                 f"slots decoding, {len(self.finished)} finished"]
        for s, rid in enumerate(self.engine.holders()):  # the request each slot holds (None: free)
            lines.append(f"slot {s}: " + ("free" if rid is None
                                          else f"r{rid:<3} {self._line(rid)}"))
        for rid in self.finished[-3:][::-1]:
            lines.append(f"done    r{rid:<3} {self._line(rid)}")
        return "\n".join(lines)

    def _line(self, rid: int) -> str:
        text = self.decode(self.texts[rid]).replace("\n", "↵ ")
        return text if len(text) <= self.width else "…" + text[-self.width:]

    # ---- the widget -----------------------------------------------------------------------
    def widget(self):
        if self._ui is None:
            import ipywidgets as widgets
            self._view, self._status = widgets.HTML(), widgets.Label()
            self._buttons = [self._button(widgets, label, fn) for label, fn in (
                ("step", lambda: self.run(1)), ("10 steps", lambda: self.run(10)),
                ("run to the end", lambda: self.run(10**6)), ("add a request", self.add))]
            self._ui = widgets.VBox([widgets.HBox(self._buttons + [self._status]), self._view])
            self._show()
        return self._ui

    def _button(self, widgets, label: str, fn):
        button = widgets.Button(description=label)
        button.on_click(lambda _: self._busy(label, fn))
        return button

    def _busy(self, label: str, fn) -> None:
        """Run fn with the buttons disabled and a 'running…' label, whatever happens."""
        for b in self._buttons:
            b.disabled = True
        self._status.value = f"{label}: running…"
        try:
            fn()
        finally:
            for b in self._buttons:
                b.disabled = False
            self._status.value = "" if self.engine.has_work() else "no work left: add a request"

    def _show(self) -> None:
        if self._ui is not None:
            self._view.value = "<pre>" + html.escape(self.text()) + "</pre>"

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget()._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = self.text()              # what a frontend without widgets shows
        return bundle


# ---- 08: prefix caching
def prefix_pool(cache, ax=None, holders: list | None = None, title: str = "",
                cols: int | None = None, tables: bool = True, legend: bool = True):
    """Step 08's pool with a prefix cache (cache.prefix), one box per block, its number on
    top: a block that tables hold is coloured by their requests (side by side when several
    share it, with a thick border; holders[s] is slot s's request id, e.g. engine.holders();
    default: the slot number) and shows its reference count; a block named by the prefix it
    holds shows its name's first 4 hex digits; a cached block nobody holds is grey and dashed,
    with its place in the eviction order (1: the least recently used, the next to go); a free
    block is white. tables=True lists the block tables below, legend=True says what grey and
    white mean. Colours per request as in block_pool."""
    from matplotlib.patches import Patch
    pc, n_blocks = cache.prefix, cache.n_blocks
    cols = cols or min(n_blocks, 10)
    n_rows = -(-n_blocks // cols)
    ax = _axes(ax, (0.6 * cols + 0.5, 0.6 * n_rows + 1.5))
    keys = {s: holders[s] if holders is not None else s
            for s in range(cache.n_slots) if cache.tables[s]}
    held_by = {b: [] for b in range(n_blocks)}
    for s, key in keys.items():
        for b in cache.tables[s]:
            held_by[b].append(key)
    order = {b: i + 1 for i, b in enumerate(pc.evictable)}             # 1: evicted next
    for b in range(n_blocks):
        x, y = b % cols, -(b // cols)
        who = held_by[b]
        for i, key in enumerate(who):                                   # one stripe per holder
            w = 0.9 / len(who)
            ax.add_patch(Rectangle((x + i * w, y), w, 0.8, facecolor=COLOURS[key % 20], lw=0))
        cached = b in order
        ax.add_patch(Rectangle((x, y), 0.9, 0.8, facecolor="0.85" if cached else "none",
                               edgecolor="k" if len(who) > 1 else "0.4",
                               lw=2 if len(who) > 1 else 0.8, ls="--" if cached else "-"))
        ax.text(x + 0.45, y + 0.66, str(b), ha="center", va="center", fontsize=9, weight="bold")
        if b in pc.hash_of:
            ax.text(x + 0.45, y + 0.41, pc.hash_of[b].hex()[:4], ha="center", va="center",
                    fontsize=7, family="monospace")
        note = f"refs {pc.refs[b]}" if who else f"evict {order[b]}" if cached else ""
        ax.text(x + 0.45, y + 0.15, note, ha="center", va="center", fontsize=7)
    ax.set(xlim=(-0.1, cols), ylim=(-n_rows + 0.9, 0.9))
    ax.set_aspect("equal")
    ax.axis("off")
    held = sum(1 for b in held_by if held_by[b])
    ax.set_title(title or f"{held} blocks held, {len(order)} cached (refs 0), "
                          f"{cache.allocator.n_free()} free", fontsize=10)
    if tables:
        for i, (s, key) in enumerate(keys.items()):
            y = -0.04 - 0.11 * i
            ax.text(0, y, "■", color=COLOURS[key % 20], transform=ax.transAxes, va="top",
                    fontsize=11)
            label = f"r{key} (slot {s})" if holders is not None else f"slot {s}"
            ax.text(0.06, y, f"{label}: {cache.tables[s]}", transform=ax.transAxes, va="top",
                    fontsize=8, family="monospace")
    if legend:
        ax.legend(handles=[Patch(facecolor="0.85", edgecolor="k", ls="--", label="cached, refs 0"),
                           Patch(facecolor="white", edgecolor="0.4", label="free")],
                  loc="upper right", bbox_to_anchor=(1, 0), fontsize=8, frameon=False)
    return ax


# ---- 07: chunked prefill

def decode_cells(trace) -> list[list[bool]]:
    """Which cells of a Trace were decodes: is_decode[step][row]. While a slot holds a request,
    its last run of one-token steps is its decodes: a decode never waits for the budget, and
    only decodes follow the chunk that ends a context. Every other step that computed
    something was a prompt chunk, of one token or more."""
    is_decode = [[False] * len(r) for r in trace.rows]
    for step in reversed(range(len(trace.rows))):
        for row, rid in enumerate(trace.rows[step]):
            if rid is None:
                continue
            n = trace.computed[step][row] if trace.computed[step] is not None else 1
            stays = (step + 1 < len(trace.rows) and row < len(trace.rows[step + 1])
                     and trace.rows[step + 1][row] == rid)       # the same request, next step
            is_decode[step][row] = n == 1 and (not stays or is_decode[step + 1][row])
    return is_decode


def chunk_timeline(trace, ax=None, step_s: list[float] | None = None, title: str = "",
                   legend: bool = True):
    """Step 07's picture of a run: slots against steps, each cell coloured by the request the
    slot holds and drawn by what it computed (trace.computed): a decode, one token (pale); a
    chunk of its context (strong, its size written in it where it fits); nothing, a context
    that waits for the budget (hatched). step_s, each step's duration in seconds, makes the x
    axis time (ms), each step as wide as it took; without it the x axis counts steps."""
    ax = _axes(ax)
    n_rows = max((len(r) for r in trace.rows), default=0)
    widths = [1.0] * len(trace.rows) if step_s is None else [1e3 * s for s in step_s]
    lo = -0.5 if step_s is None else 0.0
    starts = lo + np.r_[0.0, np.cumsum(widths)[:-1]]
    total = float(sum(widths))
    is_decode = decode_cells(trace)
    for step, holders in enumerate(trace.rows):
        x, w = starts[step], widths[step]
        for row, rid in enumerate(holders):
            if rid is None:
                continue
            n = trace.computed[step][row] if trace.computed[step] is not None else 1
            colour = COLOURS[rid % 20]
            if n == 0:
                ax.add_patch(Rectangle((x, row - 0.5), w, 1, facecolor="white", edgecolor=colour,
                                       hatch="///", lw=0))
            else:
                ax.add_patch(Rectangle((x, row - 0.5), w, 1, facecolor=colour, lw=0,
                                       alpha=0.35 if is_decode[step][row] else 1.0))
            ax.add_patch(Rectangle((x, row - 0.5), w, 1, fill=False, edgecolor="white", lw=0.6))
            if n > 0 and not is_decode[step][row] and w >= total / 45:     # the chunk's size
                narrow = w < len(str(n)) * total / 60
                ax.text(x + w / 2, row, str(n), ha="center", va="center", fontsize=7,
                        rotation=90 if narrow else 0)
    ax.set(xlim=(lo, lo + total), ylim=(n_rows - 0.5, -0.5), title=title, ylabel="slot",
           xlabel="step" if step_s is None else "time (ms), each step as wide as it took")
    ax.set_yticks(range(n_rows))
    if legend:
        grey = "0.45"
        ax.legend(handles=[Rectangle((0, 0), 1, 1, facecolor=grey, alpha=0.35,
                                     label="decode: 1 token"),
                           Rectangle((0, 0), 1, 1, facecolor=grey,
                                     label="prompt chunk (its tokens)"),
                           Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=grey, hatch="///",
                                     label="waits for the budget")],
                  loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return ax


def step_tokens(trace, ax=None, budget: int | None = None, title: str = "", legend: bool = True):
    """Tokens each step computed (trace.computed), stacked: the decodes (decode_cells) and the
    prompt chunks; a dashed line at the step's budget (max_step_tokens), if one is given."""
    ax = _axes(ax, (9, 2))
    is_decode = decode_cells(trace)
    counts = [c if c is not None else [1] * len(r) for c, r in zip(trace.computed, trace.rows)]
    decodes = np.array([sum(d) for d in is_decode])
    chunks = np.array([sum(n for n, d in zip(c, ds) if not d) for c, ds in zip(counts, is_decode)])
    steps = np.arange(len(counts))
    ax.bar(steps, decodes, width=0.85, color="0.7", label="decodes (1 token each)")
    ax.bar(steps, chunks, width=0.85, bottom=decodes, color="0.25", label="prompt tokens")
    if budget is not None:
        ax.axhline(budget, color="tab:red", ls="--", lw=1, label=f"budget: {budget} tokens")
    ax.set(xlim=(-0.5, len(steps) - 0.5), xlabel="step", ylabel="tokens", title=title)
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return ax


# step 14's picture: a layer's weights left to right (name, x, "col": split by rows, "row": by
# columns), and the arrows between them on a rank's lane
TP_WEIGHTS = [("q_proj", 0.0, "col"), ("k_proj", 1.3, "col"), ("v_proj", 2.6, "col"),
              ("o_proj", 5.2, "row"), ("gate_proj", 7.25, "col"), ("up_proj", 8.55, "col"),
              ("down_proj", 9.85, "row"), ("lm_head", 11.9, "col")]
TP_ARROWS = ((1.0, 1.3), (2.3, 2.6), (3.6, 3.85), (4.95, 5.2), (6.2, 6.38), (6.82, 7.25),
             (8.25, 8.55), (9.55, 9.85), (10.85, 11.03), (11.47, 11.9))


def _tp_linear(part, name: str):
    """A shard's linear layer of that name in layer 0 (the head for lm_head); a row-parallel
    layer's own columns."""
    block = part.layers[0]
    found = part.lm_head if name == "lm_head" else getattr(
        block.self_attn if name[0] in "qkvo" else block.mlp, name)
    return getattr(found, "local", found)


def _tp_weight(ax, x: float, y: float, name: str, kind: str, model, parts: list, r: int,
               colour) -> None:
    """W (out, in) as a square at (x, y): rank r's rows (col) or columns (row) in its colour."""
    out, inp = _tp_linear(model, name).weight.shape[:2]
    axis = 0 if kind == "col" else 1
    mine = _tp_linear(parts[r], name).weight.shape[axis]
    before = sum(_tp_linear(p, name).weight.shape[axis] for p in parts[:r])
    whole = out if kind == "col" else inp
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor="0.93", edgecolor="0.4", lw=0.8))
    if kind == "col":                                  # rows from the top: output features
        patch = (x, y + 1 - (before + mine) / whole), 1, mine / whole
    else:                                              # columns from the left: input features
        patch = (x + before / whole, y), mine / whole, 1
    ax.add_patch(Rectangle(*patch, facecolor=colour, edgecolor="none", alpha=0.85))
    ax.text(x + 0.5, y + 1.08, f"{name}\n({out}, {inp})", ha="center", va="bottom", fontsize=7.5)
    ax.text(x + 0.5, y - 0.08, f"{'rows' if kind == 'col' else 'cols'} {before}-"
            f"{before + mine - 1}", ha="center", va="top", fontsize=7.5)


def _tp_talk(ax, size: int, lane: float, d_model: int, colours) -> None:
    """The two all-reduces across every lane, and the head's logits gathered on rank 0."""
    top = (size - 1) * lane + 1
    for x, after in ((6.6, "o_proj"), (11.25, "down_proj")):
        ax.add_patch(Rectangle((x - 0.22, -0.1), 0.44, top + 0.2, facecolor="#fdd9a0",
                               edgecolor="#c25a00", lw=1.2))
        ax.text(x, top / 2, f"all-reduce (T, {d_model})", rotation=90, ha="center",
                va="center", fontsize=8)
        ax.text(x, -0.55, f"sums every rank's\n{after} partial sum", ha="center", va="top",
                fontsize=7)
    for r in range(size):
        ax.annotate("", (13.35, top - 0.5), (12.95, (size - 1 - r) * lane + 0.5),
                    arrowprops=dict(arrowstyle="->", color=colours[r], lw=1.2,
                                    connectionstyle="arc3,rad=0.25" if r else "arc3"))
    ax.text(13.4, top - 0.5, "gather: rank 0\nputs the logits\nside by side", ha="left",
            va="center", fontsize=7.5)


def tp_layer(model, size: int = 2, ax=None):
    """Step 14's split of one layer over `size` ranks, from the shapes of `shard(model, r,
    size)`: each weight W (out, in) as a square, the rows (column-parallel: q, k, v, gate, up,
    the head) or the columns (row-parallel: o, down) a rank holds in its colour, the other ranks'
    parts pale; the two all-reduces that add the row-parallel layers' partial sums, and the
    gather of the head's logits on rank 0."""
    from tinyllm.ext import parallel  # step 14's, imported when drawn (its seams by module)

    parts = [parallel.shard(model, r, size) for r in range(size)]
    cfg, lane = model.cfg, 2.0
    colours = plt.get_cmap("tab10")(np.arange(size))
    group = cfg.n_heads // cfg.n_kv_heads
    ax = _axes(ax, (13, 1.9 * size + 0.9))
    for r, (lo, hi) in enumerate(parallel.shard_ranges(cfg.n_kv_heads, size)):
        y = (size - 1 - r) * lane
        ax.text(-0.35, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=10,
                weight="bold", color=colours[r])
        for name, x, kind in TP_WEIGHTS:
            _tp_weight(ax, x, y, name, kind, model, parts, r, colours[r])
        groups = f"group {lo}" if hi - lo == 1 else f"groups {lo}-{hi - 1}"
        ax.text(4.4, y + 0.5, f"attention\nheads {lo * group}-{hi * group - 1}\nKV {groups}\n"
                "its own KV cache", ha="center", va="center", fontsize=7.5,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor=colours[r]))
        for x0, x1 in TP_ARROWS:
            ax.annotate("", (x1, y + 0.5), (x0, y + 0.5),
                        arrowprops=dict(arrowstyle="->", color="0.5", lw=0.8))
    _tp_talk(ax, size, lane, cfg.d_model, colours)
    ax.text(-0.35, -0.55, "the embedding and the norms: whole on every rank", ha="left",
            va="top", fontsize=7.5, style="italic")
    ax.set(xlim=(-1.3, 15.0), ylim=(-1.2, (size - 1) * lane + 1.65))
    ax.set_axis_off()
    ax.set_title(f"one layer over {size} ranks: what each rank holds (its colour), "
                 f"and where the ranks talk", fontsize=10)
    return ax
