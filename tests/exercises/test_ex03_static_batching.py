"""Exercise 03 - static batching: your batch loop inside run_static."""

import random

import pytest
import torch

from tests.conftest import make_tiny
from tinyllm.core.generate import generate
from tinyllm.core.requests import Request, Result
from tinyllm.core.sampling import sample_next
from tinyllm.core.static import run_static
from tinyllm.course import seams
from tinyllm.course.check import divergence, explained

EXERCISE = "ex03_static_batching"
TINY = make_tiny(seed=6)
GREEDY = lambda logits: sample_next(logits)


def clock_counter():
    ticks = iter(range(10**6))
    return lambda: float(next(ticks))


def run_batch(impl, batch, pick=None, clock=None) -> list:
    """impl.run_batch, with what came back checked: one Result per request, in order."""
    with explained("your run_batch"):
        results = impl.run_batch(TINY, batch, pick or GREEDY, clock or clock_counter())
    assert isinstance(results, list) and len(results) == len(batch), (
        f"run_batch returns a list of one Result per request ({len(batch)}), got {results!r}"
    )
    for i, r in enumerate(results):
        assert isinstance(r, Result), (
            f"request {i}: expected a Result(tokens, ttft_s, latency_s), got {r!r}"
        )
    return results


def test_one_batch_gives_each_request_its_solo_tokens(impl):
    """One batch of three prompts of different lengths: each request gets its solo tokens."""
    batch = [Request([1, 2, 3], 6), Request([4], 2), Request([5, 6, 7, 8, 9], 9)]
    results = run_batch(impl, batch)
    for i, (r, res) in enumerate(zip(batch, results)):
        msg = divergence(f"request {i}", generate(TINY, r.prompt, r.max_new_tokens), res.tokens)
        assert msg is None, msg


def test_each_request_stops_at_its_own_end(impl):
    """max_new_tokens and eos_id end a request; its row keeps computing, its tokens stop."""
    full = generate(TINY, [3, 1, 4], 12)
    eos = full[3]
    batch = [Request([3, 1, 4], 12, eos_id=eos), Request([2, 7], 12), Request([9], 1)]
    results = run_batch(impl, batch)
    want = full[: full.index(eos) + 1]
    assert results[0].tokens == want, (
        f"request 0 should stop at eos {eos}: expected {want}, got {results[0].tokens}"
    )
    assert len(results[1].tokens) == 12, (
        f"request 1 makes exactly 12 tokens, got {len(results[1].tokens)}"
    )
    assert len(results[2].tokens) == 1, "request 2 wants 1 token: the one sampled from the prefill"


def test_ttft_and_latency_come_from_the_clock(impl):
    """ttft_s: the clock when the first token was picked; latency_s: when the last was. The test
    clock counts its calls (0, 1, 2, ...), so it shows when your loop read it."""
    batch = [Request([1, 2], 1), Request([3], 4)]
    a, b = run_batch(impl, batch)
    seen = (
        f"request 0: ttft {a.ttft_s}, latency {a.latency_s}; request 1: ttft {b.ttft_s}, "
        f"latency {b.latency_s}"
    )
    assert a.ttft_s == a.latency_s == b.ttft_s, (
        f"both first tokens are picked in the same step, and request 0's only token is also its "
        f"last: its ttft, its latency and request 1's ttft are one clock reading ({seen})"
    )
    assert b.latency_s - b.ttft_s >= 3, (
        f"request 1's 4 tokens take 3 more steps after its first: its latency is at least 3 clock "
        f"readings after its ttft if the clock is read once per step ({seen})"
    )


def test_the_loop_runs_one_token_per_row_per_step(impl, monkeypatch):
    """One padded prefill, then (B, 1) per step until the longest request is done."""
    seen = []
    forward = TINY.forward
    monkeypatch.setattr(
        TINY,
        "forward",
        lambda idx, cache=None, targets=None: (
            seen.append(tuple(idx.shape)) or forward(idx, cache, targets)
        ),
    )
    run_batch(impl, [Request([1, 2, 3], 4), Request([4], 2)])
    assert seen[0] == (2, 3), f"one padded prefill of (2, 3) first, the model saw {seen[0]}"
    assert seen[1:] == [(2, 1)] * 3, (
        f"then (2, 1) per decode step until the longest (4 tokens) is done: saw {seen[1:]}"
    )


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_run_static_with_your_loop_matches_solo(plug, batch_size):
    """run_static with your loop: every request gets its solo tokens, and every token counts."""
    rng = random.Random(batch_size)
    reqs = [
        Request(
            [rng.randrange(97) for _ in range(rng.randint(1, 16))],
            rng.randint(1, 16),
            eos_id=rng.choice([None, 7]),
        )
        for _ in range(12)
    ]
    plug()  # solo generate calls no seam of this exercise
    with explained("run_static with your loop"):
        results, summary = run_static(TINY, reqs, batch_size)
    expected = [generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    for i, (e, r) in enumerate(zip(expected, results)):
        msg = divergence(f"request {i}", e, r.tokens)
        assert msg is None, msg
    assert summary["useful_tokens"] == sum(len(e) for e in expected), (
        f"useful_tokens should be {sum(len(e) for e in expected)}, got {summary['useful_tokens']}"
    )


def test_sampling_goes_through_pick(impl):
    """A seeded sampled batch: your loop draws the reference loop's tokens, so it uses pick."""
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    batch = [Request([1, 2], 8), Request([3], 8)]
    pick = lambda g: lambda logits: sample_next(logits, 1.0, 20, None, g)
    reference = seams.reference("03")["run_batch"]  # the package's own loop
    want = [r.tokens for r in reference(TINY, batch, pick(g2), clock_counter())]
    got = [r.tokens for r in run_batch(impl, batch, pick(g1))]
    for i, (e, g) in enumerate(zip(want, got)):
        assert g == e, (
            f"request {i}, sampled with one seeded generator: expected {e}, got {g} "
            f"(draw every token with pick(logits), once per step)"
        )


SPEECHES = [
    "Ham.\n",
    "Oph.\nMy lord,",
    "King.\n",
    "Pol.\nWhat do you read, my lord?\n\nHam.\n",
    "Ham.\nTo be, or not to be",
    "Queen.\n",
]


def test_bundled_model_batches_end_when_their_last_speech_does(plug, bundled64):
    """The bundled model (float64), batches of 3 speeches that end at EOS long before
    max_new_tokens: solo tokens, and each batch stops decoding when its last row is done."""
    model, tok = bundled64
    reqs = [Request(tok.encode(t), 60, eos_id=tok.eos_id) for t in SPEECHES]
    plug()  # solo generate calls no seam of this exercise
    calls = []
    hook = model.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    try:
        with explained("run_static with your loop"):
            results, _ = run_static(model, reqs, 3)
    finally:
        hook.remove()
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert all(e[-1] == tok.eos_id for e in expected), (
        "the prompts are chosen so that EOS ends every one"
    )
    for text, e, r in zip(SPEECHES, expected, results):
        msg = divergence(f"the prompt {text!r}", e, r.tokens)
        assert msg is None, msg
    # per batch: prefill + decodes
    want = sum(max(len(e) for e in expected[i : i + 3]) for i in (0, 3))
    assert len(calls) == want, (
        "two batches whose longest speeches take "
        f"{[max(len(e) for e in expected[i : i + 3]) for i in (0, 3)]} tokens: {want} forward "
        "passes in all (one prefill, then one per token until the last row ends at EOS), the "
        f"model ran {len(calls)}: stop decoding once every row is done"
    )
