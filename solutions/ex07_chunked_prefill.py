"""Exercise 07 - chunked prefill: the chunks within a step's budget, and a sequence's next one.

Two seams of the reference package, both in `tinyllm.chunked_prefill`:
- `plan_chunks` shares what is left of a step's token budget, after the decodes, among the
  sequences whose contexts are being prefilled: first come first served;
- `next_chunk` gives the tokens a sequence computes next, from `seq.computed` on, and says
  whether they end its context: only then does the step sample its next token.

A `Sequence` (tinyllm.requests) holds `context()` (its prompt, and after a preemption the tokens
it had made), `context_len()`, `computed` (how many of those tokens its slot holds) and
`left()` (context_len() - computed).

Check your work with `make check EX=07` (or `check_exercise("07")` in notebook 07). The tests
plug your functions into `ContinuousEngine(max_step_tokens=N)` and compare every request's
tokens with solo generate().
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
