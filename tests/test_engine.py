"""Steps 02-04 - every batched path gives each request exactly its solo generate() tokens."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyllm.check import divergence
from tinyllm.engine import (ContinuousEngine, Request, Sampling, Trace, prefill_padded,
                            run_continuous, run_static)
from tinyllm.generate import generate
from tests.conftest import make_tiny

TINY = make_tiny(seed=3)
V = TINY.cfg.vocab_size


def solo(req: Request, model=TINY) -> list[int]:
    s = req.sampling or Sampling()
    g = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
    return generate(model, req.prompt, req.max_new_tokens, eos_id=req.eos_id,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=g)


def assert_oracle(requests, results, skip=()):
    for i, (req, res) in enumerate(zip(requests, results)):
        if i in skip:
            continue
        msg = divergence(f"request {i}", solo(req), res.tokens)
        assert msg is None, msg


requests_st = st.lists(
    st.builds(Request,
              prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=24),
              max_new_tokens=st.integers(1, 24),
              eos_id=st.sampled_from([None, 3, 11, 40])),
    min_size=1, max_size=12)


# ---- 02: padded prefill ------------------------------------------------------------------------

def test_padded_prefill_last_logits_match_each_prompt_alone():
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11]]
    logits, cache, pad = prefill_padded(TINY, prompts, max_len=7)
    assert pad == [0, 6, 4] and cache.pos == 7 and logits.shape == (3, V)
    for b, p in enumerate(prompts):
        alone, _ = TINY(torch.tensor([p]))
        torch.testing.assert_close(logits[b], alone[0, -1], rtol=0, atol=1e-10)


# ---- 03: static batching -----------------------------------------------------------------------

def test_static_batching_serves_mixed_sampling_like_solo():
    """Per-request settings and seeds in static batches: each request gets its solo tokens."""
    rng = random.Random(0)
    reqs = [Request([rng.randrange(V) for _ in range(rng.randint(1, 12))], rng.randint(1, 20),
                    sampling=rng.choice([None, Sampling(0.8, 30, None, seed=i), Sampling(seed=i),
                                         Sampling(1.1, None, 0.9, seed=50 + i)]))
            for i in range(12)]
    results, _ = run_static(TINY, reqs, 4)
    assert_oracle(reqs, results)


@settings(max_examples=30, deadline=None)
@given(requests=requests_st, batch_size=st.integers(1, 6))
def test_static_batching_matches_solo_generate(requests, batch_size):
    """Every request gets the tokens solo generate() gives it, whatever its batch."""
    results, summary = run_static(TINY, requests, batch_size)
    assert_oracle(requests, results)
    assert summary["useful_tokens"] == sum(len(r.tokens) for r in results)
    assert 0 <= summary["row_util"] <= 1


# ---- 04: continuous batching -------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(requests=requests_st, n_slots=st.integers(1, 6))
def test_continuous_batching_matches_solo_generate(requests, n_slots):
    results, summary = run_continuous(TINY, requests, n_slots)
    assert_oracle(requests, results)
    assert summary["useful_tokens"] == sum(len(r.tokens) for r in results)
    assert summary["peak_active"] <= n_slots


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(requests=requests_st, n_slots=st.integers(1, 5), data=st.data())
def test_online_engine_with_arrivals_aborts_and_mixed_sampling(requests, n_slots, data):
    """Requests arrive between steps, some are aborted, greedy and seeded sampled mixed:
    every finished request equals solo generate, every other one finishes, no slot stays busy."""
    reqs = [Request(r.prompt, r.max_new_tokens, r.eos_id,
                    data.draw(st.sampled_from([None, Sampling(0.9, 20, None, seed=i),
                                               Sampling(1.2, None, 0.8, seed=100 + i)])))
            for i, r in enumerate(requests)]
    eng = ContinuousEngine(TINY, n_slots)
    pending = list(enumerate(reqs))
    rid_of, aborted, streamed = {}, set(), {}
    while pending or eng.has_work():
        for _ in range(data.draw(st.integers(0, 2))):
            if pending:
                i, r = pending.pop(0)
                rid_of[eng.add_request(r)] = i
        if rid_of and data.draw(st.integers(0, 9)) == 0:
            rid = data.draw(st.sampled_from(sorted(rid_of)))
            if eng.abort(rid):
                aborted.add(rid_of[rid])
        for ev in eng.step():
            streamed.setdefault(ev.rid, []).append(ev.token)
    assert not any(eng.slots.active) and eng.load() == (0, 0)
    for rid, i in rid_of.items():
        if i in aborted:
            assert rid not in eng.results
            continue
        res = eng.results.pop(rid)
        assert res.tokens == streamed[rid], "the streamed Events spell the Result"
        msg = divergence(f"request {i}", solo(reqs[i]), res.tokens)
        assert msg is None, msg
    st_ = eng.stats
    assert st_.useful_rows == st_.computed_rows <= st_.slot_rows == st_.decode_steps * n_slots


def test_bundled_model_static_and_continuous(bundled64):
    """The bundled model in float64, speeches ending at EOS: both engines match solo."""
    model, tok = bundled64
    texts = ["Ham.\n", "Oph.\nMy lord", "King.\n", "Rom.\nO", "Jul.\n", "Nurse.\n"]
    reqs = [Request(tok.encode(t), 60, eos_id=tok.eos_id) for t in texts]
    expected = [solo(r, model) for r in reqs]
    for results, _ in (run_static(model, reqs, 4), run_continuous(model, reqs, 3)):
        for i, (e, r) in enumerate(zip(expected, results)):
            assert r.tokens == e, divergence(f"request {i}", e, r.tokens)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("req, words", [
    (Request([], 5), "empty prompt"), (Request([1, V], 5), f"token id {V} is outside"),
    (Request([1, 2.5], 5), "token id 2.5"), (Request(["a"], 5), "token id 'a'"),
    (Request([1], 0), "max_new_tokens"), (Request([1] * 90, 10), "exceeds max_seq_len"),
])
def test_bad_requests_are_rejected_and_others_still_served(req, words):
    eng = ContinuousEngine(TINY, 2)
    good = Request([4, 5, 6], 8)
    rid = eng.add_request(good)
    with pytest.raises(ValueError, match=words):
        eng.add_request(req)
    assert eng.load() == (1, 0), "a rejected request leaves the engine as it was"
    while eng.has_work():
        eng.step()
    assert eng.results[rid].tokens == solo(good)
    with pytest.raises(ValueError, match=words):
        run_static(TINY, [good, req], 2)


@pytest.mark.parametrize("kw, words", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=-1), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_p=0), "top_p"), (dict(seed=1.5), "seed"),
])
def test_bad_sampling_is_named(kw, words):
    with pytest.raises(ValueError, match=words):
        Sampling(**kw)


def test_engine_settings_are_checked():
    with pytest.raises(ValueError, match="n_slots"):
        ContinuousEngine(TINY, 0)
    with pytest.raises(ValueError, match="kv must be"):
        ContinuousEngine(TINY, 2, kv="blocks")
    with pytest.raises(ValueError, match="max_seq_len"):
        ContinuousEngine(TINY, 2, max_len=1000)
    with pytest.raises(ValueError, match="batch_size"):
        run_static(TINY, [Request([1], 1)], 0)
    with pytest.raises(ValueError, match="padded prompt 60 \\+ new 40"):
        run_static(TINY, [Request([1] * 60, 1), Request([1], 40)], 2)


def test_abort_unknown_or_finished_returns_false():
    eng = ContinuousEngine(TINY, 2)
    assert eng.abort(123) is False
    rid = eng.add_request(Request([1, 2], 2))
    while eng.has_work():
        eng.step()
    assert eng.abort(rid) is False and eng.abort(-1) is False
    queued = eng.add_request(Request([1, 2], 2))
    assert eng.abort(queued) is True and eng.abort(queued) is False
    assert not eng.has_work()


def test_trace_records_who_holds_each_slot():
    reqs = [Request([i + 1], n) for i, n in enumerate([3, 1, 5, 2])]
    trace = Trace()
    _, summary = run_continuous(TINY, reqs, 2, trace=trace)
    assert len(trace.rows) == len(trace.kv_used) == summary["decode_steps"]
    assert all(len(r) == 2 for r in trace.rows)
    held = {rid for r in trace.rows for rid in r if rid is not None}
    assert held == {0, 2, 3}, "request 1 (one token) is done at prefill and never decodes"
    assert [r.count(2) for r in trace.rows].count(1) == 4, "request 2 decodes 4 steps"
    busy = sum(rid is not None for r in trace.rows for rid in r)
    assert summary["occupancy"] == busy / (2 * len(trace.rows)) < 1
    assert summary["row_util"] == 1, "the decode step computes the busy slots only"


def test_static_trace_shows_the_wasted_rows():
    reqs = [Request([1, 2], 5), Request([3], 2), Request([4], 1)]
    trace = Trace()
    _, summary = run_static(TINY, reqs, 3, trace=trace)
    assert trace.rows == [[0, 1, None], [0, None, None], [0, None, None], [0, None, None]]
    assert summary["row_util"] == summary["occupancy"] == 5 / 12
