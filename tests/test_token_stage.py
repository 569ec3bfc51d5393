"""The token stage - processors (penalties, logit bias, min_tokens), min-p, stop ids, logprobs,
prompt logprobs and n choices: every engine gives each request (each choice) exactly the
tokens and logprobs of its solo run with the same settings, whatever shares its batch."""

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_engine import TINY, V
from tinyllm.build import make_engine
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.generate import solo
from tinyllm.core.logits_processors import History, apply_penalties, penalize_row, process
from tinyllm.core.requests import Request, check_request, stop_ids
from tinyllm.core.sampling import Sampling, sampling_probs
from tinyllm.core.static import run_static
from tinyllm.core.token_stage import select

# ---- the settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias"),
        ({"stop_token_ids": "3"}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"n": 0}, "n"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 2**64 - 2, "n": 3}, "seed"),
    ],
)
def test_a_bad_setting_is_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        Sampling(**kw)


def test_ids_outside_the_vocabulary_are_refused_and_the_engine_is_unchanged():
    eng = make_engine(TINY, 2, kv="paged", block_size=4)
    for s, field in [
        (Sampling(logit_bias={V: 1.0}), "logit_bias"),
        (Sampling(stop_token_ids=[-1]), "stop_token_ids"),
        (Sampling(logprobs=V + 1), "logprobs"),
    ]:
        with pytest.raises(ValueError, match=field):
            eng.add_request(Request([1, 2], 4, sampling=s))
    assert not eng.has_work() and eng.cache.check_integrity(idle=True) is None


def test_the_stop_ids_are_eos_unless_ignored_and_the_stop_token_ids():
    assert stop_ids(3, Sampling()) == 3
    assert stop_ids(3, Sampling(stop_token_ids=[5, 3])) == (3, 5)
    assert stop_ids((3, 4), Sampling(ignore_eos=True, stop_token_ids=[5])) == 5
    assert stop_ids(3, Sampling(ignore_eos=True)) is None
    req = check_request(Request([1], 4, 3, Sampling(stop_token_ids=[9])), V, 96)
    assert req.eos_id == (3, 9)


def test_choices_are_seeded_seed_plus_i_and_only_the_first_asks_for_the_prompt():
    cs = Sampling(0.8, seed=10, n=3, prompt_logprobs=2).choices()
    assert [c.seed for c in cs] == [10, 11, 12] and {c.n for c in cs} == {1}
    assert [c.prompt_logprobs for c in cs] == [2, None, None]
    assert [c.seed for c in Sampling(n=2).choices()] == [None, None]


# ---- the processors ----------------------------------------------------------------------------


def test_penalties_batched_equal_the_rule_for_one_row():
    rng = random.Random(0)
    rows = []
    for _ in range(6):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 10))]
        output = [rng.randrange(20) for _ in range(rng.randrange(0, 12))]
        s = Sampling(
            presence_penalty=rng.uniform(-2, 2),
            frequency_penalty=rng.uniform(-2, 2),
            repetition_penalty=rng.uniform(0.5, 2),
        )
        rows.append(History(s, prompt, output))
    logits = torch.randn(len(rows), V, dtype=torch.float64)
    before = logits.clone()
    got = process(logits, rows)
    assert torch.equal(logits, before), "the processors changed their input in place"
    for i, h in enumerate(rows):
        s = h.sampling
        want = penalize_row(
            logits[i],
            h.prompt,
            h.output,
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty,
        )
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-12)


def test_apply_penalties_worked_example():
    got = apply_penalties(
        torch.tensor([[2.0, -1.0, 0.5]]),
        torch.tensor([[0, 2, 0]]),
        torch.tensor([[True, True, False]]),
        torch.tensor([[0.5]]),
        torch.tensor([[0.25]]),
        torch.tensor([[2.0]]),
    )
    assert got.tolist() == [[1.0, -3.0, 0.5]]


def test_a_row_that_asks_for_nothing_keeps_its_logits_bit_for_bit():
    logits = torch.randn(3, V, dtype=torch.float64)
    rows = [
        History(Sampling(), [1, 2], [3]),
        History(Sampling(presence_penalty=1.0, logit_bias={4: 2.0}), [1], [4, 4]),
        History(Sampling(min_tokens=3), [1], [], 7),
    ]
    got = process(logits, rows)
    assert torch.equal(got[0], logits[0])
    assert got[1, 4] == logits[1, 4] + 2.0 - 1.0 and got[2, 7] == -math.inf
    assert process(logits, rows[:1]) is logits, "nothing asked: the logits themselves"


def test_a_penalty_that_overflows_gives_solo_tokens_and_leaves_the_engine_serving():
    """repetition_penalty 5e-324 divides a seen token's positive logit to +inf: the token stage
    draws among those tokens (greedy: the first), the next step's embedding reads a token of
    the vocabulary, and the request beside it keeps its solo tokens (a draw of id V killed the
    engine). A penalty of 1e300 sends the seen negative logits to -inf."""
    eng = make_engine(TINY, 2, kv="paged", block_size=4)
    reqs = [
        Request([1, 2, 3, 1], 6, sampling=Sampling(repetition_penalty=5e-324)),
        Request(
            [4, 5, 6], 6, sampling=Sampling(temperature=1.0, seed=3, repetition_penalty=5e-324)
        ),
        Request([4, 5, 6], 6, sampling=Sampling(temperature=0.7, seed=4, repetition_penalty=1e300)),
        Request([7, 8], 6),
    ]
    ids = [eng.add_request(r) for r in reqs]
    while eng.has_work():
        eng.step()
    for i, r in zip(ids, reqs):
        assert eng.results[i].tokens == solo(TINY, r).tokens
        assert all(0 <= t < V for t in eng.results[i].tokens)
    assert eng.cache.check_integrity(idle=True) is None


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    probs = sampling_probs(logits, 1.0, min_p=0.2)
    assert probs[0, 3] == 0 and probs[0, 2] > 0 and abs(float(probs.sum()) - 1) < 1e-6


def test_min_tokens_forbids_every_stop_id_until_then():
    for seed in range(5):
        s = Sampling(1.0, seed=seed, min_tokens=6, logit_bias={3: 5.0, 11: 5.0})
        r = solo(TINY, Request([1, 2, 3], 12, eos_id=3, sampling=Sampling(**{**vars(s)})))
        r2 = solo(TINY, Request([1, 2, 3], 12, eos_id=3, sampling=s))
        assert r.tokens == r2.tokens
        assert 3 not in r.tokens[:6], f"seed {seed}: EOS before min_tokens: {r.tokens}"


def test_logit_bias_and_stop_token_ids_end_a_request_with_stop():
    r = solo(
        TINY, Request([5, 6], 10, sampling=Sampling(logit_bias={42: 100.0}, stop_token_ids=[42]))
    )
    assert r.tokens == [42] and r.finish_reason == "stop"
    r = solo(
        TINY,
        Request([5, 6], 4, eos_id=42, sampling=Sampling(logit_bias={42: 100.0}, ignore_eos=True)),
    )
    assert r.tokens == [42] * 4 and r.finish_reason == "length"


def test_logprobs_are_the_models_raw_log_softmax_and_the_prompts_too():
    prompt = [4, 8, 15, 16, 23, 42]
    s = Sampling(0.9, seed=1, presence_penalty=1.5, logprobs=3, prompt_logprobs=2)
    r = solo(TINY, Request(prompt, 6, sampling=s))
    ids = prompt + r.tokens
    with torch.no_grad():
        lp = TINY(torch.tensor([ids]))[0][0].log_softmax(-1)  # (T, V), no cache
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    for p, tl in enumerate(r.prompt_logprobs[1:] + r.logprobs, start=1):
        assert tl.token == ids[p] and abs(tl.logprob - float(lp[p - 1, ids[p]])) < 1e-9
        k = 2 if p < len(prompt) else 3
        top = lp[p - 1].topk(k)
        assert [t for t, _ in tl.top] == top.indices.tolist(), f"position {p}"
        assert max(abs(a - b) for (_, a), b in zip(tl.top, top.values.tolist())) < 1e-9


def test_a_prefill_runs_the_head_only_where_it_samples_unless_a_prompt_wants_logprobs(
    monkeypatch,
):
    """Three prompts prefilled in one step: the head runs at their three last positions; with
    one of them asking for its prompt's logprobs, at every position of the batch, and that one
    gets them. The tokens are solo's either way."""
    shapes = []
    head = TINY.compute_logits
    monkeypatch.setattr(TINY, "compute_logits", lambda x: shapes.append(x.shape[:-1]) or head(x))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    for asks in (None, 1):
        shapes.clear()
        eng = make_engine(TINY, 3)
        reqs = [
            Request(p, 3, sampling=Sampling(prompt_logprobs=asks if i == 1 else None))
            for i, p in enumerate(prompts)
        ]
        rids = [eng.add_request(r) for r in reqs]
        eng.step()
        assert shapes[0] == ((3,) if asks is None else (3, 5)), shapes
        while eng.has_work():
            eng.step()
        results = [eng.results.pop(r) for r in rids]
        assert [r.tokens for r in results] == [solo(TINY, r).tokens for r in reqs]
        assert (results[1].prompt_logprobs is None) == (asks is None)


def test_select_gives_logprobs_only_to_the_rows_that_ask():
    logits = torch.randn(3, V, dtype=torch.float64)
    rows = [History(Sampling(logprobs=k), [1], []) for k in (None, 0, 2)]
    tokens, lps = select(logits, rows, [None] * 3, None)
    assert tokens == logits.argmax(-1).tolist()
    assert lps[0] is None and lps[1].top == () and len(lps[2].top) == 2


# ---- the oracle, on every engine ---------------------------------------------------------------


def sampling_st(i: int):
    """Mixed settings, request i seeded i (so its solo run is defined)."""
    return st.builds(
        Sampling,
        temperature=st.sampled_from([0.0, 0.0, 0.9]),
        top_k=st.sampled_from([None, 20]),
        seed=st.just(i),
        presence_penalty=st.sampled_from([0.0, 0.7]),
        frequency_penalty=st.sampled_from([0.0, -0.4, 0.5]),
        repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
        min_p=st.sampled_from([0.0, 0.05]),
        logit_bias=st.sampled_from([{}, {11: 1.5}, {3: -2.0, 40: 3.0}]),
        stop_token_ids=st.sampled_from([(), (7,)]),
        ignore_eos=st.booleans(),
        min_tokens=st.sampled_from([0, 0, 4]),
        logprobs=st.sampled_from([None, 0, 3]),
        prompt_logprobs=st.sampled_from([None, None, 0, 2]),
        n=st.sampled_from([1, 1, 1, 2, 3]),
    )


@st.composite
def workloads(draw):
    """Requests with shared prefixes (prefix hits), each with its own settings."""
    stems = [draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=14)) for _ in range(2)]
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        tail = draw(st.lists(st.integers(0, V - 1), max_size=8))
        prompt = (draw(st.sampled_from(stems)) + tail)[:24]
        eos = draw(st.sampled_from([None, 3, 11, (3, 40)]))
        reqs.append(Request(prompt, draw(st.integers(1, 14)), eos, draw(sampling_st(i))))
    return reqs


def assert_same(name: str, want, got) -> None:
    """got (an engine's Result) equals want (solo's): tokens, finish, logprobs to 1e-9."""
    assert got.tokens == want.tokens, f"{name}: tokens {got.tokens}, solo {want.tokens}"
    assert got.finish_reason == want.finish_reason, name
    for what in ("logprobs", "prompt_logprobs"):
        a, b = getattr(want, what), getattr(got, what)
        assert (a is None) == (b is None), f"{name}: {what} {b!r}, solo {a!r}"
        for p, (x, y) in enumerate(zip(a or [], b or [])):
            if x is None:
                assert y is None, f"{name}: {what}[{p}]"
                continue
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-9, f"{name} {what}[{p}]"
            assert [t for t, _ in x.top] == [t for t, _ in y.top], f"{name}: {what}[{p}] top"
            assert all(abs(u - v) < 1e-9 for (_, u), (_, v) in zip(x.top, y.top)), name
        assert len(a or []) == len(b or []), f"{name}: {what} of {len(b or [])}"


def solo_choices(req: Request):
    return [
        solo(TINY, Request(req.prompt, req.max_new_tokens, req.eos_id, s))
        for s in req.sampling.choices()
    ]


def drive(eng: ContinuousEngine, reqs: list[Request], data, abort_odds: int = 0):
    """Arrivals between steps, some aborts (of one choice), the pool checked after every step.
    Returns {(request, choice): Result} of the finished choices."""
    pending, first, aborted = list(enumerate(reqs)), {}, set()
    while pending or eng.has_work():
        for _ in range(data.draw(st.integers(0, 3))):
            if pending:
                i, r = pending.pop(0)
                first[i] = eng.add_request(r)
        if abort_odds and first and data.draw(st.integers(0, abort_odds)) == 0:
            i = data.draw(st.sampled_from(sorted(first)))
            c = data.draw(st.integers(0, reqs[i].sampling.n - 1))
            if eng.abort(first[i] + c):
                aborted.add((i, c))
        eng.step()
        why = eng.cache.check_integrity()
        assert why is None, why
    assert not any(eng.cache.active) and eng.request_counts() == (0, 0)
    assert not eng.scheduler.held and not eng._seqs, "a choice was left behind"
    assert eng.cache.check_integrity(idle=True) is None
    done = {}
    for i, rid in first.items():
        for c in range(reqs[i].sampling.n):
            if (i, c) not in aborted:
                done[i, c] = eng.results.pop(rid + c)
    assert not eng.results
    return done, aborted


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(reqs=workloads(), n_slots=st.integers(1, 4), data=st.data())
def test_every_choice_equals_its_solo_run_tokens_and_logprobs(reqs, n_slots, data):
    """Mixed settings in one batch, both caches, prefix hits, a tight pool (preemption), a
    token budget (chunks), arrivals and aborts: every finished choice's tokens, logprobs and
    prompt logprobs are its solo run's; nothing leaks."""
    kv = data.draw(st.sampled_from(["slots", "paged", "paged"]))
    kw = {}
    if kv == "paged":
        bs = data.draw(st.sampled_from([2, 4]))
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens + 1) / bs) for r in reqs)
        kw = dict(
            block_size=bs,
            kv_blocks=need + data.draw(st.integers(0, 3)),
            prefix_cache=data.draw(st.booleans()),
        )
    budget = data.draw(st.sampled_from([None, n_slots + 3, n_slots + 9]))
    eng = make_engine(TINY, n_slots, kv=kv, max_step_tokens=budget, **kw)
    done, aborted = drive(eng, reqs, data, abort_odds=10)
    wants = {i: solo_choices(r) for i, r in enumerate(reqs)}
    for (i, c), got in done.items():
        assert_same(f"request {i} choice {c}", wants[i][c], got)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), batch=st.integers(1, 4))
def test_static_batching_gives_each_request_its_solo_tokens_and_logprobs(reqs, batch):
    reqs = [
        Request(
            r.prompt,
            r.max_new_tokens,
            r.eos_id,
            Sampling(**{**vars(r.sampling), "n": 1, "prompt_logprobs": None}),
        )
        for r in reqs
    ]
    results, _ = run_static(TINY, reqs, batch)
    for i, (r, got) in enumerate(zip(reqs, results)):
        assert_same(f"request {i}", solo(TINY, r), got)


def test_static_batching_refuses_choices_and_prompt_logprobs():
    for s in (Sampling(n=2), Sampling(prompt_logprobs=1)):
        with pytest.raises(ValueError, match="request 0: static batching runs one choice"):
            run_static(TINY, [Request([1, 2], 3, sampling=s)], 2)


# ---- n choices and prompt logprobs on the prefix cache -----------------------------------------


def test_n_choices_share_the_prompts_blocks_computed_once():
    """A 22-token prompt in blocks of 4, n = 4: the first choice computes it; the others wait
    for it and are served its 5 full blocks (20 tokens) by the prefix cache."""
    prompt = list(range(1, 23))
    for budget in (None, 8):
        eng = make_engine(
            TINY, 4, kv="paged", block_size=4, prefix_cache=True, max_step_tokens=budget
        )
        rid = eng.add_request(Request(prompt, 6, sampling=Sampling(0.9, seed=5, n=4)))
        while eng.has_work():
            eng.step()
        assert eng.stats.cached_prompt_tokens == 3 * 20, eng.stats.cached_prompt_tokens
        assert eng.stats.prefill_tokens == 22 + 3 * 2
        got = [eng.results.pop(rid + i) for i in range(4)]
        for i, (want, g) in enumerate(
            zip(solo_choices(Request(prompt, 6, sampling=Sampling(0.9, seed=5, n=4))), got)
        ):
            assert_same(f"choice {i}", want, g)
        assert len({tuple(g.tokens) for g in got}) > 1, "four seeds, one answer"


def test_a_request_for_prompt_logprobs_is_not_served_by_the_prefix_cache():
    """As vLLM: a cached block has no logits, so a request that asks for its prompt's
    logprobs computes its whole prompt; its blocks are cached for later requests all the same."""
    prompt = list(range(30, 50))
    eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    plain = Request(prompt, 3)
    asking = Request(prompt, 3, sampling=Sampling(prompt_logprobs=1))
    for r in (plain, asking, plain):
        rid = eng.add_request(r)
        while eng.has_work():
            eng.step()
        assert_same("request", solo(TINY, r), eng.results.pop(rid))
    assert eng.stats.cached_prompt_tokens == 16, "the third request is served, the second not"


def test_preempted_choices_keep_their_prompt_logprobs_and_logprobs():
    """A pool too small for four requests of two choices each: choices are preempted and
    computed again, in chunks; the logprobs gathered before are kept, not gathered twice."""
    reqs = [
        Request(
            [5 + i] * 3 + list(range(10, 19)),
            12,
            sampling=Sampling(
                0.9, seed=i, n=2, logprobs=1, prompt_logprobs=1, presence_penalty=0.5
            ),
        )
        for i in range(4)
    ]
    for prefix_cache in (False, True):
        eng = make_engine(
            TINY,
            4,
            kv="paged",
            block_size=2,
            kv_blocks=20,
            max_step_tokens=7,
            prefix_cache=prefix_cache,
        )
        rids = [eng.add_request(r) for r in reqs]
        while eng.has_work():
            eng.step()
            assert eng.cache.check_integrity() is None
        assert eng.stats.preemptions > 0, "the pool was meant to run dry"
        for i, (r, rid) in enumerate(zip(reqs, rids)):
            for c, want in enumerate(solo_choices(r)):
                assert_same(f"request {i} choice {c}", want, eng.results.pop(rid + c))


def test_aborting_the_first_choice_lets_the_others_run():
    eng = make_engine(TINY, 1, kv="paged", block_size=4, prefix_cache=True, max_step_tokens=4)
    rid = eng.add_request(Request(list(range(1, 20)), 4, sampling=Sampling(n=3)))
    eng.step()
    assert eng.scheduler.held, "the others wait for the first's prompt"
    eng.abort(rid)
    while eng.has_work():
        eng.step()
    assert sorted(eng.results) == [rid + 1, rid + 2]
    assert eng.cache.check_integrity(idle=True) is None
