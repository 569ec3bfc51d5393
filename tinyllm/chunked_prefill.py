"""Step 07 - chunked prefill: a budget of tokens per step.

Without a budget, a newcomer's whole context is prefilled in one step, and every running
request waits for that forward pass: one 450-token prompt stalls every stream for as long as
450 tokens take. With `max_step_tokens=N` a step computes at most N tokens in all. The running
requests' decode tokens come first (one each); what is left of the budget goes to contexts
being prefilled, first come first served (`plan_chunks`), so a long prompt is prefilled a chunk
per step while the others keep decoding. This is the Sarathi-Serve scheme; vLLM calls the
budget `max_num_batched_tokens`.

A sequence being prefilled knows how far it got (`Sequence.computed`): each step computes its
next chunk of the context (`next_chunk`), and only the chunk that reaches the end of the
context gives logits to sample from. A decode is the same move with one token left, so one
rule covers prefill, chunks, decode, and the recompute of a preempted request.

The decode rows and the chunk rows run as two forward passes of one step: our model takes
rectangular (B, T) batches, and padding every decode row to a chunk's width would cost more
than a second pass. (vLLM packs all of a step's tokens into one flat row instead.)

Seams: `plan_chunks` and `next_chunk` (exercise 07).
"""

from tinyllm.requests import Sequence


def plan_chunks(left: list[int], budget: int | None) -> list[int]:
    """How many tokens each prefilling sequence computes this step. left[i] >= 1 is what
    sequence i still has to compute, in arrival order; budget is the step's tokens left after
    the decodes (None: no limit). First come first served: each takes all it has left, or
    whatever the budget still holds; once the budget is spent the rest get 0. Returns one
    count per sequence, each in 0..left[i], summing to at most budget."""
    if budget is None:
        return list(left)
    sizes = []
    for n in left:
        take = min(n, budget)
        sizes.append(take)
        budget -= take
    return sizes


def next_chunk(seq: Sequence, n: int) -> tuple[list[int], bool]:
    """The n tokens of seq's context it computes next, the ones from seq.computed on, and
    whether they finish its context (only then does the step sample its next token from
    the last one's logits)."""
    context = seq.context()
    return context[seq.computed:seq.computed + n], seq.computed + n == len(context)
