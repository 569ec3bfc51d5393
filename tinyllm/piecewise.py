"""Step 13 - the decode step compiled in pieces, split at attention.

A decode step at a small batch is a few matrix-vector products per layer and, between them, a
dozen small operations (the norms, the rotary embedding, the SwiGLU gate, the residual adds, a
quantized layer's scaling): each one dispatched from Python, each writing its output to memory
for the next to read back. Step 06's compiled decoder fuses a whole step, but it needs the
cache in static buffers and compiles for minutes on a 30-layer model. vLLM compiles its models
piecewise instead: the graph is split at attention, which stays a call of its own, and each
piece between two attentions is compiled (on a GPU, also captured as a CUDA graph).

`PiecewiseDecoder(model)` does that here (the continuous engine's decoder="pieces", on any
cache). Each layer of a decode step runs two compiled pieces: `before` (the norm, the q, k and
v projections, RoPE) and `after` (the output projection, the residual, the norm, the MLP, the
residual). The cache's update and the attention stay eager between them, so any cache works:
slots, a paged pool, a prefix cache. Every layer runs the same code at the same shapes, so a
piece is compiled once for all the layers: one program for each power of two of rows (a batch
is padded up to the next), a few seconds each on first use, or ahead with `warm_up(max_rows)`
(bench and serve call it before any request). A prefill, a chunk or speculation's verification
(more than one token a row) runs the model as it is.

The pieces compute what the layer computes, up to the order of additions in the fused loops:
in float64 the tokens are the eager step's.
"""

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from tinyllm.model import Transformer, apply_rope
from tinyllm.quant import compiled, padded_rows


def before(block, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (B, 1, d) -> q (B, H, 1, hd), k and v (B, n_kv, 1, hd), RoPE applied."""
    attn, B = block.self_attn, x.size(0)
    h, hd = block.input_layernorm(x), attn.head_dim
    q = attn.q_proj(h).view(B, 1, attn.n_heads, hd).transpose(1, 2)
    k = attn.k_proj(h).view(B, 1, attn.n_kv_heads, hd).transpose(1, 2)
    v = attn.v_proj(h).view(B, 1, attn.n_kv_heads, hd).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def after(block, x: Tensor, y: Tensor) -> Tensor:
    """The residual stream x (B, 1, d) and attention's output y (B, H, 1, hd) -> the layer's
    output (B, 1, d)."""
    x = x + block.self_attn.o_proj(y.transpose(1, 2).reshape(x.shape))
    return x + block.mlp(block.post_attention_layernorm(x))


def layer_step(block, x: Tensor, cos: Tensor, sin: Tensor, cache) -> Tensor:
    """One layer of a decode step (x (B, 1, d), one token a row): the compiled pieces around
    the eager cache update and attention -> (B, 1, d). The pieces see the rows padded with
    zeros to a power of two (a program for 1, 2, 4, 8, ... rows); attention sees the B rows."""
    B = x.size(0)
    before_fn, after_fn = compiled_pieces()
    q, k, v = (t[:B] for t in before_fn(block, *(padded(t, B) for t in (x, cos, sin))))
    attn = block.self_attn
    k, v, mask = cache.update(attn.layer, k, v)         # (B, n_kv, S, hd), mask (B, 1, 1, S)
    g, hd = attn.n_heads // attn.n_kv_heads, attn.head_dim
    y = F.scaled_dot_product_attention(q.reshape(B, attn.n_kv_heads, g, hd), k, v,
                                       attn_mask=mask)                    # (B, n_kv, g, hd)
    y = y.reshape(B, attn.n_heads, 1, hd)
    return after_fn(block, padded(x, B), padded(y, B))[:B]


def padded(t: Tensor, B: int) -> Tensor:
    """t with its rows padded to a power of two when they are the batch's B rows (a (1, ...)
    tensor, shared by the rows, as it is)."""
    return padded_rows(t) if t.size(0) == B else t


def compiled_pieces():
    """(before, after) compiled, on first use in this process (a decoder sent to the server's
    engine process compiles there)."""
    return compiled(before), compiled(after)


class PiecewiseDecoder:
    """A model's decode step in compiled pieces: decoder(idx (B, 1), cache) -> (logits
    (B, 1, V), None), what model(idx, cache=cache) returns, its layers run by layer_step. The
    model itself is not changed: its other passes (prefill, chunks, verification) stay eager."""

    def __init__(self, model: Transformer):
        self.model = model

    @torch.no_grad()
    def warm_up(self, max_rows: int) -> float:
        """Compile the pieces now for every bucket of rows up to max_rows (1, 2, 4, ...), on
        zeros, so that no request waits for a compilation -> the seconds it took."""
        m, (before_fn, after_fn) = self.model, compiled_pieces()
        attn, p = m.layers[0].self_attn, m.embed_tokens.weight
        t0 = time.perf_counter()
        for rows in sorted({1 << (b - 1).bit_length() for b in range(1, max_rows + 1)}):
            x = p.new_zeros(rows, 1, m.cfg.d_model)                          # (B, 1, d)
            cos, sin = (p.new_zeros(rows, 1, 1, attn.head_dim) for _ in "cs")  # (B, 1, 1, hd)
            before_fn(m.layers[0], x, cos, sin)
            after_fn(m.layers[0], x, p.new_zeros(rows, attn.n_heads, 1, attn.head_dim))
            m.lm_head(m.norm(x))                        # a head with a compiled loop of its own
        return time.perf_counter() - t0

    def __call__(self, idx: Tensor, cache) -> tuple[Tensor, None]:
        m = self.model
        cos, sin = m.rope(cache.begin_step(1).to(idx.device))             # (B, 1, 1, hd)
        x = m.embed_tokens(idx)                                           # (B, 1, d)
        for block in m.layers:
            x = layer_step(block, x, cos, sin, cache)
        cache.end_step()
        return m.lm_head(m.norm(x)), None                                 # (B, 1, V)
