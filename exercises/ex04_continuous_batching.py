"""Exercise 04 - continuous batching: requests join and leave the slots, and the positions and
mask of a ragged step.

Three seams of the reference package:
- `admit_waiting` is what `tinyllm.core.scheduler.Scheduler.admit` calls every step: waiting
  requests move into the free slots, first come first served, while the cache has room;
- `leave_slot` is what the scheduler calls when a request finishes, is aborted or preempted:
  its slot is free at once, for the next waiting request;
- `ragged_mask` is what `tinyllm.core.slot_cache.SlotCache.begin_step` calls once per forward pass:
  where each row's new tokens sit, and which keys each of them may see. Every step of the
  continuous engine goes through it: a newcomer brings its whole prompt, a running request one
  token, in the same kind of step.

A request inside the engine is a `tinyllm.core.requests.Sequence`: `seq.rid` (its arrival number),
`seq.slot` (None while it waits), `seq.context()` (its prompt and the tokens it has made),
`seq.context_len()` (their number) and `seq.prefix_key()` (what a prefix cache may serve it by:
its context, or None).
The cache (`CacheBooks` in `tinyllm.core.parts`: step 04's `SlotCache`, or a later step's)
answers `free_slots()` and `can_admit([n_tokens], [key])`, and takes `admit(slot, n_tokens, key)`
and `release(slot)`; given the context as the key (`seq.prefix_key()`), a prefix cache (08)
counts and gives only what it does not hold already.

Check your work with `make check EX=04` (or `check_exercise("04")` in notebook 04). The tests
plug your functions into the engine and compare every request's tokens with solo generate().
"""

from collections import deque

import torch
from torch import Tensor

from tinyllm.core.parts import CacheBooks
from tinyllm.core.requests import Sequence


def admit_waiting(waiting: deque, running: dict, cache: CacheBooks) -> list[Sequence]:
    """Waiting sequences enter the cache's free slots, first come first served; returns them
    in the order they entered.

    A sequence enters when there is a free slot and the cache has room for its whole context
    (seq.context_len() tokens: its prompt, and after a preemption the tokens it had made,
    which it computes again), less what a prefix cache (08) holds of it already: ask
    cache.can_admit([n], [key]) and admit with cache.admit(slot, n, key), passing
    key = seq.prefix_key() both times (its context, seq.context(); None where a prefix cache
    must not serve it). The first that cannot enter stops admission: nobody overtakes it.
    Afterwards each admitted sequence has left `waiting`, holds a slot (seq.slot, and
    running[seq.slot] is seq), and the cache has admitted it there, with memory for its
    context. Any free slot will do.
    Example: three free slots, 3 free blocks of 4, waiting r0 (5 tokens, 2 blocks with its next
    token), r1 (9 tokens, 3 blocks), r2 (2 tokens): r0 enters; r1 does not fit, so r1 and r2
    wait, in that order. Were r1's first 8 tokens cached in 2 blocks a running request holds,
    r1 would need 1 fresh block: it enters too (cache.lens[r1.slot] is 8), and r2 waits."""
    raise NotImplementedError("exercise 04: move waiting requests into free slots, first come "
                              "first served, while they fit")


def leave_slot(seq: Sequence, running: dict, cache: CacheBooks) -> None:
    """seq gives its slot back (it finished, was aborted or is preempted). Afterwards the cache
    has released the slot and its memory, running no longer holds it, and seq.slot is None, so
    the next step may admit a waiting sequence there.
    Example: r1 leaves slot 1 of a cache whose slots 0 and 1 were busy: cache.free_slots() is
    then [1], running has no slot 1, and r1.slot is None."""
    raise NotImplementedError("exercise 04: release the slot and forget the request there")


def ragged_mask(lens: list[int], q_lens: list[int], device) -> tuple[Tensor, Tensor]:
    """Positions and mask of a ragged step of B rows.

    Row b's slot holds lens[b] tokens, and the row brings q_lens[b] >= 1 new ones, in columns
    0..q_lens[b]-1 of a (B, T) batch, T = max(q_lens); its later columns are padding.
    Returns positions (B, T), long: each new token's position in its own sequence (a padding
    column repeats the row's last new position); and the mask (B, 1, T, W), bool, over the
    W = max(lens[b] + q_lens[b]) keys any row may see: True where a column may attend to a
    key, which is every key of its own sequence up to and including itself, never one after.
    Example: lens [4, 0], q_lens [1, 3] (a decode, and a 3-token prompt in an empty slot):
    positions [[4, 4, 4], [0, 1, 2]]; W = 5; row 0's column 0 sees keys 0..4, row 1's column 1
    keys 0..1, and row 1 never sees key 3 or 4."""
    raise NotImplementedError("exercise 04: each new token's position, and a causal mask over "
                              "its own row's keys")
