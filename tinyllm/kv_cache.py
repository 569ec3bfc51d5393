"""Step 01 - the KV cache.

Decoding without a cache recomputes every earlier token's keys and values at every step, so
token t costs O(t). A KV cache keeps them: the prompt is run once (prefill), then each new
token attends to the stored keys/values and adds its own (decode), O(1) new work per layer.

This module writes down the protocol every cache implements (`Cache`), and the simplest
cache, `KVCache`: one contiguous buffer per layer for a batch that starts together. It is
pad-aware, so step 02 can left-pad prompts of different lengths into one batch.
"""

from typing import Protocol

import torch
from torch import Tensor


class Cache(Protocol):
    """What the model asks of a KV cache. KVCache (01), SlotKVCache (04), PagedKVCache (05)
    and the graph decoder's static cache (06) all implement it."""

    def positions(self, T: int) -> Tensor:
        """RoPE positions (B, T) of the T new tokens about to be written, per row."""
        ...

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store layer's new keys/values k, v (B, n_kv, T, hd). Returns the keys and values
        to attend to (B, n_kv, S, hd) and a boolean mask (B, 1, T, S), True = attend, or
        None when every new token may attend to every returned key. The last layer's update
        ends the step (the cache then counts the T tokens as written)."""
        ...


def append_kv(cache_k: Tensor, cache_v: Tensor, k: Tensor, v: Tensor,
              pos: int) -> tuple[Tensor, Tensor]:
    """Write k, v (B, n_kv, T, hd) into cache_k, cache_v (B, n_kv, max_len, hd) at positions
    pos .. pos+T-1, and return views of everything written so far, (B, n_kv, pos+T, hd)."""
    T = k.size(2)
    cache_k[:, :, pos:pos + T] = k                 # cache (B, n_kv, max_len, hd)
    cache_v[:, :, pos:pos + T] = v
    return cache_k[:, :, :pos + T], cache_v[:, :, :pos + T]


def rope_positions(pos: int, T: int, pad_lens: Tensor | None) -> Tensor:
    """RoPE positions of T new tokens at cache positions pos..pos+T-1: (1, T) without padding,
    else (B, T) with each row shifted by its pad count, so its first real token is at 0.
    Pad tokens get position 0 (their keys are masked out anyway)."""
    pos_t = torch.arange(pos, pos + T)[None, :]                         # (1, T)
    if pad_lens is None:
        return pos_t
    return (pos_t - pad_lens.to(pos_t.device)[:, None]).clamp(min=0)    # (B, T)


def attention_mask(pos: int, T: int, pad_lens: Tensor | None, device) -> Tensor | None:
    """Mask (B or 1, 1, T, pos+T) for T new tokens at cache positions pos.. over all keys so far.

    Causal (a token sees keys at its own position and before) and pad-aware (nobody sees a
    row's left padding). A token always sees itself, so even a pad token's softmax has one
    finite entry and no NaN can reach the cache. None when nothing needs masking."""
    if T == 1 and pad_lens is None:
        return None
    q_pos = torch.arange(pos, pos + T, device=device)[:, None]          # (T, 1)
    k_pos = torch.arange(pos + T, device=device)[None, :]               # (1, S)
    mask = k_pos <= q_pos                                               # (T, S) causal
    if pad_lens is not None:
        real = k_pos[None] >= pad_lens[:, None, None]                   # (B, 1, S)
        mask = mask & (real | (k_pos == q_pos))                         # (B, T, S)
    return mask.view(-1, 1, T, pos + T)                                 # (B or 1, 1, T, S)


class KVCache:
    """One buffer per layer, (B, n_kv, max_len, hd), for a batch whose rows start together.

    `pos` counts the positions written so far, left padding included: after a padded prefill
    of length L it is L for every row. `pad_lens` (B,) is each row's number of left pad tokens;
    a row's first real token has RoPE position 0, so a padded row computes exactly what it
    would alone. Storage is allocated at the first write, when dtype, device and head sizes
    are known.
    """

    def __init__(self, n_layers: int, max_len: int, pad_lens: Tensor | None = None):
        self.n_layers = n_layers
        self.max_len = max_len
        self.pad_lens = pad_lens
        self.pos = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def positions(self, T: int) -> Tensor:
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache full: {self.pos} positions written + {T} new "
                             f"> max_len {self.max_len}")
        return rope_positions(self.pos, T, self.pad_lens)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if not self.k:
            self._allocate(k)
        T = k.size(2)
        keys, values = append_kv(self.k[layer], self.v[layer], k, v, self.pos)
        if layer == 0:                                  # one mask serves every layer
            self._mask = attention_mask(self.pos, T, self.pad_lens, k.device)
        if layer == self.n_layers - 1:
            self.pos += T
        return keys, values, self._mask

    def _allocate(self, k: Tensor) -> None:
        B, n_kv, _, hd = k.shape
        shape = (B, n_kv, self.max_len, hd)                               # (B, n_kv, max_len, hd)
        self.k = [torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(self.n_layers)]

    def nbytes(self) -> int:
        """Bytes the cache really holds (allocated storage, all layers, keys and values)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotKVCache:
    """Step 04 - a fixed set of slots that requests join and leave (continuous batching).

    Each slot holds one request's keys/values, (n_kv, max_len, hd) per layer, reserved up
    front. A request enters through `admit` (its padded prefill copied in, padding dropped, so
    its first real token sits at slot position 0) and leaves through `release`, freeing the slot
    for the next one at once. A decode step runs one token for every *active* slot: batch row
    i of `positions` and `update` is the i-th active slot in slot order (`live_slots()`), so a
    free slot costs nothing. (The seed decoded every slot, free ones included; step 06's graph
    decoder does, because a captured graph has one fixed shape.)
    """

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device=None):
        self.n_layers, self.n_slots, self.max_len = n_layers, n_slots, max_len
        shape = (n_slots, n_kv_heads, max_len, head_dim)                 # (S, n_kv, max_len, hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.active = [False] * n_slots
        self.lens = [0] * n_slots                     # tokens stored per slot
        self.device = device

    # ---- bookkeeping -----------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if not self.active[s]]

    def live_slots(self) -> list[int]:
        """The active slots, in slot order: the rows of the next decode step."""
        return [s for s in range(self.n_slots) if self.active[s]]

    def can_admit(self, lens: list[int]) -> bool:
        """Room for requests whose contexts have these lengths (one slot each)."""
        return len(lens) <= len(self.free_slots()) and all(n < self.max_len for n in lens)

    def admit(self, slots: list[int], pre: KVCache, pad: list[int],
              arrivals: list[int] | None = None) -> None:
        """Copy row i of a padded prefill (pre.pos = L) into slots[i], without its pad[i] pads.
        (arrivals, the requests' seniority, matters to the paged cache only.)"""
        for s in slots:
            if self.active[s]:
                raise ValueError(f"slot {s} is already serving a request")
        move_prefill(self.k, self.v, pre, slots, pad)
        for s, p in zip(slots, pad):
            self.active[s] = True
            self.lens[s] = pre.pos - p

    def reserve_step(self) -> list[int]:
        """Make room for one more token per active slot; returns preempted slots (never any
        here: every slot reserved max_len positions at admission)."""
        return []

    def release(self, s: int) -> None:
        self.active[s] = False
        self.lens[s] = 0

    def used_tokens(self) -> int:
        return sum(self.lens)

    def reserved_tokens(self) -> int:
        return self.n_slots * self.max_len

    def allocated_tokens(self) -> int:
        return self.reserved_tokens()

    # ---- the cache protocol ----------------------------------------------------------------
    def positions(self, T: int) -> Tensor:
        """Starts a decode step of the B active slots: each one's next position (B, 1), and
        (once for every layer) the attention window W and mask of this step."""
        if T != 1:
            raise ValueError("SlotKVCache decodes one token per slot; prefill goes through KVCache")
        live = self.live_slots()
        if not live:
            raise ValueError("no active slot to decode")
        full = [s for s in live if self.lens[s] >= self.max_len]
        if full:
            raise ValueError(f"slot {full[0]} is full ({self.max_len} positions)")
        self._live_list = live
        self._live = torch.tensor(live, device=self.device)             # (B,) slot of each row
        self._prefix = live[-1] == len(live) - 1        # slots 0..B-1: read views, gather nothing
        self._lens, self._mask = decode_mask([self.lens[s] for s in live], self.device)
        self._window = self._mask.size(-1)                              # keys any row may see
        return self._lens[:, None]                                      # (B, 1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)     # e.g. bf16 slots, fp32 k
        self.k[layer][self._live, :, self._lens] = k[:, :, 0]           # (B, n_kv, hd) at lens
        self.v[layer][self._live, :, self._lens] = v[:, :, 0]
        W = self._window
        if layer == self.n_layers - 1:
            for s in self._live_list:
                self.lens[s] += 1
        if self._prefix:
            B = k.size(0)
            return self.k[layer][:B, :, :W], self.v[layer][:B, :, :W], self._mask
        return (self.k[layer][:, :, :W].index_select(0, self._live),     # (B, n_kv, W, hd)
                self.v[layer][:, :, :W].index_select(0, self._live), self._mask)

def decode_mask(lens: list[int], device) -> tuple[Tensor, Tensor]:
    """A decode step of B rows whose sequences hold `lens` tokens: lens as a tensor (B,) and
    the mask (B, 1, 1, W) over W = max(lens) + 1 keys, True where a key is at or before the
    row's new token (its own position, lens[b])."""
    lens_t = torch.tensor(lens, device=device)                          # (B,)
    keys = torch.arange(max(lens) + 1, device=device)                   # (W,)
    return lens_t, (keys[None, :] <= lens_t[:, None])[:, None, None, :]  # (B, 1, 1, W)


def move_prefill(slot_k: list[Tensor], slot_v: list[Tensor], pre: KVCache, slots: list[int],
                 pad: list[int]) -> None:
    """Copy row i of a padded prefill (pre.k[layer][i] is (n_kv, L, hd), L = pre.pos) into
    slot slots[i] of slot_k[layer] (S, n_kv, max_len, hd), in every layer, keys and values,
    dropping its pad[i] left pads: its first real token lands at slot position 0."""
    L = pre.pos
    for layer in range(len(slot_k)):
        for i, (s, p) in enumerate(zip(slots, pad)):
            slot_k[layer][s, :, :L - p] = pre.k[layer][i, :, p:L]       # (n_kv, L - p, hd)
            slot_v[layer][s, :, :L - p] = pre.v[layer][i, :, p:L]
