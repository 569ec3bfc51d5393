"""Exercise 02 - padded prefill: your left_pad, rope_positions and attention_mask in the engine."""

import random

import pytest
import torch

from tests.conftest import make_tiny
from tinyllm.core.generate import generate
from tinyllm.core.padded import prefill_padded
from tinyllm.core.requests import Request
from tinyllm.core.static import run_static
from tinyllm.course.check import divergence, explained

EXERCISE = "ex02_padded_prefill"
TINY = make_tiny(seed=4)


def padded(impl, prompts, pad_id):
    got = impl.left_pad(prompts, pad_id)
    assert isinstance(got, tuple) and len(got) == 2, (
        f"left_pad returns (idx, pad_lens), got {got!r}"
    )
    for name, t in zip(("idx", "pad_lens"), got):
        assert isinstance(t, torch.Tensor), (
            f"left_pad returns tensors (the model takes a tensor of ids): {name} is a "
            f"{type(t).__name__}; make it one with torch.tensor(...)"
        )
    return got


def test_left_pad_puts_padding_on_the_left(impl):
    """Shorter prompts get pad_id on their left; pad_lens counts them."""
    idx, pad_lens = padded(impl, [[1, 2, 3], [4], [5, 6]], 0)
    assert idx.tolist() == [[1, 2, 3], [0, 0, 4], [0, 5, 6]], (
        f"expected [[1, 2, 3], [0, 0, 4], [0, 5, 6]], got {idx.tolist()}"
    )
    assert pad_lens.tolist() == [0, 2, 1], f"pad_lens should be [0, 2, 1], got {pad_lens.tolist()}"
    assert idx.dtype == torch.long, "token ids must be a long tensor (the embedding needs it)"


def test_left_pad_uses_pad_id(impl):
    """The padding is pad_id, whatever it is."""
    idx, _ = padded(impl, [[9], [8, 8, 8]], 7)
    assert idx.tolist() == [[7, 7, 9], [8, 8, 8]], f"pad with pad_id=7: got {idx.tolist()}"


def test_rope_positions_without_padding(impl):
    """No padding: one row of positions pos..pos+T-1 shared by the batch."""
    got = impl.rope_positions(5, 3, None)
    assert isinstance(got, torch.Tensor), (
        "rope_positions returns a tensor (RoPE indexes its tables with it), got a "
        f"{type(got).__name__}"
    )
    assert got.tolist() == [[5, 6, 7]], f"positions 5..7 as (1, 3), got {got.tolist()}"


def test_rope_positions_shift_each_row_by_its_padding(impl):
    """Each row's first real token is at position 0, in prefill and in decode."""
    pad = torch.tensor([0, 2, 3])
    got = impl.rope_positions(0, 4, pad)
    want = [[0, 1, 2, 3], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert got.tolist() == want, (
        f"prefill of 4 with pads [0, 2, 3]: expected {want}, got {got.tolist()}"
    )
    got = impl.rope_positions(4, 1, pad)
    assert got.tolist() == [[4], [2], [1]], (
        "decoding at cache position 4: each row's own position is 4 - pad = [[4], [2], [1]], got "
        f"{got.tolist()}"
    )


def reference_mask(pos, T, pad):
    """Built the slow way: one (query, key) pair at a time."""
    B = len(pad)
    m = torch.zeros(B, 1, T, pos + T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            q = pos + i
            for k in range(pos + T):
                m[b, 0, i, k] = k == q or (k <= q and k >= pad[b])
    return m


@pytest.mark.parametrize("pos, T", [(0, 5), (5, 1), (3, 2)])
def test_attention_mask_is_causal_and_hides_padding(impl, pos, T):
    """Entry by entry against a mask built with loops: causal, and no key of the left padding."""
    pad = [0, 2, 4]
    got = impl.attention_mask(pos, T, torch.tensor(pad), "cpu")
    want = reference_mask(pos, T, pad)
    assert got is not None and got.shape == want.shape, (
        f"mask shape should be (B, 1, T, pos+T) = {tuple(want.shape)}, got "
        f"{None if got is None else tuple(got.shape)}"
    )
    bad = (got.bool() != want).nonzero().tolist()
    assert not bad, (
        f"pos={pos}, T={T}, pads {pad}: first wrong entry (row, _, query, key) = "
        f"{bad[0]}, should be {bool(want[tuple(bad[0])])}"
    )


def test_attention_mask_without_padding_is_causal(impl):
    """No padding: a plain causal mask, or None for a single new token."""
    got = impl.attention_mask(0, 3, None, "cpu")
    assert got is not None, "with T > 1 the mask must at least be causal"
    assert got.reshape(3, 3).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    one = impl.attention_mask(4, 1, None, "cpu")
    assert one is None or bool(one.all()), "one new token with no padding may see every key"


def requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(97) for _ in range(rng.randint(1, 20))],
            rng.randint(1, 15),
            eos_id=rng.choice([None, 5]),
        )
        for _ in range(n)
    ]


def test_your_padded_prefill_gives_each_prompt_its_own_logits(plug):
    """prefill_padded with your three functions: each row's last logits are its prompt's alone."""
    prompts = [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10]]
    alone = [TINY(torch.tensor([p]))[0][0, -1] for p in prompts]
    plug()
    logits, cache, pad = prefill_padded(TINY, prompts, max_len=6)
    for b in range(3):
        err = (logits[b] - alone[b]).abs().max().item()
        assert err < 1e-9, (
            f"prompt {b} (pad {pad[b]}): last logits differ from the prompt alone by {err:.3g}"
        )


@pytest.mark.parametrize("batch_size", [2, 5])
def test_static_batches_with_your_padding_match_solo_generate(plug, batch_size):
    """Your three functions inside run_static: every request gets its solo tokens."""
    reqs = requests(10, batch_size)
    expected = [generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    # after the oracle: solo generate's KVCache uses the seams too
    plug()
    results, _ = run_static(TINY, reqs, batch_size)
    for i, (e, r) in enumerate(zip(expected, results)):
        msg = divergence(f"request {i}", e, r.tokens)
        assert msg is None, msg


SPEECHES = [
    "Ham.\n",
    "Oph.\nMy lord,",
    "King.\n",
    "Pol.\nWhat do you read, my lord?\n\nHam.\n",
    "Ham.\nTo be, or not to be",
]


def test_bundled_model_padded_logits_and_tokens(plug, bundled64):
    """The bundled model (float64): a padded batch of speeches gives each its own last logits,
    and static batches give each its solo tokens, up to EOS."""
    model, tok = bundled64
    prompts = [tok.encode(t) for t in SPEECHES]
    alone = [model(torch.tensor([p]))[0][0, -1] for p in prompts]
    reqs = [Request(p, 40, eos_id=tok.eos_id) for p in prompts]
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, (
        "the prompts are chosen so that EOS fires"
    )
    plug()
    with explained("prefill_padded with your functions"):
        logits, _, pad = prefill_padded(model, prompts, max_len=64)
    for b, text in enumerate(SPEECHES):
        err = (logits[b] - alone[b]).abs().max().item()
        assert err < 1e-9, (
            f"{text!r} (pad {int(pad[b])}): last logits differ from the prompt alone by {err:.3g}"
        )
    with explained("run_static with your functions"):
        results, _ = run_static(model, reqs, 5)
    for text, e, r in zip(SPEECHES, expected, results):
        msg = divergence(f"the prompt {text!r}", e, r.tokens)
        assert msg is None, msg
