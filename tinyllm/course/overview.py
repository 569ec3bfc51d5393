"""Course tooling - one picture of the whole engine, and a request's path through it.

Every notebook opens with it (`engine_map("04")`), its own step's parts lit, so that a learner
always sees where the step sits: a request comes from a client through the server (10) to
the engine's process, waits in the scheduler (04, 05, 07) until it is admitted into the KV
cache (01, 04, 05, 08), and then every step the model runs one ragged forward pass (00, 02,
06) whose logits the token stage turns into the next token (01), until it ends and streams
back. The weights and the tokenizer come from a checkpoint (00, 09); static batching (03)
is the scheduler that waits for a whole batch. Speculative decoding (11) checks a request's
guessed tokens in that one pass, keeps a run of them in the token stage, and rolls the KV cache
back past the guesses that fell. Structured output (12) masks a constrained request's logits in
the token stage with its grammar's matcher, which moves on with every token kept. Quantized
weights (13) are read from the checkpoint as small integers, and the decode step compiled in
pieces around attention, or each of its layers one call of C. Tensor parallelism (14) splits
the model over several processes, each rank holding its own heads and their KV cache.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

# name: (x, y, width, height, text, the steps that build it)
PARTS = {
    "client": (0.0, 3.0, 1.7, 1.1, "client\nan OpenAI client,\nthe load generator", {"10"}),
    "server": (2.4, 3.0, 2.5, 1.1, "server (10)\nHTTP, server-sent events,\n"
               "text a settled piece at a time", {"10"}),
    "process": (5.6, 3.0, 2.3, 1.1, "engine process (10)\nadds, aborts in;\n"
                "each step's tokens out", {"10"}),
    "scheduler": (8.6, 3.0, 3.2, 1.1, "scheduler (03, 04, 05, 07)\n"
                  "waiting -> admitted -> running;\npreempt; a token budget",
                  {"03", "04", "05", "07"}),
    "cache": (8.6, 0.8, 3.2, 1.5, "KV cache\none request (01), slots (04),\n"
              "blocks of a pool (05),\nshared prefix blocks (08);\nrolled back (11);\n"
              "a rank's own heads (14)",
              {"01", "04", "05", "08", "11", "14"}),
    "model": (4.9, 0.8, 3.0, 1.5, "model (00), split over ranks (14):\none forward pass, a ragged\n"
              "step: prefill (02), chunks (07),\ndecode, guesses (11); replayed,\n"
              "compiled (06, 13), in C calls (13)",
              {"00", "02", "03", "06", "07", "11", "13", "14"}),
    "tokens": (1.6, 0.8, 2.6, 1.5, "token stage (01)\nlogits, a grammar's mask (12)\n"
               "-> the next token, or the\nguesses that stand (11);\nstop at EOS",
               {"00", "01", "03", "11", "12"}),
    "checkpoint": (4.9, -1.0, 3.0, 1.0, "checkpoint (00, 09)\nweights (quantized: 13),\n"
                   "tokenizer, chat template", {"00", "09", "13"}),
}

# a request's path: (from, to, label, where the label sits: dx, dy from the arrow's middle),
# numbered in order
PATH = [("client", "server", "request", (0, 0.2)), ("server", "process", "add", (0, 0.2)),
        ("process", "scheduler", "wait", (0, 0.2)),
        ("scheduler", "cache", "admit: slot, blocks", (0.95, -0.1)),
        ("cache", "model", "keys and values", (0, 0.2)), ("model", "tokens", "logits", (0, 0.2)),
        ("tokens", "server", "tokens, streamed back", (-1.15, -0.1)),
        ("checkpoint", "model", "", (0, 0))]


def _anchor(name: str, toward: str) -> tuple[float, float]:
    """The middle of the side of part `name` that faces part `toward`."""
    x, y, w, h, *_ = PARTS[name]
    tx, ty, tw, th, *_ = PARTS[toward]
    dx, dy = (tx + tw / 2) - (x + w / 2), (ty + th / 2) - (y + h / 2)
    if abs(dx) * 2.0 > abs(dy) * 3.0:
        return (x + w, y + h / 2) if dx > 0 else (x, y + h / 2)
    return (x + w / 2, y + h) if dy > 0 else (x + w / 2, y)


def engine_map(step: str | None = None, ax=None):
    """Draw the engine's parts and a request's numbered path; the parts of `step` ("00" to
    "14") are lit, the others pale. Returns the axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11.5, 4.6))
    for name, (x, y, w, h, text, steps) in PARTS.items():
        lit = step is None or step in steps
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.12",
                                    facecolor="#fdd9a0" if lit else "#f2f2f2",
                                    edgecolor="#c25a00" if lit else "#bbbbbb",
                                    lw=1.6 if lit else 0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8,
                color="black" if lit else "#888888")
    n = 0
    for a, b, label, (dx, dy) in PATH:
        start, end = _anchor(a, b), _anchor(b, a)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, lw=1.1,
                                     color="#444444", shrinkA=2, shrinkB=2))
        if label:
            n += 1
            mx, my = (start[0] + end[0]) / 2 + dx, (start[1] + end[1]) / 2 + dy
            ax.text(mx, my, f"{n} {label}", ha="center", va="center", fontsize=7.5,
                    color="#1f4e9a")
    ax.text(10.2, -0.5, "every step: the scheduler plans the rows,\nthe model runs them, the "
            "token stage\nsamples, and what finished leaves", ha="center", va="center",
            fontsize=7.5, style="italic", color="#555555")
    ax.set(xlim=(-0.2, 12.0), ylim=(-1.2, 4.4))
    ax.set_axis_off()
    ax.set_title("the engine, and a request's path through it" +
                 (f": step {step}'s parts lit" if step else ""), fontsize=10)
    return ax
