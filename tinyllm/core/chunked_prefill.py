"""Step 07 - chunked prefill: a budget of tokens per step.

Without a budget a newcomer's whole context is prefilled in one step, and every running request
waits for that pass. With `max_step_tokens=N` a step computes at most N tokens: the decode
tokens first (one each), then what is left goes to contexts being prefilled, first come first
served (`plan_step`), so a long prompt is prefilled a chunk per step while the others keep
decoding (Sarathi-Serve; vLLM's `max_num_batched_tokens`). A sequence knows how far it got
(`Sequence.num_computed_tokens`); each step computes its next chunk (`next_chunk`), and only the
chunk that reaches the end of the context gives logits to sample. A decode is the same move
with one token left. The decode rows and the chunks run in one packed pass (04's runner).
`TokenBudget` is the scheduler's planner of a budgeted engine, in the place of step 04's
WholeContexts (parts.Planner). Seams: `plan_step` and `next_chunk` (exercise 07).
"""

from collections.abc import Callable

from tinyllm.core.requests import Sequence


def plan_step(running: list[Sequence], max_step_tokens: int | None,
              admit: Callable[[], list[Sequence]]
              ) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
    """This step's work within a budget of max_step_tokens tokens (None: no limit).

    running: the sequences in slots, in slot order. One with seq.left() == 1 decodes (the
    token it last sampled); one with more left is computing its context: a newcomer, a long
    prompt a chunk at a time, or a preempted sequence recomputing what it had.
    admit(): moves waiting sequences into free slots now and returns them, each with its
    context left to compute. Call it at most once, and only when the budget has room for a
    newcomer: some tokens left after the decodes and after everything the sequences in slots
    still have to compute.
    Returns (decodes, chunks):
    - decodes: every decoding sequence, in slot order; they come first, one token each, and
      are never left out (max_step_tokens >= the slots, so they always fit);
    - chunks: (seq, n) for the sequences computing their contexts, the newcomers among them,
      first come first served (by seq.rid): each takes all it has left, or what the budget
      still holds; none gets n == 0.
    Example: running A (rid 0, left 1), B (rid 2, left 10), C (rid 1, left 1); admit() would
    bring D (rid 3, left 4). Budget 8: decodes [A, C], 6 tokens left < B's 10, so admit() is
    not called, and chunks [(B, 6)]. Budget 16: 14 left > 10: admit() brings D, chunks
    [(B, 10), (D, 4)]. No budget: admit() is called, chunks [(B, 10), (D, 4)]."""
    decodes = [s for s in running if s.left() == 1]
    prefilling = [s for s in running if s.left() > 1]
    budget = None if max_step_tokens is None else max_step_tokens - len(decodes)  # what is left
    if budget is None or budget > sum(s.left() for s in prefilling):
        prefilling += admit()                           # room for a newcomer's first chunk
    chunks = []
    for seq in sorted(prefilling, key=lambda s: s.rid):
        n = seq.left() if budget is None else min(seq.left(), budget)
        if n == 0:
            break
        chunks.append((seq, n))
        if budget is not None:
            budget -= n
    return decodes, chunks


def next_chunk(seq: Sequence, n: int) -> tuple[list[int], bool]:
    """The n tokens seq computes next, and whether they end its context.

    seq.context() is what its slot must hold before it can sample again: its prompt, and after a
    preemption the tokens it had made too. Its first seq.num_computed_tokens tokens are in the
    slot already; the chunk is the n tokens after them. done says whether the chunk reaches the
    end of the context: only then do the chunk's last logits give the next token. It only reads
    seq (the engine moves seq.num_computed_tokens after the step).
    Example: prompt [5, 6, 7, 8] and tokens made [40, 41] (it was preempted), computed 2:
    next_chunk(seq, 3) -> ([7, 8, 40], False); with computed 5: next_chunk(seq, 1) ->
    ([41], True)."""
    context = seq.context()
    return (context[seq.num_computed_tokens:seq.num_computed_tokens + n],
            seq.num_computed_tokens + n == len(context))


class TokenBudget:
    """A budgeted engine's planner: each step's plan within max_step_tokens (plan_step), and
    each sequence's next chunk (next_chunk)."""

    def __init__(self, max_step_tokens: int | None):
        self.max_step_tokens = max_step_tokens

    def plan(self, running: list[Sequence], admit: Callable[[], list[Sequence]]
             ) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        return plan_step(running, self.max_step_tokens, admit)

    def next_chunk(self, seq: Sequence, n: int) -> tuple[list[int], bool]:
        return next_chunk(seq, n)
