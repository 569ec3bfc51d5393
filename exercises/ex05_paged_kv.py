"""Exercise 05 - the paged KV cache: the block allocator, block tables that grow, the
block-table lookup, and preemption when the pool runs dry.

Five seams of the reference package:
- `allocate_blocks` and `free_blocks` are the block allocator of `tinyllm.core.paged_kv`
  (`BlockAllocator` calls them): a free list of block ids, and one allocated flag per block;
- `grow_table` (`tinyllm.core.paged_kv`) gives a sequence's block table the blocks it needs to hold
  its tokens: at admission (the context and the next token) and before each decode step;
- `slot_mapping` (`tinyllm.core.paged_kv`) turns sequence positions into pool rows through the block
  tables; the paged cache uses it to write each new key/value and to gather the keys a step
  attends to;
- `reserve_or_preempt` (`tinyllm.core.scheduler`) runs before every step: room for each running
  request's next token, and when the pool is dry, the youngest request gives its memory back
  and waits to be recomputed.

The scheduler's pieces: a `tinyllm.core.requests.Sequence` has `rid` (its arrival number)
and `slot`; `running` maps slot -> Sequence and `waiting` is a deque of Sequences;
`cache.reserve(slot, 1)` says (True/False) whether the cache could make room for one more token
of that slot;
`scheduler.leave_slot(seq, running, cache)` (exercise 04's, the package's here) frees a slot.

Check your work with `make check EX=05` (or `check_exercise("05")` in notebook 05). The tests
plug your functions into the paged engine, under memory pressure that forces preemptions, and
compare every request's tokens with solo generate().
"""

from collections import deque

from torch import Tensor

from tinyllm.core import scheduler
from tinyllm.core.parts import CacheBooks
from tinyllm.core.requests import Sequence


def allocate_blocks(free_list: list[int], allocated: list[bool], n: int) -> list[int] | None:
    """Take n blocks off free_list (any n of them), mark them in allocated (one flag per block
    of the pool) and return them. When fewer than n are free, return None and change nothing.
    Example: free_list [3, 2, 1, 0], n 2 -> two of them, say [0, 1]; free_list then holds the
    other two, and allocated is [True, True, False, False]."""
    raise NotImplementedError("exercise 05: take n blocks off the free list and mark them "
                              "allocated")


def free_blocks(free_list: list[int], allocated: list[bool], blocks: list[int]) -> None:
    """Give blocks back: clear their allocated flags and append them to free_list. A block
    that is not allocated, given twice or not of the pool raises ValueError naming it, before
    anything changes: a double free would later hand one block to two sequences.
    Example: free_list [3], allocated [True, True, True, False], blocks [1, 0] -> free_list
    holds 3, 1, 0 and allocated is [False, False, True, False]; blocks [2, 2] -> ValueError
    naming block 2, and both lists as they were."""
    raise NotImplementedError("exercise 05: check every block is allocated, then give them all "
                              "back")


def grow_table(table: list[int], n_tokens: int, block_size: int, allocate) -> bool:
    """Make a block table hold n_tokens positions: append the blocks it lacks, no more, taken
    with allocate(n), which returns a list of n free blocks, or None when the pool has fewer. A
    block holds block_size positions, and a table's last block may be partly filled. Returns
    True, or False, with the table unchanged, when the pool has too few blocks.
    Example, blocks of 4: a table [7] grows to hold 5 positions by one block ([7, b]); one of
    2 blocks holds 8 and takes nothing; an empty table takes 3 blocks for 9 positions."""
    raise NotImplementedError("exercise 05: allocate the blocks the table lacks for n_tokens "
                              "positions")


def slot_mapping(tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Where positions live in the pool. tables (B, n_table) holds each row's block ids;
    positions (B, W) holds sequence positions of that row. Returns (B, W) long, each position's
    row in the pool seen flat, (n_blocks * block_size, ...): pool block b holds rows
    b * block_size up to (b + 1) * block_size - 1, in order.
    Example, blocks of 4: a row whose table is [5, 2] keeps positions 0..3 in pool block 5
    and 4..7 in block 2: positions [0, 3, 4, 6] -> rows [20, 23, 8, 10]."""
    raise NotImplementedError("exercise 05: look up each position's block in the table, add "
                              "its offset")


def reserve_or_preempt(running: dict, waiting: deque, cache: CacheBooks) -> list[Sequence]:
    """Room for every running sequence's next token, oldest first (lowest rid). While the cache
    has none for a sequence (cache.reserve(seq.slot, 1) is False), the youngest running
    sequence (highest rid; it may be this very one) is preempted: it leaves its slot
    (leave_slot) and waits again. The waiting queue stays in arrival order (by rid), so a
    preempted sequence goes back ahead of those that arrived after it. Returns the preempted,
    in the order they were preempted.
    Example: running r0, r3, r5, waiting r6, and a pool with room for one more token: r0 gets
    it; for r3 there is none, so r5 is preempted (its blocks come back), and r3 gets one of
    them. Returns [r5]; waiting is then r5, r6."""
    raise NotImplementedError("exercise 05: reserve a token for each running request, oldest "
                              "first, preempting the youngest while the cache has no room")
