"""Exercise 11 - speculative decoding: your accepted runs (greedy and sampled) and your rollback
inside make_engine(speculate="ngram" | "draft"), on slots and on a paged pool. Greedy
requests get their solo() tokens, and keep as many guesses as the package's own run; seeded
sampled requests get the package's tokens, and the target's distribution."""

import math
import random

import pytest
import torch

from tests.conftest import SMALL_CFG, chi_square_bound, make_tiny
from tests.exercises.conftest import run_engine
from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.course import seams
from tinyllm.course.check import divergence, explained, leaks

EXERCISE = "ex11_speculative_decoding"
TINY = make_tiny(seed=11)  # random weights: it falls into loops, which a lookup finds
V = TINY.cfg.vocab_size


# ---- accept_greedy ---------------------------------------------------------------------------
GREEDY_CASES = [
    ([5, 8, 2], [5, 8, 9, 4], [5, 8, 9], "5 and 8 stand; 2 falls where the target picks 9"),
    ([5, 8], [5, 8, 1], [5, 8, 1], "both stand, then the target's pick after the last: 1"),
    ([], [7], [7], "no guesses: the target's one pick, a plain decode step"),
    (
        [1, 2],
        [3, 2, 2],
        [3],
        "the first guess falls: only the target's pick there (the "
        "second guess agrees with its pick, but it came after a guess that fell)",
    ),
    ([4], [4, 6], [4, 6], "one guess that stands, then the pick after it"),
    ([4], [9, 6], [9], "one guess that falls: the target's pick in its place"),
    ([7, 7, 7], [7, 7, 3, 7], [7, 7, 3], "a repeated token: the third 7 falls where 3 is"),
]


@pytest.mark.parametrize(
    "guesses, picks, want, why", GREEDY_CASES, ids=[case[-1] for case in GREEDY_CASES]
)
def test_accept_greedy_keeps_the_agreed_run_then_the_targets_pick(impl, guesses, picks, want, why):
    """The guesses while each equals the target's pick at its position, then the target's
    pick where the first one fell (or after the last): the docstring's examples, and the edges."""
    got = impl.accept_greedy(list(guesses), list(picks))
    assert got is not None and list(got) == want, (
        f"accept_greedy({guesses}, {picks}) should be {want} ({why}), got {got}"
    )


def test_accept_greedy_on_random_runs(impl):
    """Random guesses and picks that agree for a while: always 1 to k + 1 tokens, the guesses
    that stood and then one pick of the target's; the arguments are left as they were."""
    ref = seams.reference("11")["accept_greedy"]
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(0, 6)
        picks = [rng.randrange(4) for _ in range(k + 1)]
        guesses = [p if rng.random() < 0.7 else rng.randrange(4) for p in picks[:k]]
        g, p = list(guesses), list(picks)
        got = impl.accept_greedy(g, p)
        want = ref(guesses, picks)
        assert got is not None and list(got) == want, (
            f"accept_greedy({guesses}, {picks}) should be {want}, got {got}"
        )
        assert (g, p) == (guesses, picks), (
            f"accept_greedy changed its arguments: guesses {guesses} -> {g}, picks {picks} -> {p}"
        )


# ---- accept_sampled --------------------------------------------------------------------------
P = torch.tensor([0.3, 0.7, 0.0, 0.0], dtype=torch.float64)  # the target's distribution
Q = torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=torch.float64)  # the proposer's


@pytest.mark.parametrize(
    "guess, q, u, want, why",
    [
        (0, Q, 0.49, True, "p 0.3, q 0.6: kept with probability 0.5, so at u below 0.5"),
        (0, Q, 0.5, False, "p 0.3, q 0.6: kept when u < 0.5, and u = 0.5 is not below"),
        (0, Q, 0.0, True, "p 0.3, q 0.6: u = 0 is below any probability above 0"),
        (1, Q, 0.999, True, "p 0.7 > q 0.3: min(1, p/q) = 1, kept whatever u"),
        (2, Q, 0.0, False, "p 0: a guess the target never makes is never kept, even at u = 0"),
        (0, None, 0.29, True, "q None (a lookup, certain): kept when u < p = 0.3"),
        (0, None, 0.3, False, "q None (a lookup, certain): kept when u < p = 0.3"),
        (1, None, 0.69, True, "q None: kept when u < p = 0.7"),
        (2, None, 0.0, False, "q None, p 0: never kept"),
    ],
)
def test_accept_sampled_keeps_with_probability_min_one_p_over_q(impl, guess, q, u, want, why):
    """Keep when u < min(1, p[guess] / q[guess]), q[guess] = 1 when q is None: the docstring's
    example, p above q, p zero, and a lookup's certain guess."""
    got = impl.accept_sampled(guess, P.clone(), None if q is None else q.clone(), u)
    assert got is not None and bool(got) == want, (
        f"accept_sampled(guess {guess}, p {P.tolist()}, q {None if q is None else q.tolist()}, "
        f"u {u}) should be {want} ({why}), got {got}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accept_sampled_keeps_at_the_rate_min_one_p_over_q(impl, dtype):
    """Over 400 values of u spread evenly in [0, 1), a guess is kept for a share min(1, p/q)
    of them, for random distributions p and q (float32 and float64, as the engine's dtype)."""
    gen = torch.Generator().manual_seed(0)
    us = [(i + 0.5) / 400 for i in range(400)]
    for trial in range(6):
        p = torch.rand(8, generator=gen, dtype=torch.float64).pow(3)
        q = torch.rand(8, generator=gen, dtype=torch.float64).pow(3)
        p, q = (p / p.sum()).to(dtype), (q / q.sum()).to(dtype)
        for guess in range(8):
            for qq in (q, None):
                qx = 1.0 if qq is None else float(qq[guess])
                want = min(1.0, float(p[guess]) / qx)
                kept = sum(bool(impl.accept_sampled(guess, p, qq, u)) for u in us) / len(us)
                assert abs(kept - want) <= 1.5 / len(us), (
                    f"guess {guess} with p[guess] {float(p[guess]):.3f} and q[guess] "
                    f"{'None' if qq is None else f'{qx:.3f}'} should be kept for a share "
                    f"min(1, p/q) = {want:.3f} of the u in [0, 1); yours kept it for {kept:.3f}"
                )


# ---- roll_back -------------------------------------------------------------------------------
def target_pass(cache, slots: list[int], fed: list[int]) -> None:
    """One forward pass of TINY over these slots, each bringing fed[i] new tokens."""
    cache.plan_step(slots, fed)
    idx = torch.tensor([[(3 * i + 1) % V] * max(fed) for i in range(len(slots))])
    with torch.no_grad():
        TINY(idx, cache=cache)


def cache_after_a_pass(kind: str, context: int, fed: int):
    """A cache whose slot 1 was prefilled with a context, then fed `fed` positions (its last
    token and fed - 1 guesses) by a target pass; slot 0 holds another request of 6 tokens."""
    cfg = TINY.cfg
    if kind == "slots":
        cache = SlotKVCache(cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim, 40, torch.float64)
    else:
        cache = PagedKVCache(
            cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim, 24, 4, 40, torch.float64
        )
    cache.admit(0, 6)
    cache.admit(1, context)
    target_pass(cache, [0, 1], [6, context])  # the prefills
    assert cache.reserve(0, 1) and cache.reserve(1, fed)
    target_pass(cache, [0, 1], [1, fed])  # slot 0 decodes, slot 1 verifies its guesses
    assert cache.lens == [7, context + fed] and cache.check_integrity() is None
    return cache


@pytest.mark.parametrize("kind", ["slots", "paged"])
@pytest.mark.parametrize(
    "context, fed, kept, why",
    [
        (9, 5, 3, "2 of 4 guesses stood, then the target's own: 2 positions roll back"),
        (9, 5, 1, "the first guess fell: all 4 guesses' positions roll back"),
        (7, 6, 1, "5 guesses fell: their positions, and on a paged pool 2 blocks, go back"),
        (9, 5, 5, "all 4 guesses stood: nothing rolls back"),
        (9, 1, 1, "no guesses: the last token stands, nothing rolls back"),
    ],
)
def test_roll_back_keeps_the_positions_that_stand(impl, kind, context, fed, kept, why):
    """After a target pass that fed a slot `fed` positions, the slot keeps `kept` of them (its
    last token and the guesses that stood): its length, and on a paged pool its block table,
    shrink to that; the other slot is untouched, and the books stay sound."""
    cache = cache_after_a_pass(kind, context, fed)
    free = cache.n_free() if kind == "paged" else None
    with explained(f"your roll_back on a {kind} cache"):
        impl.roll_back(cache, 1, fed, kept)
    where = (
        f"on a {kind} cache, a slot of {context + fed} positions, fed {fed}, kept {kept} ({why})"
    )
    assert cache.lens[1] == context + kept, (
        f"{where}: the slot should hold {context} + {kept} = {context + kept} positions, "
        f"it holds {cache.lens[1]}"
    )
    assert cache.lens[0] == 7, f"{where}: slot 0 went from 7 positions to {cache.lens[0]}"
    why_not = cache.check_integrity()
    assert why_not is None, f"{where}: the cache's books are wrong: {why_not}"
    if kind == "paged":
        blocks = math.ceil((context + kept) / 4)
        assert len(cache.tables[1]) == blocks, (
            f"{where}: {context + kept} positions fill {blocks} blocks of 4, the table holds "
            f"{len(cache.tables[1])}: roll back with cache.rollback, which frees emptied blocks"
        )
        freed = math.ceil((context + fed) / 4) - blocks
        assert cache.n_free() == free + freed, (
            f"{where}: {freed} blocks should go back to the pool, {cache.n_free() - free} did"
        )


class Spy:
    """A cache that only records what roll_back asks of it."""

    def __init__(self):
        self.calls = []

    def rollback(self, slot: int, n: int) -> None:
        self.calls.append((slot, n))


@pytest.mark.parametrize("fed, kept", [(5, 3), (5, 5), (1, 1), (4, 1)])
def test_roll_back_asks_the_cache_for_exactly_the_fallen_positions(impl, fed, kept):
    """roll_back asks cache.rollback(slot, fed - kept) of the slot it was given, and nothing of
    the cache when every position stands."""
    spy = Spy()
    impl.roll_back(spy, 3, fed, kept)
    asked = sum(n for _, n in spy.calls)
    assert all(s == 3 for s, _ in spy.calls), (
        f"roll_back(cache, 3, fed {fed}, kept {kept}) called {spy.calls}: only slot 3 rolls back"
    )
    assert asked == fed - kept, (
        f"roll_back(cache, 3, fed {fed}, kept {kept}) should roll back {fed - kept} positions "
        f"(fed - kept: the guesses that fell), it called {spy.calls or 'nothing'}"
    )


# ---- end to end: greedy ------------------------------------------------------------------------
def repetitive_requests(n: int, seed: int) -> list[Request]:
    """Prompts that repeat one of three short stems, so that a lookup finds guesses and some
    prompts share their first blocks; some end at an EOS."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, V) for _ in range(rng.randint(2, 5))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        prompt = rng.choice(stems) * rng.randint(2, 5) + [rng.randrange(1, V)]
        reqs.append(Request(prompt, rng.randint(4, 24), eos_id=rng.choice([None, 14, 22])))
    return reqs


def run(eng, reqs, per_step: int = 2, expected=None) -> list[list[int]]:
    """Add per_step requests before each step, step until done (the exercises' run_engine),
    checking both caches' books after every step, and with `expected` (solo's tokens) every
    request's tokens as they come; returns each request's tokens."""
    draft = getattr(eng.runner.speculator.proposer, "cache", None)

    def books(step):
        for name, cache in (("the KV cache", eng.cache), ("the draft's cache", draft)):
            why = cache and cache.check_integrity()
            assert not why, f"after step {step}, {name}'s books are wrong: {why}"

    rids = run_engine(
        eng,
        reqs,
        "the speculating engine with your functions",
        joining=lambda step: per_step,
        after_step=books,
        expected=expected,
        limit=2_000,
        stuck="does every verdict keep a token? (accept_greedy keeps the target's own pick "
        "after the run it agrees with, accept_sampled's caller a token where a guess falls)",
    )
    for i, rid in enumerate(rids):
        assert rid in eng.results, f"request {i} never finished (no Result)"
    return [eng.results.pop(rid).tokens for rid in rids]


SETTINGS = {
    "ngram, slots": dict(speculate="ngram", spec_tokens=4),
    "ngram, paged, a tight pool": dict(
        speculate="ngram", spec_tokens=3, kv="paged", block_size=4, kv_blocks=14
    ),
    "draft, slots, a budget": dict(
        speculate="draft", spec_tokens=4, draft_layers=1, max_step_tokens=9
    ),
    "draft, paged, a prefix cache": dict(
        speculate="draft",
        spec_tokens=5,
        draft_layers=1,
        kv="paged",
        block_size=2,
        prefix_cache=True,
    ),
}


def speculation_counts(eng) -> tuple[int, int, int]:
    """(guesses proposed, guesses kept, decode steps) of a finished run."""
    s = eng.stats
    return s.spec_proposed, s.spec_accepted, s.decode_steps


GREEDY_RULE = (
    "accept_greedy keeps every guess up to the first the target does not pick, then the "
    "target's own pick there"
)
SAMPLED_RULE = "accept_sampled keeps a guess exactly when u < min(1, p[guess] / q[guess])"


def assert_same_counts(eng, ref, name: str, rule: str = GREEDY_RULE) -> None:
    """Your run proposed and kept exactly the guesses of the package's run, in as many steps."""
    want, have = speculation_counts(ref), speculation_counts(eng)
    assert have == want, (
        f"{name}: the package's run proposed {want[0]} guesses and kept {want[1]} in {want[2]} "
        f"decode steps; yours proposed {have[0]} and kept {have[1]} in {have[2]}: {rule}"
    )


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_speculation_with_your_functions_matches_solo(plug, name):
    """Twelve repetitive prompts arriving two a step into 3 slots, greedy, guessed by a lookup or
    a draft, on slots or a paged pool (tight enough to preempt, or with a prefix cache): every
    request gets its solo() tokens, the engine keeps exactly the guesses the package's run
    keeps, and nothing is held at the end."""
    reqs = repetitive_requests(12, seed=len(name))
    expected = [solo(TINY, r).tokens for r in reqs]  # before plugging
    ref = make_engine(TINY, 3, **SETTINGS[name])
    run(ref, reqs)
    proposed, accepted, _ = speculation_counts(ref)
    assert 0 < accepted < proposed, "the test needs guesses that stand and guesses that fall"
    assert "tight" not in name or ref.stats.preemptions > 0, "the pool is tight enough to preempt"
    assert "prefix" not in name or ref.stats.summary([])["cached_prompt_tokens"] > 0, "prefix hits"
    plug()
    eng = make_engine(TINY, 3, **SETTINGS[name])
    with explained(f"the speculating engine ({name}) with your functions"):
        got = run(eng, reqs, expected=expected)
    for i, (e, g) in enumerate(zip(expected, got)):
        msg = divergence(f"request {i} ({name})", e, g)
        assert msg is None, msg
    assert_same_counts(eng, ref, name)
    msg = leaks(eng)
    assert msg is None, msg
    why = eng.runner.speculator.proposer.check_integrity(idle=True)
    assert why is None, f"{name}: the draft's cache after every request finished: {why}"


@pytest.mark.parametrize("names", [("accept_greedy",), ("roll_back",)])
def test_one_of_your_functions_alone_in_the_engine(plug, names):
    """Your accept_greedy alone, then your roll_back alone, beside the package's others: each
    request still gets its solo() tokens (a failure here names the function to look at)."""
    reqs = repetitive_requests(8, seed=13)
    expected = [solo(TINY, r).tokens for r in reqs]
    settings = dict(speculate="ngram", kv="paged", block_size=4)
    ref = make_engine(TINY, 3, **settings)
    run(ref, reqs)
    assert 0 < ref.stats.spec_accepted < ref.stats.spec_proposed, "guesses stand and fall"
    plug(*names)
    eng = make_engine(TINY, 3, **settings)
    with explained(f"the speculating engine with your {names[0]} alone"):
        got = run(eng, reqs, expected=expected)
    for i, (e, g) in enumerate(zip(expected, got)):
        msg = divergence(f"request {i} (your {names[0]} alone)", e, g)
        assert msg is None, msg
    assert_same_counts(eng, ref, f"your {names[0]} alone")
    msg = leaks(eng)
    assert msg is None, msg


@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_bundled_model_with_your_functions(plug, bundled64, speculate):
    """The bundled model (float64), speeches whose prompts repeat a line, two slots on a paged
    pool, greedy up to EOS: each gets its solo() tokens, with guesses kept."""
    model, tok = bundled64
    lines = [
        "Ham.\nWords, words, words.\n",
        "Pol.\nWhat do you read, my lord?\n",
        "Oph.\nGood my lord,\n",
        "Ham.\nTo be, or not to be,\n",
    ]
    reqs = [Request(tok.encode(t * 3), 24, eos_id=tok.eos_id) for t in lines]
    expected = [solo(model, r).tokens for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 2, "the prompts are chosen so EOS fires"
    settings = dict(speculate=speculate, kv="paged", block_size=4)
    ref = make_engine(model, 2, **settings)
    run(ref, reqs, per_step=1)
    assert ref.stats.spec_accepted > 0, "the prompts are chosen so that guesses stand"
    plug()
    eng = make_engine(model, 2, **settings)
    with explained(f"the speculating engine ({speculate}) with your functions"):
        got = run(eng, reqs, per_step=1, expected=expected)
    for i, (e, g) in enumerate(zip(expected, got)):
        msg = divergence(f"request {i} ({lines[i]!r} three times)", e, g)
        assert msg is None, msg
    assert_same_counts(eng, ref, f"the bundled model, {speculate}")
    msg = leaks(eng)
    assert msg is None, msg


# ---- end to end: sampled -----------------------------------------------------------------------
def sampled_requests(n: int) -> list[Request]:
    """Repetitive prompts, half of them seeded and sampled, half greedy."""
    reqs = repetitive_requests(n, seed=3)
    return [
        Request(r.prompt, r.max_new_tokens, r.eos_id, Sampling(0.9, seed=i) if i % 2 else None)
        for i, r in enumerate(reqs)
    ]


@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_seeded_sampled_requests_get_the_packages_tokens(plug, speculate):
    """Seeded sampled requests beside greedy ones: the engine draws every u from each request's
    own generator, so a seeded run with your functions gives exactly the tokens of the same run
    with the package's (the same guesses kept, the same tokens drawn where one falls)."""
    reqs = sampled_requests(10)
    settings = dict(speculate=speculate, spec_tokens=3, kv="paged", block_size=4)
    ref = make_engine(TINY, 4, **settings)
    want = run(ref, reqs)
    assert 0 < ref.stats.spec_accepted < ref.stats.spec_proposed, "guesses stand and fall"
    plug()
    eng = make_engine(TINY, 4, **settings)
    with explained(f"the speculating engine ({speculate}) with your functions"):
        got = run(eng, reqs)
    for i, (e, g) in enumerate(zip(want, got)):
        seeded = f"seed {reqs[i].sampling.seed}" if reqs[i].sampling else "greedy"
        msg = divergence(f"request {i} ({seeded})", e, g)
        assert msg is None, (
            msg.replace("solo generate", "the package's run of the same seeds")
            + f": {SAMPLED_RULE if reqs[i].sampling else GREEDY_RULE}"
        )
    assert_same_counts(eng, ref, f"seeded, {speculate}", f"{GREEDY_RULE}; {SAMPLED_RULE}")


def test_sampled_speculation_with_your_functions_keeps_the_targets_distribution(plug):
    """3000 seeded requests of three tokens on a 6-token model, the second and third guessed by
    a draft model far from the target (so many guesses fall): the counts of each triple agree
    with the target's own probabilities (chi-square over the cells expected 5 times or more)."""
    target, other = make_tiny(seed=1, **SMALL_CFG), make_tiny(seed=7, **SMALL_CFG)
    prompt, n = [1, 2, 1, 2, 1], 3000
    with torch.no_grad():
        p = lambda ids: target(torch.tensor([prompt + ids]))[0][0, -1].softmax(-1)
        expected = torch.zeros(6, 6, 6, dtype=torch.float64)
        for a in range(6):
            for b in range(6):
                expected[a, b] = p([])[a] * p([a])[b] * p([a, b])
    expected *= n
    plug()
    eng = make_engine(target, 16, speculate="draft", spec_tokens=3, draft=other)
    with explained("the speculating engine with your functions, sampled"):
        rids = [
            eng.add_request(Request(prompt, 3, sampling=Sampling(1.0, seed=s))) for s in range(n)
        ]
        while eng.has_work():
            eng.step()
    counts = torch.zeros(6, 6, 6, dtype=torch.float64)
    for rid in rids:
        a, b, c = eng.results.pop(rid).tokens
        counts[a, b, c] += 1
    cells = expected >= 5
    chi2 = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    bound = chi_square_bound(int(cells.sum()) - 1)
    kept = eng.stats.spec_accepted / eng.stats.spec_proposed
    assert chi2 < bound, (
        f"the {n} answers are not distributed as the target's: chi-square {chi2:.0f} over "
        f"{int(cells.sum())} cells, where the target's own samples stay below {bound:.0f} (you "
        f"kept {kept:.0%} of the draft's guesses): keep a guess with probability "
        "min(1, p[guess] / q[guess]), with q the draft's distribution"
    )
