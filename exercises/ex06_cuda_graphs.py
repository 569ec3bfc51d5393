"""Exercise 06 - CUDA graphs: the bucket, the static buffers, and the decode step around them.

Three seams of the reference package, all in `tinyllm.cuda_graph`:
- `choose_bucket` picks, every decode step, the captured graph (attention-window bucket) to
  replay: the smallest that covers the longest active sequence;
- `fill_static` copies a step's inputs into the buffers the graphs were captured with;
- `decode_step` is what `SlotGraphDecoder.step` runs: the window, the bucket, the buffers, the
  replay (or the eager run), and the slots' new lengths.

The decoder's pieces: `decoder.slots` (the SlotKVCache: `lens`, `active`, `live_slots()`,
`end_step()`), `decoder.buckets` (ascending), `decoder.tokens` (S, 1) and `decoder.lens` (S,)
(the static buffers), `decoder.capture`, `decoder.graphs[W]` and `decoder.logits[W]` (a bucket's
graph and its output), `decoder.run_eager(W)` (the same step without a graph), `decoder.device`.
The compiled decoder (`tinyllm.compiled.CompiledDecoder`) runs your decode_step too: its
graphs[W] is the bucket's step compiled by torch.compile, replayed the same way.

All of it runs on a CPU too: `SlotGraphDecoder(capture=False)` runs the same bucketed,
static-buffer step without capture. Check your work with `make check EX=06` (or
`check_exercise("06")` in notebook 06). The tests plug your functions into the decoder and
compare every request's tokens with solo generate().
"""

import torch
from torch import Tensor

from tinyllm import cuda_graph


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


def decode_step(decoder: "SlotGraphDecoder", tokens: Tensor) -> Tensor:
    """One decode step of every slot of decoder.slots (the step the engine planned):
    tokens (S, 1) -> logits (S, 1, V).

    The window is the number of keys the longest busy slot attends to: its length + 1 (the new
    token sees itself). Fill the static buffers (decoder.tokens, decoder.lens) with the tokens
    and each slot's length (0 for a free slot). Then run the smallest bucket W that holds the
    window: replay decoder.graphs[W] when decoder.capture (its logits are decoder.logits[W]),
    else decoder.run_eager(W); with no such bucket, decoder.run_eager(window). Last, end the
    slots' step (decoder.slots.end_step()): a replay runs none of the forward pass's Python,
    so nothing else counts the new tokens."""
    raise NotImplementedError("exercise 06: the window, its bucket, the static buffers, the replay "
                              "(or the eager run), then end the slots' step")
