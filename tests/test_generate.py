"""Step 01 - sampling and solo generate(): settings, determinism, clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tinyllm.core.generate import generate
from tinyllm.core.sampling import draw, nucleus, sample_next

TINY = make_tiny(seed=2)
LOGITS = torch.randn(4, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_greedy_is_argmax():
    assert sample_next(LOGITS).squeeze(-1).tolist() == LOGITS.argmax(-1).tolist()
    assert sample_next(LOGITS).shape == (4, 1)


@pytest.mark.parametrize(
    "kw", [dict(top_k=1), dict(top_p=1e-9), dict(top_p=1e-50), dict(top_k=1, top_p=0.5)]
)
def test_top_k_1_and_tiny_top_p_are_greedy(kw):
    """Cutting to one candidate leaves nothing to chance, at any temperature."""
    for seed in range(5):
        got = sample_next(
            LOGITS, temperature=1.7, generator=torch.Generator().manual_seed(seed), **kw
        )
        assert got.squeeze(-1).tolist() == LOGITS.argmax(-1).tolist()


def test_top_k_and_top_p_only_draw_from_their_set():
    """top_k=3 draws among the 3 largest; top_p draws within the nucleus."""
    g = torch.Generator().manual_seed(1)
    top3 = LOGITS.topk(3, dim=-1).indices
    for _ in range(50):
        t = sample_next(LOGITS, temperature=5.0, top_k=3, generator=g)
        assert (top3 == t).any(-1).all()
    probs = LOGITS[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for _ in range(50):
        assert sample_next(LOGITS[:1], temperature=1.0, top_p=0.5, generator=g).item() in nucleus


def sorted_nucleus(logits, top_p):
    """top_p's cut by a sort of the whole row: the rule nucleus() keeps."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 3),
    vocab=st.sampled_from([5, 64, 300, 5000]),
    spread=st.sampled_from([0.01, 1.0, 10.0]),  # 0.01: the nucleus is most of the vocabulary
    top_p=st.floats(0.01, 0.999),
    seed=st.integers(0, 2**16),
)
def test_the_nucleus_of_the_likeliest_tokens_is_that_of_a_whole_sort(
    rows, vocab, spread, top_p, seed
):
    """The same logits kept, but where a token lies on the cut: the probability of the tokens
    above it is top_p up to float32's rounding of the softmax, whose sum runs in another order
    over a sorted row (and between tied tokens either may be kept)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread
    got, want = nucleus(logits, top_p), sorted_nucleus(logits, top_p)
    for row, a, b in zip(logits, got, want):
        a, b = a[a.isfinite()].sort(descending=True)[0], b[b.isfinite()].sort(descending=True)[0]
        n = min(len(a), len(b))
        assert torch.equal(a[:n], b[:n]) and abs(len(a) - len(b)) <= 1
        if len(a) != len(b):
            above = row.softmax(dim=-1).sort(descending=True)[0][:n].sum()
            assert abs(above - top_p) < 1e-5, (above, top_p)


def test_draw_inverts_the_cumulative_distribution():
    """u falls in a token's slice of [0, 1): that token. Tokens of probability 0 own no slice,
    not even at the ends (u = 0, u just below 1)."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = torch.tensor([[0.0], [0.2499], [0.25], [0.9], [1 - 2**-53]], dtype=torch.float64)
    assert draw(probs, u).squeeze(-1).tolist() == [1, 1, 3, 3, 3]


def test_a_draw_never_leaves_the_vocabulary():
    """Logits that overflowed to +inf share the draw (NaN counts as -inf); a row with no
    probability left draws the last id: never V, which the next step's embedding cannot read."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, inf, 0.0, inf, -2.0], [nan, 0.0, nan, nan, nan]])
    g = torch.Generator().manual_seed(0)
    drawn = {sample_next(logits, 1.0, generator=g)[0].item() for _ in range(40)}
    assert drawn == {1, 3}
    assert sample_next(logits, 0.7, top_k=2, top_p=0.9, min_p=0.1, generator=g)[1].item() == 1
    assert draw(torch.zeros(2, 5), torch.tensor([[0.0], [0.5]])).squeeze(-1).tolist() == [4, 4]
    assert draw(torch.full((1, 5), nan), torch.tensor([[0.5]])).item() == 4


def test_sampled_frequencies_follow_the_distribution():
    """20,000 draws from fixed probabilities: each token's share within 0.015 of its probability."""
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    logits = probs.log()[None].expand(20_000, -1)
    toks = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    share = torch.bincount(toks.squeeze(-1), minlength=5) / 20_000
    assert share[1] == 0
    assert torch.allclose(share, probs, atol=0.015), share


def test_a_row_draws_the_same_token_alone_or_in_a_batch():
    """One uniform number per row: row i of a batch sampled with generator state g equals the
    row sampled alone after the rows before it used theirs."""
    g = torch.Generator().manual_seed(3)
    batch = sample_next(LOGITS, temperature=1.0, generator=g).squeeze(-1).tolist()
    g.manual_seed(3)
    alone = [sample_next(LOGITS[i : i + 1], temperature=1.0, generator=g).item() for i in range(4)]
    assert batch == alone


def test_seeded_generator_is_deterministic():
    kw = dict(temperature=1.0, top_k=50, top_p=0.9)
    runs = [
        generate(TINY, [1, 2, 3], 25, generator=torch.Generator().manual_seed(7), **kw)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = generate(TINY, [1, 2, 3], 25, generator=torch.Generator().manual_seed(8), **kw)
    assert other != runs[0], "a different seed should give a different sample"


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_p=-0.1), "top_p"),
    ],
)
def test_invalid_sampling_settings_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        sample_next(LOGITS, **kw)
    with pytest.raises(ValueError, match=words):
        generate(TINY, [1, 2], 3, **kw)


@pytest.mark.parametrize(
    "prompt, max_new, words",
    [
        ([], 5, "empty prompt"),
        ([1, 97], 5, "token id 97 is outside the vocabulary"),
        ([-1], 5, "token id -1 is outside"),
        ([1, 2.0], 5, "token id 2.0"),
        ([1] * 90, 7, "exceeds max_seq_len 96"),
        ([1] * 97, 1, "exceeds max_seq_len"),
        ([1], 0, "max_new_tokens"),
        ([1], -3, "max_new_tokens"),
    ],
)
def test_bad_prompts_are_named(prompt, max_new, words):
    with pytest.raises(ValueError, match=words):
        generate(TINY, prompt, max_new)


def test_eos_ends_generation_and_is_returned():
    full = generate(TINY, [4, 5, 6], 20)
    eos = full[6]
    got = generate(TINY, [4, 5, 6], 20, eos_id=eos)
    assert got == full[: full.index(eos) + 1] and got[-1] == eos


def test_max_new_tokens_exactly():
    assert len(generate(TINY, [9], 13)) == 13
    assert len(generate(TINY, [9] * 95, 1)) == 1, "a prompt that just fits max_seq_len is fine"
