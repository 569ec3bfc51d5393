"""Step 01 - the KV cache: cached generation is uncached generation, token for token."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tinyllm.core.generate import generate, generate_uncached
from tinyllm.core.kv_cache import KVCache, attention_mask
from tinyllm.course.check import divergence

TINY = make_tiny(seed=1)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 96), min_size=1, max_size=60),
    max_new=st.integers(1, 30),
    seed=st.integers(0, 3),
)
def test_cached_generate_equals_uncached(prompt, max_new, seed):
    """Greedy, float64: generate() with a KVCache gives exactly generate_uncached()'s tokens."""
    model = TINY if seed == 1 else make_tiny(seed=seed)
    msg = divergence(
        f"prompt {prompt}",
        generate_uncached(model, prompt, max_new),
        generate(model, prompt, max_new),
    )
    assert msg is None, msg


@settings(max_examples=20, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 96), min_size=1, max_size=40),
    max_new=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_cached_equals_uncached_when_sampling(prompt, max_new, seed):
    """With the same seeded generator, sampling draws the same tokens with or without cache."""
    kw = dict(temperature=0.8, top_k=40, top_p=0.95)
    a = generate_uncached(
        TINY, prompt, max_new, generator=torch.Generator().manual_seed(seed), **kw
    )
    b = generate(TINY, prompt, max_new, generator=torch.Generator().manual_seed(seed), **kw)
    assert a == b, divergence("sampled run", a, b)


def test_cached_logits_match_uncached():
    """Prefill then decode, step by step: every position's logits match the full forward pass."""
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(0))
    full, _ = TINY(ids)
    cache = KVCache(TINY.cfg.n_layers, 40)
    with torch.no_grad():
        parts = [TINY(ids[:, :13], cache=cache)[0]]
        parts += [TINY(ids[:, t : t + 1], cache=cache)[0] for t in range(13, 40)]
    assert cache.pos == 40
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-10)


def test_left_padded_rows_compute_what_they_would_alone():
    """With pad_lens, a left-padded row gets its solo logits: pads are masked, RoPE starts at 0."""
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22]]
    L = 5
    pad = torch.tensor([L - len(p) for p in prompts])
    idx = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    cache = KVCache(TINY.cfg.n_layers, L + 3, pad_lens=pad)
    with torch.no_grad():
        logits, _ = TINY(idx, cache=cache)
        step, _ = TINY(torch.tensor([[1], [2], [3]]), cache=cache)
    for b, p in enumerate(prompts):
        solo, _ = TINY(torch.tensor([p + [b + 1]]))
        torch.testing.assert_close(logits[b, -1], solo[0, len(p) - 1], rtol=0, atol=1e-10)
        torch.testing.assert_close(step[b, -1], solo[0, -1], rtol=0, atol=1e-10)


def test_positions_and_mask():
    """pos counts padding; a row's first real token has position 0; nobody attends a pad."""
    cache = KVCache(1, 8, pad_lens=torch.tensor([0, 2]))
    assert cache.begin_step(4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    cache.end_step()
    assert cache.pos == 4 and cache.begin_step(1).tolist() == [[4], [2]]
    assert KVCache(1, 8).begin_step(3).tolist() == [[0, 1, 2]], "one row of positions for all"
    mask = attention_mask(0, 4, torch.tensor([0, 2]), "cpu")
    assert mask.shape == (2, 1, 4, 4)
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert attention_mask(3, 1, None, "cpu") is None


def test_cache_bytes_formula_equals_storage():
    """KV bytes per token from the formula x positions == the bytes the cache really holds."""
    cache = KVCache(TINY.cfg.n_layers, 50)
    with torch.no_grad():
        TINY(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    per_token = sum(layer.self_attn.cache_bytes_per_token(8) for layer in TINY.layers)  # float64
    assert cache.nbytes() == per_token * 50


def test_cache_overflow_is_a_clear_error():
    cache = KVCache(TINY.cfg.n_layers, 4)
    TINY(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    try:
        TINY(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    except ValueError as e:
        assert "KV cache full" in str(e)
    else:
        raise AssertionError("writing past max_len must raise")
    assert cache.pos == 3, "a refused write leaves the cache as it was"


def test_ragged_mask_sees_each_rows_own_keys():
    """A decode step (one token per row) sees each row's own keys and its new one; a ragged step
    (q_len tokens per row) is causal within the row, and a padding column repeats the row's
    last position."""
    from tinyllm.core.slot_cache import ragged_mask

    positions, mask = ragged_mask([2, 0, 3], [1, 1, 1], "cpu")
    assert positions.tolist() == [[2], [0], [3]] and mask.shape == (3, 1, 1, 4)
    assert mask[:, 0, 0].tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [True, True, True, True],
    ]
    positions, mask = ragged_mask([1, 0], [2, 3], "cpu")
    assert positions.tolist() == [[1, 2, 2], [0, 1, 2]] and mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].int().tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
