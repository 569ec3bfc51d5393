"""Step 05 - the paged KV cache: memory in blocks, handed out as a sequence grows.

A slot (04) reserves max_len positions for whatever request it holds, and most requests are
short, so most of the reservation holds nothing. Here every layer's keys and values live in one
pool of n_blocks blocks of block_size positions. A sequence owns a list of blocks, its **block
table**: its position p lives in block table[p // block_size] at offset p % block_size. It gets
a block when it grows past the last one and gives every block back when it ends, so a sequence
wastes at most one partly filled block.

Memory can now run out mid-run: requests grow, and the pool is shared. Before each decode step
`reserve_step` gives every running sequence the block its next token needs; when the pool is
dry it **preempts** the youngest running request (the last to arrive): its blocks go back to the
pool, and the engine queues it again, to be recomputed later from its prompt and the tokens it
has generated so far. The oldest requests always make progress, so the run ends.

`PagedKVCache` has the interface of `SlotKVCache` (ContinuousEngine(kv="paged") uses it in the
same places), plus block tables. Its seams are exercise 05: the block allocator
(`allocate_blocks`, `free_blocks`), the block-table lookup (`slot_mapping`) and the preemption
choice (`choose_victim`).
"""

import math

import torch
from torch import Tensor

from tinyllm.kv_cache import KVCache, decode_mask


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
    """Which slot gives up its blocks when the pool is dry. running maps each running slot to
    its request's arrival number (lower = arrived earlier). The youngest request is preempted:
    it has made the least progress, and the oldest ones keep going, so the run always ends."""
    return max(running, key=running.get)


class PagedKVCache:
    """Step 05 - keys/values of n_slots sequences in a shared pool of blocks.

    Per layer the pool is (n_blocks * block_size, n_kv, hd): pool row b * block_size + i is
    offset i of block b. tables[s] is slot s's block table. reserved_tokens() is the pool,
    allocated_tokens() what the block tables hold, used_tokens() the positions written.
    A decode step runs the active slots only, as in SlotKVCache: `positions` builds the step's
    write indices, read indices (the first W positions of every row through its block table)
    and mask, once for every layer; `update` writes and gathers.
    """

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int,
                 n_blocks: int, block_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device=None):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        self.n_layers, self.n_slots, self.max_len = n_layers, n_slots, max_len
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_blocks * block_size, n_kv_heads, head_dim)           # (N * bs, n_kv, hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.allocator = BlockAllocator(n_blocks)
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.active = [False] * n_slots
        self.lens = [0] * n_slots                     # tokens stored per slot
        self.arrival = [0] * n_slots                  # the request's arrival number, per slot
        self.device = device
        self._admitted = 0

    # ---- bookkeeping -----------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if not self.active[s]]

    def live_slots(self) -> list[int]:
        """The active slots, in slot order: the rows of the next decode step."""
        return [s for s in range(self.n_slots) if self.active[s]]

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def can_admit(self, lens: list[int]) -> bool:
        """Room for requests whose contexts have these lengths: a free slot each, and blocks
        for the context plus the next token (so a newcomer never needs a block at once)."""
        return (len(lens) <= len(self.free_slots()) and all(n < self.max_len for n in lens)
                and sum(self.blocks_for(n + 1) for n in lens) <= self.allocator.n_free())

    def admit(self, slots: list[int], pre: KVCache, pad: list[int],
              arrivals: list[int] | None = None) -> None:
        """Copy row i of a padded prefill (pre.pos = L) into blocks of slots[i], without its
        pad[i] pads. arrivals: each request's arrival number, its seniority when the pool runs
        dry (default: the order of admission)."""
        lens = [pre.pos - p for p in pad]
        for s in slots:
            if self.active[s]:
                raise ValueError(f"slot {s} is already serving a request")
        if not self.can_admit(lens):
            raise ValueError(f"no room for contexts of {lens} tokens: {len(self.free_slots())} "
                             f"free slots, {self.allocator.n_free()} free blocks")
        L = pre.pos
        for i, (s, p, n) in enumerate(zip(slots, pad, lens)):
            self.tables[s] = self.allocator.allocate(self.blocks_for(n + 1))
            where = slot_mapping(self._table_tensor([s]), torch.arange(n, device=self.device)[None],
                                 self.block_size)[0]                    # (n,)
            for layer in range(self.n_layers):
                self.k[layer][where] = pre.k[layer][i, :, p:L].transpose(0, 1)   # (n, n_kv, hd)
                self.v[layer][where] = pre.v[layer][i, :, p:L].transpose(0, 1)
            self.active[s], self.lens[s] = True, n
            self.arrival[s] = arrivals[i] if arrivals is not None else self._admitted
            self._admitted += 1

    def reserve_step(self) -> list[int]:
        """Give every active slot the block its next token needs, oldest request first. When
        the pool is dry, preempt (release) the youngest running request, until the block is
        found or the slot itself was preempted. Returns the preempted slots, youngest first."""
        preempted = []
        for s in sorted(self.live_slots(), key=lambda s: self.arrival[s]):
            while self.active[s] and self.lens[s] >= len(self.tables[s]) * self.block_size:
                got = self.allocator.allocate(1)
                if got is not None:
                    self.tables[s] += got
                    continue
                victim = choose_victim({t: self.arrival[t] for t in self.live_slots()})
                self.release(victim)
                preempted.append(victim)
        return preempted

    def release(self, s: int) -> None:
        self.allocator.free(self.tables[s])
        self.tables[s] = []
        self.active[s] = False
        self.lens[s] = 0

    def used_tokens(self) -> int:
        return sum(self.lens)

    def reserved_tokens(self) -> int:
        return self.n_blocks * self.block_size

    def allocated_tokens(self) -> int:
        return (self.n_blocks - self.allocator.n_free()) * self.block_size

    def _table_tensor(self, slots: list[int]) -> Tensor:
        """Block tables of these slots as (B, n_table), padded with block 0 (read only at
        masked positions)."""
        n = max(1, max(len(self.tables[s]) for s in slots))
        rows = [self.tables[s] + [0] * (n - len(self.tables[s])) for s in slots]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    # ---- the cache protocol ----------------------------------------------------------------
    def positions(self, T: int) -> Tensor:
        """Starts a decode step of the B active slots: each one's next position (B, 1), and
        (once for every layer) where to write it, what to read and the mask."""
        if T != 1:
            raise ValueError("PagedKVCache decodes one token per slot; prefill goes through KVCache")
        live = self.live_slots()
        if not live:
            raise ValueError("no active slot to decode")
        short = [s for s in live if self.lens[s] >= len(self.tables[s]) * self.block_size]
        if short:
            raise ValueError(f"slot {short[0]} has no block for position {self.lens[short[0]]}: "
                             "call reserve_step() before a decode step")
        self._live_list = live
        lens, self._mask = decode_mask([self.lens[s] for s in live], self.device)  # (B,), mask
        W = self._mask.size(-1)                                         # keys any row may see
        tables = self._table_tensor(live)                               # (B, n_table)
        keys = torch.arange(W, device=self.device).expand(len(live), W)  # (B, W)
        self._write = slot_mapping(tables, lens[:, None], self.block_size)[:, 0]   # (B,)
        self._read = slot_mapping(tables, keys, self.block_size)        # (B, W)
        return lens[:, None]                                            # (B, 1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)     # e.g. bf16 pool, fp32 k
        self.k[layer].index_copy_(0, self._write, k[:, :, 0])           # (B, n_kv, hd) rows
        self.v[layer].index_copy_(0, self._write, v[:, :, 0])
        if layer == self.n_layers - 1:
            for s in self._live_list:
                self.lens[s] += 1
        B, W = self._read.shape
        shape = (B, W) + k.shape[1:2] + k.shape[3:]                     # (B, W, n_kv, hd)
        # index_select of the flat indices: the same gather as pool[read], several times faster
        keys = self.k[layer].index_select(0, self._read.view(-1)).view(shape).transpose(1, 2)
        values = self.v[layer].index_select(0, self._read.view(-1)).view(shape).transpose(1, 2)
        return keys, values, self._mask                                 # (B, n_kv, W, hd)
