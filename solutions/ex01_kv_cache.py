"""Exercise 01 - the KV cache.

Two seams of the reference package:
- `append_kv` is what `tinyllm.core.kv_cache.KVCache.update` calls to store a layer's new keys and
  values;
- `decode_loop` is what `tinyllm.core.generate.generate` calls once it has checked the prompt:
  prefill, then one token at a time.

Check your work with `make check EX=01` (or `check_exercise("01")` in notebook 01). The tests
plug your functions into the engine and compare every token with generation without a cache.
"""

from collections.abc import Callable

from torch import Tensor

from tinyllm.core.kv_cache import KVCache
from tinyllm.core.model import Transformer


def append_kv(cache_k: Tensor, cache_v: Tensor, k: Tensor, v: Tensor,
              pos: int) -> tuple[Tensor, Tensor]:
    """Write k, v (B, n_kv, T, hd) into cache_k, cache_v (B, n_kv, max_len, hd) at positions
    pos .. pos+T-1, and return views of everything written so far, (B, n_kv, pos+T, hd)."""
    T = k.size(2)
    cache_k[:, :, pos:pos + T] = k                 # cache (B, n_kv, max_len, hd)
    cache_v[:, :, pos:pos + T] = v
    return cache_k[:, :, :pos + T], cache_v[:, :, :pos + T]


def decode_loop(model: Transformer, idx: Tensor, max_new_tokens: int, eos_ids: frozenset[int],
                pick: Callable[[Tensor], Tensor]) -> list[int]:
    """The cached generate loop: prefill idx (1, T) into a fresh KVCache, then feed back one
    token at a time. pick maps last-position logits (1, V) to a token (1, 1). Stops after
    max_new_tokens tokens or at a token of eos_ids (returned as the last token; the set may be
    empty: a chat model may end its turn with any of several ids).

    The cache: KVCache(model.cfg.n_layers, max_len) with room for prompt and new tokens.
    The model: logits, _ = model(ids, cache=cache) returns logits (1, T, V) for T new ids."""
    cache = KVCache(model.cfg.n_layers, idx.size(1) + max_new_tokens)
    logits, _ = model(idx, cache=cache)            # prefill: (1, T, V)
    out: list[int] = []
    while True:
        nxt = pick(logits[:, -1])                  # (1, 1)
        out.append(nxt.item())
        if len(out) >= max_new_tokens or out[-1] in eos_ids:
            return out
        logits, _ = model(nxt, cache=cache)        # decode: (1, 1, V)
