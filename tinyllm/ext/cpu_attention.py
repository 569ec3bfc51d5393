"""Step 13 - attention in C where the cache keeps the keys, installed on a loaded model.

`CAttention` does a decode step's attention in one call of `cpu_kernels.decode_attention`, in
place of the cache's writes, a gather and scaled_dot_product_attention, reading the keys where a
slot or paged cache (04, 05) holds them (`cache.layout`, as vLLM's paged attention reads them).
`install(model)` puts it in the place of each layer's Attention, sharing its projections; the
model's other passes are unchanged.

The kernel attends a query at a time: a decode, a speculation's guesses, a short prompt. A row
of more than QUERY_ROWS tokens (a prefill) is left to the library, so a packed step (04) splits,
and every key of the step is written before any row reads one. Where the kernel cannot run (no
C compiler, a GPU, half precision, a cache without a layout) the layer is the model's own
Attention. The first step builds the kernels where the cache has none yet; installed with
wait_for_kernels=False (a server's model), it builds them in a thread instead, and the steps
attend as the model does until they are built.
"""

import torch
from torch import Tensor, nn

from tinyllm.core.model import Attention, Transformer
from tinyllm.core.slot_cache import RaggedStep, additive
from tinyllm.ext import cpu_kernels

QUERY_ROWS = 32     # a packed row of at most this many new tokens attends a query at a time


class CAttention(Attention):
    """An Attention whose decode step, and a packed step's rows of at most QUERY_ROWS tokens,
    attend in one decode_attention call a layer, where the cache keeps the keys."""

    def __init__(self, attn: Attention, wait_for_kernels: bool = True):
        nn.Module.__init__(self)                        # the same projections, not copies
        self.wait_for_kernels = wait_for_kernels
        self.layer, self.n_heads = attn.layer, attn.n_heads
        self.n_kv_heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = \
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache) -> Tensor:
        """Attention.decode in one C call: the new keys and values written where the cache
        keeps them, then every row's g query heads of each KV head attending there."""
        rows = kernel_rows(cache, self.layer, v, wait=self.wait_for_kernels)
        if rows is None or rows[2].size(0) != v.size(0):    # the model's own names a bad batch
            return super().decode(q, k, v, cache)
        B, hd = v.size(0), self.head_dim
        q = q.reshape(B, self.n_kv_heads, self.n_heads // self.n_kv_heads, hd)  # (B, n_kv, g, hd)
        y = cpu_kernels.decode_attention(q, k, v, *rows)                      # (B, n_kv, g, hd)
        return y.reshape(B, self.n_heads, 1, hd)

    def packed(self, x: Tensor, cos: Tensor, sin: Tensor, cache) -> Tensor:
        """Attention.packed with the short rows' tokens in one C call: 1) the long rows' new
        keys stored, 2) the short rows' tokens, a query row each, write theirs and attend, 3)
        the long rows attend, in the library's groups."""
        packing = cache.packing
        short = [b for b, n in enumerate(packing.q_lens) if n <= QUERY_ROWS]
        few = packing.tokens(short)[0] if short else None                    # (D,) of the N
        rows = kernel_rows(cache, self.layer, x, few, self.wait_for_kernels) if short else None
        if rows is None:
            return super().packed(x, cos, sin, cache)
        q, k, v = self.qkv(x, cos, sin)                 # (1, H, N, hd), (1, n_kv, N, hd) twice
        N, H, hd = x.size(1), self.n_heads, self.head_dim
        groups = packing.groups([b for b, n in enumerate(packing.q_lens) if n > QUERY_ROWS])
        self.store(k, v, cache, groups)                                       # 1)
        y = q.new_empty(N, H, hd)
        qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))     # (N, h, hd): a token a row
        y[few] = cpu_kernels.decode_attention(                                # 2)
            qt[few].reshape(len(few), self.n_kv_heads, -1, hd), kt[few][:, :, None],
            vt[few][:, :, None], *rows).view(len(few), H, hd)
        return self.attend(q, cache, groups, y).view(1, N, H * hd)            # 3)


def kernel_rows(cache, layer: int, x: Tensor, tokens: Tensor | None = None,
                wait: bool = True) -> tuple | None:
    """decode_attention's arguments of the cache where they lie for this step: the layer's
    keys and values, write (D, n_kv), read (D, W), the head stride and the additive mask (D, W),
    for the step's query rows (a decode step's rows, or a packed step's `tokens`, D of its N,
    or every token of a step of T tokens a row without padding: each with its row's keys and
    its own column of the mask, causal, so a token sees its row's new tokens up to itself,
    which the kernel writes before it attends). None where the kernel
    cannot run: a cache without a layout, x not on a CPU in float32 or float64, keys of
    another dtype, or no kernels built (with wait False: not built yet, their build started).
    Made at the step's first layer, kept in cache.memo."""
    if (not isinstance(cache, RaggedStep) or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.float64)
            or not cpu_kernels.available(wait)):
        return None
    keys, values, write, read, stride = cache.layout(layer)
    if keys.dtype != x.dtype:
        return None
    if "c-attention" not in cache.memo:
        mask, packing = cache.mask, cache.packing
        bool_mask = mask.bool.view(-1, mask.W)                                # (B * T, W)
        if packing is not None:
            cols = packing.places[tokens]                                     # (D,) of B * T
            rows = torch.div(cols, packing.T, rounding_mode="floor")
            write, read, bool_mask = write[tokens], read[rows], bool_mask[cols]
        elif bool_mask.size(0) > read.size(0):      # T > 1 tokens a row, none padded: each a row
            read = read.repeat_interleave(bool_mask.size(0) // read.size(0), 0)   # (B * T, W)
        cache.memo["c-attention"] = (write, read, stride, additive(bool_mask, mask.dtype))
    return (keys, values, *cache.memo["c-attention"])


def install(model: Transformer, wait_for_kernels: bool = True) -> Transformer:
    """Put CAttention in the place of each layer's Attention, in place (sharing its weights);
    returns the model. A model already installed is left as it is."""
    for block in model.layers:
        if not isinstance(block.self_attn, CAttention):
            block.self_attn = CAttention(block.self_attn, wait_for_kernels)
    return model
