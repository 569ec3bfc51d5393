"""Exercise 04 - continuous batching: admission, and moving a prefill into slots.

Two seams of the reference package:
- `choose_admissions` is what `tinyllm.continuous.ContinuousEngine` calls every step to pick the
  queued requests that enter the free slots now;
- `move_prefill` is what `tinyllm.kv_cache.SlotKVCache.admit` calls to copy the newcomers'
  padded prefill into their slots, dropping the padding.

Check your work with `make check EX=04` (or `check_exercise("04")` in notebook 04). The tests
plug your functions into the engine and compare every request's tokens with solo generate().
"""

from torch import Tensor

from tinyllm.kv_cache import KVCache


def choose_admissions(queue: list[int], n_free: int, fits) -> list[int]:
    """Which queued requests enter now: the longest prefix of the queue (first come, first
    served) with at most n_free requests for which fits(prefix) holds. fits(rids) says whether
    these requests can share one padded prefill and the cache has room for them."""
    chosen: list[int] = []
    for rid in queue:
        if len(chosen) == n_free or not fits(chosen + [rid]):
            break
        chosen.append(rid)
    return chosen


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
