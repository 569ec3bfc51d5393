"""Step 00 - the model: shapes, grouped-query attention, the loss, clear errors."""

import pytest
import torch

from tests.conftest import make_tiny
from tinyllm.core.model import ModelConfig, Transformer, apply_rope, rope_table


def test_forward_shapes_and_loss(tiny):
    """logits are (B, T, V); with targets the loss is a scalar near log(V) for random weights."""
    idx = torch.randint(0, 97, (3, 11))
    logits, loss = tiny(idx, targets=idx)
    assert logits.shape == (3, 11, 97)
    assert loss.dim() == 0 and 2.0 < loss.item() < 8.0
    assert tiny(idx)[1] is None


def test_causal_the_future_does_not_leak(tiny):
    """Changing token 7 changes no logit before position 7."""
    idx = torch.randint(0, 97, (1, 12))
    other = idx.clone()
    other[0, 7] = (other[0, 7] + 1) % 97
    a, b = tiny(idx)[0], tiny(other)[0]
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.equal(a[:, 7:], b[:, 7:])


def test_rope_rotates_pairs_by_position():
    """RoPE keeps each vector's norm and makes q.k depend only on the position difference."""
    cos, sin = rope_table(8, 32, 10000.0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cos, sin = cos.double(), sin.double()
    rot = lambda x, p: apply_rope(
        x[None, None, None], cos[p][None, None, None], sin[p][None, None, None]
    )[0, 0, 0]
    assert torch.allclose(rot(q, 5).norm(), q.norm())
    assert torch.allclose(rot(q, 3) @ rot(k, 1), rot(q, 12) @ rot(k, 10))


def test_gqa_heads_and_cache_bytes():
    """n_kv_heads < n_heads: the K/V projections and the cache are n_heads/n_kv_heads smaller."""
    m = make_tiny(n_heads=4, n_kv_heads=1)
    attn = m.layers[0].self_attn
    assert attn.k_proj.weight.shape == (16, 64) and attn.q_proj.weight.shape == (64, 64)
    assert attn.cache_bytes_per_token(4) == 2 * 1 * 16 * 4


def test_tied_embeddings_share_one_tensor():
    m = make_tiny(tie_embeddings=True)
    assert m.lm_head.weight is m.embed_tokens.weight


def test_bad_config_and_input_are_named():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    m = make_tiny()
    with pytest.raises(ValueError, match="exceeds max_seq_len 96"):
        m(torch.zeros(1, 97, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, time\)"):
        m(torch.zeros(5, dtype=torch.long))


def test_bf16_forward_runs():
    """The checkpoint dtype runs too (what a GPU uses); logits stay finite."""
    m = make_tiny(dtype=torch.bfloat16)
    logits, _ = m(torch.randint(0, 97, (2, 9)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert isinstance(m, Transformer)
