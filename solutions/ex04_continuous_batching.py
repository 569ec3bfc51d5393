"""Exercise 04 - continuous batching: requests join and leave the slots, and the positions and
mask of a ragged step.

Three seams of the reference package:
- `admit_waiting` is what `tinyllm.scheduler.Scheduler.admit` calls every step: waiting
  requests move into the free slots, first come first served, while the cache has room;
- `leave_slot` is what the scheduler calls when a request finishes, is aborted or preempted:
  its slot is free at once, for the next waiting request;
- `ragged_mask` is what `tinyllm.slot_cache.SlotCache.begin_step` calls once per forward pass:
  where each row's new tokens sit, and which keys each of them may see. Every step of the
  continuous engine goes through it: a newcomer brings its whole prompt, a running request one
  token, in the same kind of step.

A request inside the engine is a `tinyllm.requests.Sequence`: `seq.rid` (its arrival number),
`seq.slot` (None while it waits), `seq.context_len()` (its prompt and the tokens it has made).
The cache (`tinyllm.slot_cache.SlotCache`) answers `free_slots()`, `can_admit([n_tokens])`,
and takes `admit(slot, n_tokens)` and `release(slot)`.

Check your work with `make check EX=04` (or `check_exercise("04")` in notebook 04). The tests
plug your functions into the engine and compare every request's tokens with solo generate().
"""

from collections import deque

import torch
from torch import Tensor

from tinyllm.requests import Sequence
from tinyllm.slot_cache import SlotCache


def admit_waiting(waiting: deque, running: dict, cache: SlotCache) -> list[Sequence]:
    """Move waiting sequences into the cache's free slots, first come first served, and return
    them in queue order. For each free slot: the first waiting sequence enters if the cache can
    take its context (cache.can_admit([seq.context_len()])): it leaves the queue, the cache
    admits it (cache.admit(slot, seq.context_len())), and it is recorded as running
    (seq.slot = slot, running[slot] = seq). The first that does not fit stops admission:
    nobody overtakes it."""
    admitted = []
    for slot in cache.free_slots():
        if not waiting or not cache.can_admit([waiting[0].context_len()]):
            break
        seq = waiting.popleft()
        cache.admit(slot, seq.context_len())
        seq.slot, running[slot] = slot, seq
        admitted.append(seq)
    return admitted


def leave_slot(seq: Sequence, running: dict, cache: SlotCache) -> None:
    """seq leaves its slot (it finished, was aborted or is preempted): the cache frees the
    slot and its memory (cache.release(slot)), running forgets it, and seq.slot is None."""
    cache.release(seq.slot)
    del running[seq.slot]
    seq.slot = None


def ragged_mask(lens: list[int], q_lens: list[int], device) -> tuple[Tensor, Tensor]:
    """Positions and mask of a ragged step of B rows. Row b holds lens[b] tokens and brings
    q_lens[b] >= 1 new ones, in columns 0..q_lens[b]-1 of a (B, T) batch, T = max(q_lens);
    its later columns are padding. Returns positions (B, T): column i of row b sits at
    lens[b] + i (a padding column repeats the row's last new position), and the mask
    (B, 1, T, W) over W = max(lens[b] + q_lens[b]) keys: True where key j <= the column's
    position (causal, and never past the row's own tokens)."""
    lens_t = torch.tensor(lens, device=device)[:, None]                 # (B, 1)
    last = torch.tensor(q_lens, device=device)[:, None] - 1             # (B, 1)
    cols = torch.arange(max(q_lens), device=device)[None, :]            # (1, T)
    positions = lens_t + torch.minimum(cols, last)                      # (B, T)
    keys = torch.arange(max(n + q for n, q in zip(lens, q_lens)), device=device)   # (W,)
    mask = keys[None, None, :] <= positions[:, :, None]                 # (B, T, W)
    return positions, mask[:, None]                                     # (B, T), (B, 1, T, W)
