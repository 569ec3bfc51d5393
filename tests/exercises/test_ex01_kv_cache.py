"""Exercise 01 - the KV cache: your append_kv and decode_loop, plugged into tinyllm."""

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tinyllm.core.generate import generate, generate_uncached
from tinyllm.core.kv_cache import KVCache
from tinyllm.course.check import divergence, explained

EXERCISE = "ex01_kv_cache"
TINY = make_tiny()


def test_append_kv_writes_at_pos(impl):
    """append_kv stores k, v at positions pos..pos+T-1 and returns the filled prefix."""
    B, n_kv, max_len, hd, pos, T = 2, 3, 10, 4, 3, 2
    cache_k, cache_v = torch.zeros(B, n_kv, max_len, hd), torch.zeros(B, n_kv, max_len, hd)
    cache_k[:, :, :pos], cache_v[:, :, :pos] = 7.0, 8.0  # what earlier steps wrote
    k, v = torch.randn(B, n_kv, T, hd), torch.randn(B, n_kv, T, hd)
    keys, values = impl.append_kv(cache_k, cache_v, k, v, pos)
    assert keys.shape == (B, n_kv, pos + T, hd), (
        f"returned keys should be (B, n_kv, pos+T, hd) = {(B, n_kv, pos + T, hd)}, got "
        f"{tuple(keys.shape)}"
    )
    assert values.shape == keys.shape, f"returned values have shape {tuple(values.shape)}"
    assert torch.equal(cache_k[:, :, pos : pos + T], k), (
        "the new keys are not at positions pos..pos+T-1 of cache_k"
    )
    assert torch.equal(cache_v[:, :, pos : pos + T], v), (
        "the new values are not at positions pos..pos+T-1 of cache_v"
    )
    assert (cache_k[:, :, :pos] == 7).all() and (cache_v[:, :, :pos] == 8).all(), (
        "positions before pos were overwritten: earlier tokens' keys/values must stay"
    )
    assert (cache_k[:, :, pos + T :] == 0).all(), "positions after pos+T-1 were written"
    assert torch.equal(keys, cache_k[:, :, : pos + T]) and torch.equal(
        values, cache_v[:, :, : pos + T]
    ), "return everything written so far: cache[:, :, :pos+T]"


def test_append_kv_writes_into_the_cache_in_place(impl):
    """The cache tensors themselves hold the new keys (a copy would be lost after the call)."""
    cache_k, cache_v = torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2)
    impl.append_kv(cache_k, cache_v, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    impl.append_kv(cache_k, cache_v, 2 * torch.ones(1, 1, 1, 2), 2 * torch.ones(1, 1, 1, 2), 1)
    assert cache_k[0, 0, :, 0].tolist() == [1, 2, 0, 0], (
        "after writes at pos 0 and 1 the cache should hold [1, 2, 0, 0], holds "
        f"{cache_k[0, 0, :, 0].tolist()}"
    )
    k_all, v_all = impl.append_kv(
        cache_k, cache_v, 3 * torch.ones(1, 1, 1, 2), 3 * torch.ones(1, 1, 1, 2), 2
    )
    assert k_all.data_ptr() == cache_k.data_ptr() and v_all.data_ptr() == cache_v.data_ptr(), (
        "append_kv returns views of the cache (a slice of it), not copies: copying everything "
        "written so far at every step costs as much as the cache holds, the very work it saves"
    )


def test_your_append_kv_gives_uncached_logits(plug):
    """KVCache with your append_kv: prefill + 6 decode steps give the logits of no cache."""
    plug("append_kv")
    torch.manual_seed(1)
    ids = torch.randint(0, TINY.cfg.vocab_size, (2, 12))
    full, _ = TINY(ids)  # (2, 12, V)
    cache = KVCache(TINY.cfg.n_layers, 12)
    with torch.no_grad():
        pre, _ = TINY(ids[:, :6], cache=cache)
        steps = [TINY(ids[:, t : t + 1], cache=cache)[0] for t in range(6, 12)]
    got = torch.cat([pre] + steps, dim=1)
    err = (got - full).abs().max().item()
    assert err < 1e-9, f"cached logits differ from uncached ones by up to {err:.3g}"


@pytest.mark.parametrize("max_new", [1, 2, 17])
def test_decode_loop_matches_uncached_generate(plug, max_new):
    """generate() with your decode_loop gives the tokens of generation without a cache."""
    plug("decode_loop")
    for i, n in enumerate([1, 5, 30]):
        prompt = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        expected = generate_uncached(TINY, prompt, max_new)
        msg = divergence(f"prompt {i} ({n} tokens)", expected, generate(TINY, prompt, max_new))
        assert msg is None, msg


def test_decode_loop_feeds_one_token_at_a_time(plug, monkeypatch):
    """Prefill runs the prompt once; each later step runs exactly one new token."""
    plug("decode_loop")
    seen = []
    forward = TINY.forward
    monkeypatch.setattr(
        TINY,
        "forward",
        lambda idx, cache=None, targets=None: (
            seen.append((idx.shape[1], cache is not None)) or forward(idx, cache, targets)
        ),
    )
    generate(TINY, list(range(10)), 5)
    assert seen and all(c for _, c in seen), "call the model with cache=your KVCache every time"
    assert [t for t, _ in seen] == [10, 1, 1, 1, 1], (
        "expected one prefill of 10 tokens then 4 single-token steps, the model saw "
        f"{[t for t, _ in seen]}"
    )


def test_decode_loop_stops_at_eos(plug):
    """Generation stops right after eos_id, which is the last token returned."""
    prompt = [3, 1, 4, 1, 5]
    full = generate_uncached(TINY, prompt, 12)
    eos = full[4]
    expected = full[: full.index(eos) + 1]
    plug("decode_loop")
    got = generate(TINY, prompt, 12, eos_id=eos)
    assert got == expected, f"with eos_id={eos}: expected {expected}, got {got}"


def test_decode_loop_stops_at_any_of_several_eos_ids(plug):
    """A chat model may end its turn with any of several ids: decode_loop gets them as a set,
    and stops at the first token that is one of them, whichever member of the set it is (the
    smallest, the largest, or one between), however the set happens to be ordered."""
    prompt = [3, 1, 4, 1, 5]
    full = generate_uncached(TINY, prompt, 12)
    first = next(i for i in range(2, 12) if full[i] not in full[:i])
    fired = full[first]
    others = [t for t in range(97) if t not in full]
    low, high = [t for t in others if t < fired], [t for t in others if t > fired]
    twin = next(t for t in others if t % 8 == fired % 8)  # a set iterates it before fired
    sets = [
        (fired, high[0], high[-1]) if high else None,
        (low[0], fired, high[0]) if low and high else None,
        (low[0], low[-1], fired) if low else None,
        (twin, fired),
        (full[-1], fired) if full[-1] != fired else None,
    ]
    plug("decode_loop")
    expected = full[: first + 1]
    for eos in filter(None, sets):
        got = generate(TINY, prompt, 12, eos_id=eos)
        assert got == expected, (
            f"with eos_id={eos} (decode_loop gets eos_ids={set(eos)}): stop "
            f"at the first token that is any of them, here {fired} at token "
            f"{first}; expected {expected}, got {got}"
        )


def test_decode_loop_uses_pick(plug):
    """Sampling goes through pick: a seeded sampled run equals the reference's."""
    prompt = [7, 8, 9]
    expected = generate_uncached(
        TINY, prompt, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(0)
    )
    plug("decode_loop")
    got = generate(
        TINY, prompt, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(0)
    )
    msg = divergence("sampled run (temperature 1, top_k 20, seed 0)", expected, got)
    assert msg is None, msg


# a failing example is reported as found, not shrunk: shrinking reruns the model hundreds of
# times (minutes), and the message already names the prompt and the first wrong token
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(prompt=st.lists(st.integers(0, 96), min_size=1, max_size=40), max_new=st.integers(1, 30))
def test_both_functions_match_uncached_on_random_prompts(plug, prompt, max_new):
    """Your append_kv and decode_loop together, on random prompts: exactly the uncached tokens."""
    plug()  # the uncached oracle calls no seam
    got = generate(TINY, prompt, max_new)
    expected = generate_uncached(TINY, prompt, max_new)
    msg = divergence(f"prompt {prompt}", expected, got)
    assert msg is None, msg


SPEECHES = [
    "Ham.\n",
    "Oph.\nMy lord,",
    "King.\n",
    "Pol.\nWhat do you read, my lord?\n\nHam.\n",
    "Ham.\nTo be, or not to be",
]


def test_bundled_model_with_your_cache(plug, bundled64):
    """The bundled model (float64), your code: Shakespeare speeches token for token as without a
    cache, each ending at EOS, and not one forward pass after it."""
    model, tok = bundled64
    plug()  # the uncached oracle calls no seam: computed after your run
    calls = []
    hook = model.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[1]))
    try:
        for text in SPEECHES:
            p = tok.encode(text)
            calls.clear()
            with explained("generate with your decode_loop"):
                got = generate(model, p, 40, eos_id=tok.eos_id)
            n_calls = len(calls)
            e = generate_uncached(model, p, 40, eos_id=tok.eos_id)
            assert e[-1] == tok.eos_id, "the prompts are chosen so that EOS fires"
            msg = divergence(f"the prompt {text!r}", e, got)
            assert msg is None, msg
            assert n_calls == len(e), (
                f"the prompt {text!r}: {len(e)} tokens take one prefill and "
                f"{len(e) - 1} decode steps, the model ran {n_calls} times"
            )
    finally:
        hook.remove()
