"""Exercise 06 - CUDA graphs: choosing the bucket, filling the static buffers.

Two seams of the reference package, both in `tinyllm.cuda_graph`:
- `choose_bucket` picks, every decode step, the captured graph (attention-window bucket) to
  replay: the smallest that covers the longest active sequence;
- `fill_static` copies a step's inputs into the buffers the graphs were captured with.

Both run on a CPU too: `SlotGraphDecoder(capture=False)` runs the same bucketed, static-buffer
step without capture. Check your work with `make check EX=06` (or `check_exercise("06")` in
notebook 06). The tests plug your functions into the decoder and compare every request's
tokens with solo generate().
"""

from torch import Tensor


def choose_bucket(buckets: list[int], window: int) -> int | None:
    """The smallest bucket >= window, the number of keys the longest active sequence attends
    to (its length + 1: the new token sees itself). buckets are sorted ascending. None when
    no bucket is that large (the step then runs eagerly)."""
    raise NotImplementedError("exercise 06: the smallest bucket that holds the window")


def fill_static(static_tokens: Tensor, static_lens: Tensor, tokens: Tensor, lens: Tensor) -> None:
    """Copy this step's inputs into the static buffers, in place: static_tokens (S, 1) gets
    tokens (S, 1), static_lens (S,) gets lens (S,). A captured graph reads the buffers it was
    captured with, so they must be written into, never replaced."""
    raise NotImplementedError("exercise 06: copy the inputs into the static buffers in place")
