"""Step 02 - padded prefill: prompts of different lengths in one forward pass.

A batch is a rectangle, prompts are not. Left-pad every prompt to the longest, and make each row
compute exactly what it would alone: a pad mask hides the padding from every query, and RoPE
positions start at each row's first real token (kv_cache.rope_positions and attention_mask).
Builds on 01 (KVCache); static batching (03) prefills each batch this way.
"""

import torch
from torch import Tensor

from tinyllm.core.generate import autocast_for
from tinyllm.core.kv_cache import KVCache
from tinyllm.core.model import Transformer


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad to the longest prompt: every row ends with its prompt, after pad_id repeated as
    often as it is shorter than the longest. Returns two long tensors, idx (B, L) and pad_lens
    (B,), each row's pad count.
    Example: [[1, 2, 3], [4]], pad_id 0 -> idx [[1, 2, 3], [0, 0, 4]], pad_lens [0, 2]."""
    L = max(len(p) for p in prompts)
    pad_lens = torch.tensor([L - len(p) for p in prompts])              # (B,)
    idx = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts])   # (B, L)
    return idx, pad_lens


@torch.no_grad()
def prefill_padded(model: Transformer, prompts: list[list[int]], max_len: int,
                   pad_id: int = 0) -> tuple[Tensor, KVCache, list[int]]:
    """Left-pad prompts to one length, run one prefill. Returns last-position logits (B, V),
    the filled cache (pos = padded length) and each row's pad count."""
    device = next(model.parameters()).device
    idx, pad_lens = left_pad(prompts, pad_id)
    if not isinstance(idx, Tensor) or not isinstance(pad_lens, Tensor):
        raise TypeError(f"left_pad returns two tensors, idx (B, L) and pad_lens (B,); got "
                        f"{type(idx).__name__} and {type(pad_lens).__name__}")
    idx, pad_lens = idx.to(device), pad_lens.to(device)
    cache = KVCache(model.cfg.n_layers, max_len, pad_lens=pad_lens)
    with autocast_for(device):
        logits, _ = model(idx, cache=cache)                             # (B, L, V)
    return logits[:, -1], cache, pad_lens.tolist()
