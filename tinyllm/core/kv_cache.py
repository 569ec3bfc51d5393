"""Step 01 - the KV cache.

Decoding without a cache recomputes every earlier token's keys and values at every step, so
token t costs O(t). A KV cache keeps them: the prompt is run once (prefill), then each new
token attends to the stored keys/values and adds its own (decode), O(1) new work per layer.

This module writes down the protocol every cache implements (`Cache`), and the simplest
cache, `KVCache`: one contiguous buffer per layer for a batch that starts together. It is
pad-aware, so step 02 can left-pad prompts of different lengths into one batch.
"""

from typing import Any, Protocol

import torch
from torch import Tensor


class Cache(Protocol):
    """What the model asks of a KV cache, once per forward pass: `begin_step`, then `update`
    in every layer, then `end_step`. KVCache (01), SlotKVCache (04), PagedKVCache (05) and the
    graph decoder's window (06) implement it; the model never knows which one it holds. A
    cache of ragged steps (04) may also pack one: after begin_step, `packing` holds the new
    tokens' places among the step's (B * T) columns when some columns are padding (else None,
    as always here), and instead of update each layer stores groups of the step's rows'
    new tokens (`store(layer, k, v, rows)`, (1, n_kv, n, hd)), all of them before any group
    reads what it attends to (`read(layer, rows)`) (slot_cache.PackedStep)."""

    packing: Any                        # None, or a ragged step's PackedStep (04)

    def begin_step(self, T: int) -> Tensor:
        """Start a forward pass of T token columns: returns their RoPE positions, (B, T) or
        (1, T) when every row shares them."""
        ...

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store layer's new keys/values k, v (B, n_kv, T, hd). Returns the keys and values
        to attend to (B, n_kv, S, hd) and a boolean mask (B, 1, T, S), True = attend, or None
        when every new token may attend to every returned key."""
        ...

    def end_step(self) -> None:
        """The forward pass is over: the tokens it wrote now count as stored."""
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
    """RoPE positions of T new tokens at cache positions pos..pos+T-1, a long tensor: (1, T)
    without padding, else (B, T), where each row counts from its first real token (position
    0). Pad tokens get position 0 (their keys are masked out anyway).
    Example: pos 0, T 4, pad_lens [0, 2] -> [[0, 1, 2, 3], [0, 0, 0, 1]]; then decoding at pos
    4, T 1 -> [[4], [2]]."""
    pos_t = torch.arange(pos, pos + T)[None, :]                         # (1, T)
    if pad_lens is None:
        return pos_t
    return (pos_t - pad_lens.to(pos_t.device)[:, None]).clamp(min=0)    # (B, T)


def attention_mask(pos: int, T: int, pad_lens: Tensor | None, device) -> Tensor | None:
    """Mask (B or 1, 1, T, pos+T) for T new tokens at cache positions pos.. over all keys so far.

    Causal (a token sees keys at its own position and before) and pad-aware (nobody sees a
    row's left padding). A token always sees itself, so even a pad token's softmax has one
    finite entry and no NaN can reach the cache. None when nothing needs masking.
    Example: pos 0, T 3, pad_lens [1]: the (1, 1, 3, 3) mask [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    (True = may attend): the pad token sees only itself, and nobody sees it."""
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
    """One buffer per layer, (B, n_kv, max_len, hd), for a batch whose rows start together
    and each bring T tokens per forward pass.

    `pos` counts the positions written so far, left padding included: after a padded prefill
    of length L it is L for every row. `pad_lens` (B,) is each row's number of left pad tokens;
    a row's first real token has RoPE position 0, so a padded row computes exactly what it
    would alone. Storage is allocated at the first write, when dtype, device and head sizes
    are known.
    """

    packing = None                      # every step's columns are its tokens

    def __init__(self, n_layers: int, max_len: int, pad_lens: Tensor | None = None):
        self.n_layers = n_layers
        self.max_len = max_len
        self.pad_lens = pad_lens
        self.pos = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self._T = 0                                     # columns of the step in progress
        self._mask: Tensor | None = None

    def begin_step(self, T: int) -> Tensor:
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache full: {self.pos} positions written + {T} new "
                             f"> max_len {self.max_len}")
        self._T, self._mask = T, None
        return rope_positions(self.pos, T, self.pad_lens)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if not self.k:
            self._allocate(k)
        keys, values = append_kv(self.k[layer], self.v[layer], k, v, self.pos)
        if layer == 0:                                  # one mask serves every layer
            self._mask = attention_mask(self.pos, self._T, self.pad_lens, k.device)
        return keys, values, self._mask

    def end_step(self) -> None:
        self.pos += self._T
        self._T = 0

    def _allocate(self, k: Tensor) -> None:
        B, n_kv, _, hd = k.shape
        shape = (B, n_kv, self.max_len, hd)                               # (B, n_kv, max_len, hd)
        self.k = [torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(self.n_layers)]

    def nbytes(self) -> int:
        """Bytes the cache really holds (allocated storage, all layers, keys and values)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
