"""Step 06 - CUDA graphs for decode: one launch for a whole decode step.

Small-batch decode is launch-bound: the CPU takes longer to launch a step's few hundred small
kernels than the GPU takes to run them. A CUDA graph records them once and replays them with one
launch, on the same addresses and shapes, so the step is rebuilt around static buffers (each
slot's token and length, the logits: `fill_static` copies into them), one graph per window
bucket (`choose_bucket`: the smallest that holds the longest busy slot; the mask hides the rest;
above the largest the step runs eagerly) and one decode step (`decode_step`) that replays it.
Every bucket is captured after a warm-up, on a side stream, in one memory pool.

The step decodes every slot, free or not (a graph has one batch shape); prefill stays eager. A
paged cache (05) adds one static input, the block tables (`fill_tables`, `PagedWindowCache`); a
row that decodes nothing gets the pad block alone. On a CPU `capture=False` runs the same
bucketed, static-buffer step eagerly, so CPU tests check its arithmetic token for token.
"""

from typing import Any

import torch
from torch import Tensor

from tinyllm.core import paged_kv
from tinyllm.core.model import Transformer, gpu_dtype
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.parts import DecodeStep
from tinyllm.core.slot_cache import SlotKVCache


def default_buckets(max_len: int, smallest: int = 32) -> list[int]:
    """Powers of two from `smallest`, and max_len itself: (32, 64, 128, 256, 512) for 512."""
    out, w = [], smallest
    while w < max_len:
        out.append(w)
        w *= 2
    return out + [max_len]


def choose_bucket(buckets: list[int], window: int) -> int | None:
    """The bucket a decode step runs at: the smallest of buckets (sorted ascending) that holds
    window keys, the number the longest active sequence attends to (its length + 1: the new
    token sees itself). None when no bucket is that large (the step then runs eagerly).
    Example: buckets [8, 16, 32]: window 8 -> 8, window 9 -> 16, window 40 -> None."""
    for b in buckets:
        if b >= window:
            return b
    return None


def fill_static(static_tokens: Tensor, static_lens: Tensor, tokens: Tensor, lens: Tensor) -> None:
    """Put this step's inputs in the static buffers: afterwards static_tokens (S, 1) holds the
    values of tokens (S, 1), and static_lens (S,) those of lens (S,). A captured graph reads
    the very memory it was captured with, so the buffers keep their memory (the same tensors,
    written into), and hold copies: the caller may reuse tokens and lens.
    Example: static_tokens zeros (3, 1), tokens [[7], [8], [9]]: afterwards static_tokens is
    [[7], [8], [9]], still at static_tokens.data_ptr(), and setting tokens[0, 0] = 99 later
    leaves it 7."""
    static_tokens.copy_(tokens)
    static_lens.copy_(lens)


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
    slots = decoder.slots
    window = max(slots.lens[s] for s in slots.live_slots()) + 1
    W = choose_bucket(decoder.buckets, window)
    lens = torch.tensor([n if a else 0 for n, a in zip(slots.lens, slots.active)],
                        device=decoder.device)                         # (S,)
    fill_static(decoder.tokens, decoder.lens, tokens, lens)
    if W is not None and decoder.capture:
        decoder.graphs[W].replay()
        logits = decoder.logits[W]
    else:                                               # eager: no capture, or no bucket fits
        logits = decoder.run_eager(W or window)
    slots.end_step()
    return logits


class WindowCache:
    """The decode step's cache as a graph sees it: all S slots of a SlotKVCache, attending to
    the first W positions, each slot writing its new key at its length from the static lens
    buffer. Implements the Cache protocol with tensor operations only: no Python state changes
    between steps, so a replay repeats it faithfully."""

    packing = None

    def __init__(self, slots: SlotKVCache, lens: Tensor, W: int):
        self.slots, self.lens, self.W = slots, lens, W
        self.rows = torch.arange(slots.n_slots, device=lens.device)     # (S,)
        self.keys = torch.arange(W, device=lens.device)                 # (W,)

    def begin_step(self, T: int) -> Tensor:
        self.mask = (self.keys[None, :] <= self.lens[:, None])[:, None, None, :]   # (S, 1, 1, W)
        return self.lens[:, None]                                       # (S, 1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        sk, sv = self.slots.k[layer], self.slots.v[layer]               # (S, n_kv, max_len, hd)
        k, v = k.to(sk.dtype), v.to(sv.dtype)
        sk[self.rows, :, self.lens] = k[:, :, 0]                        # (S, n_kv, hd) at lens
        sv[self.rows, :, self.lens] = v[:, :, 0]
        return sk[:, :, :self.W], sv[:, :, :self.W], self.mask

    def end_step(self) -> None:
        """Nothing to count here: the slot cache ends its own step after the replay."""


class PagedWindowCache:
    """The decode step's cache as a graph sees it over a paged pool (05): each of the S rows
    writes its new key at its length (the static lens buffer) through its block table (the
    static tables buffer, (S, n_table)) and reads its first W positions through the same table
    (slot_mapping). Tensor operations only, as WindowCache: a replay repeats it faithfully."""

    packing = None

    def __init__(self, pool: PagedKVCache, lens: Tensor, tables: Tensor, W: int):
        self.pool, self.lens, self.tables, self.W = pool, lens, tables, W
        self.keys = torch.arange(W, device=lens.device)                 # (W,)

    def begin_step(self, T: int) -> Tensor:
        S, bs, where = self.tables.size(0), self.pool.block_size, paged_kv.slot_mapping
        self.mask = (self.keys[None, :] <= self.lens[:, None])[:, None, None, :]   # (S, 1, 1, W)
        self.write = where(self.tables, self.lens[:, None], bs)[:, 0]               # (S,)
        self.read = where(self.tables, self.keys.expand(S, self.W), bs)             # (S, W)
        return self.lens[:, None]                                       # (S, 1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        pk, pv = self.pool.k[layer], self.pool.v[layer]                 # (rows, n_kv, hd)
        pk.index_copy_(0, self.write, k[:, :, 0].to(pk.dtype))          # (S, n_kv, hd) rows
        pv.index_copy_(0, self.write, v[:, :, 0].to(pv.dtype))
        shape = self.read.shape + pk.shape[1:]                          # (S, W, n_kv, hd)
        keys = pk.index_select(0, self.read.view(-1)).view(shape).transpose(1, 2)
        values = pv.index_select(0, self.read.view(-1)).view(shape).transpose(1, 2)
        return keys, values, self.mask                                  # (S, n_kv, W, hd)

    def end_step(self) -> None:
        """Nothing to count here: the paged cache ends its own step after the replay."""


class SlotGraphDecoder(DecodeStep):
    """Decode steps of a slot cache's slots (a SlotKVCache, or a PagedKVCache's), replayed as
    CUDA graphs, one per window bucket.

    step(tokens (S, 1)) -> logits (S, 1, V) for every slot (read the busy ones): the decode
    step the engine planned (`slots.plan_step(the decoding slots, one token each)`; a busy
    slot it does not plan, one whose prompt is still being prefilled, is computed like a free
    one: in a SlotKVCache the prefill that follows overwrites the key it wrote, in a paged
    pool it writes to the pad block). A replay runs the captured kernels but none of the
    forward pass's Python, so step() ends the slots' step itself, as the model's forward pass
    does. capture: record graphs (default: on CUDA); False runs the same bucketed
    static-buffer step eagerly. Capture writes into the slots, so it happens at construction,
    while every slot is free. The logits returned by a replay are the graph's static output:
    use them before the next step.
    """

    def __init__(self, model: Transformer, slots: SlotKVCache | PagedKVCache, buckets=None,
                 capture: bool | None = None):
        if not isinstance(slots, (SlotKVCache, PagedKVCache)):
            raise ValueError(f"SlotGraphDecoder decodes a SlotKVCache or a PagedKVCache, got "
                             f"{type(slots).__name__}")
        self.model, self.slots = model, slots
        self.device = slots.k[0].device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; on a CPU use capture=False")
        if buckets is not None and (not buckets or any(
                isinstance(b, bool) or not isinstance(b, int) for b in buckets)):
            raise ValueError(f"buckets must be window sizes, whole numbers of positions, got "
                             f"{buckets!r}")
        buckets = sorted(set(buckets or default_buckets(slots.max_len)))
        if buckets[0] < 1 or buckets[-1] > slots.max_len:
            raise ValueError(f"buckets must lie in 1..{slots.max_len} (the slots' max_len), "
                             f"got {buckets}")
        self.buckets = buckets
        S = slots.n_slots
        self.tokens = torch.zeros(S, 1, dtype=torch.long, device=self.device)   # static inputs
        self.lens = torch.zeros(S, dtype=torch.long, device=self.device)
        self.tables = None                              # a paged cache's tables (S, n_table)
        if isinstance(slots, PagedKVCache):
            self.tables = torch.full((S, slots.blocks_for(slots.max_len)), slots.pad,
                                     dtype=torch.long, device=self.device)
        self.views = {W: self._view(W) for W in buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}                             # static outputs
        self.pool: Any = None                           # the graphs' memory pool
        if self.capture:
            self._capture_all()

    def __getstate__(self):
        """A decoder sent to another process (the server's engine) goes without its graphs: a
        CUDA graph belongs to the process that captured it. It captures them again on arrival,
        while its slots are still free."""
        return {**self.__dict__, "graphs": {}, "logits": {}, "pool": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.capture:
            self._capture_all()

    def _view(self, W: int):
        """The cache as the step at window W sees it, over the static buffers."""
        if not isinstance(self.slots, PagedKVCache):
            return WindowCache(self.slots, self.lens, W)
        return PagedWindowCache(self.slots, self.lens, self.tables, W)

    def fill_tables(self, rows: list[int]) -> None:
        """A paged cache's block tables into the static tables buffer: row s holds slot s's
        table, padded with the pad block, when s is one of the step's rows, else the pad block
        alone (a free slot, or one still prefilling: what it computes is written where no
        table reads). Nothing to do for a SlotKVCache."""
        pool = self.slots
        if self.tables is None or not isinstance(pool, PagedKVCache):
            return
        stepping = set(rows)
        tables = [t if s in stepping else [] for s, t in enumerate(pool.tables)]
        self.tables.copy_(paged_kv.table_tensor(tables, "cpu", pool.pad, self.tables.size(1)))

    def run_eager(self, W: int) -> Tensor:
        """The decode step at window W, run eagerly from the static buffers (what a graph of
        bucket W records): logits (S, 1, V)."""
        if W not in self.views:                         # the eager fallback's window
            self.views[W] = self._view(W)
        # the autocast cache must be off while capturing: its casts would be captured once
        on_gpu = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=gpu_dtype(self.device) if on_gpu else None,
                            enabled=on_gpu, cache_enabled=False):
            logits, _ = self.model(self.tokens, cache=self.views[W])    # (S, 1, V)
        return logits

    @torch.no_grad()
    def _capture_all(self) -> None:
        if any(self.slots.active):
            raise ValueError("capture writes into the slots: build the decoder while they are free")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):                   # warm-up: lazy init, kernel choice
            for W in self.buckets:
                for _ in range(3):
                    self.run_eager(W)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for W in reversed(self.buckets):                # largest first; the rest share its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[W] = self.run_eager(W)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[W] = graph
        torch.cuda.synchronize(self.device)

    computes_every_slot = True      # its step is every slot's: the engine gives it its own pass

    def __call__(self, idx: Tensor, cache=None) -> tuple[Tensor, None]:
        """The planned decode step as the model computes it: idx (B, 1), a token for each of
        the step's rows (the cache's planned slots) -> (logits (B, 1, V), None). Every slot is
        computed; a slot that decodes nothing brings token 0."""
        rows = self.slots.planned()[0]
        tokens = torch.zeros(self.slots.n_slots, 1, dtype=torch.long, device=idx.device)
        tokens[rows] = idx
        return self.step(tokens)[rows], None                            # (S, 1, V) -> (B, 1, V)

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """The planned decode step, computed for every slot: tokens (S, 1) -> logits (S, 1, V)."""
        slots = self.slots
        live = slots.live_slots()
        if not live:
            raise ValueError("no active slot to decode")
        if max(slots.lens[s] for s in live) >= slots.max_len:
            raise ValueError(f"a slot is full ({slots.max_len} positions)")
        self.fill_tables(slots.planned()[0])
        return decode_step(self, tokens)
