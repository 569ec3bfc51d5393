"""Steps 02-04 - every batched path gives each request exactly its solo generate() tokens."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tinyllm.core.generate import generate
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.sampling import GREEDY_BELOW, is_greedy
from tinyllm.core.stats import kv_bytes_per_token
from tinyllm.course.check import divergence
from tinyllm.engine import (
    ContinuousEngine,
    EngineConfig,
    Request,
    Sampling,
    Trace,
    make_engine,
    prefill_padded,
    run_continuous,
    run_static,
)

TINY = make_tiny(seed=3)
V = TINY.cfg.vocab_size


def solo(req: Request, model=TINY) -> list[int]:
    s = req.sampling or Sampling()
    g = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
    return generate(
        model,
        req.prompt,
        req.max_new_tokens,
        eos_id=req.eos_id,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        generator=g,
    )


def assert_oracle(requests, results, skip=()):
    for i, (req, res) in enumerate(zip(requests, results)):
        if i in skip:
            continue
        msg = divergence(f"request {i}", solo(req), res.tokens)
        assert msg is None, msg


requests_st = st.lists(
    st.builds(
        Request,
        prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=24),
        max_new_tokens=st.integers(1, 24),
        eos_id=st.sampled_from([None, 3, 11, 40, (3, 11), [40, 7, 11]]),
    ),
    min_size=1,
    max_size=12,
)


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
    reqs = [
        Request(
            [rng.randrange(V) for _ in range(rng.randint(1, 12))],
            rng.randint(1, 20),
            sampling=rng.choice(
                [
                    None,
                    Sampling(0.8, 30, None, seed=i),
                    Sampling(seed=i),
                    Sampling(1.1, None, 0.9, seed=50 + i),
                ]
            ),
        )
        for i in range(12)
    ]
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


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(requests=requests_st, n_slots=st.integers(1, 5), data=st.data())
def test_online_engine_with_arrivals_aborts_and_mixed_sampling(requests, n_slots, data):
    """Requests arrive between steps, some are aborted, greedy and seeded sampled mixed:
    every finished request equals solo generate, every other one finishes, no slot stays busy."""
    reqs = [
        Request(
            r.prompt,
            r.max_new_tokens,
            r.eos_id,
            data.draw(
                st.sampled_from(
                    [None, Sampling(0.9, 20, None, seed=i), Sampling(1.2, None, 0.8, seed=100 + i)]
                )
            ),
        )
        for i, r in enumerate(requests)
    ]
    eng = make_engine(TINY, n_slots)
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
    assert not any(eng.cache.active) and eng.request_counts() == (0, 0)
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


@pytest.mark.parametrize(
    "req, words",
    [
        (Request([], 5), "empty prompt"),
        (Request([1, V], 5), f"token id {V} is outside"),
        (Request([1, 2.5], 5), "token id 2.5"),
        (Request(["a"], 5), "token id 'a'"),
        (Request([1], 0), "max_new_tokens"),
        (Request([1] * 90, 10), "exceeds max_seq_len"),
    ],
)
def test_bad_requests_are_rejected_and_others_still_served(req, words):
    eng = make_engine(TINY, 2)
    good = Request([4, 5, 6], 8)
    rid = eng.add_request(good)
    with pytest.raises(ValueError, match=words):
        eng.add_request(req)
    assert eng.request_counts() == (1, 0), "a rejected request leaves the engine as it was"
    while eng.has_work():
        eng.step()
    assert eng.results[rid].tokens == solo(good)
    with pytest.raises(ValueError, match=words):
        run_static(TINY, [good, req], 2)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0), "top_p"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_sampling_is_named(kw, words):
    with pytest.raises(ValueError, match=words):
        Sampling(**kw)


def test_engine_settings_are_checked():
    with pytest.raises(ValueError, match="n_slots"):
        make_engine(TINY, 0)
    with pytest.raises(ValueError, match="kv must be"):
        make_engine(TINY, 2, kv="blocks")
    with pytest.raises(ValueError, match="max_seq_len"):
        make_engine(TINY, 2, max_len=1000)
    with pytest.raises(ValueError, match="batch_size"):
        run_static(TINY, [Request([1], 1)], 0)
    with pytest.raises(ValueError, match="padded prompt 60 \\+ new 40"):
        run_static(TINY, [Request([1] * 60, 1), Request([1], 40)], 2)


def test_the_kv_cache_stays_within_its_budget():
    """kv_mib bounds what the cache reserves: by default a slot cache's max_len and the paged
    pool shrink to fit it; settings given explicitly that need more are refused, naming kv_mib;
    a request longer than the budgeted max_len is refused and the engine serves the rest."""
    per_token = kv_bytes_per_token(TINY, torch.device("cpu"))
    mib = 40 * 4 * per_token / 2**20  # room for 4 slots of 40 positions
    eng = make_engine(TINY, 4, kv_mib=mib)
    assert eng.max_len == 40 and eng.cache.reserved_tokens() == 160
    assert make_engine(TINY, 4).max_len == TINY.cfg.max_seq_len, "the default budget is ample here"
    paged = make_engine(TINY, 4, kv="paged", block_size=8, kv_mib=mib)
    assert paged.cache.n_blocks == 20 and paged.max_len == TINY.cfg.max_seq_len
    with pytest.raises(ValueError, match="prompt of 30 tokens \\+ 20 new tokens"):
        eng.add_request(Request([1] * 30, 20))
    rid = eng.add_request(Request([1, 2, 3], 5))
    while eng.has_work():
        eng.step()
    assert eng.results[rid].tokens == solo(Request([1, 2, 3], 5))
    for kw in (dict(max_len=41), dict(kv="paged", block_size=8, kv_blocks=21)):
        with pytest.raises(
            ValueError, match=r"needs [\d.]+ MiB, over kv_mib=[\d.e-]+ \(160 positions"
        ):
            make_engine(TINY, 4, kv_mib=mib, **kw)
    for bad in (0, -1.0, "64", True, float("inf"), float("nan")):  # inf was an OverflowError
        with pytest.raises(ValueError, match="kv_mib must be a finite number of MiB > 0"):
            make_engine(TINY, 4, kv_mib=bad)
    results, summary = run_continuous(TINY, [Request([1, 2], 4)], 4, kv_mib=mib)
    assert summary["kv_reserved_mib"] == pytest.approx(160 * per_token / 2**20)


def test_abort_unknown_or_finished_returns_false():
    eng = make_engine(TINY, 2)
    assert eng.abort(123) is False
    rid = eng.add_request(Request([1, 2], 2))
    while eng.has_work():
        eng.step()
    assert eng.abort(rid) is False and eng.abort(-1) is False
    queued = eng.add_request(Request([1, 2], 2))
    assert eng.abort(queued) is True and eng.abort(queued) is False
    assert not eng.has_work()
    assert eng.step() == [] and eng.request_counts() == (0, 0), "an idle step does nothing"


def test_step_of_an_engine_that_never_had_a_request():
    """step() of a new, idle engine returns no events, as it does once requests have come and
    gone."""
    eng = make_engine(TINY, 2)
    assert eng.step() == [] and eng.request_counts() == (0, 0)


def test_trace_records_who_holds_each_slot():
    """Every step: who holds each slot and how many tokens it computed. A newcomer's prompt is
    its step's prefill (a 1-token prompt too); its next token comes with the next step."""
    reqs = [Request([i + 1], n) for i, n in enumerate([3, 1, 5, 2])]
    trace = Trace()
    _, summary = run_continuous(TINY, reqs, 2, trace=trace)
    assert trace.rows == [[0, 1], [0, 2], [0, 2], [3, 2], [3, 2], [None, 2]]
    assert trace.computed == [[1, 1]] * 5 + [[0, 1]]
    assert len(trace.kv_used) == len(trace.kv_alloc) == 6
    assert summary["decode_steps"] == 5, "step 1 only prefills"
    assert summary["occupancy"] == 7 / 10, "decoding rows: 1, 2, 1, 2, 1 of 2 slots"
    assert summary["row_util"] == 1, "the decode step computes the decoding slots only"


def test_static_trace_shows_the_wasted_rows():
    reqs = [Request([1, 2], 5), Request([3], 2), Request([4], 1)]
    trace = Trace()
    _, summary = run_static(TINY, reqs, 3, trace=trace)
    assert trace.rows == [[0, 1, None], [0, None, None], [0, None, None], [0, None, None]]
    assert summary["row_util"] == summary["occupancy"] == 5 / 12


# ---- bad input, and odd input that is fine -----------------------------------------------------

ENGINE_KINDS = {
    "slots": dict(),
    "paged": dict(kv="paged", block_size=4, kv_blocks=12),
    "graph": dict(decoder="graphs"),
}


def assert_idle(eng: ContinuousEngine) -> None:
    """Nothing waits or runs, no slot is busy, no token or block is held."""
    cache = eng.cache
    assert eng.request_counts() == (0, 0) and not any(cache.active) and cache.used_tokens() == 0
    assert eng.holders() == [None] * eng.config.n_slots
    if isinstance(cache, PagedKVCache):
        assert cache.allocated_tokens() == 0 and cache.allocator.n_free() == cache.n_blocks


def assert_refused_without_trace(kind: str, bad_call, exc, words: str) -> None:
    """An engine with one request decoding and one waiting: bad_call(eng) raises exc matching
    words and leaves the engine as it was. The next request gets the next id, everything is
    served as solo, and no slot or block is held at the end."""
    eng = make_engine(TINY, 1, **ENGINE_KINDS[kind])
    good = [Request([4, 5, 6], 8), Request([7, 8], 5, eos_id=11)]
    rids = [eng.add_request(good[0])]
    eng.step()
    rids.append(eng.add_request(good[1]))
    before = (
        eng.request_counts(),
        eng.holders(),
        list(eng.cache.lens),
        eng.cache.allocated_tokens(),
    )
    assert before[0] == (1, 1)
    with pytest.raises(exc, match=words):
        bad_call(eng)
    assert (
        eng.request_counts(),
        eng.holders(),
        list(eng.cache.lens),
        eng.cache.allocated_tokens(),
    ) == before
    good.append(Request([9], 6))
    rids.append(eng.add_request(good[2]))
    assert rids == [0, 1, 2], "a refused request takes no id"
    while eng.has_work():
        eng.step()
    for i, (rid, req) in enumerate(zip(rids, good)):
        assert eng.results.pop(rid).tokens == solo(req), f"request {i}"
    assert_idle(eng)


def serve_all(kind: str, reqs: list[Request], n_slots: int = 2) -> list[list[int]]:
    """The tokens of every request, served together by a fresh engine of this kind."""
    return [r.tokens for r in run_continuous(TINY, reqs, n_slots, **ENGINE_KINDS[kind])[0]]


@pytest.mark.parametrize(
    "make",
    [iter, lambda p: (t for t in p), tuple, np.array],
    ids=["iter", "generator-expression", "tuple", "numpy"],
)
def test_a_prompt_given_as_an_iterable_is_served_like_the_list(make):
    """A prompt given as an iterator (consumed once), a generator expression, a tuple or a numpy
    array is served exactly like the list: by generate(), run_static and every continuous
    engine, alone and batched with another request."""
    p, other = [3, 1, 4, 1, 5], Request([9, 2, 6], 7)
    want = generate(TINY, p, 9, eos_id=40)
    assert generate(TINY, make(p), 9, eos_id=40) == want
    assert run_static(TINY, [Request(make(p), 9, 40)], 1)[0][0].tokens == want
    batched, _ = run_static(TINY, [other, Request(make(p), 9, 40)], 2)
    assert [r.tokens for r in batched] == [solo(other), want]
    for kind in ENGINE_KINDS:
        assert serve_all(kind, [Request(make(p), 9, 40)]) == [want], kind
        assert serve_all(kind, [Request(make(p), 9, 40), other]) == [want, solo(other)], kind
        eng = make_engine(TINY, 2, **ENGINE_KINDS[kind])
        rid = eng.add_request(Request(make(p), 9, 40))
        while eng.has_work():
            eng.step()
        assert eng.results.pop(rid).tokens == want, kind
        assert_idle(eng)


def test_a_tiny_temperature_is_greedy_everywhere():
    """temperature 1e-40 (below sampling.GREEDY_BELOW) is greedy in generate() and every engine:
    ids inside the vocabulary, equal to greedy, and no random number drawn."""
    assert is_greedy(1e-40) and is_greedy(0.0) and not is_greedy(GREEDY_BELOW)
    prompts = [[1, 2, 3], [50, 60], [7] * 9]
    greedy = [generate(TINY, p, 12) for p in prompts]
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    for kw in (dict(), dict(top_k=3), dict(top_p=0.5), dict(top_k=1, top_p=1.0)):
        got = [generate(TINY, p, 12, temperature=1e-40, generator=g, **kw) for p in prompts]
        assert got == greedy, kw
    assert torch.equal(g.get_state(), state), "a greedy pick draws no random number"
    reqs = [Request(p, 12) for p in prompts]
    mixed = [
        Request(prompts[0], 12, sampling=Sampling(1e-40)),
        Request(prompts[1], 12, sampling=Sampling(1e-40, 5, 0.9, seed=3)),
        Request(prompts[2], 12, sampling=Sampling(temperature=1e-40, seed=2**64 - 1)),
    ]
    runs = {
        "static": [r.tokens for r in run_static(TINY, reqs, 2, temperature=1e-40, top_k=4)[0]],
        "static, per request": [r.tokens for r in run_static(TINY, mixed, 3)[0]],
    }
    for kind in ENGINE_KINDS:
        runs[kind] = [
            r.tokens
            for r in run_continuous(TINY, reqs, 2, temperature=1e-40, **ENGINE_KINDS[kind])[0]
        ]
        runs[f"{kind}, per request"] = serve_all(kind, mixed)
    for name, got in runs.items():
        assert all(0 <= t < V for toks in got for t in toks), name
        assert got == greedy, name


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, True, "7", 1.0])
def test_a_seed_out_of_range_is_named(seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[-2\*\*63, 2\*\*64\) or None"):
        Sampling(seed=seed)


@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
def test_a_refused_sampling_leaves_no_trace(kind):
    """A request with a seed out of range, or a sampling that is not a Sampling, is refused
    and the engine serves the others as before; the extreme seeds are served like solo."""
    assert_refused_without_trace(
        kind,
        lambda eng: eng.add_request(Request([1], 3, sampling=Sampling(0.8, seed=2**64))),
        ValueError,
        "seed",
    )
    assert_refused_without_trace(
        kind,
        lambda eng: eng.add_request(Request([1], 3, sampling="greedy")),
        TypeError,
        "sampling must be a Sampling, got str",
    )
    edge = [
        Request([5, 6], 10, sampling=Sampling(1.0, seed=2**64 - 1)),
        Request([5, 6], 10, sampling=Sampling(1.0, seed=-(2**63))),
    ]
    assert serve_all(kind, edge) == [solo(r) for r in edge]


def test_numpy_token_ids_and_eos_are_accepted():
    """np.int64 token ids (a list of them, or an array) and a numpy eos_id work everywhere, and
    the tokens come back as Python ints equal to the plain ones."""
    p = [12, 30, 5, 77]
    full = generate(TINY, p, 20)
    eos = full[5]
    want = full[: full.index(eos) + 1]
    for prompt in ([np.int64(t) for t in p], np.array(p), np.array(p, dtype=np.int32)):
        for eos_id in (np.int64(eos), np.int32(eos), np.uint8(eos)):
            assert generate(TINY, prompt, 20, eos_id=eos_id) == want
    reqs = [Request(np.array(p), 20, eos_id=np.int64(eos)), Request([np.int64(3)], 6)]
    expected = [want, solo(Request([3], 6))]
    runs = {"static": [r.tokens for r in run_static(TINY, reqs, 2)[0]]}
    for kind in ENGINE_KINDS:
        runs[kind] = serve_all(kind, reqs)
    for name, got in runs.items():
        assert got == expected, name
        assert all(type(t) is int for toks in got for t in toks), name


def test_several_eos_ids_end_a_request_at_the_first_of_them():
    """eos_id may be several ids (a list or a tuple): every engine stops at the first token
    that is one of them, as solo generate() does, and says "stop"."""
    p = [12, 30, 5, 77]
    full = generate(TINY, p, 20)
    first = next(i for i in range(2, 20) if full[i] not in full[:i])
    eos = [full[-1], full[first], 0]
    want = full[: first + 1]
    assert generate(TINY, p, 20, eos_id=eos) == want
    reqs = [Request(p, 20, eos_id=eos), Request([3], 6, eos_id=tuple(eos))]
    expected = [want, solo(Request([3], 6, eos_id=tuple(eos)))]
    results = run_static(TINY, reqs, 2)[0]
    assert [r.tokens for r in results] == expected and results[0].finish_reason == "stop"
    for kind in ENGINE_KINDS:
        assert serve_all(kind, reqs) == expected, kind


@pytest.mark.parametrize(
    "eos_id",
    [V, -1, "3", 2.0, True, [3, V], [], ("3",), np.int64(V)],
    ids=["V", "negative", "str", "float", "bool", "list-V", "empty", "tuple-str", "numpy-V"],
)
def test_a_bad_eos_id_is_named(eos_id):
    """eos_id out of range, negative, a string (or anything not a token id) raises naming
    eos_id, in generate(), run_static (naming the request) and add_request (no trace left)."""
    words = rf"eos_id must be a token id in \[0, {V}\), several of them \(a list\), or None, got"
    with pytest.raises(ValueError, match=words):
        generate(TINY, [1, 2], 3, eos_id=eos_id)
    with pytest.raises(ValueError, match="request 1: " + words):
        run_static(TINY, [Request([1], 2), Request([1, 2], 3, eos_id=eos_id)], 2)
    for kind in ENGINE_KINDS:
        assert_refused_without_trace(
            kind, lambda eng: eng.add_request(Request([1, 2], 3, eos_id=eos_id)), ValueError, words
        )


@pytest.mark.parametrize("max_len", [0, -1, 2.5, True, "64"])
def test_a_bad_max_len_is_named(max_len):
    """max_len 0 (never read as 'the default'), negative, a fraction, a bool or a string."""
    with pytest.raises(ValueError, match=f"max_len must be an int >= 1, got {max_len!r}"):
        make_engine(TINY, 2, max_len=max_len)
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        EngineConfig(2, max_len=max_len)
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        run_continuous(TINY, [Request([1], 2)], 2, max_len=max_len)


def test_max_len_is_used_when_given():
    """A small max_len is the engine's: a request that does not fit it is refused."""
    eng = make_engine(TINY, 2, max_len=8)
    assert eng.max_len == 8 and eng.cache.max_len == 8
    with pytest.raises(ValueError, match="exceeds a slot's 8 positions"):
        eng.add_request(Request([1] * 5, 4))
    rid = eng.add_request(Request([1] * 5, 3))
    while eng.has_work():
        eng.step()
    assert eng.results[rid].tokens == solo(Request([1] * 5, 3))


@pytest.mark.parametrize("generator", [42, "cpu", torch.device("cpu"), np.random.default_rng(0)])
def test_a_bad_generator_is_named(generator):
    words = "generator must be a torch.Generator or None, got"
    with pytest.raises(ValueError, match=words):
        generate(TINY, [1, 2], 3, temperature=1.0, generator=generator)
    with pytest.raises(ValueError, match=words):
        run_static(TINY, [Request([1], 2)], 1, generator=generator)
    for kind in ENGINE_KINDS:
        with pytest.raises(ValueError, match=words):
            make_engine(TINY, 2, generator=generator, **ENGINE_KINDS[kind])
        with pytest.raises(ValueError, match=words):
            run_continuous(TINY, [Request([1], 2)], 2, generator=generator, **ENGINE_KINDS[kind])


@pytest.mark.parametrize(
    "bad, exc, words",
    [
        (Request([1, 2], 3, eos_id=V), ValueError, "eos_id must be a token id"),
        (Request([], 3), ValueError, "empty prompt"),
        (Request([1, V + 3], 3), ValueError, f"token id {V + 3} is outside the vocabulary"),
        (Request([1], 0), ValueError, "max_new_tokens must be an int >= 1"),
        (Request([1], 3, sampling="greedy"), TypeError, "sampling must be a Sampling"),
        ("not a request", TypeError, "expected a Request, got str"),
    ],
)
def test_run_continuous_names_the_bad_request(bad, exc, words):
    """run_continuous says which request is bad, whenever it arrives; run_static too."""
    good = Request([4, 5], 3)
    with pytest.raises(exc, match=f"request 1: {words}"):
        run_continuous(TINY, [good, bad, good], 2)
    with pytest.raises(exc, match=f"request 2: {words}"):
        run_continuous(TINY, [good, good, bad], 2, arrivals=[0.0, 0.0, 0.01])
    with pytest.raises(exc, match=f"request 2: {words}"):
        run_continuous(TINY, [good, good, bad], 1, kv="paged", block_size=2)
    if exc is ValueError:
        with pytest.raises(exc, match=f"request 1: {words}"):
            run_static(TINY, [good, bad], 2)


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_long_lived_engines_stats_stay_the_same_size(kind):
    """Stats keep running sums, not per-step lists: 200 steps of a steady stream of requests
    leave every field a single number (and the same fields), and every answer is solo's."""
    eng = make_engine(TINY, 3, **ENGINE_KINDS[kind])

    def shape():
        fields = dataclasses.astuple(eng.stats)
        assert all(type(v) in (int, float) for v in fields), fields
        return [f.name for f in dataclasses.fields(eng.stats)], len(fields)

    before = shape()
    reqs, rids, n = {}, [], 0
    for step in range(200):
        while eng.request_counts()[0] < 2:
            req = Request([1 + n % (V - 1), 1 + (7 * n) % (V - 1)], 1 + n % 9)
            reqs[eng.add_request(req)] = req
            n += 1
        eng.step()
        for rid in list(eng.results):
            assert eng.results.pop(rid).tokens == solo(reqs[rid]), f"request {rid}"
            rids.append(rid)
    assert eng.stats.decode_steps >= 190 and len(rids) > 30
    assert shape() == before
    summary = eng.stats.summary([])
    assert 0 < summary["kv_used_mean"] <= summary["kv_used_peak"] <= 1
