"""Step 05 - the paged KV cache: memory in blocks, handed out as a sequence grows.

A slot (04) reserves max_len positions for whatever request it holds, and most requests are
short. Here every layer's keys and values live in one pool of n_blocks blocks of block_size
positions; a sequence owns a list of blocks, its **block table** (position p lives in block
table[p // block_size] at offset p % block_size), takes a block as it grows past its last one
and gives them all back when it ends: it wastes at most one partly filled block.

Memory can now run out mid-run. Each step reserves every running sequence's next token
(`reserve`); when the pool is dry the scheduler preempts a request and recomputes it later. A
newcomer enters only while every running sequence could still take a block (`can_admit`'s
headroom). `PagedKVCache` is a `SlotCache` with block tables; with a prefix cache (08) its full
blocks are named and shared, named only once nobody can read them unwritten (after the step that
fills them, or at admission when no token budget splits a context: `name_at_admission`).
Seams (exercise 05): `allocate_blocks`, `free_blocks`, `grow_table`, `slot_mapping`.
"""

import math

import torch
from torch import Tensor

from tinyllm.core.slot_cache import SlotCache, check_admission


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

    def check_integrity(self, counts: list[int], evictable=None) -> str | None:
        """None when the free list agrees with counts (counts[b]: the block tables holding
        block b), else what is wrong: the free list holds a block once at most, a block is
        flagged allocated exactly when it is off the free list, and every block is exactly one
        of free, held by tables, or evictable (a prefix cache's named blocks that nobody holds,
        08). Without a prefix cache (evictable None) no two tables hold one block."""
        free = set(self.free_list)
        if not free <= set(range(self.n_blocks)):
            return f"the free list holds {sorted(free - set(range(self.n_blocks)))}: not blocks"
        if len(free) != len(self.free_list):
            twice = sorted({b for b in self.free_list if self.free_list.count(b) > 1})
            return f"blocks {twice} are on the free list twice: each would go to two sequences"
        flags = [b for b in range(self.n_blocks) if self.allocated[b] == (b in free)]
        if flags:
            return (f"blocks {flags} are flagged allocated while free, or free while flagged "
                    f"allocated: a block is allocated exactly when it is off the free list")
        kept = set(evictable or ())
        both = sorted(b for b in free if counts[b] or b in kept)
        if both:
            return (f"blocks {both} are free, yet a block table holds them or they wait cached: "
                    f"the next allocation would hand them out twice")
        lost = [b for b in range(self.n_blocks)
                if not counts[b] and b not in free and b not in kept]
        if lost:
            return (f"blocks {lost} are allocated, yet no block table holds them"
                    f"{'' if evictable is None else ' and none waits cached'}: blocks leaked")
        shared = [b for b in range(self.n_blocks) if counts[b] > 1]
        if evictable is None and shared:
            return (f"blocks {shared} are in two block tables at once: two sequences would "
                    f"write the same positions")
        return None


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


def held_counts(tables: list[list[int]], n_blocks: int) -> list[int]:
    """How many of these block tables hold each of the pool's n_blocks blocks."""
    counts = [0] * n_blocks
    for table in tables:
        for b in table:
            counts[b] += 1
    return counts


def table_tensor(tables: list[list[int]], device, pad: int = 0, n: int | None = None) -> Tensor:
    """Block tables as (B, n) long, n the longest table's length unless given, each padded
    with block pad (read only at masked positions; a graph's idle rows also write there)."""
    n = n or max(1, max(len(t) for t in tables))
    return torch.tensor([t + [pad] * (n - len(t)) for t in tables], dtype=torch.long,
                        device=device)


def tables_problem(cache: "PagedKVCache") -> str | None:
    """What is wrong with a paged cache's block tables and their names, between steps, or
    None: a free slot's table is empty, a table holds blocks of the pool and no more than
    max_len needs, its names (hashes[s]) cover full blocks it has written, and each named block
    it holds is named as its table says."""
    hash_of = {} if cache.prefix is None else cache.prefix.hash_of
    for s, (table, names) in enumerate(zip(cache.tables, cache.hashes)):
        if not cache.active[s] and (table or names):
            return (f"slot {s} is free but its block table holds blocks {table}: release gives "
                    f"them back")
        wrong = [b for b in table if isinstance(b, bool) or not isinstance(b, int)
                 or not 0 <= b < cache.n_blocks]
        if wrong:
            return f"slot {s}'s block table holds {wrong}: not blocks 0..{cache.n_blocks - 1}"
        if len(table) > cache.blocks_for(cache.max_len):
            return (f"slot {s}'s block table holds {len(table)} blocks, more than a sequence of "
                    f"{cache.max_len} tokens needs")
        if len(names) * cache.block_size > cache.lens[s] or len(names) > len(table):
            return (f"slot {s} names {len(names)} blocks, but it holds {cache.lens[s]} tokens "
                    f"in {len(table)} blocks: only full blocks, written, are named")
        for i, b in enumerate(table):
            if b in hash_of and (i >= len(names) or hash_of[b] != names[i]):
                return (f"block {b}, block {i} of slot {s}'s table, is cached under another name "
                        f"than the table gives it: it would serve another prefix")
    return None


def gather(pool: Tensor, read: Tensor) -> Tensor:
    """The keys (or values) at each row's W positions: pool (rows, n_kv, hd) at read (B, W) ->
    (B, n_kv, W, hd). index_select of the flat indices: the same gather as pool[read], several
    times faster."""
    B, W = read.shape
    return pool.index_select(0, read.reshape(-1)).view(B, W, *pool.shape[1:]).transpose(1, 2)


def made_prefix_cache(prefix_cache, allocator: BlockAllocator, block_size: int):
    """A pool's prefix cache (08): prefix_cache(allocator, block_size), a class such as
    prefix_cache.PrefixCache, or None."""
    if isinstance(prefix_cache, bool):
        raise ValueError("prefix_cache takes a class (08: prefix_cache.PrefixCache) or None, "
                         "not a bool (tinyllm.build makes EngineConfig(prefix_cache=True)'s)")
    return None if prefix_cache is None else prefix_cache(allocator, block_size)


def check_rollback(cache: "PagedKVCache", slot: int, n: int) -> None:
    """Raise ValueError if rolling slot back by n would reach into a block the prefix cache
    named (08): other requests may be reading it."""
    named = len(cache.hashes[slot]) * cache.block_size
    if named and 0 < n <= cache.lens[slot] and named > cache.lens[slot] - n:
        raise ValueError(f"cannot roll slot {slot} back by {n}: its first "
                         f"{len(cache.hashes[slot])} blocks are in the prefix cache")


def forget_unwritten(cache: "PagedKVCache", slot: int) -> None:
    """The blocks of slot that the prefix cache names but the slot never wrote lose their names:
    blocks named at admission (08), whose step raised before its pass wrote them
    (engine_core.step_alone fails that step's requests). Between steps there are none."""
    if cache.prefix is not None:
        written = cache.lens[slot] // cache.block_size
        cache.prefix.forget(cache.tables[slot][written:len(cache.hashes[slot])])


class PagedKVCache(SlotCache):
    """Keys/values of n_slots sequences in a shared pool of n_blocks blocks of block_size.

    Per layer the pool is ((n_blocks + 1) * block_size, n_kv, hd): row b * block_size + i is offset
    i of block b; the last block, `pad`, is no table's (a graph's step writes its idle rows there,
    06). tables[s] is slot s's block table. A step writes each new token through its row's table
    and reads each row's first W positions (`slot_mapping`). `pool`, the BlockAllocator or the
    PrefixCache, hands blocks out and back.

    prefix_cache (08: prefix_cache.PrefixCache, made over the pool's allocator): blocks are
    counted by the tables holding them, hashes[s] names slot s's full blocks in order, a
    newcomer admitted with its context starts with the cached blocks of its longest cached
    prefix, and a block is named once written (`cache_blocks`), or with name_at_admission as
    its newcomer is admitted (see `admit`; `release` forgets the names of blocks never written)."""
    n_blocks: int

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int,
                 n_blocks: int, block_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device=None, prefix_cache=None,
                 name_at_admission: bool = False, headroom: bool = True):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need n_blocks, block_size >= 1, got {n_blocks}, {block_size}")
        super().__init__(n_layers, n_slots, max_len, device)
        self.n_blocks, self.block_size, self.pad = n_blocks, block_size, n_blocks
        shape = ((n_blocks + 1) * block_size, n_kv_heads, head_dim)     # ((N + 1) * bs, n_kv, hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.allocator = BlockAllocator(n_blocks)
        self.prefix = made_prefix_cache(prefix_cache, self.allocator, block_size)
        self.pool = self.allocator if self.prefix is None else self.prefix
        self.name_at_admission = name_at_admission and self.prefix is not None
        self.headroom = headroom                        # can_admit: a block per running one
        self.shares_prefixes = self.prefix is not None
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.hashes: list[list[bytes]] = [[] for _ in range(n_slots)]

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def n_free(self) -> int:
        """Blocks a table could take now (with a prefix cache: cached blocks nobody holds too)."""
        return self.pool.n_free()

    # ---- memory: blocks on demand, less a newcomer's cached prefix (08) ---------------------
    def can_admit(self, lens: list[int], contexts: list[list[int]] | None = None) -> bool:
        """As SlotCache.can_admit, in blocks, with one left for every running sequence to grow
        into (self.headroom; else newcomers fill the pool, and whoever grows first pushes them
        out again). 10 free, 3 running: a context of 3 blocks enters (3 + 3 <= 10); 8: not."""
        if not super().can_admit(lens, contexts):
            return False
        need = sum(self._need(n, c)[0] for n, c in zip(lens, contexts or [None] * len(lens)))
        return need + self.headroom * len(self.live_slots()) <= self.n_free()

    def _need(self, n_tokens: int, context: list[int] | None) -> tuple[int, list[int]]:
        """The free blocks that admitting a context of n_tokens takes, and the cached blocks
        it shares (none without a prefix cache or the context): fresh blocks for the rest and
        the next token, and each shared block nobody held (it counted as free)."""
        shared = [] if self.prefix is None or context is None else self.prefix.match(context)
        fresh = self.blocks_for(n_tokens + 1) - len(shared)
        return fresh + sum(self.prefix.refs[b] == 0 for b in shared), shared

    def admit(self, slot: int, n_tokens: int, context: list[int] | None = None) -> None:
        """As SlotCache.admit, with blocks for the context and its next token. Given the
        context, a prefix cache looks it up first: the table starts with the shared blocks,
        lens[slot] counts their tokens, and fresh blocks hold the rest. name_at_admission
        names the context's full blocks at once (the module's docstring says when it may)."""
        check_admission(self, slot, n_tokens, context)
        need, shared = self._need(n_tokens, context)
        if need > self.n_free():
            raise ValueError(f"a context of {n_tokens} tokens needs {need} blocks, {self.n_free()} "
                             f"are free: admit only what can_admit (same context) accepts")
        super().admit(slot, n_tokens, context)
        if shared:                                      # out of the eviction order, then fresh
            self.prefix.share(shared)
        self.tables[slot], self.lens[slot] = list(shared), len(shared) * self.block_size
        self.hashes[slot] = [self.prefix.hash_of[b] for b in shared]
        grow_table(self.tables[slot], n_tokens + 1, self.block_size, self.pool.allocate)
        if self.name_at_admission and context is not None:
            self.prefix.name_blocks(self.tables[slot], self.hashes[slot], context, n_tokens)

    def reserve(self, slot: int, n: int = 1) -> bool:
        """Blocks for n more tokens in slot, taken from the pool as needed; False (and nothing
        taken) when the pool has too few."""
        if self.lens[slot] + n > self.max_len:
            return False
        return grow_table(self.tables[slot], self.lens[slot] + n, self.block_size,
                          self.pool.allocate)

    def release(self, slot: int) -> None:
        forget_unwritten(self, slot)
        self.pool.free(self.tables[slot])
        self.tables[slot], self.hashes[slot] = [], []
        super().release(slot)

    def rollback(self, slot: int, n: int) -> None:
        """As SlotCache.rollback, and the blocks left holding no token go back to the pool.
        A named block (08) is never rolled into: others may be reading it."""
        check_rollback(self, slot, n)
        super().rollback(slot, n)
        keep = self.blocks_for(self.lens[slot])
        self.pool.free(self.tables[slot][keep:])
        del self.tables[slot][keep:]

    def cache_blocks(self, slot: int, context) -> None:
        """Name the slot's full blocks not named yet, for later requests: context() gives the
        tokens they hold (asked only when a block has filled since the last naming)."""
        if self.prefix is not None and self.lens[slot] // self.block_size > len(self.hashes[slot]):
            self.prefix.name_blocks(self.tables[slot], self.hashes[slot], context(),
                                    self.lens[slot])

    def check_integrity(self, idle: bool = False) -> str | None:
        """As SlotCache.check_integrity, then the tables (tables_problem) and the pool's books:
        every block is free, held by tables (counted as often as they hold it), or cached and
        held by nobody. idle: no table holds a block."""
        why = super().check_integrity(idle) or tables_problem(self)
        return why or self.pool.check_integrity(held_counts(self.tables, self.n_blocks))

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
    def _index(self, rows: list[int], positions: Tensor) -> None:
        B, W = len(rows), self.mask.W                                  # keys any row may see
        tables = table_tensor([self.tables[s] for s in rows], self.device)   # (B, n_table)
        keys = torch.arange(W, device=self.device).expand(B, W)         # (B, W)
        at = self.new_columns(slot_mapping(tables, positions, self.block_size))   # (N,)
        n_kv = self.k[0].size(1)                  # the pool as (rows * n_kv, hd): head h 1 on
        self._write = (at[:, None] * n_kv + torch.arange(n_kv, device=self.device)).view(-1)
        self._reads = slot_mapping(tables, keys, self.block_size)       # (B, W)

    def _where(self) -> tuple[Tensor, Tensor, int]:
        n_kv = self.k[0].size(1)
        return self._write.view(-1, n_kv), self._reads * n_kv, 1         # (N, n_kv), (B, W)

    def _gather(self, layer: int, reads: Tensor, W: int, whole: bool) -> tuple[Tensor, Tensor]:
        reads = reads[:, :W]                                            # (R, W): what they see
        return gather(self.k[layer], reads), gather(self.v[layer], reads)   # (R, n_kv, W, hd)
