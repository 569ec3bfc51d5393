"""Step 05 - the paged KV cache: memory in blocks, handed out as a sequence grows.

A slot (04) reserves max_len positions for whatever request it holds, and most requests are
short, so most of the reservation holds nothing. Here every layer's keys and values live in one
pool of n_blocks blocks of block_size positions. A sequence owns a list of blocks, its **block
table**: its position p lives in block table[p // block_size] at offset p % block_size. It gets
a block when it grows past the last one and gives every block back when it ends, so a sequence
wastes at most one partly filled block.

Memory can now run out mid-run: requests grow, and the pool is shared. Before each decode step
the engine reserves every running sequence's next token (`reserve`); when the pool is dry, the
scheduler preempts a request (scheduler.py) and recomputes it later.

`PagedKVCache` has the interface of `SlotKVCache` (both are `SlotCache`s), plus block tables.
With `prefix_cache=True` (08, prefix_cache.py) its full blocks are named by the prefix they
hold and shared between the tables of requests that start alike. Its seams are exercise 05: the block allocator (`allocate_blocks`, `free_blocks`), a block
table's growth (`grow_table`: how many blocks a sequence needs, and taking them) and the
block-table lookup (`slot_mapping`).
"""

import math

import torch
from torch import Tensor

from tinyllm import prefix_cache
from tinyllm.prefix_cache import PrefixCache
from tinyllm.slot_cache import SlotCache


class BlockAllocator:
    """The pool's bookkeeping: which of n_blocks blocks (numbered 0..n_blocks-1) are free.
    allocate(n) hands out n free blocks, free(blocks) takes them back."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.free_list = list(range(n_blocks - 1, -1, -1))    # handed out from the end: 0 first
        self.allocated = [False] * n_blocks

    def n_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int) -> list[int] | None:
        return allocate_blocks(self.free_list, self.allocated, n)

    def free(self, blocks: list[int]) -> None:
        free_blocks(self.free_list, self.allocated, blocks)


def allocate_blocks(free_list: list[int], allocated: list[bool], n: int) -> list[int] | None:
    """Take n blocks off free_list (any n of them), mark them in allocated (one flag per block
    of the pool) and return them. When fewer than n are free, return None and change nothing.
    Example: free_list [3, 2, 1, 0], n 2 -> two of them, say [0, 1]; free_list then holds the
    other two, and allocated is [True, True, False, False]."""
    if n > len(free_list):
        return None
    blocks = [free_list.pop() for _ in range(n)]
    for b in blocks:
        allocated[b] = True
    return blocks


def free_blocks(free_list: list[int], allocated: list[bool], blocks: list[int]) -> None:
    """Give blocks back: clear their allocated flags and append them to free_list. A block
    that is not allocated, given twice or not of the pool raises ValueError naming it, before
    anything changes: a double free would later hand one block to two sequences.
    Example: free_list [3], allocated [True, True, True, False], blocks [1, 0] -> free_list
    holds 3, 1, 0 and allocated is [False, False, True, False]; blocks [2, 2] -> ValueError
    naming block 2, and both lists as they were."""
    for i, b in enumerate(blocks):
        if b in blocks[:i]:
            raise ValueError(f"block {b} is given twice")
        if not 0 <= b < len(allocated) or not allocated[b]:
            raise ValueError(f"block {b} is not allocated")
    for b in blocks:
        allocated[b] = False
        free_list.append(b)


def grow_table(table: list[int], n_tokens: int, block_size: int, allocate) -> bool:
    """Make a block table hold n_tokens positions: append the blocks it lacks, no more, taken
    with allocate(n), which returns a list of n free blocks, or None when the pool has fewer. A
    block holds block_size positions, and a table's last block may be partly filled. Returns
    True, or False, with the table unchanged, when the pool has too few blocks.
    Example, blocks of 4: a table [7] grows to hold 5 positions by one block ([7, b]); one of
    2 blocks holds 8 and takes nothing; an empty table takes 3 blocks for 9 positions."""
    need = -(-n_tokens // block_size) - len(table)                      # ceil, less what it has
    if need <= 0:
        return True
    got = allocate(need)
    if got is None:
        return False
    table += got
    return True


def slot_mapping(tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Where positions live in the pool. tables (B, n_table) holds each row's block ids;
    positions (B, W) holds sequence positions of that row. Returns (B, W) long, each position's
    row in the pool seen flat, (n_blocks * block_size, ...): pool block b holds rows
    b * block_size up to (b + 1) * block_size - 1, in order.
    Example, blocks of 4: a row whose table is [5, 2] keeps positions 0..3 in pool block 5
    and 4..7 in block 2: positions [0, 3, 4, 6] -> rows [20, 23, 8, 10]."""
    blocks = tables.gather(1, positions // block_size)                   # (B, W) block ids
    return blocks * block_size + positions % block_size                 # (B, W)


class PagedKVCache(SlotCache):
    """Keys/values of n_slots sequences in a shared pool of n_blocks blocks of block_size.

    Per layer the pool is (n_blocks * block_size, n_kv, hd): pool row b * block_size + i is
    offset i of block b. tables[s] is slot s's block table. reserved_tokens() is the pool,
    allocated_tokens() what the block tables hold, used_tokens() the positions written. A step
    writes each new token through its row's block table and gathers the first W positions of
    every row (`slot_mapping`), indices built once for every layer.

    prefix_cache (08): blocks are counted by the tables that hold them (`prefix`, a
    PrefixCache), hashes[s] names slot s's full blocks in order, a newcomer's table starts with
    the cached blocks of its context's prefix (`reuse_prefix`), and each block that fills up is
    named for the next (`cache_blocks`).
    """

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int,
                 n_blocks: int, block_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device=None, prefix_cache: bool = False):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        super().__init__(n_layers, n_slots, max_len, device)
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_blocks * block_size, n_kv_heads, head_dim)           # (N * bs, n_kv, hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.allocator = BlockAllocator(n_blocks)
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.prefix = PrefixCache(self.allocator, block_size) if prefix_cache else None
        self.hashes: list[list[bytes]] = [[] for _ in range(n_slots)]

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    # ---- the pool: the allocator's, or shared through the prefix cache (08) ----------------
    def n_free(self) -> int:
        """Blocks a table could take now (with a prefix cache: cached blocks nobody holds too)."""
        return self.allocator.n_free() if self.prefix is None else self.prefix.n_free()

    def _allocate(self, n: int) -> list[int] | None:
        return self.allocator.allocate(n) if self.prefix is None else self.prefix.allocate(n)

    def _free(self, blocks: list[int]) -> None:
        if self.prefix is None:
            self.allocator.free(blocks)
        else:
            self.prefix.free(blocks)

    # ---- memory: blocks on demand ----------------------------------------------------------
    def can_admit(self, lens: list[int]) -> bool:
        return (super().can_admit(lens)
                and sum(self.blocks_for(n + 1) for n in lens) <= self.n_free())

    def admit(self, slot: int, n_tokens: int) -> None:
        need = self.blocks_for(n_tokens + 1)
        if need > self.n_free():
            raise ValueError(f"a context of {n_tokens} tokens needs {need} blocks, "
                             f"{self.n_free()} are free")
        super().admit(slot, n_tokens)
        self.tables[slot], self.hashes[slot] = [], []   # room for the context and its next token
        grow_table(self.tables[slot], n_tokens + 1, self.block_size, self._allocate)

    def reserve(self, slot: int, n: int = 1) -> bool:
        """Blocks for n more tokens in slot, taken from the pool as needed; False (and nothing
        taken) when the pool has too few."""
        if self.lens[slot] + n > self.max_len:
            return False
        return grow_table(self.tables[slot], self.lens[slot] + n, self.block_size, self._allocate)

    def release(self, slot: int) -> None:
        self._free(self.tables[slot])
        self.tables[slot], self.hashes[slot] = [], []
        super().release(slot)

    def rollback(self, slot: int, n: int) -> None:
        """As SlotCache.rollback, and the blocks left holding no token go back to the pool.
        A named block (08) is never rolled into: others may be reading it."""
        named = len(self.hashes[slot]) * self.block_size
        if named and 0 < n <= self.lens[slot] and named > self.lens[slot] - n:
            raise ValueError(f"cannot roll slot {slot} back by {n}: its first "
                             f"{len(self.hashes[slot])} blocks are in the prefix cache")
        super().rollback(slot, n)
        keep = self.blocks_for(self.lens[slot])
        self._free(self.tables[slot][keep:])
        del self.tables[slot][keep:]

    # ---- the prefix cache (08) -------------------------------------------------------------
    def reuse_prefix(self, slot: int, context: list[int]) -> int:
        """A newcomer's table starts with the cached blocks of its context's longest cached
        prefix (match_prefix) in place of the fresh blocks admit gave it, which go back.
        Returns the tokens it need not compute: the slot now holds them. (The lookup follows
        the step's admissions, so in a pool so full that a newcomer's fresh blocks evicted a
        cached block, that block's prefix is computed again; vLLM looks up first.)"""
        if self.prefix is None or self.lens[slot] != 0:
            return 0
        blocks = prefix_cache.match_prefix(context, self.block_size, self.prefix.cached)
        if not blocks:
            return 0
        m = len(blocks)
        if m * self.block_size >= len(context):
            raise ValueError(f"match_prefix gave {m} blocks ({m * self.block_size} tokens) for a "
                             f"context of {len(context)} tokens: the last token must be left to "
                             f"compute, for the logits of the request's next token")
        unknown = [b for b in blocks if b not in self.prefix.hash_of]
        if unknown:
            raise ValueError(f"match_prefix gave blocks {unknown}, which hold no cached prefix: "
                             f"it returns blocks of `cached`, the values of its names")
        self.prefix.share(blocks)
        fresh, self.tables[slot][:m] = self.tables[slot][:m], blocks
        self._free(fresh)
        self.hashes[slot] = [self.prefix.hash_of[b] for b in blocks]
        self.lens[slot] = m * self.block_size
        return m * self.block_size

    def cache_blocks(self, slot: int, context: list[int]) -> None:
        """Name the slot's blocks that are full now (their tokens are context's, in order),
        so that later requests can share them."""
        if self.prefix is None:
            return
        named, full = self.hashes[slot], self.lens[slot] // self.block_size
        if full > len(named):
            bs = self.block_size
            new = prefix_cache.block_hashes(context[len(named) * bs:full * bs], bs,
                                            named[-1] if named else b"")
            for b, h in zip(self.tables[slot][len(named):full], new):
                self.prefix.register(b, h)
            named += new

    def never_fits(self, n_tokens: int) -> str | None:
        need = self.blocks_for(n_tokens)
        if need > self.n_blocks:
            return (f"needs {need} blocks of {self.block_size}, but the whole KV pool "
                    f"has {self.n_blocks}")
        return super().never_fits(n_tokens)

    def reserved_tokens(self) -> int:
        return self.n_blocks * self.block_size

    def allocated_tokens(self) -> int:
        return (self.n_blocks - self.n_free()) * self.block_size

    def capacity(self, slot: int) -> int:
        return min(self.max_len, len(self.tables[slot]) * self.block_size)

    # ---- the step: write and read through the block tables ---------------------------------
    def _table_tensor(self, slots: list[int]) -> Tensor:
        """Block tables of these slots as (B, n_table), padded with block 0 (read only at
        masked positions)."""
        n = max(1, max(len(self.tables[s]) for s in slots))
        rows = [self.tables[s] + [0] * (n - len(self.tables[s])) for s in slots]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _index(self, rows: list[int], positions: Tensor) -> None:
        B, W = len(rows), self._mask.size(-1)                           # keys any row may see
        tables = self._table_tensor(rows)                               # (B, n_table)
        keys = torch.arange(W, device=self.device).expand(B, W)         # (B, W)
        self._write = self.new_columns(slot_mapping(tables, positions, self.block_size))  # (N,)
        self._read = slot_mapping(tables, keys, self.block_size)        # (B, W)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        pk, pv = self.k[layer], self.v[layer]
        pk.index_copy_(0, self._write, self.new_tokens(k).to(pk.dtype))  # (N, n_kv, hd) rows
        pv.index_copy_(0, self._write, self.new_tokens(v).to(pv.dtype))
        B, W = self._read.shape
        shape = (B, W) + k.shape[1:2] + k.shape[3:]                     # (B, W, n_kv, hd)
        # index_select of the flat indices: the same gather as pool[read], several times faster
        keys = pk.index_select(0, self._read.view(-1)).view(shape).transpose(1, 2)
        values = pv.index_select(0, self._read.view(-1)).view(shape).transpose(1, 2)
        return keys, values, self._mask                                 # (B, n_kv, W, hd)
