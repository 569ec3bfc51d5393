"""Steps 04-08 - the engine's KV cache from its spec: one factory for every kind.

A `CacheSpec` says what a cache is: slots (04) or a pool of blocks (05), with a prefix cache
in it or not (08), its sizes and its dtype. `cache_spec` reads one from a model and an
EngineConfig, `spec_of` from a cache, however it was made; `make_cache` makes the cache a spec
describes: the builder makes an engine's cache here and checks a lent decoder's against it, and
a rank of a split model (14) makes its own copy of rank 0's.
"""

import dataclasses

import torch

from tinyllm.core.config import EngineConfig
from tinyllm.core.model import Transformer, gpu_dtype
from tinyllm.core.slot_cache import SlotCache, SlotKVCache
from tinyllm.core.stats import kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    kind: str                           # "slots" (04) or "paged" (05)
    n_layers: int
    n_slots: int
    n_kv_heads: int
    head_dim: int
    max_len: int                        # the positions one request may hold
    dtype: torch.dtype
    n_blocks: int | None = None         # a pool's blocks of block_size positions (05)
    block_size: int | None = None
    prefix_cache: bool = False          # blocks named and shared by prefix (08),
    name_at_admission: bool = False     # named as a newcomer is admitted (no token budget)


def cache_spec(model: Transformer, config: EngineConfig, device) -> CacheSpec:
    """The cache an engine of this config keeps for this model on device: config.n_slots slots
    of max_len positions, or (kv="paged") a pool of blocks they share, within the config's KV
    memory, in the model's dtype (a GPU's compute dtype on CUDA). With a prefix cache and no
    token budget every admitted context is computed whole in its admission step, so its blocks
    are named as it is admitted (a newcomer of the same step shares them); under a budget a
    block is named after the step that writes it."""
    max_len, n_blocks = config.kv_sizes(model.cfg.max_seq_len, kv_bytes_per_token(model, device))
    dtype = gpu_dtype(device) if device.type == "cuda" else next(model.parameters()).dtype
    cfg = model.cfg
    spec = CacheSpec("slots", cfg.n_layers, config.n_slots, cfg.n_kv_heads, cfg.head_dim, max_len,
                     dtype)
    if config.kv == "slots":
        return spec
    return dataclasses.replace(spec, kind="paged", n_blocks=n_blocks,
                               block_size=config.block_size, prefix_cache=config.prefix_cache,
                               name_at_admission=config.prefix_cache and
                               config.max_step_tokens is None)


def make_cache(spec: CacheSpec, device=None) -> SlotCache:
    """The cache a spec describes, on device."""
    if spec.kind == "slots":
        return SlotKVCache(spec.n_layers, spec.n_slots, spec.n_kv_heads, spec.head_dim,
                           spec.max_len, spec.dtype, device)
    from tinyllm.core.paged_kv import PagedKVCache
    prefix = None
    if spec.prefix_cache:                               # step 08, loaded only when asked
        from tinyllm.core.prefix_cache import PrefixCache
        prefix = PrefixCache
    return PagedKVCache(spec.n_layers, spec.n_slots, spec.n_kv_heads, spec.head_dim,
                        spec.n_blocks, spec.block_size, spec.max_len, spec.dtype, device, prefix,
                        name_at_admission=spec.name_at_admission)


def spec_of(cache: SlotCache) -> CacheSpec:
    """What a cache is: its kind, sizes and dtype (its keys: (S, n_kv, max_len, hd) per layer
    in slots, ((n_blocks + 1) * block_size, n_kv, hd) in a pool)."""
    k = cache.k[0]
    spec = CacheSpec("slots", cache.n_layers, cache.n_slots, k.size(1), k.size(-1),
                     cache.max_len, k.dtype)
    if cache.n_blocks is None:
        return spec
    from tinyllm.core.paged_kv import PagedKVCache
    assert isinstance(cache, PagedKVCache)
    return dataclasses.replace(spec, kind="paged", n_blocks=cache.n_blocks,
                               block_size=cache.block_size, prefix_cache=cache.shares_prefixes,
                               name_at_admission=cache.name_at_admission)
