"""Step 00 - the model.

A Llama-architecture decoder written to be read: token embedding, RMSNorm, rotary position
embeddings (RoPE), grouped-query attention through `scaled_dot_product_attention`, a SwiGLU
MLP and a tied or untied output head. Module names follow Hugging Face's `LlamaForCausalLM`,
so a checkpoint's tensor names map one to one (see `checkpoint.py`).

The model never knows which KV cache it is given: a forward pass begins a step of the cache
(which answers the positions of the new tokens), hands it each layer's new keys and values, and
ends the step (`kv_cache.Cache`). With no cache it is plain causal attention over the whole
input: the slow reference every fast path is checked against. A ragged step with padding
(slot_cache.py) is packed: the layers compute its new tokens alone, as one row of N tokens, and
attention puts them back in their sequences (`Attention.packed`). Attention is one module a
layer, so a faster one can take its place on a loaded model (step 13's C attention, as
`quantize` puts quantized layers in the place of the linear ones).
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def gpu_dtype(device) -> torch.dtype:
    """The low-precision dtype of weights, caches and autocast on a CUDA device: bfloat16 where
    the GPU computes in it (compute capability 8.0 and later: A100, L4, H100...), else float16
    (a T4, Colab's free GPU). Its results match float32 up to near-ties (check.near_tie)."""
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


@dataclass
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    d_ff: int = 688
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False            # Qwen2 (and Llama with attention_bias) add biases here,
    o_bias: bool = False              # Llama with attention_bias here too
    rope_scaling: dict | None = None  # Llama 3's {"rope_type": "llama3", "factor": ...}
    arch: str = "llama"               # the checkpoint's model_type: "llama" or "qwen2"

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as Llama does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_table(head_dim: int, max_len: int, theta: float,
               scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin for every position, each (max_len, head_dim), in Llama's half-split layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling)
    freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]    # (max_len, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                 # (max_len, hd)
    return emb.cos(), emb.sin()


def llama3_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3's long-context RoPE: rotations slower than the original context (wavelength
    longer than original_max_position_embeddings / low_freq_factor) are slowed by `factor`,
    rotations faster than original / high_freq_factor are kept, and those between are blended
    linearly in 1 / wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq                                       # (hd/2,)
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)          # 0: slow, 1: kept
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, hd), cos/sin (B, 1, T, hd): rotate each pair by its position's angle, in
    x's dtype (under bf16 autocast x is bf16 while the tables may be float32)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """Grouped-query attention: each of the n_kv key/value heads serves n_heads // n_kv query
    heads. (B, n_kv, S, hd) -> (B, n_heads, S, hd), head h reading KV head h // (n_heads // n_kv).
    expand + reshape, like repeat_interleave but with no data-dependent size (CUDA graphs, 06)."""
    B, n_kv, S, hd = x.shape
    if n_kv == n_heads:
        return x
    return x[:, :, None].expand(B, n_kv, n_heads // n_kv, S, hd).reshape(B, n_heads, S, hd)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.o_bias)

    def cache_bytes_per_token(self, elem_bytes: int) -> int:
        """Bytes this layer's KV cache holds per token: a key and a value per KV head."""
        return 2 * self.n_kv_heads * self.head_dim * elem_bytes

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache=None) -> Tensor:
        """x (B, T, d) -> (B, T, d). In a packed step (cache.packing, see layers_pass) x is
        (1, N, d), the step's N new tokens; attention alone sees them in their rows."""
        B, T, _ = x.shape
        if cache is not None and cache.packing is not None:
            return self.o_proj(self.packed(x, cos, sin, cache))               # (1, N, d)
        q, k, v = self.qkv(x, cos, sin)                 # (B, H, T, hd), (B, n_kv, T, hd) twice
        if T == 1 and cache is not None:
            y = self.decode(q, k, v, cache)                                   # (B, H, 1, hd)
        else:
            if cache is None:
                mask, causal = None, True
            else:
                k, v, mask = cache.update(self.layer, k, v)    # (B, n_kv, S, hd), mask (B, 1, T, S)
                causal = False
            k, v = repeat_kv(k, self.n_heads), repeat_kv(v, self.n_heads)     # (B, H, S, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)     # (B, T, H * hd)
        return self.o_proj(y)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries, keys and values of x (B, T, d), rotated to their positions: q (B, H, T,
        hd), k and v (B, n_kv, T, hd)."""
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2)       # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)    # (B, n_kv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)    # (B, n_kv, T, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def packed(self, x: Tensor, cos: Tensor, sin: Tensor, cache) -> Tensor:
        """Attention of a packed step: x (1, N, d), the N new tokens of the step's B rows in
        row order, cos and sin at their positions (1, 1, N, hd) -> (1, N, H * hd). The
        products and RoPE run on the N tokens; attention takes the rows in groups
        (cache.packing.groups: the rows of one token, then the others), each back in its
        (rows, T) columns for scaled_dot_product_attention, the cache's mask hiding what each
        may not see. Every row's new keys and values are in the cache before any row attends
        (store, then attend): rows of one step may share blocks (08)."""
        q, k, v = self.qkv(x, cos, sin)                 # (1, H, N, hd), (1, n_kv, N, hd) twice
        groups = cache.packing.groups()
        self.store(k, v, cache, groups)
        y = self.attend(q, cache, groups, q.new_empty(x.size(1), self.n_heads, self.head_dim))
        return y.view(1, x.size(1), self.n_heads * self.head_dim)            # (1, N, H * hd)

    def store(self, k: Tensor, v: Tensor, cache, groups: list[list[int]]) -> None:
        """A packed step's new keys and values k, v (1, n_kv, N, hd), the tokens of each group
        of rows stored in the cache (cache.store)."""
        for rows in groups:
            among = cache.packing.tokens(rows)[0]                            # of the N
            cache.store(self.layer, k[:, :, among], v[:, :, among], rows)

    def attend(self, q: Tensor, cache, groups: list[list[int]], y: Tensor) -> Tensor:
        """Each group of a packed step's rows attends, its queries q (1, H, N, hd) back in its
        (rows, T) columns, to the keys and mask the cache reads for it; its tokens' outputs go
        to their places in y (N, H, hd), which is returned."""
        qt = q[0].transpose(0, 1)                                             # (N, H, hd)
        H, hd = self.n_heads, self.head_dim
        for rows in groups:
            among, cols, T = cache.packing.tokens(rows)  # their tokens: of the N, of (R * T)
            keys, values, mask = cache.read(self.layer, rows)
            R = len(rows)                               # keys (R, n_kv, W, hd), mask (R, 1, _, W)
            grid = qt.new_zeros(R * T, H, hd).index_copy_(0, cols, qt[among])
            keys, values = repeat_kv(keys, H), repeat_kv(values, H)           # (R, H, W, hd)
            out = F.scaled_dot_product_attention(grid.view(R, T, H, hd).transpose(1, 2),
                                                 keys, values, attn_mask=mask[:, :, :T])
            y[among] = out.transpose(1, 2).reshape(R * T, H, hd)[cols]       # (R, H, T, hd)
        return y

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache) -> Tensor:
        """Attention for one new token a row: q (B, H, 1, hd), k and v (B, n_kv, 1, hd) -> y
        (B, H, 1, hd). The g query heads of each KV head become g query rows of that head, (B,
        n_kv, g, hd), so the keys and values need no repeat per query head: the cache's update
        returns them (a view, or a gather) and scaled_dot_product_attention attends."""
        B, hd = v.size(0), self.head_dim     # v's rows: RoPE's positions may broadcast q and k
        k, v, mask = cache.update(self.layer, k, v)           # (B, n_kv, S, hd), mask (B, 1, 1, S)
        q = q.reshape(B, self.n_kv_heads, self.n_heads // self.n_kv_heads, hd)  # (B, n_kv, g, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.reshape(B, self.n_heads, 1, hd)


def unpacked(x: Tensor, where: Tensor | None, B: int, T: int) -> Tensor:
    """A packed step's values x (1, N, ...) back in its (B, T, ...) columns, zeros in the
    padding (where: the N tokens' places among the B * T); x itself when where is None."""
    if where is None:
        return x
    out = x.new_zeros((B * T,) + x.shape[2:]).index_copy_(0, where, x[0])
    return out.view(B, T, *x.shape[2:])


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """`model(idx, cache=None, targets=None)` -> (logits (B, T, V), loss or None).

    idx holds token ids (B, T). With a cache, the forward pass is one step of the cache: it
    begins the step (the cache supplies the RoPE positions of these T columns), every layer
    stores its keys and values and attends to what the cache returns, and it ends the step.
    Without a cache, idx is the whole sequence from position 0. Token ids are not range-checked
    here (that would cost a device sync on every step); `generate()` and the engines check
    prompts before they reach the model.
    """

    rope_cos: Tensor                    # buffers (max_len, hd)
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding's own init (normal_), except on the meta device, where the loaders build
        # the model before its weights arrive: there an operation runs PyTorch's Python version
        # of itself, whose first call imports torch.compile's machinery (seconds), so the
        # loaders build the RoPE tables too once the weights are in place (init_rope)
        weight = torch.empty(cfg.vocab_size, cfg.d_model)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, _weight=weight)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not weight.is_meta:
            self.init_rope()

    def init_rope(self, device=None) -> None:
        """(Re)build the RoPE tables, e.g. after the weights were built on the meta device."""
        cfg = self.cfg
        cos, sin = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)   # (max_len, hd)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)   # (max_len, hd)

    def forward(self, idx: Tensor, cache=None, targets: Tensor | None = None):
        x, where = self.layers_pass(idx, cache)               # (B, T, d), or (1, N, d) packed
        logits = unpacked(self.compute_logits(x), where, *idx.shape)          # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-100)
        return logits, loss

    def compute_logits(self, x: Tensor) -> Tensor:
        """The final norm and the head: hidden states x (..., d) -> logits (..., V)."""
        return self.lm_head(self.norm(x))

    def layers_pass(self, idx: Tensor, cache=None) -> tuple[Tensor, Tensor | None]:
        """The embedding and the layers, one step of the cache: idx (B, T) -> (x (B, T, d),
        None); or, when the cache packs the step (cache.packing, 04: its N new tokens among the
        B * T columns), the layers run on those tokens alone: (x (1, N, d), their places (N,)).
        x is the last layer's output, before the final norm and the head: an engine that samples
        at a few positions takes only those rows to compute_logits (the head is a fifth of a
        small model's arithmetic)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, time) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if cache is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len "
                                 f"{self.cfg.max_seq_len}")
            pos = torch.arange(T, device=idx.device)[None]                    # (1, T)
        else:
            pos = cache.begin_step(T).to(idx.device)                          # (B or 1, T)
        packing = None if cache is None else cache.packing
        where = None if packing is None else packing.places                   # (N,) of B * T
        if where is not None:
            idx, pos = idx.reshape(-1)[where][None], pos.reshape(-1)[where][None]  # (1, N)
        cos, sin = self.rope(pos)                                             # (B or 1, 1, T, hd)
        x = self.embed_tokens(idx)                                            # (B, T, d)
        for block in self.layers:
            x = block(x, cos, sin, cache)
        if cache is not None:
            cache.end_step()
        return x, where

    def rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary embedding's cos and sin at positions pos (B or 1, T), in the weights'
        dtype, shaped to broadcast over the heads: (B or 1, 1, T, hd) each."""
        dtype = self.embed_tokens.weight.dtype
        return (self.rope_cos[pos].to(dtype).unsqueeze(1),
                self.rope_sin[pos].to(dtype).unsqueeze(1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
