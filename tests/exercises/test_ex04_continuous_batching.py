"""Exercise 04 - continuous batching: your admission, slot release and ragged mask inside
ContinuousEngine."""

import functools
import random
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tests.exercises.conftest import run_engine
from tinyllm.build import make_engine, run_continuous
from tinyllm.core.generate import generate
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.prefix_cache import PrefixCache
from tinyllm.core.requests import Request, Sequence
from tinyllm.core.sampling import Sampling
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.course.check import divergence, explained, leaks

EXERCISE = "ex04_continuous_batching"
TINY = make_tiny(seed=5)


# ---- admit_waiting and leave_slot ---------------------------------------------------------
def seqs(*context_lens: int) -> deque:
    """Waiting Sequences with prompts of these lengths, rids 0, 1, ... in arrival order."""
    return deque(
        Sequence(i, Request([1] * n, 4), 0.0, Sampling(), None) for i, n in enumerate(context_lens)
    )


def slots(n_slots: int, busy=()) -> SlotKVCache:
    cfg = TINY.cfg
    cache = SlotKVCache(
        cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, 32, torch.float64, "cpu"
    )
    for s in busy:
        cache.admit(s, 3)
    return cache


def admitted(impl, waiting, running, cache):
    got = impl.admit_waiting(waiting, running, cache)
    assert isinstance(got, list), (
        f"admit_waiting returns the admitted sequences as a list, got {got!r}"
    )
    return got


def test_admission_fills_the_free_slots_first_come_first_served(impl):
    """Slot 1 is busy: the first two waiting take the free slots 0 and 2 (either may take
    either), the others keep waiting."""
    waiting, running, cache = seqs(4, 2, 6, 3), {}, slots(3, busy=[1])
    a, b, c, d = waiting
    got = admitted(impl, waiting, running, cache)
    assert [s.rid for s in got] == [0, 1], (
        "2 free slots, 4 waiting: requests 0 and 1 enter (in arrival order), got rids "
        f"{[s.rid for s in got]}"
    )
    assert {a.slot, b.slot} == {0, 2}, (
        f"they take the free slots 0 and 2, got {a.slot} and {b.slot}"
    )
    assert running == {a.slot: a, b.slot: b}, (
        f"running maps each new slot to its sequence: expected {{{a.slot}: r0, {b.slot}: r1}}, "
        f"got {running}"
    )
    assert list(waiting) == [c, d], (
        f"the admitted leave the queue, the rest keep their order: {list(waiting)}"
    )
    assert cache.active == [True, True, True], (
        f"the cache admitted them into their slots: active {cache.active}"
    )
    assert c.slot is None and d.slot is None, "a waiting sequence has no slot"


def test_the_first_that_does_not_fit_stops_admission(impl):
    """A pool of 4 blocks of 4: request 0 takes 2 blocks, request 1 would need 3, so it waits,
    and request 2 (1 block, it would fit) waits behind it: nobody overtakes."""
    cfg = TINY.cfg
    cache = PagedKVCache(
        cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim, 4, 4, 32, torch.float64, "cpu"
    )
    waiting, running = seqs(5, 9, 2), {}
    got = admitted(impl, waiting, running, cache)
    assert [s.rid for s in got] == [0], (
        "request 0 fits (2 blocks), request 1 does not (3 "
        "blocks, 2 free) and request 2 waits behind it: admit "
        f"[0], got rids {[s.rid for s in got]} (ask "
        "cache.can_admit first)"
    )
    assert [s.rid for s in waiting] == [1, 2], (
        f"1 and 2 keep waiting, in order: {[s.rid for s in waiting]}"
    )


def test_admission_gives_the_cache_each_context(impl):
    """A prefix cache (08) holds request 0's first 8 tokens in 2 blocks that a running request
    holds; 2 blocks of 4 are free, one of them the running request's headroom (05). Request 0
    (9 tokens, 3 blocks with its next token) fits only if the cache sees its context: ask
    can_admit and admit with seq.context()."""
    cfg = TINY.cfg
    cache = PagedKVCache(
        cfg.n_layers,
        2,
        cfg.n_kv_heads,
        cfg.head_dim,
        5,
        4,
        32,
        torch.float64,
        "cpu",
        prefix_cache=PrefixCache,
        name_at_admission=True,
    )
    shared = [5, 17, 3, 88, 40, 2, 61, 7]
    cache.admit(0, 8, shared)  # running, in 3 blocks: its 2 full ones named
    waiting, running = deque([Sequence(0, Request(shared + [9], 4), 0.0, Sampling(), None)]), {}
    got = admitted(impl, waiting, running, cache)
    assert [s.rid for s in got] == [0], (
        f"request 0 needs 1 fresh block once its 2 cached ones are shared, and 2 are free (1 "
        f"kept for the running request to grow): it enters, got rids {[s.rid for s in got]} "
        f"(pass seq.context() to can_admit and admit)"
    )
    assert cache.lens[1] == 8, (
        f"the cache starts slot 1 with the 8 cached tokens when admit is given the context: "
        f"lens[1] is {cache.lens[1]}"
    )


def test_admission_with_nothing_to_do(impl):
    """An empty queue, or no free slot: nobody enters and nothing changes."""
    cache = slots(2)
    assert admitted(impl, deque(), {}, cache) == [], "an empty queue: admit nobody"
    assert cache.active == [False, False], "and take no slot"
    waiting, cache = seqs(3), slots(2, busy=[0, 1])
    assert admitted(impl, waiting, {}, cache) == [], "no free slot: admit nobody"
    assert len(waiting) == 1 and waiting[0].slot is None, "the request keeps waiting"


def test_leave_slot_frees_the_slot_and_its_memory(impl):
    """A finished sequence's slot is free at once: the cache, running and the sequence agree."""
    cfg = TINY.cfg
    cache = PagedKVCache(
        cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim, 6, 4, 32, torch.float64, "cpu"
    )
    seq = Sequence(0, Request([1] * 9, 4), 0.0, Sampling(), None)
    cache.admit(1, 9)
    seq.slot, running = 1, {1: seq}
    impl.leave_slot(seq, running, cache)
    assert cache.free_slots() == [0, 1], (
        f"slot 1 is free again (cache.release), free slots {cache.free_slots()}"
    )
    assert cache.allocator.n_free() == 6, (
        f"its blocks go back to the pool: {cache.allocator.n_free()} of 6 free "
        "(cache.release frees them)"
    )
    assert running == {}, f"running forgets the sequence, holds {running}"
    assert seq.slot is None, f"the sequence no longer has a slot, seq.slot = {seq.slot}"


# ---- ragged_mask ----------------------------------------------------------------------------
def reference_ragged(lens, q_lens):
    """Built the slow way, one row, column and key at a time: positions [b][i], mask [b][i][j]."""
    T, W = max(q_lens), max(n + q for n, q in zip(lens, q_lens))
    positions = [[n + min(i, q - 1) for i in range(T)] for n, q in zip(lens, q_lens)]
    mask = [[[j <= p for j in range(W)] for p in row] for row in positions]
    return positions, mask


def check_ragged(impl, lens, q_lens):
    """Your ragged_mask against the reference: shapes, then every position, then every entry."""
    where = f"lens {lens}, q_lens {q_lens}"
    B, T, W = len(lens), max(q_lens), max(n + q for n, q in zip(lens, q_lens))
    got = impl.ragged_mask(lens, q_lens, "cpu")
    assert isinstance(got, tuple) and len(got) == 2, (
        f"{where}: return (positions, mask), got {type(got)}"
    )
    positions, mask = got
    want_pos, want_mask = reference_ragged(lens, q_lens)
    assert tuple(positions.shape) == (B, T), (
        f"{where}: positions should be (B, T) = {(B, T)} (T = max(q_lens)), got "
        f"{tuple(positions.shape)}"
    )
    assert tuple(mask.shape) == (B, 1, T, W), (
        f"{where}: the mask should be (B, 1, T, W) = {(B, 1, T, W)} (W = max(lens + q_lens) "
        f"keys), got {tuple(mask.shape)}"
    )
    for b in range(B):
        for i in range(T):
            what = (
                "a new token" if i < q_lens[b] else "padding, repeats the row's last new position"
            )
            assert int(positions[b, i]) == want_pos[b][i], (
                f"{where}: row {b}, column {i} ({what}): expected position {want_pos[b][i]}, "
                f"got {int(positions[b, i])}"
            )
    for b in range(B):
        for i in range(T):
            for j in range(W):
                e, g = want_mask[b][i][j], bool(mask[b, 0, i, j])
                assert g == e, (
                    f"{where}: row {b}, column {i} (position {want_pos[b][i]}), "
                    f"key {j}: expected {e}, got {g} "
                    "(a column sees keys 0..its own position)"
                )


def test_ragged_mask_of_decode_rows(impl):
    """Decode rows (q_len 1): each new token at its row's length, seeing keys 0..length."""
    check_ragged(impl, [4, 9, 1], [1, 1, 1])


def test_ragged_mask_of_a_prefill_from_empty(impl):
    """A prompt entering an empty slot: positions 0..q_len-1 and a causal mask."""
    check_ragged(impl, [0], [5])


def test_ragged_mask_of_a_mixed_ragged_batch(impl):
    """A prefill, a decode row and a 2-token row in one step: padding columns included."""
    check_ragged(impl, [0, 5, 2], [3, 1, 2])


def test_ragged_mask_types(impl):
    """Positions are integers (RoPE indexes with them); the mask is bool, True = attend."""
    positions, mask = impl.ragged_mask([0, 5, 2], [3, 1, 2], "cpu")
    assert not positions.is_floating_point() and positions.dtype != torch.bool, (
        f"positions must be an integer tensor, got {positions.dtype}"
    )
    assert mask.dtype == torch.bool, (
        f"the mask must be a bool tensor (a float one is added to the scores), got {mask.dtype}"
    )


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=5))
def test_ragged_mask_on_random_steps(impl, rows):
    """Random ragged steps (lens 0..12, q_lens 1..6, 1 to 5 rows) against the reference."""
    check_ragged(impl, [n for n, _ in rows], [q for _, q in rows])


def test_your_ragged_mask_gives_each_row_its_solo_logits(plug):
    """SlotKVCache with your ragged_mask: prefill, decode and both mixed give the uncached
    logits."""
    plug("ragged_mask")
    cfg = TINY.cfg
    cache = SlotKVCache(cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim, 32, torch.float64, "cpu")
    a, b = [5, 17, 3, 88, 40, 2], [61, 7, 7, 30]
    alone = lambda seq: TINY(torch.tensor([seq]))[0][0]  # (len, V), no cache
    with torch.no_grad():
        cache.admit(2, len(a))
        cache.plan_step([2], [len(a)])
        got = TINY(torch.tensor([a]), cache=cache)[0][0]  # a prefill from empty
        err = (got - alone(a)).abs().max().item()
        assert err < 1e-9, (
            f"slot 2's prefill of {len(a)} tokens: logits differ from no cache by {err:.3g}"
        )
        cache.admit(0, len(b))
        cache.plan_step([2, 0], [1, len(b)])  # row 0: slot 2, row 1: slot 0
        idx = torch.tensor([[9] + [0] * (len(b) - 1), b])  # row 0 is padded after its token
        logits = TINY(idx, cache=cache)[0]  # (2, len(b), V)
        for row, seq, cols in ((0, a + [9], 1), (1, b, len(b))):
            err = (logits[row, :cols] - alone(seq)[-cols:]).abs().max().item()
            assert err < 1e-9, (
                f"mixed step, row {row} ({cols} new tokens): logits differ from "
                f"its sequence alone by {err:.3g}"
            )
        cache.plan_step([0, 2], [1, 1])  # both decode
        logits = TINY(torch.tensor([[11], [12]]), cache=cache)[0]
        for row, seq in ((0, b + [11]), (1, a + [9, 12])):
            err = (logits[row, 0] - alone(seq)[-1]).abs().max().item()
            assert err < 1e-9, (
                f"decode step, row {row}: logits differ from its sequence alone by {err:.3g}"
            )
    assert cache.lens == [len(b) + 1, 0, len(a) + 2], (
        f"slot lengths after three steps: {cache.lens}"
    )


# ---- the engine -----------------------------------------------------------------------------
def requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(97) for _ in range(rng.randint(1, 20))],
            rng.randint(1, 20),
            eos_id=rng.choice([None, 5, 9]),
        )
        for _ in range(n)
    ]


def solo(model, reqs):
    return [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]


@functools.cache
def solo_tokens(n: int, seed: int) -> list[list[int]]:
    """Solo generate's tokens for requests(n, seed), computed once for the module."""
    return solo(TINY, requests(n, seed))


def check_results(eng, rids, expected, where=""):
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i}{where} never finished (no Result)"
        msg = divergence(f"request {i}{where}", e, eng.results[rid].tokens)
        assert msg is None, msg
    msg = leaks(eng)
    assert msg is None, msg


def test_your_admission_fills_the_free_slots_in_order(plug):
    """The engine with your admission: the first come take the free slots, the rest wait, and a
    finished request's slot goes to the next in line."""
    plug("admit_waiting", "leave_slot")
    reqs = [Request([i + 1, i + 2], 6) for i in range(4)]
    eng = make_engine(TINY, 2)
    rids = [eng.add_request(r) for r in reqs]
    with explained("the engine's first step with your admit_waiting"):
        eng.step()
    assert sorted(eng.holders()) == [rids[0], rids[1]], (
        "2 free slots, 4 queued: requests 0 and 1 take the two slots, the slots hold "
        f"{eng.holders()}"
    )
    assert eng.request_counts() == (2, 2), (
        f"2 waiting and 2 running after the first step, got {eng.request_counts()}"
    )
    run_engine(eng, [])
    check_results(eng, rids, solo(TINY, reqs))


def test_an_aborted_request_frees_its_slot_at_once(plug):
    """abort() frees the slot in the same call, and the next waiting request takes it."""
    plug("admit_waiting", "leave_slot")
    reqs = [Request([i + 1, i + 2], 8) for i in range(3)]
    eng = make_engine(TINY, 2)
    rids = [eng.add_request(r) for r in reqs]
    with explained("the engine with your functions"):
        eng.step()
        freed = eng.holders().index(rids[0])
        eng.abort(rids[0])
        assert eng.holders()[freed] is None and rids[1] in eng.holders(), (
            f"after aborting request 0, its slot {freed} is free at once: the slots hold "
            f"{eng.holders()}"
        )
        eng.step()
    assert eng.holders()[freed] == rids[2], (
        f"the next step admits request 2 into the freed slot {freed}: the slots hold "
        f"{eng.holders()}"
    )
    run_engine(eng, [])
    check_results(eng, rids[1:], solo(TINY, reqs[1:]))


@pytest.mark.parametrize("n_slots", [1, 3, 6])
def test_continuous_batching_with_your_functions_matches_solo(plug, n_slots):
    """run_continuous with both your functions: every request gets its solo tokens."""
    plug()
    reqs = requests(14, 0)
    with explained(f"run_continuous ({n_slots} slots) with your functions"):
        results, summary = run_continuous(TINY, reqs, n_slots)
    assert len(results) == len(reqs), (
        f"one Result per request: expected {len(reqs)}, got {len(results)}"
    )
    for i, (e, r) in enumerate(zip(solo_tokens(14, 0), results)):
        msg = divergence(f"request {i} ({n_slots} slots)", e, r.tokens)
        assert msg is None, msg
    assert summary["peak_active"] <= n_slots, (
        f"at most {n_slots} requests decode at once, {summary['peak_active']} did"
    )


def test_requests_arriving_while_others_decode(plug):
    """Requests join mid-run, one every other step: still solo tokens, and every slot freed."""
    plug()
    reqs = requests(10, 1)
    eng = make_engine(TINY, 3)
    rids = run_engine(eng, reqs, every=2)
    check_results(eng, rids, solo_tokens(10, 1))


@pytest.mark.parametrize("budget", [None, 4])
def test_a_paged_pool_that_preempts_with_your_functions(plug, budget):
    """A paged pool too small for everyone (05): requests are preempted and admitted again,
    now with their prompt and the tokens they had made to compute. Your admission must make
    room for that whole context: every request still gets its solo tokens, nothing leaks."""
    plug()
    reqs = [Request([(7 * i + j) % 97 for j in range(3 + i % 4)], 18 + i % 5) for i in range(8)]
    where = f" (paged, 10 blocks of 4, max_step_tokens {budget})"
    eng = make_engine(TINY, 3, kv="paged", block_size=4, kv_blocks=10, max_step_tokens=budget)
    rids = run_engine(eng, reqs, every=1)
    assert eng.stats.preemptions > 0, "the pool is small enough that requests are preempted"
    check_results(eng, rids, solo(TINY, reqs), where)


def test_bundled_model_with_your_functions(plug, bundled64):
    """The bundled model (float64), speeches arriving mid-run into 2 slots: solo tokens up to
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
    eng = make_engine(model, 2)
    rids = run_engine(eng, reqs, every=1)
    expected = solo(model, reqs)
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, (
        "the prompts are chosen so that EOS fires"
    )
    check_results(eng, rids, expected, where="")
