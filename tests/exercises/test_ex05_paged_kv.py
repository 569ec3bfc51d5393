"""Exercise 05 - the paged KV cache: your allocator, block tables, block-table lookup and
preemption inside the paged engine."""

import random
from collections import deque

import pytest
import torch

from tests.conftest import make_tiny
from tinyllm.build import make_engine, run_continuous
from tinyllm.core.generate import generate
from tinyllm.core.requests import Request, Sequence
from tinyllm.core.sampling import Sampling
from tinyllm.core.slot_cache import SlotCache
from tinyllm.course.check import divergence, explained, leaks

EXERCISE = "ex05_paged_kv"
TINY = make_tiny(seed=6)


# ---- allocate_blocks and free_blocks -------------------------------------------------------
def test_allocate_hands_out_free_blocks_and_marks_them(impl):
    """n blocks that were free leave the free list, marked allocated (any n of them will do)."""
    free, allocated = [3, 2, 1, 0], [False] * 4
    got = impl.allocate_blocks(free, allocated, 2)
    assert isinstance(got, list) and len(got) == 2, (
        f"2 blocks asked: return a list of 2 block ids, got {got!r}"
    )
    assert len(set(got)) == 2 and set(got) <= {0, 1, 2, 3}, (
        f"2 distinct blocks of the pool, got {got}"
    )
    assert sorted(free + got) == [0, 1, 2, 3], (
        f"the blocks handed out leave the free list (free list now {free}, handed out {got})"
    )
    assert allocated == [b in got for b in range(4)], (
        f"exactly the blocks handed out are marked allocated: {allocated} for {got}"
    )


def test_allocate_more_than_is_free_changes_nothing(impl):
    """Asking for more blocks than are free gives None and takes nothing; asking for 0 gives []."""
    free, allocated = [3, 2], [True, True, False, False]
    got = impl.allocate_blocks(free, allocated, 3)
    assert got is None, f"3 blocks asked, 2 free: return None, got {got!r}"
    assert free == [3, 2] and allocated == [True, True, False, False], (
        f"and take nothing: free list {free}, flags {allocated}"
    )
    got = impl.allocate_blocks(free, allocated, 0)
    assert got == [], f"no block asked: none given ([]), got {got!r}"


def test_free_gives_blocks_back(impl):
    """Freed blocks return to the free list with their flags cleared, ready to be handed out."""
    free, allocated = [3], [True, True, True, False]
    impl.free_blocks(free, allocated, [1, 0])
    assert sorted(free) == [0, 1, 3], (
        f"0 and 1 are free again: the free list should hold 0, 1, 3, it holds {free}"
    )
    assert allocated == [False, False, True, False], f"their flags are cleared: {allocated}"
    again = impl.allocate_blocks(free, allocated, 3)
    assert again is not None and sorted(again) == [0, 1, 3], (
        f"all three free blocks can be handed out again, allocate_blocks gave {again!r}"
    )


@pytest.mark.parametrize(
    "blocks, bad, why",
    [
        ([0], 0, "block 0 is free already"),
        ([2, 2], 2, "block 2 is given twice"),
        ([2, 7], 7, "block 7 is not a block of this pool of 4 (0..3)"),
    ],
)
def test_double_free_is_refused_and_changes_nothing(impl, blocks, bad, why):
    """A free block, a block given twice or one outside the pool: ValueError naming it, and
    nothing changed (not even the blocks before it)."""
    free, allocated = [1, 0], [False, False, True, True]
    call = f"free_blocks(free_list [1, 0], allocated [False, False, True, True], {blocks})"
    try:
        impl.free_blocks(free, allocated, list(blocks))
    except NotImplementedError:
        raise
    except ValueError as e:
        assert str(bad) in str(e), (
            f"{call}: {why}; the ValueError must name block {bad}, it says {str(e)!r}"
        )
    except Exception as e:
        raise AssertionError(
            f"{call} raised {type(e).__name__}: {e}; {why}: raise ValueError naming block {bad}"
        ) from None
    else:
        raise AssertionError(
            f"{call} did not raise: {why}. A double free would later hand one "
            f"block to two sequences: raise ValueError naming block {bad}, before "
            f"changing anything (the free list is now {free}, the flags "
            f"{allocated})"
        )
    assert free == [1, 0] and allocated == [False, False, True, True], (
        f"{call} must fail before changing anything: the free list is now {free}, the flags "
        f"{allocated} (check every block first, then give them back)"
    )


# ---- grow_table ------------------------------------------------------------------------------
class Pool:
    """allocate(n) from a pool of `free` blocks numbered from 100, counting what was asked."""

    def __init__(self, free: int):
        self.next, self.free, self.asked = 100, free, []

    def allocate(self, n):
        self.asked.append(n)
        if n > self.free:
            return None
        self.free -= n
        self.next += n
        return list(range(self.next - n, self.next))


@pytest.mark.parametrize(
    "have, n_tokens, want",
    [(0, 1, 1), (0, 4, 1), (0, 5, 2), (0, 9, 3), (2, 8, 0), (2, 9, 1), (1, 13, 3)],
)
def test_grow_table_takes_exactly_the_missing_blocks(impl, have, n_tokens, want):
    """Blocks of 4 positions: a table of `have` blocks grows to hold n_tokens, no more."""
    table, pool = list(range(have)), Pool(10)
    ok = impl.grow_table(table, n_tokens, 4, pool.allocate)
    need = -(-n_tokens // 4)
    assert ok is True, f"the pool has room: return True, got {ok!r}"
    assert len(table) == have + want, (
        f"blocks of 4, a table of {have} blocks, {n_tokens} tokens to hold: it needs "
        f"ceil({n_tokens}/4) = {need} blocks, so {want} more; it has {len(table)}"
    )
    assert table[:have] == list(range(have)), "the blocks it had stay first, in order"
    assert sum(pool.asked) == want, (
        f"take exactly the {want} missing blocks, allocate was asked for {pool.asked}"
    )


def test_grow_table_with_a_dry_pool_changes_nothing(impl):
    """2 blocks missing, 1 free: False, and the table is as it was."""
    table, pool = [7], Pool(1)
    ok = impl.grow_table(table, 10, 4, pool.allocate)
    assert ok is False, f"the pool has too few blocks: return False, got {ok!r}"
    assert table == [7], f"and leave the table as it was, it is {table}"


# ---- slot_mapping ----------------------------------------------------------------------------
def test_slot_mapping_follows_the_block_table(impl):
    """Each row through its own table: blocks of 4, row 0's table [5, 2] keeps positions 0..3
    in pool block 5 (rows 20..23) and 4..7 in block 2 (rows 8..11)."""
    tables = torch.tensor([[5, 2], [7, 0]])
    positions = torch.tensor([[0, 3, 4, 7], [1, 5, 0, 2]])
    got = impl.slot_mapping(tables, positions, 4)
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 4), (
        f"slot_mapping returns a (B, W) = (2, 4) tensor, got {got!r}"
    )
    want = torch.tensor([[20, 23, 8, 11], [29, 1, 28, 30]])
    for b in range(2):
        for i in range(4):
            p, blk = int(positions[b, i]), int(tables[b, int(positions[b, i]) // 4])
            assert int(got[b, i]) == int(want[b, i]), (
                f"blocks of 4, row {b} with table {tables[b].tolist()}: position {p} is in the "
                f"table's block {p // 4}, pool block {blk}, which holds pool rows {blk * 4}.."
                f"{blk * 4 + 3}; expected row {int(want[b, i])}, got {int(got[b, i])}"
            )


# ---- reserve_or_preempt --------------------------------------------------------------------
class Budget(SlotCache):
    """A cache whose memory is a count of free tokens: reserve(slot, 1) takes one, release gives
    back what the slot held. Enough to watch who is preempted."""

    def __init__(self, n_slots: int, free: int):
        super().__init__(1, n_slots, 64)
        self.free, self.held = free, [0] * n_slots

    def reserve(self, slot, n=1):
        if self.free < n:
            return False
        self.free -= n
        self.held[slot] += n
        return True

    def release(self, slot):
        self.free += self.held[slot]
        self.held[slot] = 0
        super().release(slot)


def running_on(cache, rids_by_slot: dict) -> dict:
    running = {}
    for slot, rid in rids_by_slot.items():
        seq = Sequence(rid, Request([1, 2], 4), 0.0, Sampling(), None)
        cache.admit(slot, 2)
        seq.slot, running[slot] = slot, seq
    return running


def test_with_room_for_all_nobody_is_preempted(impl):
    cache = Budget(3, free=10)
    running = running_on(cache, {0: 4, 1: 2, 2: 7})
    waiting = deque()
    got = impl.reserve_or_preempt(running, waiting, cache)
    assert list(got) == [], f"room for every next token: nobody is preempted, got {got}"
    assert cache.held == [1, 1, 1], f"one token reserved for each running request: {cache.held}"


def test_the_youngest_gives_way_and_waits_in_arrival_order(impl):
    """Room for 2 of 3 next tokens: the youngest (rid 7) is preempted; it waits again, ahead of
    rid 9 that arrived after it and behind rid 1."""
    cache = Budget(3, free=2)
    running = running_on(cache, {0: 4, 1: 2, 2: 7})
    early, late = (Sequence(r, Request([1], 4), 0.0, Sampling(), None) for r in (1, 9))
    waiting = deque([early, late])
    got = impl.reserve_or_preempt(running, waiting, cache)
    assert [s.rid for s in got] == [7], (
        f"the youngest running request (rid 7) is preempted, got {[s.rid for s in got]}"
    )
    assert sorted(running) == [0, 1], (
        f"slots 0 and 1 keep running, running holds slots {sorted(running)}"
    )
    assert got[0].slot is None and cache.active[2] is False, (
        "the preempted request leaves its slot (leave_slot)"
    )
    assert [s.rid for s in waiting] == [1, 7, 9], (
        f"the queue stays in arrival order: rids [1, 7, 9], got {[s.rid for s in waiting]}"
    )
    assert cache.held[:2] == [1, 1], f"rids 2 and 4 have their next token reserved: {cache.held}"


def test_preemption_goes_on_until_the_oldest_has_room(impl):
    """Slot 1's request (rid 2) is the oldest but its memory is gone: the others are preempted,
    youngest first, until the memory they free gives it room."""
    cache = Budget(3, free=0)
    running = running_on(cache, {0: 4, 1: 2, 2: 7})
    cache.held = [1, 0, 0]  # rid 4 holds one token; rid 7 holds none
    got = impl.reserve_or_preempt(running, deque(), cache)
    assert [s.rid for s in got] == [7, 4], (
        f"the oldest (rid 2) needs a token and none is free: preempt rid 7 (frees nothing), "
        f"then rid 4 (frees 1): got {[s.rid for s in got]}"
    )
    assert list(running) == [1], (
        f"only the oldest keeps running, running holds slots {list(running)}"
    )


# ---- the paged engine ----------------------------------------------------------------------
def requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(97) for _ in range(rng.randint(1, 20))],
            rng.randint(1, 30),
            eos_id=rng.choice([None, 5]),
        )
        for _ in range(n)
    ]


def test_paged_engine_with_your_functions_matches_solo(plug):
    """A pool too small for everyone at once: requests are preempted and recomputed, and
    still each gets exactly its solo tokens, and every block comes back."""
    plug()
    reqs = requests(12, 0)
    expected = None
    for block_size, n_blocks in ((4, 14), (1, 52), (8, 7)):
        where = f"blocks of {block_size}, {n_blocks} of them"
        with explained(f"the paged engine with your functions ({where})"):
            results, summary = run_continuous(
                TINY, reqs, 4, kv="paged", block_size=block_size, kv_blocks=n_blocks
            )
        expected = expected or [
            generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs
        ]
        for i, (e, r) in enumerate(zip(expected, results)):
            msg = divergence(f"request {i} ({where})", e, r.tokens)
            assert msg is None, msg
        assert summary["preemptions"] > 0, (
            f"{where}: the pool is small enough that someone is preempted"
        )
        assert summary["kv_allocated_at_end"] == 0, (
            f"{where}: every block is freed at the end, {summary['kv_allocated_at_end']} "
            "positions are still allocated"
        )


def test_bundled_model_under_memory_pressure(plug, bundled64):
    """The bundled model (float64), 8 speeches through 4 slots and a pool of 15 blocks of 4:
    preemptions, EOS, every request's solo tokens, and no block left behind."""
    model, tok = bundled64
    texts = [
        "Ham.\n",
        "Oph.\nMy lord,",
        "King.\n",
        "Pol.\nWhat do you read, my lord?\n\nHam.\n",
        "Ham.\nTo be, or not to be",
        "Queen.\n",
        "Hor.\n",
        "Laer.\n",
    ]
    reqs = [Request(tok.encode(t), 40, eos_id=tok.eos_id) for t in texts]
    plug()  # solo generate calls no seam of this exercise
    eng = make_engine(model, 4, kv="paged", block_size=4, kv_blocks=15)
    with explained("the paged engine with your functions"):
        rids = [eng.add_request(r) for r in reqs]
        for _ in range(5000):
            if not eng.has_work():
                break
            eng.step()
    assert not eng.has_work(), (
        "the engine never finished: a request is never admitted, or never leaves"
    )
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, (
        "the prompts are chosen so that EOS fires"
    )
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, (
            f"request {i} ({texts[i]!r}) never finished: was it preempted and never re-queued?"
        )
        msg = divergence(f"request {i} ({texts[i]!r})", e, eng.results[rid].tokens)
        assert msg is None, msg
    assert eng.stats.preemptions > 0, (
        "a pool of 15 blocks is small enough that someone is preempted"
    )
    msg = leaks(eng)
    assert msg is None, msg
