"""Exercise 06 - CUDA graphs: your bucket choice, static-buffer copy and decode step inside the
graph decoder, run eagerly (capture=False), so on any machine."""

import random

import pytest
import torch

from tests.conftest import make_tiny
from tinyllm.build import run_continuous
from tinyllm.core.cuda_graph import SlotGraphDecoder
from tinyllm.core.generate import generate
from tinyllm.core.requests import Request
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.course.check import divergence, explained

EXERCISE = "ex06_cuda_graphs"
TINY = make_tiny(seed=7)


@pytest.mark.parametrize(
    "window, want", [(1, 32), (31, 32), (32, 32), (33, 64), (100, 128), (128, 128)]
)
def test_the_smallest_bucket_that_holds_the_window(impl, window, want):
    """The smallest bucket >= the window: an exact fit included."""
    got = impl.choose_bucket([32, 64, 128], window)
    assert got == want, f"buckets [32, 64, 128], window {window}: want {want}, got {got}"


def test_a_window_beyond_every_bucket_has_no_bucket(impl):
    """A window larger than every bucket: None, and the step runs eagerly."""
    got = impl.choose_bucket([32, 64, 128], 129)
    assert got is None, f"window 129 > every bucket: None (the step runs eagerly), got {got}"


def test_fill_static_writes_into_the_buffers(impl):
    """The static buffers get copies of the step's inputs, in their own memory."""
    static_tokens = torch.zeros(3, 1, dtype=torch.long)
    static_lens = torch.zeros(3, dtype=torch.long)
    where = (static_tokens.data_ptr(), static_lens.data_ptr())
    tokens, lens = torch.tensor([[7], [8], [9]]), torch.tensor([4, 0, 11])
    impl.fill_static(static_tokens, static_lens, tokens, lens)
    if (static_tokens.data_ptr(), static_lens.data_ptr()) != where:
        raise AssertionError(
            "fill_static moved a buffer to other memory (set_ or resize?): a "
            "graph reads the memory it was captured with; write into it"
        )
    if static_tokens.tolist() == [[0]] * 3 and static_lens.tolist() == [0] * 3:
        raise AssertionError(
            "fill_static left both buffers as they were (all zeros): assigning "
            "to the name (static_tokens = tokens) only rebinds it inside the "
            "function; write the values into the buffers themselves"
        )
    assert static_tokens.tolist() == [[7], [8], [9]], (
        f"static_tokens should hold the tokens [[7], [8], [9]], it holds {static_tokens.tolist()}"
    )
    assert static_lens.tolist() == [4, 0, 11], (
        f"static_lens should hold the lengths [4, 0, 11], it holds {static_lens.tolist()}"
    )
    tokens[0, 0], lens[0] = 99, 99
    assert static_tokens[0, 0] == 7 and static_lens[0] == 4, (
        "after fill_static the caller changed tokens[0, 0] and lens[0] to 99, and the buffers "
        "changed too: they share memory with the inputs; hold copies, since a graph must not "
        "read tensors the caller reuses"
    )


# ---- decode_step ----------------------------------------------------------------------------
def decoder_with(lens: list[int], buckets=(4, 8, 16)):
    """A decoder (capture=False) over 3 slots of 24 positions; slot s holds lens[s] tokens of a
    known sequence (0: free), and the next decode step is planned for the busy ones."""
    cfg = TINY.cfg
    slots = SlotKVCache(cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim, 24, torch.float64, "cpu")
    decoder = SlotGraphDecoder(TINY, slots, buckets, capture=False)
    seqs = [[(7 * s + 3 * i) % 97 for i in range(n)] for s, n in enumerate(lens)]
    busy = [s for s, n in enumerate(lens) if n]
    for s in busy:
        slots.admit(s, lens[s])
    slots.plan_step(busy, [lens[s] for s in busy])
    T = max(lens)
    with torch.no_grad():
        TINY(torch.tensor([seqs[s] + [0] * (T - lens[s]) for s in busy]), cache=slots)
    slots.plan_step(busy, [1] * len(busy))
    return decoder, seqs, busy


def spy_on_run_eager(decoder, monkeypatch) -> list:
    windows, run = [], decoder.run_eager
    monkeypatch.setattr(decoder, "run_eager", lambda W: windows.append(W) or run(W))
    return windows


@pytest.mark.parametrize(
    "lens, want", [([5, 0, 7], 8), ([3, 2, 1], 4), ([8, 4, 0], 16), ([0, 0, 15], 16)]
)
def test_decode_step_runs_the_bucket_of_the_longest_busy_slot(impl, monkeypatch, lens, want):
    """Buckets (4, 8, 16): the window is the longest busy slot's length + 1, and the step runs
    the smallest bucket that holds it."""
    decoder, _, _ = decoder_with(lens)
    windows = spy_on_run_eager(decoder, monkeypatch)
    with explained(f"your decode_step (slot lengths {lens})"):
        impl.decode_step(decoder, torch.tensor([[1], [2], [3]]))
    window = max(lens) + 1
    assert windows == [want], (
        f"slot lengths {lens}: the window is {max(lens)} + 1 = {window} "
        f"keys (the new token sees itself), so bucket {want} runs; "
        f"run_eager was called with {windows}"
    )


def test_decode_step_beyond_every_bucket_runs_at_the_window(impl, monkeypatch):
    """No bucket holds the window: the step runs eagerly at the window itself."""
    decoder, _, _ = decoder_with([0, 18, 3])
    windows = spy_on_run_eager(decoder, monkeypatch)
    with explained("your decode_step (slot lengths [0, 18, 3])"):
        impl.decode_step(decoder, torch.tensor([[1], [2], [3]]))
    assert windows == [19], (
        f"window 19 > every bucket (4, 8, 16): run_eager(19), got calls {windows}"
    )


def test_decode_step_fills_the_buffers_and_counts_the_tokens(impl):
    """The static buffers hold the step's tokens and each slot's length (a free slot's is 0),
    in their own memory; afterwards each busy slot holds one more token."""
    decoder, _, _ = decoder_with([5, 0, 7])
    where = (decoder.tokens.data_ptr(), decoder.lens.data_ptr())
    with explained("your decode_step"):
        impl.decode_step(decoder, torch.tensor([[11], [12], [13]]))
    assert (decoder.tokens.data_ptr(), decoder.lens.data_ptr()) == where, (
        "write into decoder.tokens and decoder.lens (fill_static): a graph reads only those buffers"
    )
    assert decoder.tokens.tolist() == [[11], [12], [13]], (
        f"decoder.tokens holds {decoder.tokens.tolist()}"
    )
    assert decoder.lens.tolist() == [5, 0, 7], (
        "decoder.lens holds each slot's length before the step (0 for the free slot 1): "
        f"{decoder.lens.tolist()}"
    )
    assert decoder.slots.lens == [6, 0, 8], (
        "after the step the busy slots hold one more token (slots.end_step()): "
        f"{decoder.slots.lens}"
    )


def test_decode_step_gives_each_busy_slot_its_logits(impl):
    """The logits of each busy slot are those of its sequence and new token, without a cache."""
    decoder, seqs, busy = decoder_with([5, 0, 7])
    tokens = torch.tensor([[11], [12], [13]])
    with explained("your decode_step"), torch.no_grad():
        logits = impl.decode_step(decoder, tokens)
    assert tuple(logits.shape) == (3, 1, TINY.cfg.vocab_size), (
        f"logits for every slot, (S, 1, V) = {(3, 1, TINY.cfg.vocab_size)}, got "
        f"{tuple(logits.shape)}"
    )
    for s in busy:
        with torch.no_grad():
            alone = TINY(torch.tensor([seqs[s] + [int(tokens[s])]]))[0][0, -1]
        err = (logits[s, 0] - alone).abs().max().item()
        assert err < 1e-9, f"slot {s}: logits differ from its sequence without a cache by {err:.3g}"


# ---- the engine -----------------------------------------------------------------------------
def test_graph_decoder_with_your_functions_matches_solo(plug):
    """The graph decoder (run eagerly) with your functions: every request gets its solo tokens."""
    plug()
    rng = random.Random(0)
    reqs = [
        Request(
            [rng.randrange(97) for _ in range(rng.randint(1, 20))],
            rng.randint(1, 40),
            eos_id=rng.choice([None, 5]),
        )
        for _ in range(10)
    ]
    expected = None
    for n_slots, buckets in ((3, (8, 16, 32)), (5, None)):
        with explained(
            f"the graph decoder with your functions ({n_slots} slots, buckets {buckets})"
        ):
            results, summary = run_continuous(
                TINY, reqs, n_slots, decoder="graphs", buckets=buckets
            )
        expected = expected or [
            generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs
        ]
        for i, (e, r) in enumerate(zip(expected, results)):
            msg = divergence(f"request {i} ({n_slots} slots, buckets {buckets})", e, r.tokens)
            assert msg is None, msg


def test_bundled_model_with_your_decoder(plug, bundled64):
    """The bundled model (float64), where every key matters: small buckets (8, 16, 32, 64), so
    steps change bucket often, speeches ending at EOS; each request's solo tokens."""
    model, tok = bundled64
    texts = [
        "Ham.\n",
        "Oph.\nMy lord,",
        "King.\n",
        "Pol.\nWhat do you read, my lord?\n\nHam.\n",
        "Ham.\nTo be, or not to be",
        "Queen.\n",
    ]
    reqs = [Request(tok.encode(t), 40, eos_id=tok.eos_id) for t in texts]
    plug()  # solo generate calls no seam of this exercise
    with explained("the graph decoder with your functions"):
        results, _ = run_continuous(model, reqs, 3, decoder="graphs", buckets=(8, 16, 32, 64))
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, (
        "the prompts are chosen so that EOS fires"
    )
    for i, (e, r) in enumerate(zip(expected, results)):
        msg = divergence(f"request {i} ({texts[i]!r})", e, r.tokens)
        assert msg is None, msg
