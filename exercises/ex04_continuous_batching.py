"""Exercise 04 - continuous batching: admission, and the positions and mask of a ragged step.

Two seams of the reference package:
- `choose_admissions` is what `tinyllm.scheduler.Scheduler.admit` calls every step to pick the
  queued requests that enter the free slots now;
- `ragged_mask` is what `tinyllm.slot_cache.SlotCache.begin_step` calls once per forward pass:
  where each row's new tokens sit, and which keys each of them may see. Every step of the
  continuous engine goes through it: a newcomer brings its whole prompt, a running request one
  token, in the same kind of step.

Check your work with `make check EX=04` (or `check_exercise("04")` in notebook 04). The tests
plug your functions into the engine and compare every request's tokens with solo generate().
"""

import torch
from torch import Tensor


def choose_admissions(queue: list, n_free: int, fits) -> list:
    """Which queued requests enter now: the longest prefix of the queue (first come, first
    served) with at most n_free requests for which fits(prefix) holds. fits(requests) says
    whether the cache has room for all of these requests together."""
    raise NotImplementedError("exercise 04: take queued requests in order while they fit")


def ragged_mask(lens: list[int], q_lens: list[int], device) -> tuple[Tensor, Tensor]:
    """Positions and mask of a ragged step of B rows. Row b holds lens[b] tokens and brings
    q_lens[b] >= 1 new ones, in columns 0..q_lens[b]-1 of a (B, T) batch, T = max(q_lens);
    its later columns are padding. Returns positions (B, T): column i of row b sits at
    lens[b] + i (a padding column repeats the row's last new position), and the mask
    (B, 1, T, W) over W = max(lens[b] + q_lens[b]) keys: True where key j <= the column's
    position (causal, and never past the row's own tokens)."""
    raise NotImplementedError("exercise 04: each column's position lens[b] + i, and a causal "
                              "mask over the keys of the row")
