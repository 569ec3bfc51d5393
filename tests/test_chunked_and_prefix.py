"""Steps 07-08 - chunked prefill (a token budget per step) and prefix caching (shared blocks)
give each request exactly its solo generate() tokens, keep to the budget, and leave no block
referenced; the prefix cache's books always balance."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_engine import TINY, V, assert_oracle, requests_st, solo
from tests.test_paged_and_graphs import drive, need_blocks
from tinyllm.core import prefix_cache
from tinyllm.core.chunked_prefill import next_chunk, plan_step
from tinyllm.core.paged_kv import BlockAllocator, PagedKVCache
from tinyllm.core.prefix_cache import PrefixCache, block_hashes, match_prefix
from tinyllm.core.requests import Sequence
from tinyllm.core.scheduler import WholeContexts
from tinyllm.engine import (
    EngineConfig,
    Request,
    Sampling,
    Trace,
    make_engine,
    run_continuous,
)


def check_prefix_pool(cache: PagedKVCache) -> None:
    """The books of a pool with a prefix cache, between steps: each block's count is the number
    of tables holding it; every block is held, free, or cached and held by nobody (exactly one
    of these); the hash map and its reverse agree; only full blocks are named; and the cache's
    own check_integrity finds them sound."""
    why = cache.check_integrity()
    assert why is None, why
    pc = cache.prefix
    held = [b for table in cache.tables for b in table]
    for b in range(cache.n_blocks):
        assert pc.refs[b] == held.count(b), (
            f"block {b}: count {pc.refs[b]}, held {held.count(b)} times"
        )
    free, evictable = set(cache.allocator.free_list), set(pc.evictable)
    assert len(free) == len(cache.allocator.free_list), "a block is on the free list twice"
    assert free.isdisjoint(evictable) and free.isdisjoint(held) and evictable.isdisjoint(held)
    assert free | evictable | set(held) == set(range(cache.n_blocks)), "a block was lost"
    assert all(b in pc.hash_of for b in evictable), "an unnamed block waits among the cached"
    assert all(b not in pc.hash_of for b in free), "a free block still has a name"
    assert {b: h for h, b in pc.cached.items()} == pc.hash_of
    for s in range(cache.n_slots):
        assert len(cache.hashes[s]) * cache.block_size <= cache.lens[s], "a partial block was named"
        assert len(cache.hashes[s]) <= len(cache.tables[s])
    assert cache._plan is None


def budget_kept(trace: Trace, budget: int) -> None:
    for i, computed in enumerate(trace.computed):
        assert sum(computed) <= budget, f"step {i} computed {computed}: more than {budget} tokens"


# ---- 07: chunked prefill -----------------------------------------------------------------------


def seq_left(rid: int, left: int, slot: int) -> Sequence:
    """A Sequence in `slot` with `left` tokens of its context still to compute."""
    seq = Sequence(rid, Request(list(range(1, left + 1)), 4), 0.0, Sampling(), None)
    seq.slot = slot
    return seq


def test_plan_step_decodes_first_then_chunks_first_come_first_served():
    a, b, c, d = seq_left(0, 1, 0), seq_left(2, 10, 1), seq_left(1, 1, 2), seq_left(3, 4, 3)
    calls = []

    def admit():
        calls.append(1)
        return [d]

    assert plan_step([a, b, c], 8, admit) == ([a, c], [(b, 6)]) and not calls
    assert plan_step([a, b, c], 16, admit) == ([a, c], [(b, 10), (d, 4)]) and len(calls) == 1
    assert plan_step([a, b, c], None, admit) == ([a, c], [(b, 10), (d, 4)]) and len(calls) == 2
    assert plan_step([a, c], 2, admit) == ([a, c], []) and len(calls) == 2


def test_next_chunk_samples_only_at_the_end_of_the_context():
    seq = Sequence(0, Request([10, 11, 12, 13, 14], 4), 0.0, Sampling(), None)
    assert next_chunk(seq, 2) == ([10, 11], False)
    seq.num_computed_tokens = 2
    assert next_chunk(seq, 3) == ([12, 13, 14], True)
    seq.tokens, seq.num_computed_tokens = [20], 5  # decoding: the token it last sampled
    assert next_chunk(seq, 1) == ([20], True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=requests_st,
    n_slots=st.integers(1, 5),
    extra=st.integers(0, 12),
    kv=st.sampled_from(["slots", "paged"]),
)
def test_chunked_engine_matches_solo_generate_within_the_budget(requests, n_slots, extra, kv):
    """Any budget from n_slots up (1 token of prefill a step at the least), slots or blocks:
    solo tokens, and no step computes more than the budget."""
    budget = n_slots + extra
    trace = Trace()
    results, summary = run_continuous(
        TINY, requests, n_slots, kv=kv, block_size=4, max_step_tokens=budget, trace=trace
    )
    assert_oracle(requests, results)
    budget_kept(trace, budget)
    assert (
        summary["prefill_tokens"]
        == summary["prompt_tokens"]
        == sum(len(r.prompt) for r in requests)
    )


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(
    requests=requests_st,
    n_slots=st.integers(1, 4),
    block_size=st.sampled_from([1, 3, 8]),
    data=st.data(),
)
def test_chunked_engine_online_with_preemption_aborts_and_sampling(
    requests, n_slots, block_size, data
):
    """Arrivals between steps, aborts, seeded sampling and a tight pool, so that preempted
    requests are recomputed in chunks too: every finished request equals solo."""
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
    budget = n_slots + data.draw(st.integers(0, 6))
    trace = Trace()
    eng = make_engine(
        TINY,
        n_slots,
        kv="paged",
        block_size=block_size,
        kv_blocks=n_blocks,
        max_step_tokens=budget,
        trace=trace,
    )
    done, aborted = drive(eng, reqs, data, abort_odds=8)
    assert set(done) | aborted == set(range(len(reqs)))
    for i, tokens in done.items():
        assert tokens == solo(reqs[i]), f"request {i}"
    budget_kept(trace, budget)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=requests_st,
    n_slots=st.integers(1, 4),
    extra=st.integers(0, 6),
    kv=st.sampled_from(["slots", "paged"]),
)
def test_chunked_engine_with_the_graph_decoder(requests, n_slots, extra, kv):
    """The graph decoder's step (eager bucketed on a CPU) computes every slot, a slot halfway
    through its prefill too: in a slot cache that slot's next chunk overwrites the stray key,
    in a paged pool its row writes to the pad block. Solo tokens."""
    results, _ = run_continuous(
        TINY, requests, n_slots, kv=kv, decoder="graphs", max_step_tokens=n_slots + extra
    )
    assert_oracle(requests, results)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    """The picture of 07 in numbers: three short requests decode every step while a long
    prompt takes the rest of the budget, a chunk a step."""
    reqs = [Request([1 + i, 2, 3], 12) for i in range(3)] + [Request(list(range(1, 61)), 4)]
    trace = Trace()
    eng = make_engine(TINY, 4, max_step_tokens=16, trace=trace)
    for r in reqs[:3]:
        eng.add_request(r)
    eng.step()  # the short prompts' prefill
    eng.add_request(reqs[3])
    while eng.has_work():
        eng.step()
    chunks = [c[3] for c in trace.computed[1:] if c[3] > 1]
    assert chunks == [13, 13, 13, 13, 8], chunks  # 16 - 3 decodes, until 60 are done
    assert all(c[:3] == [1, 1, 1] for c in trace.computed[1:6]), "the short ones kept decoding"
    assert_oracle(reqs, [eng.results[i] for i in range(4)])


def test_budget_below_the_slots_is_refused():
    with pytest.raises(ValueError, match="max_step_tokens 3 is less than n_slots 4"):
        EngineConfig(4, max_step_tokens=3)
    with pytest.raises(ValueError, match="max_step_tokens must be an int >= 1"):
        EngineConfig(4, max_step_tokens=0)


# ---- 08: prefix caching ------------------------------------------------------------------------


def test_block_hashes_name_prefixes_not_blocks():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3, "three full blocks, the partial fourth unnamed"
    b = block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert a[0] != b[0] and a[1] != b[1], "the same block after another prefix is another prefix"
    assert block_hashes([1, 2, 3, 4, 8], 2) == a[:2]
    assert block_hashes([5, 6], 2, parent=a[1]) == [a[2]], "a chain continues from its parent"


def test_match_prefix_stops_at_the_first_miss_and_leaves_a_token():
    ctx = list(range(1, 13))  # 12 tokens, blocks of 4
    h = block_hashes(ctx, 4)
    cached = {h[0]: 7, h[1]: 3, h[2]: 5}
    assert match_prefix(ctx, 4, cached) == [7, 3], "the third block holds the last token"
    assert match_prefix(ctx + [13], 4, cached) == [7, 3, 5]
    assert match_prefix(ctx, 4, {h[1]: 3}) == [], "a block is only reused after its parents"


def test_evictable_blocks_go_least_recently_used_first():
    pc = PrefixCache(BlockAllocator(4), block_size=2)
    a, b = pc.allocate(2), pc.allocate(2)
    for blk, name in zip(a + b, [b"a0", b"a1", b"b0", b"b1"]):
        pc.register(blk, name)
    pc.free(b)
    pc.free(a)  # b's blocks were let go first,
    assert pc.n_free() == 4 and pc.allocator.n_free() == 0
    assert list(pc.evictable) == [b[1], b[0], a[1], a[0]], "each table's from its end"
    got = pc.allocate(2)
    assert got == [b[1], b[0]] and b"b0" not in pc.cached and b"a0" in pc.cached
    with pytest.raises(ValueError, match="not held by any table"):
        pc.free([a[0]])


prefixes_st = st.lists(st.integers(1, V - 1), min_size=0, max_size=40)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)
@given(
    systems=st.lists(prefixes_st, min_size=1, max_size=3),
    block_size=st.sampled_from([1, 2, 4, 8]),
    n_slots=st.integers(1, 5),
    data=st.data(),
)
def test_prefix_cache_matches_solo_generate(systems, block_size, n_slots, data):
    """Prompts that share system prompts (a few, some empty), arriving between steps, greedy and
    seeded, some aborted, pools from tight to ample, with and without a budget, the decode step
    eager or the graph decoder's (its tables in a static buffer, 06): solo tokens,
    the books balanced after every step, nothing referenced at the end."""
    reqs = []
    for i in range(data.draw(st.integers(1, 10))):
        system = data.draw(st.sampled_from(systems))
        question = data.draw(
            st.lists(st.integers(1, V - 1), min_size=1 if not system else 0, max_size=8)
        )
        reqs.append(
            Request(
                system + question,
                data.draw(st.integers(1, 12)),
                data.draw(st.sampled_from([None, 3])),
                data.draw(st.sampled_from([None, Sampling(0.9, 20, None, seed=i)])),
            )
        )
    n_blocks = max(need_blocks(r, block_size) for r in reqs) + data.draw(st.integers(0, 24))
    budget = data.draw(st.sampled_from([None, n_slots + 3]))
    eng = make_engine(
        TINY,
        n_slots,
        kv="paged",
        block_size=block_size,
        kv_blocks=n_blocks,
        prefix_cache=True,
        max_step_tokens=budget,
        decoder=data.draw(st.sampled_from(["eager", "graphs"])),
    )
    done, aborted = drive(eng, reqs, data, abort_odds=10, check=check_prefix_pool)
    assert set(done) | aborted == set(range(len(reqs)))
    for i, tokens in done.items():
        assert tokens == solo(reqs[i]), f"request {i}"
    assert sum(eng.cache.prefix.refs) == 0, "a block is still referenced after every request ended"
    assert eng.cache.allocated_tokens() == 0


def test_later_requests_reuse_the_system_prompt_and_a_whole_conversation():
    """The second request of a conversation (its first prompt, the answer, a new question)
    finds every full block of the first turn, its answer's too."""
    system = [(5 * j) % (V - 1) + 1 for j in range(32)]
    first = Request(system + [7, 8, 9], 10)
    eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    rid = eng.add_request(first)
    while eng.has_work():
        eng.step()
    answer = eng.results.pop(rid).tokens
    assert answer == solo(first)
    second = Request(first.prompt + answer + [11, 12], 6)
    rid = eng.add_request(second)
    while eng.has_work():
        eng.step()
    assert eng.results.pop(rid).tokens == solo(second)
    summary = eng.stats.summary([])
    ctx = len(first.prompt) + len(answer)  # in the cache after turn 1 (the last
    reusable = (ctx - 1) // 4 * 4  # answer token was never computed)
    assert summary["cached_prompt_tokens"] == reusable
    assert summary["prefill_tokens"] == len(first.prompt) + len(second.prompt) - reusable
    assert sum(eng.cache.prefix.refs) == 0


SYSTEM = [(3 * j) % (V - 1) + 1 for j in range(12)]  # a system prompt of 3 blocks of 4


def test_newcomers_of_one_step_share_a_prefix_without_a_budget():
    """Without a budget each newcomer's context is computed whole in its admission step, so
    its blocks are named as it is admitted and the next newcomer of the step shares them: two
    requests with a 3-block system prompt, added together, both done after ONE step, the
    second served 12 prompt tokens from the cache; and both get their solo tokens."""
    reqs = [Request(SYSTEM + [20 + i, 30 + i], 1) for i in range(2)]
    eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    rids = [eng.add_request(r) for r in reqs]
    eng.step()
    assert not eng.has_work(), "both prefilled and sampled in one step"
    summary = eng.stats.summary([])
    assert summary["cached_prompt_tokens"] == 12, summary["cached_prompt_tokens"]
    assert summary["prefill_tokens"] == 2 * 14 - 12
    assert eng.cache.check_integrity(idle=True) is None
    assert_oracle(reqs, [eng.results[r] for r in rids])
    reqs = [Request(SYSTEM + [20 + i] * (i + 1), 9) for i in range(3)]  # longer answers
    trace = Trace()
    results, summary = run_continuous(
        TINY, reqs, 3, kv="paged", block_size=4, prefix_cache=True, trace=trace
    )
    assert_oracle(reqs, results)
    assert trace.computed[0] == [13, 2, 3], "all three admitted in the first step"
    assert summary["cached_prompt_tokens"] == 2 * 12


def test_under_a_budget_newcomers_of_one_step_compute_their_prefix_each():
    """Under a token budget a block is named only after the step that writes it (a later chunk
    could be read before it is computed): two newcomers admitted in one step both compute the
    shared prefix, and one admitted a step later shares it; solo tokens throughout."""
    reqs = [Request(SYSTEM + [20 + i], 3) for i in range(3)]
    trace = Trace()
    eng = make_engine(
        TINY, 3, kv="paged", block_size=4, prefix_cache=True, max_step_tokens=40, trace=trace
    )
    rids = [eng.add_request(r) for r in reqs[:2]]
    eng.step()
    assert trace.computed[0] == [13, 13, 0], "both admitted in the first step, and computed whole"
    rids.append(eng.add_request(reqs[2]))
    while eng.has_work():
        eng.step()
        check_prefix_pool(eng.cache)
    summary = eng.stats.summary([])
    assert summary["cached_prompt_tokens"] == 12, "only the third, a step later, shares"
    assert_oracle(reqs, [eng.results[r] for r in rids])
    chunked, _ = run_continuous(
        TINY, reqs, 3, kv="paged", block_size=4, prefix_cache=True, max_step_tokens=5
    )
    assert_oracle(reqs, chunked)


def test_with_no_budget_a_plan_computes_every_context_whole(monkeypatch):
    """With no budget a newcomer's blocks are named as it is admitted, for the step's forward
    pass to write: a plan that leaves part of a context, or a whole newcomer, for later is
    refused by name."""

    plan = WholeContexts.plan

    def planned(change):
        monkeypatch.setattr(
            WholeContexts, "plan", lambda self, running, admit: change(*plan(self, running, admit))
        )
        eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
        for i in range(2):
            eng.add_request(Request(SYSTEM + [20 + i], 3))
        eng.step()

    with pytest.raises(ValueError, match="a chunk of 6 tokens with no budget; it has 13 left"):
        planned(lambda decodes, chunks: (decodes, [(s, n // 2) for s, n in chunks]))
    with pytest.raises(ValueError, match=r"plan_step left requests \[1\] out with no budget"):
        planned(lambda decodes, chunks: (decodes, chunks[:1]))


# ---- 08: admission looks the prefix up first ---------------------------------------------------


def prefix_pool(n_blocks: int, n_slots: int = 2, **kw) -> PagedKVCache:
    cfg = TINY.cfg
    return PagedKVCache(
        cfg.n_layers,
        n_slots,
        cfg.n_kv_heads,
        cfg.head_dim,
        n_blocks,
        4,
        32,
        torch.float64,
        prefix_cache=PrefixCache,
        **kw,
    )


def prefill(cache: PagedKVCache, slot: int, context: list[int]) -> None:
    """Compute the rest of a slot's context into it (one ragged step), then name its blocks."""
    cache.plan_step([slot], [len(context) - cache.lens[slot]])
    with torch.no_grad():
        TINY(torch.tensor([context[cache.lens[slot] :]]), cache=cache)
    cache.cache_blocks(slot, lambda: context)


def books(cache: PagedKVCache) -> tuple:
    pc = cache.prefix
    return (
        [list(t) for t in cache.tables],
        list(cache.lens),
        list(cache.active),
        list(pc.refs),
        list(pc.evictable),
        list(pc.allocator.free_list),
        dict(pc.cached),
    )


def test_admission_takes_fresh_blocks_only_for_what_the_cache_lacks():
    """A newcomer given its context starts with the cached blocks of its prefix that a
    running request holds: can_admit counts only its fresh blocks (and a block of headroom for
    the running one), and afterwards its slot holds the cached tokens (lens)."""
    cache = prefix_pool(5)
    a, b = SYSTEM[:8] + [50], SYSTEM[:8] + [60]  # 2 shared blocks, 3 blocks each
    assert cache.can_admit([9], [a])
    cache.admit(0, 9, a)
    assert cache.lens[0] == 0 and len(cache.tables[0]) == 3, "nothing cached yet"
    prefill(cache, 0, a)
    assert not cache.can_admit([9]), "without its context: 3 blocks and 1 of headroom, 2 free"
    assert cache.can_admit([9], [b]), "with it: 2 blocks shared, 1 fresh"
    cache.admit(1, 9, b)
    assert cache.lens[1] == 8 and cache.tables[1][:2] == cache.tables[0][:2]
    assert cache.prefix.refs[cache.tables[0][0]] == 2 and cache.n_free() == 1
    check_prefix_pool(cache)
    prefill(cache, 1, b)
    check_prefix_pool(cache)


def test_a_matched_block_nobody_holds_counts_as_free_until_shared():
    """Cached blocks that nobody holds count as free; sharing them takes them out of the free
    count, so a newcomer needs its fresh blocks plus those. Refused, nothing changes."""
    cache = prefix_pool(4)
    a, b = SYSTEM[:8] + [50], SYSTEM[:8] + [60]
    cache.admit(0, 9, a)
    prefill(cache, 0, a)
    cache.release(0)  # its 2 named blocks wait, evictable
    cache.admit(1, 5, [90, 91, 92, 93, 94])  # 2 fresh blocks: the free ones
    assert cache.n_free() == 2 and len(cache.prefix.evictable) == 2
    assert not cache.can_admit([9], [b]), "sharing the 2 evictable blocks leaves none for the 3rd"
    before = books(cache)
    with pytest.raises(ValueError, match="a context of 9 tokens needs 3 blocks, 2 are free"):
        cache.admit(0, 9, b)
    assert books(cache) == before, "a refused admission changes nothing, the eviction order too"
    cache.release(1)
    assert cache.can_admit([9], [b])
    cache.admit(0, 9, b)
    assert cache.lens[0] == 8 and cache.n_free() == 1 and not cache.prefix.evictable
    check_prefix_pool(cache)


def test_a_bad_match_is_named_at_admission(monkeypatch):
    """A match_prefix that covers the context's last token, or gives blocks that hold no cached
    prefix, is refused by name when the newcomer is admitted (and by can_admit)."""
    cache = prefix_pool(6)
    a = SYSTEM[:8] + [50]
    cache.admit(0, 9, a)
    prefill(cache, 0, a)
    named, unnamed = cache.tables[0][:2], cache.tables[0][2]
    monkeypatch.setattr(prefix_cache, "match_prefix", lambda context, bs, cached: named)
    for ask in (lambda: cache.can_admit([8], [SYSTEM[:8]]), lambda: cache.admit(1, 8, SYSTEM[:8])):
        with pytest.raises(
            ValueError, match="for a context of 8 tokens: the last token must be left to compute"
        ):
            ask()
    monkeypatch.setattr(prefix_cache, "match_prefix", lambda context, bs, cached: [unnamed])
    with pytest.raises(
        ValueError,
        match=rf"match_prefix gave blocks \[{unnamed}\], which hold no "
        r"cached prefix",
    ):
        cache.admit(1, 9, SYSTEM[:8] + [60])
    assert not cache.active[1] and cache.check_integrity() is None


def test_named_at_admission_a_newcomer_of_the_same_step_reads_them_written():
    """name_at_admission: a newcomer's full blocks are named as it is admitted, and the next
    newcomer shares them at once; in their one forward pass every layer writes both rows' keys
    before it reads, so the sharer's logits are its own, whatever the rows' order."""
    cache = prefix_pool(8, name_at_admission=True)
    a, b = SYSTEM + [50], SYSTEM + [60, 61]
    cache.admit(0, 13, a)
    assert len(cache.hashes[0]) == 3 and len(cache.prefix.cached) == 3, "named at admission"
    cache.admit(1, 14, b)
    assert cache.lens == [0, 12] and cache.tables[1][:3] == cache.tables[0][:3]
    cache.plan_step([1, 0], [2, 13])  # the sharer's row first
    with torch.no_grad():
        logits, _ = TINY(torch.tensor([[60, 61] + [0] * 11, a]), cache=cache)
        for row, (ctx, last) in enumerate([(b, 1), (a, 12)]):
            torch.testing.assert_close(
                logits[row, last], TINY(torch.tensor([ctx]))[0][0, -1], rtol=0, atol=1e-10
            )
    check_prefix_pool(cache)


def test_check_integrity_names_each_broken_book_of_the_prefix_cache():
    """The books of shared blocks, broken one way at a time: a block in two places (free or
    evictable, and held), a reference count off, a named block on the free list, an evictable
    block with no name, the two maps apart, a table's name that is not its block's, a named
    block not yet written, and a block lost. Each is one sentence; sound books give None."""

    def broken(how) -> str | None:
        cache = prefix_pool(6, n_slots=3)
        a, b = SYSTEM[:8] + [50], SYSTEM[:8] + [60]
        cache.admit(0, 9, a)
        prefill(cache, 0, a)  # blocks 0, 1 named, 2 not
        cache.admit(1, 9, b)  # shares 0 and 1, takes 3
        cache.admit(2, 2, [7, 8])  # takes 4; block 5 is free
        cache.release(2)  # 4 goes back, unnamed
        assert cache.check_integrity() is None
        how(cache, cache.prefix)
        return cache.check_integrity()

    def free_and_held(c, pc):
        pc.allocator.free_list.append(2)
        pc.allocator.allocated[2] = False

    assert "blocks [2] are free, yet a block table holds them" in broken(free_and_held)
    assert "are evictable, yet block tables hold them" in broken(
        lambda c, pc: pc.evictable.__setitem__(0, None)
    )
    assert "block 0 has refs 3, but 2 block tables hold it" in broken(
        lambda c, pc: pc.refs.__setitem__(0, 3)
    )
    assert "block 1 has refs 1, but 2 block tables hold it" in broken(
        lambda c, pc: pc.refs.__setitem__(1, 1)
    )
    assert "blocks [5] are free but still named" in broken(lambda c, pc: pc.register(5, b"x" * 32))

    def unnamed_evictable(c, pc):
        c.tables[1].remove(3)
        pc.refs[3] = 0
        pc.evictable[3] = None

    assert "blocks [3] are evictable but hold no named prefix" in broken(unnamed_evictable)
    assert "cached (name -> block) and hash_of (block -> name) disagree" in broken(
        lambda c, pc: pc.cached.__setitem__(b"y" * 32, 2)
    )
    assert "is cached under another name than the table gives it" in broken(
        lambda c, pc: c.hashes[1].__setitem__(1, b"z" * 32)
    )
    assert "slot 1 names 3 blocks, but it holds 8 tokens" in broken(
        lambda c, pc: c.hashes[1].append(b"w" * 32)
    )

    def lost(c, pc):
        c.tables[1].remove(3)
        pc.refs[3] = 0

    assert (
        "blocks [3] are allocated, yet no block table holds them and none waits cached: "
        "blocks leaked" in broken(lost)
    )


def test_prefix_cache_needs_a_paged_cache():
    with pytest.raises(ValueError, match="prefix_cache shares blocks of a paged cache"):
        EngineConfig(2, prefix_cache=True)
