"""Exercise 05 - the paged KV cache: the block allocator, the block-table lookup, preemption.

Four seams of the reference package:
- `allocate_blocks` and `free_blocks` are the block allocator of `tinyllm.paged_kv`
  (`BlockAllocator` calls them): a free list of block ids, and one allocated flag per block;
- `slot_mapping` (`tinyllm.paged_kv`) turns sequence positions into pool rows through the block
  tables; the paged cache uses it to write each new key/value and to gather the keys a step
  attends to;
- `choose_victim` (`tinyllm.scheduler`) picks the request that gives up its blocks when the
  pool runs dry.

Check your work with `make check EX=05` (or `check_exercise("05")` in notebook 05). The tests
plug your functions into the paged engine, under memory pressure that forces preemptions, and
compare every request's tokens with solo generate().
"""

from torch import Tensor


def allocate_blocks(free_list: list[int], allocated: list[bool], n: int) -> list[int] | None:
    """Take n blocks off the end of free_list, mark them in allocated (one flag per block of
    the pool) and return them. When fewer than n are free, return None and change nothing."""
    if n > len(free_list):
        return None
    blocks = [free_list.pop() for _ in range(n)]
    for b in blocks:
        allocated[b] = True
    return blocks


def free_blocks(free_list: list[int], allocated: list[bool], blocks: list[int]) -> None:
    """Give blocks back: clear their allocated flags and append them to free_list. A block
    that is not allocated (or is given twice) raises ValueError naming it, and nothing changes:
    a double free would later hand one block to two sequences."""
    for i, b in enumerate(blocks):
        if not 0 <= b < len(allocated) or not allocated[b] or b in blocks[:i]:
            raise ValueError(f"block {b} is not allocated")
    for b in blocks:
        allocated[b] = False
        free_list.append(b)


def slot_mapping(tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Where positions live in the pool. tables (B, n_table) holds each row's block ids;
    positions (B, W) holds sequence positions of that row. Returns (B, W) indices into the
    pool flattened to (n_blocks * block_size, ...): block * block_size + offset."""
    blocks = tables.gather(1, positions // block_size)                   # (B, W) block ids
    return blocks * block_size + positions % block_size                 # (B, W)


def choose_victim(running: dict[int, int]) -> int:
    """Which slot gives up its memory when the pool is dry. running maps each running slot to
    its request's arrival number (lower = arrived earlier). The youngest request is preempted:
    it has made the least progress, and the oldest ones keep going, so the run always ends."""
    return max(running, key=running.get)
