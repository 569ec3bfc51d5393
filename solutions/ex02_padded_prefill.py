"""Exercise 02 - padded prefill: prompts of different lengths in one batch.

Three seams of the reference package:
- `left_pad` is what `tinyllm.core.padded.prefill_padded` calls to build the batch;
- `rope_positions` is what `tinyllm.core.kv_cache.KVCache.begin_step` calls: each row's positions,
  so that its first real token has position 0;
- `attention_mask` is what `tinyllm.core.kv_cache.KVCache.update` calls: causal, and nobody
  attends to a row's left padding.

Check your work with `make check EX=02` (or `check_exercise("02")` in notebook 02). The tests
plug your functions into the engine and compare every request's tokens with solo generate().
"""

import torch
from torch import Tensor


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad to the longest prompt: every row ends with its prompt, after pad_id repeated as
    often as it is shorter than the longest. Returns two long tensors, idx (B, L) and pad_lens
    (B,), each row's pad count.
    Example: [[1, 2, 3], [4]], pad_id 0 -> idx [[1, 2, 3], [0, 0, 4]], pad_lens [0, 2]."""
    L = max(len(p) for p in prompts)
    pad_lens = torch.tensor([L - len(p) for p in prompts])              # (B,)
    idx = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts])   # (B, L)
    return idx, pad_lens


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
