"""Step 04 - the slot cache: a fixed set of slots that requests join and leave.

A request holds a slot from admission to its last token, then the slot serves the next one at
once. Every forward pass is a **ragged step**: each row (a busy slot) brings its own number of
new tokens: its context when admitted, one token while it decodes, later a chunk of a prompt or
a run of guesses. `SlotCache` is the engine's half (free slots, admit, reserve, release, roll
back, tokens used; parts.CacheBooks), `RaggedStep` the model's (parts.StepView): the engine
plans a step (`plan_step(rows, q_lens)`), the forward pass begins it (`begin_step`: positions,
mask, where to write and read, once for every layer), stores and reads in each layer, and ends
it (`end_step`: each row grows by its new tokens). A step whose rows differ in length is
**packed** (`packing`): the model computes its N new tokens alone, and each layer stores every
row's new tokens (`store`) before any group of rows reads (`read`), since two newcomers of one
step may share blocks (08). `layout` says where the keys lie, for attention in place (13).
`SlotKVCache` reserves max_len positions per slot up front; the paged cache (05) keeps the
same interface with its memory in blocks.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


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
    lens_t = torch.tensor(lens, device=device)[:, None]                 # (B, 1)
    last = torch.tensor(q_lens, device=device)[:, None] - 1             # (B, 1)
    cols = torch.arange(max(q_lens), device=device)[None, :]            # (1, T)
    positions = lens_t + torch.minimum(cols, last)                      # (B, T)
    keys = torch.arange(max(n + q for n, q in zip(lens, q_lens)), device=device)   # (W,)
    mask = keys[None, None, :] <= positions[:, :, None]                 # (B, T, W)
    return positions, mask[:, None]                                     # (B, T), (B, 1, T, W)


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True: may attend) as the float mask attention adds to its scores: 0, or
    -inf where a key is hidden. SDPA turns a bool mask into this on every call, so a step
    makes it once for all its layers."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


class StepMask:
    """A step's mask: `bool` (B, 1, T, W), ragged_mask's, True = may attend; and as attention
    adds it to its scores (`additive`): `whole()`, made at the first layer that asks and kept
    for the others (a decode step whose attention runs in C never asks), or `rows(picked, W)`,
    a packed step's group of rows alone, over the W keys they may see (R, 1, T, W), kept by
    PackedStep.picked."""

    def __init__(self, mask: Tensor, dtype: torch.dtype):
        self.bool, self.dtype = mask, dtype
        self._whole: Tensor | None = None
        self.T, self.W = mask.size(2), mask.size(3)

    def whole(self) -> Tensor:
        if self._whole is None:
            self._whole = additive(self.bool, self.dtype)
        return self._whole

    def rows(self, picked: Tensor, W: int) -> Tensor:
        return additive(self.bool.index_select(0, picked)[..., :W], self.dtype)


class PackedStep:
    """A ragged step with padding, packed: its N new tokens in row order (row b's q_lens[b]
    tokens, then row b + 1's), and where they sit among its (B, T) columns (`places`, (N,)).
    Attention takes its rows in groups, each padded to its own longest row (`groups`): the rows
    of one token (decodes), then the others (prompts, chunks, guesses), so that no decode is
    padded to a prompt's width, as vLLM's backends split a step's decodes from its prefills."""

    def __init__(self, q_lens: list[int], device):
        T, starts = max(q_lens), [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.q_lens, self.T, self._starts, self.device = q_lens, T, starts, device
        self._picked: dict = {}                         # rows -> a cache's indices (picked)
        self._tokens: dict = {}                         # rows -> their tokens (tokens)
        self.places = torch.tensor([b * T + i for b, q in enumerate(q_lens) for i in range(q)],
                                   device=device)                       # (N,)

    def groups(self, rows: list[int] | None = None) -> list[list[int]]:
        """These rows (default: all of them) in attention's groups: those of one token, then
        the others; empty groups left out."""
        picked = range(len(self.q_lens)) if rows is None else rows
        groups = [[b for b in picked if self.q_lens[b] == 1],
                  [b for b in picked if self.q_lens[b] > 1]]
        return [g for g in groups if g]

    def picked(self, rows: list[int], pick) -> tuple:
        """A cache's indices for these rows' store and read: pick(their new tokens among the
        N, the rows), made at the step's first layer and kept for the others."""
        key = tuple(rows)
        if key not in self._picked:
            self._picked[key] = pick(self.tokens(rows)[0], torch.tensor(rows, device=self.device))
        return self._picked[key]

    def tokens(self, rows: list[int]) -> tuple[Tensor, Tensor, int]:
        """The new tokens of these rows, as places among the N and as places among the rows'
        own (len(rows), T) columns, T their longest row's tokens: (n,), (n,), T. Made at the
        step's first layer and kept for the others."""
        key = tuple(rows)
        if key not in self._tokens:
            q, start = self.q_lens, self._starts
            T = max(q[b] for b in rows)
            among = [start[b] + i for b in rows for i in range(q[b])]
            cols = [r * T + i for r, b in enumerate(rows) for i in range(q[b])]
            self._tokens[key] = (torch.tensor(among, device=self.device),
                                 torch.tensor(cols, device=self.device), T)
        return self._tokens[key]


@dataclass
class PlannedStep:
    """A planned step as another copy of the cache needs it (14: a rank's cache follows rank
    0's books): the rows' slots and new tokens (as plan_step took them), the tokens each row's
    slot holds, and a paged cache's block tables of the rows (None for slots)."""
    rows: list[int]
    q_lens: list[int]
    lens: list[int]
    tables: list[list[int]] | None


def check_slot(cache: "RaggedStep", slot) -> None:
    """Raise ValueError unless slot is one of the cache's slots."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < cache.n_slots:
        raise ValueError(f"slot {slot!r} is not one of the cache's slots 0..{cache.n_slots - 1}")


def check_plan(cache: "RaggedStep", rows: list[int], q_lens: list[int]) -> None:
    """Raise ValueError naming why a step of these rows and q_lens cannot run: slots that are
    not distinct or not busy, a q_len that is not a positive int, or no room for the tokens."""
    if not rows or len(rows) != len(q_lens) or len(set(rows)) != len(rows):
        raise ValueError(f"a step needs distinct slots and one q_len each, got {rows}, {q_lens}")
    for s, q in zip(rows, q_lens):
        check_slot(cache, s)
        if not cache.active[s]:
            raise ValueError(f"slot {s} is free: admit a sequence before stepping it")
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ValueError(f"slot {s}: a row brings q_len >= 1 new tokens, got {q!r}")
        if cache.lens[s] + q > cache.capacity(s):
            raise ValueError(f"slot {s} holds {cache.lens[s]} tokens and has room for "
                             f"{cache.capacity(s)}: it cannot take {q} more (reserve first)")


def check_admission(cache: "SlotCache", slot: int, n_tokens: int,
                    context: list[int] | None) -> None:
    """Raise ValueError naming why slot cannot be given to a context of n_tokens: not a slot
    of the cache, busy, a context that cannot fit a slot, or a context of another length."""
    check_slot(cache, slot)
    if cache.active[slot]:
        raise ValueError(f"slot {slot} is already serving a request")
    if not 0 < n_tokens < cache.max_len:
        raise ValueError(f"a context of {n_tokens} tokens does not fit a slot of "
                         f"{cache.max_len}")
    if context is not None and len(context) != n_tokens:
        raise ValueError(f"admit(slot, {n_tokens}, context) was given a context of "
                         f"{len(context)} tokens: pass the sequence's whole context")


def slots_problem(cache: "SlotCache", idle: bool) -> str | None:
    """What is wrong with a slot cache's books between steps, or None: a free slot holds no
    token, no slot holds more than its room (capacity), and no step is left half done; idle,
    no slot is busy."""
    busy = cache.live_slots()
    if idle and busy:
        return f"slots {busy} are still busy after every request finished: nobody released them"
    for s in range(cache.n_slots):
        if not cache.active[s] and cache.lens[s]:
            return f"slot {s} is free but holds {cache.lens[s]} tokens: a released slot holds none"
        if not 0 <= cache.lens[s] <= cache.capacity(s):
            return f"slot {s} holds {cache.lens[s]} tokens, but it has room for {cache.capacity(s)}"
    if cache._plan is not None:
        return "a step was planned (plan_step) and no forward pass ended it"
    return None


class RaggedStep:
    """The model's half of a slot cache: one ragged step at a time (`plan_step`, then the
    forward pass's `begin_step`, `update` or `store` and `read` in each layer, or `layout`,
    and `end_step`), over the slots' lengths (`lens`) and the keys and values a subclass keeps.
    During a step: `mask` (a StepMask), `packing` (a PackedStep, or None when no column is
    padding) and `memo`, what the step's layers share. SlotCache is the engine's half."""

    # what a step reads of the slots' books (SlotCache) and of their storage (a subclass)
    n_slots: int
    active: list[bool]
    lens: list[int]
    device: Any
    k: list[Tensor]
    v: list[Tensor]
    _plan: tuple[list[int], list[int]] | None
    packing: PackedStep | None
    memo: dict
    _write: Tensor                      # made by _index
    _reads: Tensor

    def capacity(self, slot: int) -> int:
        raise NotImplementedError

    def plan_step(self, rows: list[int], q_lens: list[int]) -> None:
        """The next forward pass runs these busy slots, in this order (batch row i is slot
        rows[i]), and row i brings q_lens[i] >= 1 new tokens."""
        check_plan(self, rows, q_lens)
        self._plan = (list(rows), list(q_lens))

    def planned(self) -> tuple[list[int], list[int]]:
        """The planned step: its rows' slots and the new tokens each brings."""
        if self._plan is None:
            raise ValueError("no step planned: call plan_step(rows, q_lens) before the pass")
        return self._plan

    def begin_step(self, T: int) -> Tensor:
        rows, q_lens = self.planned()
        if T != max(q_lens):
            raise ValueError(f"the step was planned for {max(q_lens)} columns, the batch has {T}")
        lens = [self.lens[s] for s in rows]
        positions, mask = ragged_mask(lens, q_lens, self.device)       # (B, T), (B, 1, T, W)
        self.mask = StepMask(mask, self.k[0].dtype)
        self.packing = None if min(q_lens) == T else PackedStep(q_lens, self.device)
        self._B, self._n, self.memo = len(rows), sum(q_lens), {}
        self._layout: tuple | None = None
        self._widths = [n + q for n, q in zip(lens, q_lens)]           # keys each row may see
        self._index(rows, positions)
        return positions

    def layout(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Where the step's keys lie, for code that writes and reads them in place (a C kernel,
        13): the layer's keys and values (contiguous: rows of hd); write (N, n_kv), the row each
        new token's key and value go to, for each KV head; read (B, W), the row of KV head 0's
        key at each position a row may see (head h's: + h * stride); stride. Made at the step's
        first layer and kept for the others."""
        self._layout = self._layout or self._where()
        return (self.k[layer], self.v[layer], *self._layout)

    def new_tokens(self, x: Tensor, n: int | None = None) -> Tensor:
        """The step's new keys (or values) as rows (N, n_kv, hd): x (B, n_kv, T, hd) of a step
        without padding, or (1, n_kv, n, hd), n of a packed step's new tokens (n: all N)."""
        B, n_kv, T, hd = x.shape
        if B * T != (n or self._n) or B != (self._B if self.packing is None else 1):
            raise ValueError(f"the step was planned for {self._B} rows and {n or self._n} new "
                             f"tokens, the batch has {B} rows of {T}")
        return x.transpose(1, 2).reshape(B * T, n_kv, hd)                # (N, n_kv, hd)

    def new_columns(self, x: Tensor) -> Tensor:
        """A value per column of the batch, x (B, T) (a position, a slot, a pool row), for the
        step's new tokens only, padding left out: (N,)."""
        flat = x.reshape(-1)
        return flat if self.packing is None else flat.index_select(0, self.packing.places)

    def end_step(self) -> None:
        rows, q_lens = self.planned()
        for s, q in zip(rows, q_lens):
            self.lens[s] += q
        self._plan, self.packing, self.memo = None, None, {}

    def _index(self, rows: list[int], positions: Tensor) -> None:
        """Where the step writes and reads: `_write` (N * n_kv,), each new token's row for each
        KV head in a layer's cache seen as rows of hd; `_reads`, what each of the B rows reads
        (its slot, or its W keys' rows)."""
        raise NotImplementedError

    def _picked(self, rows: list[int]) -> tuple[Tensor, Tensor, Tensor, int]:
        """A packed step's group of rows: where their new tokens go (n * n_kv,), what they read,
        their additive mask (R, 1, T, W) and W, the most keys one of them may see (a group of
        decodes reads no further than its own longest context, whatever the step's prompts
        are); made at the step's first layer."""
        n_kv, W = self.k[0].size(1), max(self._widths[b] for b in rows)
        assert self.packing is not None, "a group of rows is a packed step's"
        return self.packing.picked(rows, lambda tokens, picked: (
            self._write.view(-1, n_kv).index_select(0, tokens).view(-1),
            self._reads.index_select(0, picked), self.mask.rows(picked, W), W))

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Cache.update: the step's new keys and values stored, then every row's read."""
        self.store(layer, k, v)
        return self.read(layer)

    def store(self, layer: int, k: Tensor, v: Tensor, rows: list[int] | None = None) -> None:
        """Write new keys and values k, v: the step's, (B, n_kv, T, hd) without padding, or the
        n new tokens of a packed step's `rows`, (1, n_kv, n, hd) in row order. A layer stores
        every new token of its step before any row reads: a newcomer may attend to blocks that
        another newcomer of the same step writes (a prefix cache names them at admission, 08)."""
        write = self._write if rows is None else self._picked(rows)[0]
        n_kv = self.k[0].size(1)
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):   # index_copy_ of rows:
            hd = cache.size(-1)                                         # twice index_put's speed
            new = self.new_tokens(new, len(write) // n_kv).to(cache.dtype).reshape(-1, hd)
            cache.view(-1, hd).index_copy_(0, write, new)               # (n * n_kv, hd)

    def read(self, layer: int, rows: list[int] | None = None
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the step's rows (or a packed step's `rows`) attend to, once every new token is
        stored: keys and values (R, n_kv, W, hd) and the additive mask (R, 1, T, W)."""
        if rows is None:
            return (*self._gather(layer, self._reads, self.mask.W, True), self.mask.whole())
        _, reads, mask, W = self._picked(rows)
        return (*self._gather(layer, reads, W, False), mask)

    def _gather(self, layer: int, reads: Tensor, W: int, whole: bool) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _where(self) -> tuple[Tensor, Tensor, int]:
        raise NotImplementedError


class SlotCache(RaggedStep):
    """The engine's half of a cache of n_slots slots, each holding at most max_len tokens (the
    model's half, the step, is RaggedStep's): `active[s]`, `lens[s]` (tokens stored), and the
    step in progress. Subclasses store the keys and values
    (in lists `k` and `v`, a tensor per layer; `_index`: where a step writes and reads;
    `_gather`: the keys a read returns; `_where`: the rows of `layout`) and say
    how much memory a slot may use (`capacity`, `reserve`)."""

    n_blocks: int | None = None         # a pool's blocks (05); slots have none
    tables: Any = None                  # a pool's block tables, a list per slot (05)
    name_at_admission = False           # a prefix cache names blocks as it admits (08)

    def __init__(self, n_layers: int, n_slots: int, max_len: int, device=None):
        self.n_layers, self.n_slots, self.max_len, self.device = n_layers, n_slots, max_len, device
        self.active = [False] * n_slots
        self.lens = [0] * n_slots                     # tokens stored per slot
        self._plan: tuple[list[int], list[int]] | None = None
        self.packing: PackedStep | None = None        # a step's new tokens among its columns
        self.memo: dict = {}                          # what a step's layers share
        self.shares_prefixes = False                  # admitted contexts share blocks (08)

    # ---- slots ----------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if not self.active[s]]

    def live_slots(self) -> list[int]:
        """The busy slots, in slot order."""
        return [s for s in range(self.n_slots) if self.active[s]]

    def can_admit(self, lens: list[int], contexts: list[list[int]] | None = None) -> bool:
        """Room for sequences whose contexts hold these numbers of tokens: a free slot each,
        and memory for each context plus its next token. Given the contexts themselves, a
        prefix cache (08) counts only the memory of what it does not hold already."""
        if contexts is not None and len(contexts) != len(lens):
            raise ValueError(f"can_admit takes a context per length: {len(lens)} lengths, "
                             f"{len(contexts)} contexts")
        return len(lens) <= len(self.free_slots()) and all(0 < n < self.max_len for n in lens)

    def admit(self, slot: int, n_tokens: int, context: list[int] | None = None) -> None:
        """Give a free slot to a sequence whose context of n_tokens is about to be computed,
        with memory for the context and its next token. Afterwards lens[slot] is the tokens
        the slot holds already: none here; given the context (n_tokens of them), a prefix
        cache (08) starts the slot with the cached blocks of its longest cached prefix."""
        check_admission(self, slot, n_tokens, context)
        self.active[slot], self.lens[slot] = True, 0

    def reserve(self, slot: int, n: int = 1) -> bool:
        """Memory for n more tokens in slot; False (and nothing changed) when there is none."""
        return self.lens[slot] + n <= self.capacity(slot)

    def release(self, slot: int) -> None:
        """The slot's sequence is gone (finished, aborted or preempted): the slot is free."""
        self.active[slot], self.lens[slot] = False, 0

    def rollback(self, slot: int, n: int) -> None:
        """Forget the slot's last n tokens (speculative decoding drops the guesses that were
        wrong); their positions are written again by the next tokens."""
        if not self.active[slot] or not 0 <= n <= self.lens[slot]:
            raise ValueError(f"cannot roll slot {slot} back by {n}: it holds {self.lens[slot]} "
                             f"tokens")
        self.lens[slot] -= n

    def cache_blocks(self, slot: int, context) -> None:
        """After a step: the slot's stored tokens (the first lens[slot] of context(), a callable
        asked only when needed) may serve later requests (a prefix cache names its full
        blocks, 08; a slot keeps nothing)."""

    def never_fits(self, n_tokens: int) -> str | None:
        """Why a sequence of n_tokens can never be held, even alone; None when it can."""
        if n_tokens > self.max_len:
            return f"exceeds a slot's {self.max_len} positions"
        return None

    def used_tokens(self) -> int:
        return sum(self.lens)

    def reserved_tokens(self) -> int:
        return self.n_slots * self.max_len

    def allocated_tokens(self) -> int:
        return self.reserved_tokens()

    def capacity(self, slot: int) -> int:
        """Tokens the slot can hold with the memory it has now."""
        return self.max_len

    def planned_step(self) -> PlannedStep:
        """The planned step (plan_step) with the books of its rows."""
        rows, q_lens = self.planned()
        tables = None if self.tables is None else [list(self.tables[s]) for s in rows]
        return PlannedStep(list(rows), list(q_lens), [self.lens[s] for s in rows], tables)

    def follow(self, step: PlannedStep) -> None:
        """Take another copy's planned step: its rows' books as it says, and the step planned."""
        for i, s in enumerate(step.rows):
            self.active[s], self.lens[s] = True, step.lens[i]
            if step.tables is not None:
                self.tables[s] = step.tables[i]
        self.plan_step(step.rows, step.q_lens)

    def check_integrity(self, idle: bool = False) -> str | None:
        """None when the slots' books are sound, else what is wrong, in one sentence
        (slots_problem). idle (every request has finished): no slot is busy either. Call it
        between steps."""
        return slots_problem(self, idle)


class SlotKVCache(SlotCache):
    """Keys and values of n_slots sequences, max_len positions reserved per slot up front,
    (S, n_kv, max_len, hd) per layer. A slot's position p is its p-th token. A step writes the
    rows' new tokens at their positions and reads the first W positions of each row's slot:
    views when the rows are slots 0..B-1, a gather otherwise."""

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__(n_layers, n_slots, max_len, device)
        shape = (n_slots, n_kv_heads, max_len, head_dim)                 # (S, n_kv, max_len, hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    def _index(self, rows: list[int], positions: Tensor) -> None:
        B, T = positions.shape
        self._reads = torch.tensor(rows, device=self.device)             # (B,) slot of each row
        self._prefix = rows == list(range(B))           # slots 0..B-1: read views, gather nothing
        slot = self.new_columns(self._reads[:, None].expand(B, T))      # (N,)
        n_kv = self.k[0].size(1)
        heads = torch.arange(n_kv, device=self.device)
        # each new token's row for each head in a layer's (S * n_kv * max_len, hd) view
        self._write = ((slot[:, None] * n_kv + heads) * self.max_len
                       + self.new_columns(positions)[:, None]).view(-1)  # (N * n_kv,)

    def _where(self) -> tuple[Tensor, Tensor, int]:
        W, n_kv = self.mask.W, self.k[0].size(1)          # a row per slot, head h max_len on
        first = self._reads[:, None] * (n_kv * self.max_len)                         # (B, 1)
        read = first + torch.arange(W, device=self.device)                           # (B, W)
        return self._write.view(-1, n_kv), read, self.max_len                        # (N, n_kv)

    def _gather(self, layer: int, slots: Tensor, W: int, whole: bool) -> tuple[Tensor, Tensor]:
        ck, cv = self.k[layer][:, :, :W], self.v[layer][:, :, :W]
        if whole and self._prefix:
            return ck[:self._B], cv[:self._B]
        return ck.index_select(0, slots), cv.index_select(0, slots)      # (R, n_kv, W, hd)
