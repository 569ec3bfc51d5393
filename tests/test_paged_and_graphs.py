"""Steps 05-06 - the paged cache (with preemption) and the graph decoder's eager bucketed step
give each request exactly its solo generate() tokens; the pool's books always balance."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_engine import TINY, V, assert_oracle, requests_st, solo
from tinyllm.core.config import EngineConfig
from tinyllm.core.cuda_graph import SlotGraphDecoder, WindowCache, choose_bucket, default_buckets
from tinyllm.core.kv_cache import KVCache
from tinyllm.core.paged_kv import BlockAllocator, PagedKVCache
from tinyllm.core.requests import Sequence
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.course.check import leaks
from tinyllm.engine import ContinuousEngine, Request, Sampling, make_engine, run_continuous


def need_blocks(req: Request, block_size: int) -> int:
    return math.ceil((len(req.prompt) + req.max_new_tokens) / block_size)


def check_pool(cache: PagedKVCache) -> None:
    """The books of the block pool, between steps: no block held twice, none lost, none held
    by a free slot, the allocator's flags and free list agree, every busy slot's table covers
    its tokens and never exceeds max_len, and no step is left half done; and the cache's own
    check_integrity finds them sound."""
    why = cache.check_integrity()
    assert why is None, why
    held = [b for table in cache.tables for b in table]
    assert len(held) == len(set(held)), "a block is held by two sequences"
    free = cache.allocator.free_list
    assert sorted(held + free) == list(range(cache.n_blocks)), (
        "every block is either held once or free once (the pool is never over-committed)"
    )
    assert [not a for a in cache.allocator.allocated] == [
        b in set(free) for b in range(cache.n_blocks)
    ], "a block is flagged allocated exactly when it is off the free list"
    assert cache.allocator.n_free() == len(free)
    assert cache.allocated_tokens() == len(held) * cache.block_size
    assert cache.used_tokens() == sum(cache.lens)
    assert cache._plan is None, "a step was planned and never run"
    for s in range(cache.n_slots):
        if cache.active[s]:
            assert len(cache.tables[s]) * cache.block_size >= cache.lens[s]
            assert len(cache.tables[s]) <= cache.blocks_for(cache.max_len)
        else:
            assert cache.tables[s] == [] and cache.lens[s] == 0


def drive(
    eng: ContinuousEngine, reqs: list[Request], data=None, abort_odds: int = 0, check=check_pool
):
    """Add requests between steps (all at once without data), abort some, check the pool after
    every step (check: the books of a paged cache). Returns {index: tokens} of the finished
    requests and the aborted indices."""
    pending, rid_of, aborted = list(enumerate(reqs)), {}, set()
    while pending or eng.has_work():
        n = data.draw(st.integers(0, 3)) if data is not None else len(pending)
        for _ in range(n):
            if pending:
                i, r = pending.pop(0)
                rid_of[eng.add_request(r)] = i
        if abort_odds and rid_of and data.draw(st.integers(0, abort_odds)) == 0:
            rid = data.draw(st.sampled_from(sorted(rid_of)))
            if eng.abort(rid):
                aborted.add(rid_of[rid])
        eng.step()
        if isinstance(eng.cache, PagedKVCache):
            check(eng.cache)
    assert not any(eng.cache.active) and eng.request_counts() == (0, 0)
    why = eng.cache.check_integrity(idle=True)
    assert why is None, why
    done = {i: eng.results.pop(rid).tokens for rid, i in rid_of.items() if i not in aborted}
    return done, aborted


# ---- 05: the paged cache -------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=requests_st,
    n_slots=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    slack=st.integers(0, 12),
)
def test_paged_engine_matches_solo_generate(requests, n_slots, block_size, slack):
    """Any block size, pools from 'the largest request only' up: solo tokens, books balanced,
    every block back in the pool at the end."""
    n_blocks = max(need_blocks(r, block_size) for r in requests) + slack
    eng = make_engine(TINY, n_slots, kv="paged", block_size=block_size, kv_blocks=n_blocks)
    done, _ = drive(eng, requests)
    for i, req in enumerate(requests):
        assert done[i] == solo(req), f"request {i}"
    assert eng.cache.allocated_tokens() == 0 and eng.cache.allocator.n_free() == n_blocks


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(
    requests=requests_st,
    n_slots=st.integers(1, 5),
    block_size=st.sampled_from([1, 3, 8]),
    decoder=st.sampled_from(["eager", "graphs"]),
    buckets=st.sampled_from([None, (8, 16, 32, 64), (1, 2, 3, 50)]),
    data=st.data(),
)
def test_paged_engine_online_with_preemption_aborts_and_sampling(
    requests, n_slots, block_size, decoder, buckets, data
):
    """Arrivals between steps, aborts (of running, queued and preempted requests), greedy and
    seeded sampled requests, a tight pool, the eager decode step or the graph decoder's (the
    block tables in a static buffer, every slot computed, 06): every finished request equals
    solo, the books balance after every step and every block is back at the end."""
    reqs = [
        Request(
            r.prompt,
            r.max_new_tokens,
            r.eos_id,
            data.draw(st.sampled_from([None, Sampling(0.9, 20, None, seed=i)])),
        )
        for i, r in enumerate(requests)
    ]
    n_blocks = max(need_blocks(r, block_size) for r in reqs) + data.draw(st.integers(0, 4))
    eng = make_engine(
        TINY,
        n_slots,
        kv="paged",
        block_size=block_size,
        kv_blocks=n_blocks,
        decoder=decoder,
        buckets=buckets if decoder == "graphs" else None,
    )
    done, aborted = drive(eng, reqs, data, abort_odds=8)
    assert set(done) | aborted == set(range(len(reqs))), "every request finished or was aborted"
    for i, tokens in done.items():
        assert tokens == solo(reqs[i]), f"request {i}"
    assert eng.cache.allocator.n_free() == n_blocks


def pressure_workload(n: int = 16) -> list[Request]:
    """Long answers, no EOS: they outgrow a small pool together."""
    return [
        Request([(7 * i + j) % V for j in range(3 + i % 5)], 20 + (5 * i) % 17) for i in range(n)
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_repeated_preemption_under_a_small_pool(block_size):
    reqs = pressure_workload()
    n_blocks = max(need_blocks(r, block_size) for r in reqs) + 1
    results, summary = run_continuous(
        TINY, reqs, 6, kv="paged", block_size=block_size, kv_blocks=n_blocks
    )
    assert summary["preemptions"] >= 5, f"only {summary['preemptions']} preemptions"
    assert summary["recomputed_tokens"] > 0
    assert summary["kv_allocated_at_end"] == 0
    assert_oracle(reqs, results)


def test_a_newcomer_enters_only_with_a_block_left_for_each_running_sequence():
    """can_admit's headroom: with 10 free blocks of 16, a 40-token context (3 blocks with its
    next token) enters beside 3 running sequences (3 + 3 <= 10), not beside 8 (3 + 8 > 10), and
    with nobody running whenever the pool holds it."""
    cfg = TINY.cfg

    def pool(n_blocks: int, running: int) -> PagedKVCache:
        cache = PagedKVCache(
            cfg.n_layers, 12, cfg.n_kv_heads, cfg.head_dim, n_blocks, 16, 64, torch.float64, "cpu"
        )
        for s in range(running):
            cache.admit(s, 1)  # a block each
        assert cache.n_free() == n_blocks - running
        return cache

    assert pool(13, 3).can_admit([40]), "3 blocks and 3 of headroom, 10 free"
    assert not pool(18, 8).can_admit([40]), "3 blocks and 8 of headroom, 10 free"
    assert pool(3, 0).can_admit([40]), "nobody running: the whole pool"
    assert not pool(3, 0).can_admit([48]), "4 blocks with its next token, 3 in the pool"


def test_abort_of_a_preempted_request_frees_nothing_twice():
    reqs = pressure_workload(8)
    eng = make_engine(
        TINY, 4, kv="paged", block_size=2, kv_blocks=max(need_blocks(r, 2) for r in reqs) + 1
    )
    rids = [eng.add_request(r) for r in reqs]
    while eng.stats.preemptions == 0:
        eng.step()
    waiting = [seq.rid for seq in eng.scheduler.waiting if seq.tokens]
    assert waiting, "a preempted request waits in the queue"
    assert all(seq.slot is None for seq in eng.scheduler.waiting)
    assert eng.abort(waiting[0]) is True
    assert waiting[0] not in [seq.rid for seq in eng.scheduler.waiting]
    check_pool(eng.cache)
    while eng.has_work():
        eng.step()
        check_pool(eng.cache)
    for i, rid in enumerate(rids):
        if rid != waiting[0]:
            assert eng.results[rid].tokens == solo(reqs[i])
    assert eng.cache.allocated_tokens() == 0


def test_a_request_larger_than_the_pool_is_refused_at_once():
    eng = make_engine(TINY, 2, kv="paged", block_size=4, kv_blocks=5)
    good = Request([1, 2, 3], 10)  # 13 positions: 4 blocks
    rid = eng.add_request(good)
    with pytest.raises(ValueError, match="needs 6 blocks of 4, but the whole KV pool has 5"):
        eng.add_request(Request([1] * 4, 20))  # 24 positions: 6 blocks
    assert eng.request_counts() == (1, 0), "the refused request left no trace"
    while eng.has_work():
        eng.step()
    assert eng.results[rid].tokens == solo(good)


def test_paged_settings_are_checked():
    for kw, words in [
        (dict(block_size=0), "block_size"),
        (dict(kv_blocks=-3), "kv_blocks"),
        (dict(block_size=2.5), "block_size"),
    ]:
        with pytest.raises(ValueError, match=words):
            make_engine(TINY, 2, kv="paged", **kw)


def test_paged_memory_is_allocated_as_sequences_grow():
    """Allocated tracks used within a block per sequence; slots reserve everything up front."""
    reqs = [Request([1, 2, 3], 30), Request([4, 5], 12), Request([6], 21)]
    _, paged = run_continuous(TINY, reqs, 3, kv="paged", block_size=4)
    _, slots = run_continuous(TINY, reqs, 3)
    assert paged["kv_alloc_used_mean"] > 0.75 > slots["kv_alloc_used_mean"]
    assert paged["kv_reserved_mib"] == pytest.approx(slots["kv_reserved_mib"], rel=0.05), (
        "by default the pool has the memory of the slot cache"
    )


def paged_cache(n_slots: int = 3, n_blocks: int = 6, block_size: int = 4, **kw) -> PagedKVCache:
    cfg = TINY.cfg
    return PagedKVCache(
        cfg.n_layers,
        n_slots,
        cfg.n_kv_heads,
        cfg.head_dim,
        n_blocks,
        block_size,
        32,
        torch.float64,
        **kw,
    )


def test_check_integrity_names_each_broken_book_of_the_pool():
    """check_integrity returns None for sound books, and one sentence for each kind of
    violation: a block in two places, a block lost, flags off the free list, a free slot
    that holds tokens or blocks, a slot past its room; idle, a busy slot."""

    def broken(how) -> str | None:
        cache = paged_cache()
        cache.admit(0, 5)  # 2 blocks for 5 tokens and the next
        cache.admit(1, 2)  # 1 block
        assert cache.check_integrity() is None
        how(cache)
        return cache.check_integrity()

    def both(c):  # held by slot 0 and free as well
        c.allocator.free_list.append(c.tables[0][0])
        c.allocator.allocated[c.tables[0][0]] = False

    assert "are free, yet a block table holds them" in broken(both)
    assert "in two block tables at once" in broken(lambda c: c.tables[1].append(c.tables[0][0]))
    assert "blocks leaked" in broken(lambda c: c.tables[0].pop())
    assert "on the free list twice" in broken(
        lambda c: c.allocator.free_list.append(c.allocator.free_list[0])
    )
    assert "flagged allocated" in broken(
        lambda c: c.allocator.allocated.__setitem__(c.allocator.free_list[0], True)
    )
    assert "slot 2 is free but holds 3 tokens" in broken(lambda c: c.lens.__setitem__(2, 3))
    assert "slot 0 holds 9 tokens, but it has room for 8" in broken(
        lambda c: c.lens.__setitem__(0, 9)
    )
    assert "slot 2 is free but its block table holds blocks [3]" in broken(
        lambda c: c.tables[2].append(c.allocator.allocate(1)[0])
    )
    assert "not blocks 0..5" in broken(lambda c: c.tables[1].append(9))
    cache = paged_cache()
    cache.admit(1, 3)
    why = cache.check_integrity(idle=True)
    assert why == "slots [1] are still busy after every request finished: nobody released them"
    cache.release(1)
    assert cache.check_integrity(idle=True) is None


def test_leaks_names_what_an_idle_engine_still_holds():
    """check.leaks asks the scheduler and the cache's check_integrity(idle=True): None once
    every request gave everything back, else a sentence naming what is held."""
    eng = make_engine(TINY, 2, kv="paged", block_size=4, kv_blocks=8)
    eng.add_request(Request([1, 2, 3], 4))
    while eng.has_work():
        eng.step()
    assert leaks(eng) is None
    lost = eng.cache.allocator.allocate(1)  # a block nobody will give back
    assert leaks(eng) == (
        f"blocks {lost} are allocated, yet no block table holds them: blocks leaked"
    )
    eng.cache.allocator.free(lost)
    eng.cache.admit(1, 3)  # a slot nobody releases
    assert leaks(eng) == (
        "slots [1] are still busy after every request finished: nobody released them"
    )
    eng.cache.release(1)
    eng.scheduler.add(Sequence(9, Request([1], 2), 0.0, Sampling(), None))
    assert leaks(eng) == (
        "the scheduler still holds 0 running and 1 waiting requests after every request finished"
    )


def test_allocator_refuses_what_it_cannot_give():
    alloc = BlockAllocator(3)
    assert alloc.allocate(4) is None and alloc.n_free() == 3
    blocks = alloc.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and alloc.n_free() == 0
    with pytest.raises(ValueError, match="block 7"):
        alloc.free([7])
    alloc.free(blocks)
    with pytest.raises(ValueError, match="is not allocated"):
        alloc.free([blocks[0]])


# ---- 06: the graph decoder, eager ----------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=requests_st,
    n_slots=st.integers(1, 6),
    buckets=st.sampled_from([None, (8, 16, 32, 64), (1, 2, 3, 50), (96,)]),
)
def test_eager_bucketed_decoder_matches_the_plain_decoder(requests, n_slots, buckets):
    """Every slot decoded at a bucketed window from static buffers: the same tokens as the
    plain decode step, and so as solo generate()."""
    plain, _ = run_continuous(TINY, requests, n_slots)
    graphed, summary = run_continuous(TINY, requests, n_slots, decoder="graphs", buckets=buckets)
    assert [r.tokens for r in graphed] == [r.tokens for r in plain]
    assert_oracle(requests, graphed)
    assert summary["occupancy"] == summary["row_util"], "the graph computes every slot"


def test_rows_that_decode_nothing_write_only_the_pad_block():
    """A paged graph step of 4 slots, two of them decoding, one free and one admitted but not
    yet prefilled: the pool changes only at the two decoding rows' new positions and in the pad
    block, and the static tables hold the decoding rows' tables, the pad elsewhere."""
    cfg = TINY.cfg
    pool = PagedKVCache(cfg.n_layers, 4, cfg.n_kv_heads, cfg.head_dim, 12, 4, 32, torch.float64)
    dec = SlotGraphDecoder(TINY, pool, buckets=(8, 16))
    for s, prompt in ((0, [5, 6, 7, 8, 9]), (2, [1, 2])):
        pool.admit(s, len(prompt))
        pool.plan_step([s], [len(prompt)])
        TINY(torch.tensor([prompt]), cache=pool)
    pool.admit(3, 6)  # admitted, not prefilled: no token yet
    assert pool.reserve(0) and pool.reserve(2)
    before = [k.clone() for k in pool.k]
    pool.plan_step([0, 2], [1, 1])
    dec.step(torch.tensor([[3], [0], [4], [0]]))
    assert pool.lens == [6, 0, 3, 0]
    pad, n = pool.pad, dec.tables.size(1)
    assert dec.tables.tolist() == [
        pool.tables[0] + [pad] * (n - len(pool.tables[0])),
        [pad] * n,
        pool.tables[2] + [pad] * (n - len(pool.tables[2])),
        [pad] * n,
    ]
    written = {pool.tables[0][5 // 4] * 4 + 5 % 4, pool.tables[2][0] * 4 + 2}
    for layer, (old, new) in enumerate(zip(before, pool.k)):
        changed = {r for r in range(pad * 4) if not torch.equal(old[r], new[r])}
        assert changed == written, f"layer {layer}: rows {sorted(changed)} changed"
    check_pool(pool)


def test_a_paged_graph_decoder_is_reused_only_by_a_pool_like_its_own():
    eng = make_engine(TINY, 3, kv="paged", block_size=4, kv_blocks=20, decoder="graphs")
    reqs = [Request([1, 2, 3], 9), Request([4], 14)]
    first, _ = run_continuous(TINY, reqs, 3, decoder=eng.decoder)
    assert [r.tokens for r in first] == [solo(r) for r in reqs]
    again = make_engine(TINY, 3, decoder=eng.decoder)
    assert again.cache is eng.cache and again.config.kv == "paged"
    for kw in (dict(kv_blocks=21), dict(block_size=2), dict(prefix_cache=True), dict(kv="slots")):
        with pytest.raises(ValueError, match="the decoder serves another model"):
            make_engine(TINY, 3, decoder=eng.decoder, **kw)


def test_graph_decoder_settings_are_checked():
    slots = SlotKVCache(2, 2, 2, 16, 32, torch.float64)
    with pytest.raises(ValueError, match="CUDA device"):
        SlotGraphDecoder(TINY, slots, capture=True)
    with pytest.raises(ValueError, match="buckets must lie in 1..32"):
        SlotGraphDecoder(TINY, slots, buckets=(16, 64))
    with pytest.raises(ValueError, match="a SlotKVCache or a PagedKVCache, got KVCache"):
        SlotGraphDecoder(TINY, KVCache(2, 32))
    for bad in [(8.5,), (0, 16), ()]:  # named when made, not at the first step
        with pytest.raises(ValueError, match="bucket"):
            make_engine(TINY, 2, decoder="graphs", buckets=bad)
        with pytest.raises(ValueError, match="buckets must"):
            SlotGraphDecoder(TINY, slots, buckets=bad)
    assert default_buckets(512) == [32, 64, 128, 256, 512] and default_buckets(96) == [32, 64, 96]
    assert choose_bucket([4, 8], 9) is None, "above the largest bucket: the eager fallback"


def test_a_decoder_is_reused_by_a_second_engine():
    eng = make_engine(TINY, 3, decoder="graphs")
    reqs = [Request([1, 2, 3], 9), Request([4], 14)]
    first, _ = run_continuous(TINY, reqs, 3, decoder=eng.decoder)
    second, _ = run_continuous(TINY, reqs, 3, decoder=eng.decoder)
    assert [r.tokens for r in first] == [r.tokens for r in second] == [solo(r) for r in reqs]
    busy = make_engine(TINY, 3, decoder=eng.decoder)
    busy.add_request(Request([1], 5))
    busy.step()
    with pytest.raises(ValueError, match="idle slots"):
        make_engine(TINY, 3, decoder=eng.decoder)
    with pytest.raises(ValueError, match="idle slots"):
        make_engine(
            TINY, 4, decoder=SlotGraphDecoder(TINY, SlotKVCache(2, 2, 2, 16, 96, torch.float64))
        )


@pytest.mark.parametrize("kind", ["slots", "paged", "graph"])
def test_bf16_caches_under_autocast(kind):
    """What CUDA runs: a bf16 cache, the model under bf16 autocast (here on the CPU), float32
    weights. A ragged prefill and the decode step (plain, or the graph decoder's eager one)
    write and read the cache without a dtype clash."""
    model = TINY.float()
    cfg = model.cfg
    if kind == "paged":
        cache = PagedKVCache(
            cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim, 8, 4, 32, torch.bfloat16
        )
    else:
        cache = SlotKVCache(cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim, 32, torch.bfloat16)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    tokens = torch.tensor([[1], [2]])
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for s, p in enumerate(prompts):
                cache.admit(s, len(p))
            cache.plan_step([0, 1], [3, 5])
            model(torch.tensor([p + [0] * (5 - len(p)) for p in prompts]), cache=cache)
            assert cache.lens == [3, 5]
            assert cache.reserve(0, 1) and cache.reserve(1, 1)
            cache.plan_step([0, 1], [1, 1])
            if kind == "graph":  # the graph decoder's cache view, then its end of the step
                logits, _ = model(tokens, cache=WindowCache(cache, torch.tensor([3, 5]), 8))
                cache.end_step()
            else:
                logits, _ = model(tokens, cache=cache)
    finally:
        model.double()
    assert logits.shape == (2, 1, V) and torch.isfinite(logits).all()
    assert cache.lens == [4, 6] and cache._plan is None
    if kind == "paged":
        check_pool(cache)


def test_the_headroom_is_a_paged_pools_setting_and_a_run_without_it_preempts_more():
    """kv_headroom=False admits newcomers while their blocks are free (the pool fills, and
    the requests that grow first push the youngest out); the default keeps a block per running
    request. Both give every request its solo tokens; a slot cache has no such setting."""
    with pytest.raises(ValueError, match="kv_headroom is the paged pool's admission"):
        EngineConfig(2, kv_headroom=False)
    with pytest.raises(ValueError, match="kv_headroom must be True or False, got 'no'"):
        EngineConfig(2, kv="paged", kv_headroom="no")
    reqs = pressure_workload()
    n_blocks = max(need_blocks(r, 4) for r in reqs) + 6
    counts = {}
    for headroom in (True, False):
        results, summary = run_continuous(
            TINY, reqs, 6, kv="paged", block_size=4, kv_blocks=n_blocks, kv_headroom=headroom
        )
        assert_oracle(reqs, results)
        counts[headroom] = summary["preemptions"]
    assert counts[False] > counts[True], counts
