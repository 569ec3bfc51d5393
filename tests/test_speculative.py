"""Step 11 - speculative decoding: greedy requests keep exactly their solo tokens (and logprobs)
with either proposer, on either cache, under preemption, prefix hits, chunks and aborts;
sampled requests keep the target's distribution (a chi-square test) and are reproducible."""

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import SMALL_CFG, chi_square_bound, make_tiny
from tests.test_engine import TINY, V
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.ext.speculative import accept_greedy, accept_sampled, early_exit, lookup, residual

# ---- the rules ---------------------------------------------------------------------------------


def test_accept_greedy_keeps_the_agreed_run_and_the_targets_next():
    assert accept_greedy([5, 8, 2], [5, 8, 9, 4]) == [5, 8, 9]
    assert accept_greedy([5, 8], [5, 8, 1]) == [5, 8, 1]
    assert accept_greedy([], [7]) == [7]
    assert accept_greedy([1, 2], [3, 2, 2]) == [3]


def test_accept_sampled_is_min_one_p_over_q():
    p = torch.tensor([0.3, 0.7], dtype=torch.float64)
    q = torch.tensor([0.6, 0.4], dtype=torch.float64)
    assert accept_sampled(0, p, q, 0.49) and not accept_sampled(0, p, q, 0.5)
    assert accept_sampled(1, p, q, 0.999), "p > q: always kept"
    assert accept_sampled(0, p, None, 0.29) and not accept_sampled(0, p, None, 0.3)


def test_the_residual_is_what_p_has_beyond_q():
    p = torch.tensor([0.3, 0.5, 0.2], dtype=torch.float64)
    q = torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64)
    torch.testing.assert_close(residual(p, q, 0), torch.tensor([0.0, 1.0, 0.0], dtype=p.dtype))
    torch.testing.assert_close(residual(p, None, 1), torch.tensor([0.6, 0.0, 0.4], dtype=p.dtype))


def test_lookup_finds_the_latest_longest_earlier_occurrence():
    assert lookup([1, 2, 3, 9, 1, 2], 2, 4, 1) == [3, 9]
    assert lookup([1, 2, 7, 5, 2, 8, 1, 2], 3, 4, 1) == [7, 5, 2], "the longest n first"
    assert lookup([4, 2, 6, 2], 2, 4, 1) == [6, 2]
    assert lookup([1, 2, 3], 2, 4, 1) == [] and lookup([1, 1], 0, 4, 1) == []


def test_early_exit_shares_the_targets_weights():
    draft = early_exit(TINY, 1)
    assert draft.cfg.n_layers == 1 and len(draft.layers) == 1 and len(TINY.layers) == 2
    assert draft.layers[0] is TINY.layers[0] and draft.lm_head is TINY.lm_head
    with pytest.raises(ValueError, match="a draft of 2 layers"):
        early_exit(TINY, 2)


def test_bad_speculation_settings_are_named():
    with pytest.raises(ValueError, match="speculate must be one of"):
        EngineConfig(2, speculate="medusa")
    with pytest.raises(ValueError, match="spec_tokens must be an int >= 1"):
        EngineConfig(2, speculate="ngram", spec_tokens=0)
    with pytest.raises(ValueError, match="decoder='eager'"):
        EngineConfig(2, speculate="ngram", decoder="graphs")


# ---- greedy: the solo tokens exactly -----------------------------------------------------------


@st.composite
def greedy_workloads(draw):
    """Repetitive prompts (so lookups find something) with shared stems (prefix hits)."""
    stems = [draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=6)) for _ in range(2)]
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        stem = draw(st.sampled_from(stems))
        prompt = (
            stem * draw(st.integers(1, 4)) + draw(st.lists(st.integers(0, V - 1), max_size=4))
        )[:24]
        s = Sampling(
            presence_penalty=draw(st.sampled_from([0.0, 0.6])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
            logprobs=draw(st.sampled_from([None, 2])),
            min_tokens=draw(st.sampled_from([0, 3])),
        )
        eos = draw(st.sampled_from([None, 3, 11, (3, 40)]))
        reqs.append(Request(prompt, draw(st.integers(1, 20)), eos, s))
    return reqs


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(reqs=greedy_workloads(), n_slots=st.integers(1, 4), data=st.data())
def test_greedy_speculation_gives_the_solo_tokens(reqs, n_slots, data):
    """Either proposer, any k, both caches, a tight pool (preemption), prefix hits, a token
    budget, arrivals and aborts: every finished request's tokens and logprobs are solo's, and
    both caches (the target's and the draft's) are empty at the end."""
    kw = dict(
        speculate=data.draw(st.sampled_from(["ngram", "draft"])),
        spec_tokens=data.draw(st.integers(1, 5)),
        kv=data.draw(st.sampled_from(["slots", "paged"])),
        max_step_tokens=data.draw(st.sampled_from([None, n_slots + 2, n_slots + 8])),
    )
    if kw["kv"] == "paged":
        bs = data.draw(st.sampled_from([2, 4]))
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens + 1) / bs) for r in reqs)
        kw.update(
            block_size=bs,
            kv_blocks=need + data.draw(st.integers(0, 4)),
            prefix_cache=data.draw(st.booleans()),
        )
    eng = make_engine(TINY, n_slots, **kw)
    pending, rids, aborted = list(enumerate(reqs)), {}, set()
    while pending or eng.has_work():
        for _ in range(data.draw(st.integers(0, 3))):
            if pending:
                i, r = pending.pop(0)
                rids[i] = eng.add_request(r)
        if rids and data.draw(st.integers(0, 12)) == 0:
            i = data.draw(st.sampled_from(sorted(rids)))
            if eng.abort(rids[i]):
                aborted.add(i)
        eng.step()
        for cache in (eng.cache, getattr(eng.runner.speculator.proposer, "cache", None)):
            why = cache and cache.check_integrity()
            assert not why, why
    assert eng.cache.check_integrity(idle=True) is None
    assert eng.runner.speculator.proposer.check_integrity(idle=True) is None, "a draft slot leaked"
    for i, rid in rids.items():
        if i in aborted:
            continue
        want, got = solo(TINY, reqs[i]), eng.results.pop(rid)
        assert got.tokens == want.tokens, f"request {i}: {got.tokens}, solo {want.tokens} ({kw})"
        for a, b in zip(want.logprobs or [], got.logprobs or []):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-9
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_speculation_counts_what_it_proposed_and_kept():
    prompt = [5, 6, 7, 8] * 5
    results = {}
    for spec in (None, "ngram", "draft"):
        eng = make_engine(TINY, 2, speculate=spec, spec_tokens=4)
        rid = eng.add_request(Request(prompt, 16))
        while eng.has_work():
            eng.step()
        results[spec] = eng.stats.summary([eng.results[rid]])
        assert eng.results[rid].tokens == solo(TINY, Request(prompt, 16)).tokens
    assert "tokens_per_pass" not in results[None]
    for spec in ("ngram", "draft"):
        s = results[spec]
        assert 0 <= s["spec_accepted"] <= s["spec_proposed"] and s["spec_proposed"] > 0
        assert s["acceptance_rate"] == s["spec_accepted"] / s["spec_proposed"]
        assert 1 <= s["tokens_per_pass"] <= 5
        assert s["decode_steps"] < results[None]["decode_steps"] or s["spec_accepted"] == 0


def test_a_request_whose_guesses_fall_stops_guessing_and_tries_again_later(monkeypatch):
    """Guesses are paid for: a request whose guesses keep falling (a proposer that always
    guesses wrong) stops guessing once under PAYS of them stand, its steps then run the plain
    decode step (no verify pass), and it tries one guess after PROBE_STEPS steps, then twice
    as many after each try that falls; its tokens are its solo run's all along. One whose
    guesses half stand makes 2 a step alone, 1 beside another row and none among 8; one whose
    3 guesses all stood makes k alone, 2 among 8, none among 64; a newcomer makes as many as a
    request whose guesses half stand."""
    from tinyllm.ext import speculative

    req = Request([3, 1, 4, 1, 5], 60, eos_id=None)
    want = solo(TINY, req).tokens

    def wrong(self, seqs, ks, shared=None):  # never the target's pick: its solo token, plus one
        return [[(want[len(s.tokens)] + 1) % V] * k for s, k in zip(seqs, ks)], [None] * len(seqs)

    monkeypatch.setattr(speculative.NgramProposer, "propose", wrong)
    eng = make_engine(TINY, 1, speculate="ngram", spec_tokens=3)
    passes = {"verify": 0, "decode": 0}
    for name in passes:
        run = getattr(eng.runner.base, name)
        monkeypatch.setattr(
            eng.runner.base,
            name,
            lambda *a, name=name, run=run: passes.__setitem__(name, passes[name] + 1) or run(*a),
        )
    rid = eng.add_request(req)
    ks = []
    while eng.has_work():
        seqs = list(eng.scheduler.running.values())
        if seqs and seqs[0].tokens:
            ks.append(eng.runner.speculator.allowed(seqs, None)[0])
        eng.step()
    assert eng.results[rid].tokens == want
    guessed = [i for i, k in enumerate(ks) if k]
    assert ks[0] == 2 and len(guessed) < len(ks) // 2, ks
    later = [b - a for a, b in zip(guessed[1:], guessed[2:])]
    waits = [speculative.PROBE_STEPS << min(m, speculative.BACKOFF) for m in range(2, 9)]
    assert later and later == [w + 1 for w in waits[: len(later)]], ks  # twice as long each
    assert all(ks[i] == 1 for i in guessed[1:]), ks  # a try is one guess
    assert passes["decode"] > passes["verify"] > 0, passes
    spec = eng.runner.speculator
    spec.record[99], spec.record[97] = [4.0, 2.0], [3.0, 3.0]
    assert [spec.guesses_for(99, rows) for rows in (1, 2, 8)] == [2, 1, 0]
    assert [spec.guesses_for(97, rows) for rows in (1, 8, 64)] == [3, 2, 0]
    assert spec.guesses_for(98) == 2


# ---- sampled: the target's distribution --------------------------------------------------------

SMALL = make_tiny(seed=1, **SMALL_CFG)


def target_triples(prompt: list[int]) -> torch.Tensor:
    """P(the first three tokens) under the target at temperature 1: (V, V, V)."""
    with torch.no_grad():
        p = lambda ids: SMALL(torch.tensor([prompt + ids]))[0][0, -1].softmax(-1)
        out = torch.zeros(6, 6, 6, dtype=torch.float64)
        p1 = p([])
        for a in range(6):
            p2 = p([a])
            for b in range(6):
                out[a, b] = p1[a] * p2[b] * p([a, b])
    return out


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_sampled_speculation_keeps_the_targets_distribution(spec, monkeypatch):
    """6000 seeded requests of three tokens (the second and third guessed and verified, by a
    lookup or by a draft model of its own, whose guesses the target often rejects; guesses
    that pay at any chance of standing): the counts of each triple agree with the target's
    probabilities (chi-square over the cells expected at least 5 times)."""
    from tinyllm.ext import speculative

    monkeypatch.setattr(speculative, "FREE_ROWS", 10**9)
    prompt, n = [1, 2, 1, 2, 1], 6000
    other = make_tiny(seed=7, **SMALL_CFG)  # a draft of its own, far from the target
    draft = other if spec == "draft" else None
    eng = make_engine(SMALL, 16, speculate=spec, spec_tokens=3, draft=draft)
    rids = [eng.add_request(Request(prompt, 3, sampling=Sampling(1.0, seed=s))) for s in range(n)]
    while eng.has_work():
        eng.step()
    counts = torch.zeros(6, 6, 6, dtype=torch.float64)
    for rid in rids:
        a, b, c = eng.results.pop(rid).tokens
        counts[a, b, c] += 1
    s = eng.stats
    assert 0 < s.spec_accepted < s.spec_proposed, "all or nothing kept: the test would test little"
    expected = target_triples(prompt) * n
    cells = expected >= 5
    chi2 = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    bound = chi_square_bound(int(cells.sum()) - 1)
    assert chi2 < bound, f"chi-square {chi2:.1f} over {int(cells.sum())} cells, bound {bound:.1f}"


def test_a_sampled_request_makes_its_plain_tokens_under_the_lookup(monkeypatch):
    """A lookup's guesses are certain (q one-hot): a seeded sampled row draws the target's
    token at each position as a plain step does and keeps a guess while they agree, so it
    makes exactly its solo tokens, batched or alone, guessing every step or never."""
    from tinyllm.ext import speculative

    rng = random.Random(1)
    stem = [rng.randrange(1, V) for _ in range(6)]
    reqs = [
        Request(stem * 3, 16, sampling=Sampling(t, seed=i, top_k=k))
        for i, (t, k) in enumerate([(0.3, None), (0.7, 3), (1.0, None), (0.5, 5)])
    ]
    want = [solo(TINY, r).tokens for r in reqs]
    monkeypatch.setattr(speculative.Speculator, "guesses_for", lambda self, rid, rows=1: 3)
    for slots in (1, 4):
        eng = make_engine(TINY, slots, speculate="ngram", spec_tokens=3)
        got = []
        for r in reqs if slots == 1 else [None]:
            rids = [eng.add_request(r)] if r else [eng.add_request(q) for q in reqs]
            while eng.has_work():
                eng.step()
            got += [eng.results.pop(rid).tokens for rid in rids]
        assert got == want, slots
        assert eng.stats.spec_accepted > 0 and eng.stats.spec_proposed > eng.stats.spec_accepted


def test_a_seeded_sampled_request_is_reproducible_alone_or_batched():
    rng = random.Random(0)
    reqs = [
        Request([rng.randrange(V) for _ in range(8)] * 2, 12, sampling=Sampling(0.9, seed=i))
        for i in range(6)
    ]
    for spec in ("ngram", "draft"):
        alone = []
        for r in reqs:
            eng = make_engine(TINY, 1, speculate=spec)
            rid = eng.add_request(r)
            while eng.has_work():
                eng.step()
            alone.append(eng.results.pop(rid).tokens)
        eng = make_engine(TINY, 4, speculate=spec, kv="paged", block_size=4)
        rids = [eng.add_request(r) for r in reqs]
        while eng.has_work():
            eng.step()
        assert [eng.results.pop(rid).tokens for rid in rids] == alone, spec


def test_a_draft_of_its_own_proposes_and_a_bad_one_is_named():
    """A separately given draft (here the target itself: every greedy guess stands) proposes;
    one with another vocabulary, or given without speculate='draft', is refused."""
    eng = make_engine(TINY, 2, speculate="draft", spec_tokens=3, draft=make_tiny(seed=3))
    rid = eng.add_request(Request([5, 6, 7, 8] * 3, 12))
    while eng.has_work():
        eng.step()
    assert eng.results[rid].tokens == solo(TINY, Request([5, 6, 7, 8] * 3, 12)).tokens
    assert eng.stats.spec_accepted == eng.stats.spec_proposed > 0
    with pytest.raises(ValueError, match="a draft shares the tokenizer"):
        make_engine(TINY, 2, speculate="draft", draft=SMALL)
    with pytest.raises(ValueError, match="a draft model proposes only with speculate='draft'"):
        make_engine(TINY, 2, draft=TINY)
