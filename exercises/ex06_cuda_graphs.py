"""Exercise 06 - CUDA graphs: the bucket, the static buffers, and the decode step around them.

Three seams of the reference package, all in `tinyllm.core.cuda_graph`:
- `choose_bucket` picks, every decode step, the captured graph (attention-window bucket) to
  replay: the smallest that covers the longest active sequence;
- `fill_static` copies a step's inputs into the buffers the graphs were captured with;
- `decode_step` is what `SlotGraphDecoder.step` runs: the window, the bucket, the buffers, the
  replay (or the eager run), and the slots' new lengths.

The decoder's pieces: `decoder.slots` (the SlotKVCache: `lens`, `active`, `live_slots()`,
`end_step()`), `decoder.buckets` (ascending), `decoder.tokens` (S, 1) and `decoder.lens` (S,)
(the static buffers), `decoder.capture`, `decoder.graphs[W]` and `decoder.logits[W]` (a bucket's
graph and its output), `decoder.run_eager(W)` (the same step without a graph), `decoder.device`.
The compiled decoder (`tinyllm.core.compiled.CompiledDecoder`) runs your decode_step too: its
graphs[W] is the bucket's step compiled by torch.compile, replayed the same way.

All of it runs on a CPU too: `SlotGraphDecoder(capture=False)` runs the same bucketed,
static-buffer step without capture. Check your work with `make check EX=06` (or
`check_exercise("06")` in notebook 06). The tests plug your functions into the decoder and
compare every request's tokens with solo generate().
"""

import torch
from torch import Tensor

from tinyllm.core import cuda_graph
from tinyllm.core.cuda_graph import SlotGraphDecoder


def choose_bucket(buckets: list[int], window: int) -> int | None:
    """The bucket a decode step runs at: the smallest of buckets (sorted ascending) that holds
    window keys, the number the longest active sequence attends to (its length + 1: the new
    token sees itself). None when no bucket is that large (the step then runs eagerly).
    Example: buckets [8, 16, 32]: window 8 -> 8, window 9 -> 16, window 40 -> None."""
    raise NotImplementedError("exercise 06: the smallest bucket that holds the window")


def fill_static(static_tokens: Tensor, static_lens: Tensor, tokens: Tensor, lens: Tensor) -> None:
    """Put this step's inputs in the static buffers: afterwards static_tokens (S, 1) holds the
    values of tokens (S, 1), and static_lens (S,) those of lens (S,). A captured graph reads
    the very memory it was captured with, so the buffers keep their memory (the same tensors,
    written into), and hold copies: the caller may reuse tokens and lens.
    Example: static_tokens zeros (3, 1), tokens [[7], [8], [9]]: afterwards static_tokens is
    [[7], [8], [9]], still at static_tokens.data_ptr(), and setting tokens[0, 0] = 99 later
    leaves it 7."""
    raise NotImplementedError("exercise 06: copy the inputs into the static buffers in place")


def decode_step(decoder: "SlotGraphDecoder", tokens: Tensor) -> Tensor:
    """One decode step of every slot of decoder.slots (the step the engine planned):
    tokens (S, 1) -> logits (S, 1, V), row s the logits of slot s's new token.

    The step runs at the bucket that holds its window (choose_bucket), from the static
    buffers: decoder.tokens holds the tokens and decoder.lens each slot's length (0 for a free
    slot). With decoder.capture, the bucket's graph decoder.graphs[W] is replayed, and its
    logits are decoder.logits[W]; without, decoder.run_eager(W) runs the same step; a window
    larger than every bucket runs decoder.run_eager(window). Afterwards each busy slot holds
    one more token (decoder.slots.end_step(): a replay runs none of the forward pass's Python,
    so nothing else counts the new tokens).
    Example: buckets [4, 8, 16], busy slots of 5 and 7 tokens and a free one: the window is 8,
    decoder.lens holds [5, 0, 7], the step runs at 8, and the slots then hold 6 and 8."""
    raise NotImplementedError("exercise 06: the window, its bucket, the static buffers, the "
                              "replay (or the eager run), then end the slots' step")
