"""Exercise 07 - chunked prefill: your step plan (decodes, admission, chunks within the budget)
and next chunk inside make_engine(max_step_tokens=N), slots and paged."""

import functools
import random

import pytest
import torch

from tests.conftest import make_tiny
from tests.exercises.conftest import run_engine as conftest_run
from tinyllm.build import make_engine
from tinyllm.core.generate import generate
from tinyllm.core.requests import Request, Sequence
from tinyllm.core.sampling import Sampling
from tinyllm.core.stats import Trace
from tinyllm.course.check import divergence, explained, leaks

EXERCISE = "ex07_chunked_prefill"
TINY = make_tiny(seed=8)


# ---- plan_step -------------------------------------------------------------------------------
def seq_left(rid: int, left: int, slot: int | None = None) -> Sequence:
    """A Sequence (rid = its arrival order) in `slot`, with `left` tokens still to compute."""
    seq = Sequence(rid, Request(list(range(1, left + 1)), 8), 0.0, Sampling(), None)
    seq.slot = slot
    return seq


class Admit:
    """admit() for the tests: brings `newcomers` once, and counts its calls."""

    def __init__(self, *newcomers):
        self.newcomers, self.calls = list(newcomers), 0

    def __call__(self):
        self.calls += 1
        out, self.newcomers = self.newcomers, []
        return out


def planned(impl, running, budget, admit):
    what = (
        f"plan_step(running with {[s.left() for s in running]} tokens left (rids "
        f"{[s.rid for s in running]}), budget {budget})"
    )
    try:
        got = impl.plan_step(list(running), budget, admit)
    except (NotImplementedError, AssertionError):
        raise
    except TypeError as e:
        if budget is None:
            raise AssertionError(
                f"{what} raised TypeError: {e}; a budget of None means no "
                f"limit: every sequence takes all it has left"
            ) from None
        raise AssertionError(f"{what} raised TypeError: {e}") from None
    assert isinstance(got, tuple) and len(got) == 2, (
        f"{what} returns (decodes, chunks), got {got!r}"
    )
    decodes, chunks = got
    assert all(isinstance(c, tuple) and len(c) == 2 for c in chunks), (
        f"{what}: chunks are (sequence, n) pairs, got {chunks!r}"
    )
    return list(decodes), [(s.rid, n) for s, n in chunks]


def test_plan_step_decodes_first_then_prompts_first_come_first_served(impl):
    """Budget 8: A and C decode (2 tokens); B (10 left) takes the 6 that remain. 6 < 10, so
    nothing is left for a newcomer: admit() is not called."""
    a, b, c = seq_left(0, 1, 0), seq_left(2, 10, 1), seq_left(1, 1, 2)
    admit = Admit(seq_left(3, 4, 3))
    decodes, chunks = planned(impl, [a, b, c], 8, admit)
    assert decodes == [a, c], (
        "the decoding sequences (1 token left) are A and C, in slot order: got rids "
        f"{[s.rid for s in decodes]}"
    )
    assert chunks == [(2, 6)], (
        f"B (rid 2) takes the 6 tokens the decodes left of 8: expected [(2, 6)], got {chunks}"
    )
    assert admit.calls == 0, (
        "after the decodes and B's 10 tokens the budget of 8 has no room "
        "for a newcomer: admit() must not be called (it would take a slot "
        "and memory for a request that computes nothing this step)"
    )


def test_plan_step_admits_when_the_budget_has_room(impl):
    """Budget 16: 2 decodes, B's 10, and 4 more: admit() brings D (rid 3), which takes them."""
    a, b, c, d = seq_left(0, 1, 0), seq_left(2, 10, 1), seq_left(1, 1, 2), seq_left(3, 4, 3)
    admit = Admit(d)
    decodes, chunks = planned(impl, [a, b, c], 16, admit)
    assert admit.calls == 1, (
        f"14 tokens left after the decodes, B needs 10: admit() once, called {admit.calls} times"
    )
    assert chunks == [(2, 10), (3, 4)], (
        f"B takes its 10, then newcomer D its 4: expected [(2, 10), (3, 4)], got {chunks}"
    )
    assert decodes == [a, c]


def test_plan_step_admits_nobody_when_the_prompts_take_the_rest(impl):
    """Budget 7: A decodes, B takes the 6 it has left: nothing remains for a newcomer, so
    admit() is not called (a newcomer would hold a slot and compute nothing)."""
    a, b = seq_left(0, 1, 0), seq_left(1, 6, 1)
    admit = Admit(seq_left(2, 3))
    decodes, chunks = planned(impl, [a, b], 7, admit)
    assert chunks == [(1, 6)] and admit.calls == 0, (
        f"1 decode and B's 6 tokens fill the budget of 7 exactly: chunks [(1, 6)] and no "
        f"admission; got {chunks}, admit() called {admit.calls} times"
    )


def test_plan_step_without_a_budget_takes_every_context_whole(impl):
    """budget None (no max_step_tokens): everyone computes all it has left, newcomers too."""
    a, b, d = seq_left(0, 1, 0), seq_left(2, 30, 1), seq_left(5, 44, 2)
    admit = Admit(d)
    decodes, chunks = planned(impl, [a, b], None, admit)
    assert (decodes, chunks) == ([a], [(2, 30), (5, 44)]), (
        f"no budget: A decodes, B takes its 30, newcomer its 44; got {[s.rid for s in decodes]}, "
        f"{chunks}"
    )
    assert admit.calls == 1, "with no budget, newcomers are always admitted"


def test_plan_step_with_a_spent_budget(impl):
    """Three decodes and a budget of 3: no prompt computes anything, no newcomer enters."""
    running = [seq_left(i, 1, i) for i in range(3)] + [seq_left(3, 5, 3)]
    admit = Admit(seq_left(4, 2))
    decodes, chunks = planned(impl, running, 3, admit)
    assert len(decodes) == 3 and chunks == [], (
        f"the decodes spend the budget of 3: chunks [] (no chunk of 0 tokens), got {chunks}"
    )
    assert admit.calls == 0, "a spent budget admits nobody"


@pytest.mark.parametrize(
    "lefts, budget, want",
    [
        ([9, 3, 2], 5, [(0, 5)]),
        ([2, 9, 3, 6], 5, [(0, 2), (1, 3)]),
        ([2, 20, 3, 2], 11, [(0, 2), (1, 9)]),
        ([3, 4], 7, [(0, 3), (1, 4)]),
    ],
    ids=["9,3,2 budget 5", "2,9,3,6 budget 5", "2,20,3,2 budget 11", "3,4 budget 7"],
)
def test_plan_step_spreads_the_budget_in_arrival_order(impl, lefts, budget, want):
    """Prompts in slots in reverse arrival order: the budget goes by rid, all of each in turn,
    a part to the first that does not fit, nothing to those after (nobody overtakes)."""
    n = len(lefts)
    running = [seq_left(i, left, n - 1 - i) for i, left in enumerate(lefts)][::-1]  # slot order
    _, chunks = planned(impl, running, budget, Admit())
    assert chunks == want, (
        f"tokens left {lefts} by arrival (rid 0 first), budget {budget}: "
        f"expected {want}, got {chunks}"
    )


# ---- next_chunk ------------------------------------------------------------------------------
def sequence(prompt, made=(), computed=0) -> Sequence:
    """A Sequence whose context is prompt + made, `computed` of it in its slot."""
    seq = Sequence(0, Request(list(prompt), 8), 0.0, Sampling(), None)
    seq.tokens, seq.num_computed_tokens = list(made), computed
    return seq


def chunk(impl, seq, n):
    before = (seq.num_computed_tokens, list(seq.tokens), list(seq.request.prompt))
    got = impl.next_chunk(seq, n)
    assert isinstance(got, tuple) and len(got) == 2, (
        f"next_chunk returns (the chunk's tokens, whether they end the context), got {got!r}"
    )
    toks, done = got
    assert isinstance(toks, list), f"the chunk's tokens are a list of token ids, got {toks!r}"
    assert (seq.num_computed_tokens, seq.tokens, seq.request.prompt) == before, (
        f"next_chunk only reads the sequence: computed went from {before[0]} to "
        f"{seq.num_computed_tokens} (the engine moves seq.num_computed_tokens after the step)"
    )
    return toks, done


def test_next_chunk_slices_from_computed(impl):
    """10 prompt tokens, 3 already computed: the next 4 are tokens 3..6, and they do not end
    the context."""
    seq = sequence(range(10, 20), computed=3)
    toks, done = chunk(impl, seq, 4)
    assert toks == [13, 14, 15, 16], (
        "prompt 10..19, computed 3: the next 4 tokens are "
        f"context[3:7] = [13, 14, 15, 16], got {toks}"
    )
    assert done is False, (
        f"tokens 3..6 of a 10-token context do not end it: done must be False, got {done!r}"
    )


def test_next_chunk_is_done_only_at_the_end_of_the_context(impl):
    """Chunks of a 10-token context: only the one that reaches token 9 is done."""
    for computed, n, want in (
        (0, 9, False),
        (0, 10, True),
        (4, 5, False),
        (4, 6, True),
        (9, 1, True),
    ):
        seq = sequence(range(10, 20), computed=computed)
        toks, done = chunk(impl, seq, n)
        assert toks == list(range(10 + computed, 10 + computed + n)), (
            f"prompt 10..19, computed {computed}, {n} tokens: expected "
            f"context[{computed}:{computed + n}] = "
            f"{list(range(10 + computed, 10 + computed + n))}, got {toks}"
        )
        assert done is want, (
            f"prompt of 10, computed {computed}, a chunk of {n}: it "
            f"{'ends' if want else 'does not end'} the context, so done is "
            f"{want}, got {done!r} "
            "(only the chunk that ends it gives logits to sample from)"
        )


def test_next_chunk_of_a_decoding_sequence_is_its_last_token(impl):
    """A decoding sequence has 1 token left, the one it last sampled: that token, done."""
    seq = sequence([5, 6, 7], made=[40, 41], computed=4)
    toks, done = chunk(impl, seq, 1)
    assert (toks, done) == ([41], True), (
        f"prompt [5, 6, 7], made [40, 41], computed 4: its one token left is 41, the last it "
        f"sampled, and it ends the context: expected ([41], True), got ({toks}, {done!r})"
    )


def test_next_chunk_of_a_preempted_sequence_includes_its_tokens(impl):
    """A preempted sequence recomputes its prompt and the tokens it had made (seq.context()):
    a chunk may cross from the prompt into them."""
    seq = sequence([5, 6, 7, 8], made=[40, 41, 42], computed=2)
    toks, done = chunk(impl, seq, 3)
    assert (toks, done) == ([7, 8, 40], False), (
        f"prompt [5, 6, 7, 8], made [40, 41, 42] (preempted), computed 2: the context is the "
        f"prompt and the made tokens (seq.context()), its next 3 tokens [7, 8, 40], not its end: "
        f"expected ([7, 8, 40], False), got ({toks}, {done!r})"
    )
    seq.num_computed_tokens = 5
    toks, done = chunk(impl, seq, 2)
    assert (toks, done) == ([41, 42], True), (
        "the same context, computed 5: the last 2 tokens end it: expected ([41, 42], True), got "
        f"({toks}, {done!r})"
    )


# ---- the engine ------------------------------------------------------------------------------
def requests(n: int, seed: int, longest: int = 40) -> list[Request]:
    """Prompts of 1..longest tokens, greedy and seeded sampling, some with an EOS."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(97) for _ in range(rng.randint(1, longest))],
            rng.randint(1, 16),
            eos_id=rng.choice([None, 5, 9]),
            sampling=rng.choice([None, Sampling(0.9, 20, None, seed=i)]),
        )
        for i in range(n)
    ]


def solo(model, req: Request) -> list[int]:
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


@functools.cache
def solo_tokens(n: int, seed: int) -> list[list[int]]:
    """Solo generate's tokens for requests(n, seed), computed once for the module."""
    return [solo(TINY, r) for r in requests(n, seed)]


def run_engine(eng, reqs, every: int = 0, what: str = "the chunked engine with your functions"):
    """The exercises' driver (conftest.run_engine), for a chunked engine."""
    return conftest_run(
        eng, reqs, what, every=every, stuck="a context is never computed to its end"
    )


def budget_kept(trace: Trace, budget: int | None, where: str) -> None:
    if budget is None:
        return
    for i, computed in enumerate(trace.computed):
        assert sum(computed) <= budget, (
            f"{where}: step {i} computed {computed} tokens per slot, {sum(computed)} in all, "
            f"more than the budget of {budget}"
        )


def check_results(eng, rids, expected, where=""):
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i}{where} never finished (no Result)"
        msg = divergence(f"request {i}{where}", e, eng.results[rid].tokens)
        assert msg is None, msg
    msg = leaks(eng)
    assert msg is None, msg


@pytest.mark.parametrize(
    "kv, n_slots, budget, every",
    [("slots", 3, 5, 0), ("slots", 2, 2, 1), ("slots", 4, 1000, 2), ("paged", 3, 7, 1)],
)
def test_chunked_engine_with_your_functions_matches_solo(plug, kv, n_slots, budget, every):
    """Prompts of up to 40 tokens, greedy and seeded, arriving together or mid-run, under a
    budget of a few tokens a step (or one above every prompt, which computes each whole):
    every request gets its solo tokens, no step computes more than the budget, and every slot
    and block comes back."""
    plug()
    reqs = requests(10, 0)
    where = f" ({kv}, {n_slots} slots, max_step_tokens {budget})"
    trace = Trace()
    eng = make_engine(TINY, n_slots, kv=kv, block_size=4, max_step_tokens=budget, trace=trace)
    rids = run_engine(eng, reqs, every, what=f"the chunked engine with your functions{where}")
    budget_kept(trace, budget, where[2:-1])
    check_results(eng, rids, solo_tokens(10, 0), where)
    if budget < 1000:
        assert max(max(c) for c in trace.computed) <= budget < max(len(r.prompt) for r in reqs), (
            "the prompts are chosen longer than the budget, so some are prefilled in chunks"
        )


def test_preempted_requests_are_recomputed_in_chunks(plug):
    """A paged pool too small for everyone: preempted requests come back and recompute their
    prompt and the tokens they had made, a chunk a step; still solo tokens, no block left."""
    plug()
    reqs = requests(10, 1)
    trace = Trace()
    eng = make_engine(
        TINY, 3, kv="paged", block_size=4, kv_blocks=16, max_step_tokens=6, trace=trace
    )
    rids = run_engine(
        eng, reqs, every=1, what="the chunked paged engine with your functions (16 blocks of 4)"
    )
    budget_kept(trace, 6, "16 blocks of 4, max_step_tokens 6")
    assert eng.stats.preemptions > 0, (
        "a pool of 16 blocks of 4 is small enough that someone is preempted"
    )
    check_results(eng, rids, solo_tokens(10, 1), " (16 blocks of 4, max_step_tokens 6)")


def test_a_preempted_request_samples_only_at_the_end_of_its_recompute(plug):
    """Two requests of 3-token prompts and 24 new tokens in a pool of 12 blocks of 4: the
    younger is preempted after it has made several tokens, then recomputes its prompt and
    those tokens 4 or 5 at a time. Only the chunk that ends that whole context samples: a
    chunk that passes the prompt's end is still mid-recompute."""
    plug()
    reqs = [Request([3, 1, 4], 24), Request([2, 7, 1], 24)]
    trace = Trace()
    eng = make_engine(
        TINY, 2, kv="paged", block_size=4, kv_blocks=12, max_step_tokens=5, trace=trace
    )
    rids = run_engine(
        eng, reqs, what="the chunked paged engine with your functions (12 blocks of 4)"
    )
    assert eng.stats.preemptions > 0, (
        "the pool of 12 blocks is too small for both: one is preempted"
    )
    recomputed = eng.stats.summary([])["prefill_tokens"] - 6
    assert recomputed > 5, "the preempted request had made tokens, and recomputes them in chunks"
    check_results(
        eng, rids, [solo(TINY, r) for r in reqs], " (preempted, then recomputed in chunks)"
    )


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(plug):
    """Three short requests decode every step while a 60-token prompt takes the rest of a
    budget of 16: 13 tokens a step, then the 8 left; then all four decode."""
    plug()
    reqs = [Request([1 + i, 2, 3], 12) for i in range(3)] + [Request(list(range(1, 61)), 4)]
    trace = Trace()
    eng = make_engine(TINY, 4, max_step_tokens=16, trace=trace)
    with explained("the chunked engine with your functions"):
        rids = [eng.add_request(r) for r in reqs[:3]]
        eng.step()  # the short prompts' prefill
        rids.append(eng.add_request(reqs[3]))
    run_engine(eng, [])
    steps = trace.computed[1:7]
    assert [c[:3] for c in steps[:5]] == [[1, 1, 1]] * 5, (
        f"the three short requests decode one token every step while the long prompt is "
        f"prefilled: slots 0-2 computed {[c[:3] for c in steps[:5]]} in steps 1-5"
    )
    assert [c[3] for c in steps] == [13, 13, 13, 13, 8, 1], (
        f"a budget of 16, 3 decodes: the 60-token prompt (slot 3) takes the 13 tokens left each "
        f"step, 13 + 13 + 13 + 13 + 8 = 60, then decodes; "
        f"it computed {[c[3] for c in steps]} in steps 1-6"
    )
    expected = [solo(TINY, r) for r in reqs]
    check_results(eng, rids, expected)


def test_a_budget_of_one_prefill_token_a_step(plug):
    """max_step_tokens = n_slots: once every slot decodes, nothing is left for prompts; a
    newcomer gets one token a step only while a slot is not decoding. Solo tokens anyway."""
    plug()
    reqs = [Request([7, 8, 9, 10, 11, 12, 13], 5), Request([20, 21, 22, 23, 24], 3)]
    trace = Trace()
    eng = make_engine(TINY, 2, max_step_tokens=2, trace=trace)
    rids = run_engine(
        eng, reqs, what="the chunked engine with your functions (max_step_tokens 2, 2 slots)"
    )
    budget_kept(trace, 2, "2 slots, max_step_tokens 2")
    assert trace.computed[0] == [2, 0], (
        f"step 0: a budget of 2, nobody decodes: request 0 (7 tokens) takes both, request 1 "
        f"waits; the slots computed {trace.computed[0]}"
    )
    check_results(eng, rids, [solo(TINY, r) for r in reqs])


def test_bundled_model_with_your_functions(plug, bundled64):
    """The bundled model (float64), speeches arriving mid-run into 2 slots with a budget of 3
    tokens a step, so every prompt is prefilled a token or three at a time: solo tokens up to
    EOS, and every slot free at the end."""
    model, tok = bundled64
    texts = [
        "Ham.\n",
        "Oph.\nMy lord,",
        "King.\n",
        "Pol.\nWhat do you read, my lord?\n\nHam.\n",
        "Ham.\nTo be, or not to be",
    ]
    reqs = [Request(tok.encode(t), 40, eos_id=tok.eos_id) for t in texts]
    plug()  # solo generate calls no seam of this exercise
    trace = Trace()
    eng = make_engine(model, 2, max_step_tokens=3, trace=trace)
    rids = run_engine(eng, reqs, every=1)
    budget_kept(trace, 3, "2 slots, max_step_tokens 3")
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, (
        "the prompts are chosen so that EOS fires"
    )
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i} ({texts[i]!r}) never finished (no Result)"
        msg = divergence(f"request {i} ({texts[i]!r})", e, eng.results[rid].tokens)
        assert msg is None, msg
    msg = leaks(eng)
    assert msg is None, msg
