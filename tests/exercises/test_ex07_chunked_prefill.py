"""Exercise 07 - chunked prefill: your budget plan and next chunk inside
ContinuousEngine(max_step_tokens=N), slots and paged."""

import functools
import random

import pytest
import torch

from tinyllm.check import divergence, explained, leaks
from tinyllm.continuous import ContinuousEngine
from tinyllm.generate import generate
from tinyllm.requests import Request, Sequence
from tinyllm.sampling import Sampling
from tinyllm.stats import Trace
from tests.conftest import make_tiny

EXERCISE = "ex07_chunked_prefill"
TINY = make_tiny(seed=8)


# ---- plan_chunks -----------------------------------------------------------------------------
def planned(impl, left, budget):
    got = impl.plan_chunks(list(left), budget)
    assert isinstance(got, (list, tuple)) and len(got) == len(left), \
        f"plan_chunks({left}, {budget}) returns one count per sequence, a list of {len(left)}, got {got!r}"
    return list(got)


def test_plan_chunks_first_come_first_served(impl):
    """A budget of 7 for sequences with 5, 3 and 4 tokens left: the first takes its 5, the
    second the 2 that remain, the third waits for the next step."""
    got = planned(impl, [5, 3, 4], 7)
    assert got == [5, 2, 0], (f"left [5, 3, 4], budget 7: the first takes all its 5, the second "
                              f"the 2 left of the budget, the third 0 (first come first served): "
                              f"expected [5, 2, 0], got {got}")


def test_plan_chunks_without_a_budget_takes_every_context_whole(impl):
    """budget None (no max_step_tokens): each sequence computes everything it has left."""
    got = planned(impl, [5, 3, 40], None)
    assert got == [5, 3, 40], f"left [5, 3, 40], no budget (None): each takes all it has left, expected [5, 3, 40], got {got}"
    got = planned(impl, [], None)
    assert got == [], f"nobody to prefill: expected [], got {got}"


def test_plan_chunks_with_a_spent_budget_gives_nothing(impl):
    """The decodes took the whole budget: every prefilling sequence waits (0 each)."""
    got = planned(impl, [5, 3, 4], 0)
    assert got == [0, 0, 0], f"left [5, 3, 4], budget 0: nobody computes anything, expected [0, 0, 0], got {got}"


@pytest.mark.parametrize("left, budget, want", [([3, 4], 7, [3, 4]), ([3, 4], 3, [3, 0]),
                                                ([2, 3], 100, [2, 3]), ([9], 9, [9])],
                         ids=["3,4 budget 7", "3,4 budget 3", "2,3 budget 100", "9 budget 9"])
def test_plan_chunks_with_an_exact_or_ample_budget(impl, left, budget, want):
    """A budget that ends exactly where a sequence's context does, or exceeds them all."""
    got = planned(impl, left, budget)
    assert got == want, (f"left {left}, budget {budget}: each takes all it has left while the "
                         f"budget lasts, expected {want}, got {got}")


@pytest.mark.parametrize("left, budget, want", [([1, 1, 1, 1], 2, [1, 1, 0, 0]),
                                                ([2, 9, 1, 6], 5, [2, 3, 0, 0]),
                                                ([10, 1, 1], 4, [4, 0, 0]),
                                                ([1, 20, 3, 2], 11, [1, 10, 0, 0])],
                         ids=["1,1,1,1 budget 2", "2,9,1,6 budget 5", "10,1,1 budget 4", "1,20,3,2 budget 11"])
def test_plan_chunks_spreads_the_budget_in_arrival_order(impl, left, budget, want):
    """A budget that covers some sequences and part of one: the part goes to the first that
    does not fit, the ones after it get 0 (nobody overtakes, and nobody splits the budget evenly)."""
    got = planned(impl, left, budget)
    assert got == want, (f"left {left}, budget {budget}: in arrival order each takes min(left, "
                         f"what the budget still holds), expected {want}, got {got}")
    assert sum(got) <= budget, f"the counts {got} sum to more than the budget {budget}"


# ---- next_chunk ------------------------------------------------------------------------------
def sequence(prompt, made=(), computed=0) -> Sequence:
    """A Sequence whose context is prompt + made, `computed` of it in its slot."""
    seq = Sequence(0, Request(list(prompt), 8), 0.0, Sampling(), None)
    seq.tokens, seq.computed = list(made), computed
    return seq


def chunk(impl, seq, n):
    before = (seq.computed, list(seq.tokens), list(seq.request.prompt))
    got = impl.next_chunk(seq, n)
    assert isinstance(got, tuple) and len(got) == 2, \
        f"next_chunk returns (the chunk's tokens, whether they end the context), got {got!r}"
    toks, done = got
    assert isinstance(toks, list), f"the chunk's tokens are a list of token ids, got {toks!r}"
    assert (seq.computed, seq.tokens, seq.request.prompt) == before, \
        (f"next_chunk only reads the sequence: computed went from {before[0]} to {seq.computed} "
         f"(the engine moves seq.computed after the step)")
    return toks, done


def test_next_chunk_slices_from_computed(impl):
    """10 prompt tokens, 3 already computed: the next 4 are tokens 3..6, and they do not end
    the context."""
    seq = sequence(range(10, 20), computed=3)
    toks, done = chunk(impl, seq, 4)
    assert toks == [13, 14, 15, 16], (f"prompt 10..19, computed 3: the next 4 tokens are context[3:7] "
                                      f"= [13, 14, 15, 16], got {toks}")
    assert done is False, f"tokens 3..6 of a 10-token context do not end it: done must be False, got {done!r}"


def test_next_chunk_is_done_only_at_the_end_of_the_context(impl):
    """Chunks of a 10-token context: only the one that reaches token 9 is done."""
    for computed, n, want in ((0, 9, False), (0, 10, True), (4, 5, False), (4, 6, True), (9, 1, True)):
        seq = sequence(range(10, 20), computed=computed)
        toks, done = chunk(impl, seq, n)
        assert toks == list(range(10 + computed, 10 + computed + n)), \
            (f"prompt 10..19, computed {computed}, {n} tokens: expected context[{computed}:{computed + n}] "
             f"= {list(range(10 + computed, 10 + computed + n))}, got {toks}")
        assert done is want, (f"prompt of 10, computed {computed}, a chunk of {n}: it "
                              f"{'ends' if want else 'does not end'} the context, so done is {want}, "
                              f"got {done!r} (only the chunk that ends it gives logits to sample from)")


def test_next_chunk_of_a_decoding_sequence_is_its_last_token(impl):
    """A decoding sequence has 1 token left, the one it last sampled: that token, done."""
    seq = sequence([5, 6, 7], made=[40, 41], computed=4)
    toks, done = chunk(impl, seq, 1)
    assert (toks, done) == ([41], True), \
        (f"prompt [5, 6, 7], made [40, 41], computed 4: its one token left is 41, the last it "
         f"sampled, and it ends the context: expected ([41], True), got ({toks}, {done!r})")


def test_next_chunk_of_a_preempted_sequence_includes_its_tokens(impl):
    """A preempted sequence recomputes its prompt and the tokens it had made (seq.context()):
    a chunk may cross from the prompt into them."""
    seq = sequence([5, 6, 7, 8], made=[40, 41, 42], computed=2)
    toks, done = chunk(impl, seq, 3)
    assert (toks, done) == ([7, 8, 40], False), \
        (f"prompt [5, 6, 7, 8], made [40, 41, 42] (preempted), computed 2: the context is the "
         f"prompt and the made tokens (seq.context()), its next 3 tokens [7, 8, 40], not its end: "
         f"expected ([7, 8, 40], False), got ({toks}, {done!r})")
    seq.computed = 5
    toks, done = chunk(impl, seq, 2)
    assert (toks, done) == ([41, 42], True), \
        f"the same context, computed 5: the last 2 tokens end it: expected ([41, 42], True), got ({toks}, {done!r})"


# ---- the engine ------------------------------------------------------------------------------
def requests(n: int, seed: int, longest: int = 40) -> list[Request]:
    """Prompts of 1..longest tokens, greedy and seeded sampling, some with an EOS."""
    rng = random.Random(seed)
    return [Request([rng.randrange(97) for _ in range(rng.randint(1, longest))], rng.randint(1, 16),
                    eos_id=rng.choice([None, 5, 9]),
                    sampling=rng.choice([None, Sampling(0.9, 20, None, seed=i)])) for i in range(n)]


def solo(model, req: Request) -> list[int]:
    s = req.sampling or Sampling()
    g = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
    return generate(model, req.prompt, req.max_new_tokens, eos_id=req.eos_id,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=g)


@functools.cache
def solo_tokens(n: int, seed: int) -> list[list[int]]:
    """Solo generate's tokens for requests(n, seed), computed once for the module."""
    return [solo(TINY, r) for r in requests(n, seed)]


def run_engine(eng, reqs, every: int = 0, what: str = "the chunked engine with your functions") -> list[int]:
    """Add reqs (all at once, or one every `every` steps) and step until done; the rids."""
    rids, step = [], 0
    with explained(what):
        while len(rids) < len(reqs) or eng.has_work():
            while len(rids) < len(reqs) and (every == 0 or step % every == 0):
                rids.append(eng.add_request(reqs[len(rids)]))
                if every:
                    break
            if eng.has_work():
                eng.step()
            step += 1
            assert step < 5_000, "the engine never finishes: a context is never computed to its end"
    return rids


def budget_kept(trace: Trace, budget: int | None, where: str) -> None:
    if budget is None:
        return
    for i, computed in enumerate(trace.computed):
        assert sum(computed) <= budget, \
            (f"{where}: step {i} computed {computed} tokens per slot, {sum(computed)} in all, "
             f"more than the budget of {budget}")


def check_results(eng, rids, expected, where=""):
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i}{where} never finished (no Result)"
        msg = divergence(f"request {i}{where}", e, eng.results[rid].tokens)
        assert msg is None, msg
    msg = leaks(eng)
    assert msg is None, msg


@pytest.mark.parametrize("kv, n_slots, budget, every", [("slots", 3, 5, 0), ("slots", 2, 2, 1),
                                                         ("slots", 4, None, 2), ("paged", 3, 7, 1)])
def test_chunked_engine_with_your_functions_matches_solo(plug, kv, n_slots, budget, every):
    """Prompts of up to 40 tokens, greedy and seeded, arriving together or mid-run, under a
    budget of a few tokens a step: every request gets its solo tokens, no step computes more
    than the budget, and every slot and block comes back."""
    plug()
    reqs = requests(10, 0)
    where = f" ({kv}, {n_slots} slots, max_step_tokens {budget})"
    trace = Trace()
    eng = ContinuousEngine(TINY, n_slots, kv=kv, block_size=4, max_step_tokens=budget, trace=trace)
    rids = run_engine(eng, reqs, every, what=f"the chunked engine with your functions{where}")
    budget_kept(trace, budget, where[2:-1])
    check_results(eng, rids, solo_tokens(10, 0), where)
    if budget is not None:
        assert max(max(c) for c in trace.computed) <= budget < max(len(r.prompt) for r in reqs), \
            "the prompts are chosen longer than the budget, so some are prefilled in chunks"


def test_preempted_requests_are_recomputed_in_chunks(plug):
    """A paged pool too small for everyone: preempted requests come back and recompute their
    prompt and the tokens they had made, a chunk a step; still solo tokens, no block left."""
    plug()
    reqs = requests(10, 1)
    trace = Trace()
    eng = ContinuousEngine(TINY, 3, kv="paged", block_size=4, kv_blocks=16, max_step_tokens=6, trace=trace)
    rids = run_engine(eng, reqs, every=1, what="the chunked paged engine with your functions (16 blocks of 4)")
    budget_kept(trace, 6, "16 blocks of 4, max_step_tokens 6")
    assert eng.stats.preemptions > 0, "a pool of 16 blocks of 4 is small enough that someone is preempted"
    check_results(eng, rids, solo_tokens(10, 1), " (16 blocks of 4, max_step_tokens 6)")


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(plug):
    """Three short requests decode every step while a 60-token prompt takes the rest of a
    budget of 16: 13 tokens a step, then the 8 left; then all four decode."""
    plug()
    reqs = [Request([1 + i, 2, 3], 12) for i in range(3)] + [Request(list(range(1, 61)), 4)]
    trace = Trace()
    eng = ContinuousEngine(TINY, 4, max_step_tokens=16, trace=trace)
    with explained("the chunked engine with your functions"):
        rids = [eng.add_request(r) for r in reqs[:3]]
        eng.step()                                          # the short prompts' prefill
        rids.append(eng.add_request(reqs[3]))
    run_engine(eng, [])
    steps = trace.computed[1:7]
    assert [c[:3] for c in steps[:5]] == [[1, 1, 1]] * 5, \
        (f"the three short requests decode one token every step while the long prompt is "
         f"prefilled: slots 0-2 computed {[c[:3] for c in steps[:5]]} in steps 1-5")
    assert [c[3] for c in steps] == [13, 13, 13, 13, 8, 1], \
        (f"a budget of 16, 3 decodes: the 60-token prompt (slot 3) takes the 13 tokens left each "
         f"step, 13 + 13 + 13 + 13 + 8 = 60, then decodes; it computed {[c[3] for c in steps]} in steps 1-6")
    expected = [solo(TINY, r) for r in reqs]
    check_results(eng, rids, expected)


def test_a_budget_of_one_prefill_token_a_step(plug):
    """max_step_tokens = n_slots: once every slot decodes, nothing is left for prompts; a
    newcomer gets one token a step only while a slot is not decoding. Solo tokens anyway."""
    plug()
    reqs = [Request([7, 8, 9, 10, 11, 12, 13], 5), Request([20, 21, 22, 23, 24], 3)]
    trace = Trace()
    eng = ContinuousEngine(TINY, 2, max_step_tokens=2, trace=trace)
    rids = run_engine(eng, reqs, what="the chunked engine with your functions (max_step_tokens 2, 2 slots)")
    budget_kept(trace, 2, "2 slots, max_step_tokens 2")
    assert trace.computed[0] == [2, 0], \
        (f"step 0: a budget of 2, nobody decodes: request 0 (7 tokens) takes both, request 1 "
         f"waits; the slots computed {trace.computed[0]}")
    check_results(eng, rids, [solo(TINY, r) for r in reqs])


def test_bundled_model_with_your_functions(plug, bundled64):
    """The bundled model (float64), speeches arriving mid-run into 2 slots with a budget of 3
    tokens a step, so every prompt is prefilled a token or three at a time: solo tokens up to
    EOS, and every slot free at the end."""
    model, tok = bundled64
    texts = ["Ham.\n", "Oph.\nMy lord,", "King.\n", "Pol.\nWhat do you read, my lord?\n\nHam.\n",
             "Ham.\nTo be, or not to be"]
    reqs = [Request(tok.encode(t), 40, eos_id=tok.eos_id) for t in texts]
    plug()                          # solo generate calls no seam of this exercise
    trace = Trace()
    eng = ContinuousEngine(model, 2, max_step_tokens=3, trace=trace)
    rids = run_engine(eng, reqs, every=1)
    budget_kept(trace, 3, "2 slots, max_step_tokens 3")
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, "the prompts are chosen so that EOS fires"
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i} ({texts[i]!r}) never finished (no Result)"
        msg = divergence(f"request {i} ({texts[i]!r})", e, eng.results[rid].tokens)
        assert msg is None, msg
    msg = leaks(eng)
    assert msg is None, msg
