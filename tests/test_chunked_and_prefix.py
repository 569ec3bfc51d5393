"""Steps 07-08 - chunked prefill (a token budget per step) and prefix caching (shared blocks)
give each request exactly its solo generate() tokens, keep to the budget, and leave no block
referenced; the prefix cache's books always balance."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyllm.chunked_prefill import next_chunk, plan_step
from tinyllm.engine import ContinuousEngine, EngineConfig, Request, Sampling, Trace, run_continuous
from tinyllm.paged_kv import BlockAllocator, PagedKVCache
from tinyllm.prefix_cache import PrefixCache, block_hashes, match_prefix
from tinyllm.requests import Sequence
from tests.test_engine import TINY, V, assert_oracle, requests_st, solo
from tests.test_paged_and_graphs import drive, need_blocks


def check_prefix_pool(cache: PagedKVCache) -> None:
    """The books of a pool with a prefix cache, between steps: each block's count is the number
    of tables holding it; every block is held, free, or cached and held by nobody (exactly one
    of these); the hash map and its reverse agree; only full blocks are named."""
    pc = cache.prefix
    held = [b for table in cache.tables for b in table]
    for b in range(cache.n_blocks):
        assert pc.refs[b] == held.count(b), f"block {b}: count {pc.refs[b]}, held {held.count(b)} times"
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


# ---- 07: chunked prefill ---------------------------------------------------------------------------

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
    seq.tokens, seq.num_computed_tokens = [20], 5                  # decoding: the token it last sampled
    assert next_chunk(seq, 1) == ([20], True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_st, n_slots=st.integers(1, 5), extra=st.integers(0, 12),
       kv=st.sampled_from(["slots", "paged"]))
def test_chunked_engine_matches_solo_generate_within_the_budget(requests, n_slots, extra, kv):
    """Any budget from n_slots up (1 token of prefill a step at the least), slots or blocks:
    solo tokens, and no step computes more than the budget."""
    budget = n_slots + extra
    trace = Trace()
    results, summary = run_continuous(TINY, requests, n_slots, kv=kv, block_size=4,
                                      max_step_tokens=budget, trace=trace)
    assert_oracle(requests, results)
    budget_kept(trace, budget)
    assert summary["prefill_tokens"] == summary["prompt_tokens"] == sum(len(r.prompt) for r in requests)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(requests=requests_st, n_slots=st.integers(1, 4), block_size=st.sampled_from([1, 3, 8]),
       data=st.data())
def test_chunked_engine_online_with_preemption_aborts_and_sampling(requests, n_slots, block_size, data):
    """Arrivals between steps, aborts, seeded sampling and a tight pool, so that preempted
    requests are recomputed in chunks too: every finished request equals solo."""
    reqs = [Request(r.prompt, r.max_new_tokens, r.eos_id,
                    data.draw(st.sampled_from([None, Sampling(0.9, 20, None, seed=i)])))
            for i, r in enumerate(requests)]
    n_blocks = max(need_blocks(r, block_size) for r in reqs) + data.draw(st.integers(0, 4))
    budget = n_slots + data.draw(st.integers(0, 6))
    trace = Trace()
    eng = ContinuousEngine(TINY, n_slots, kv="paged", block_size=block_size, kv_blocks=n_blocks,
                           max_step_tokens=budget, trace=trace)
    done, aborted = drive(eng, reqs, data, abort_odds=8)
    assert set(done) | aborted == set(range(len(reqs)))
    for i, tokens in done.items():
        assert tokens == solo(reqs[i]), f"request {i}"
    budget_kept(trace, budget)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_st, n_slots=st.integers(1, 4), extra=st.integers(0, 6))
def test_chunked_engine_with_the_graph_decoder(requests, n_slots, extra):
    """The graph decoder's step (eager bucketed on a CPU) writes every slot, a slot halfway
    through its prefill too; that slot's next chunk overwrites the stray key: solo tokens."""
    results, _ = run_continuous(TINY, requests, n_slots, decoder="graphs",
                                max_step_tokens=n_slots + extra)
    assert_oracle(requests, results)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    """The picture of 07 in numbers: three short requests decode every step while a long
    prompt takes the rest of the budget, a chunk a step."""
    reqs = [Request([1 + i, 2, 3], 12) for i in range(3)] + [Request(list(range(1, 61)), 4)]
    trace = Trace()
    eng = ContinuousEngine(TINY, 4, max_step_tokens=16, trace=trace)
    for r in reqs[:3]:
        eng.add_request(r)
    eng.step()                                          # the short prompts' prefill
    eng.add_request(reqs[3])
    while eng.has_work():
        eng.step()
    chunks = [c[3] for c in trace.computed[1:] if c[3] > 1]
    assert chunks == [13, 13, 13, 13, 8], chunks        # 16 - 3 decodes, until 60 are done
    assert all(c[:3] == [1, 1, 1] for c in trace.computed[1:6]), "the short ones kept decoding"
    assert_oracle(reqs, [eng.results[i] for i in range(4)])


def test_budget_below_the_slots_is_refused():
    with pytest.raises(ValueError, match="max_step_tokens 3 is less than n_slots 4"):
        EngineConfig(4, max_step_tokens=3)
    with pytest.raises(ValueError, match="max_step_tokens must be an int >= 1"):
        EngineConfig(4, max_step_tokens=0)


# ---- 08: prefix caching ----------------------------------------------------------------------------

def test_block_hashes_name_prefixes_not_blocks():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3, "three full blocks, the partial fourth unnamed"
    b = block_hashes([9, 9, 3, 4, 5, 6], 2)
    assert a[0] != b[0] and a[1] != b[1], "the same block after another prefix is another prefix"
    assert block_hashes([1, 2, 3, 4, 8], 2) == a[:2]
    assert block_hashes([5, 6], 2, parent=a[1]) == [a[2]], "a chain continues from its parent"


def test_match_prefix_stops_at_the_first_miss_and_leaves_a_token():
    ctx = list(range(1, 13))                            # 12 tokens, blocks of 4
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
    pc.free(a)                                          # b's blocks were let go first,
    assert pc.n_free() == 4 and pc.allocator.n_free() == 0
    assert list(pc.evictable) == [b[1], b[0], a[1], a[0]], "each table's from its end"
    got = pc.allocate(2)
    assert got == [b[1], b[0]] and b"b0" not in pc.cached and b"a0" in pc.cached
    with pytest.raises(ValueError, match="not held by any table"):
        pc.free([a[0]])


prefixes_st = st.lists(st.integers(1, V - 1), min_size=0, max_size=40)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(systems=st.lists(prefixes_st, min_size=1, max_size=3), block_size=st.sampled_from([1, 2, 4, 8]),
       n_slots=st.integers(1, 5), data=st.data())
def test_prefix_cache_matches_solo_generate(systems, block_size, n_slots, data):
    """Prompts that share system prompts (a few, some empty), arriving between steps, greedy and
    seeded, some aborted, pools from tight to ample, with and without a budget: solo tokens,
    the books balanced after every step, nothing referenced at the end."""
    reqs = []
    for i in range(data.draw(st.integers(1, 10))):
        system = data.draw(st.sampled_from(systems))
        question = data.draw(st.lists(st.integers(1, V - 1), min_size=1 if not system else 0, max_size=8))
        reqs.append(Request(system + question, data.draw(st.integers(1, 12)),
                            data.draw(st.sampled_from([None, 3])),
                            data.draw(st.sampled_from([None, Sampling(0.9, 20, None, seed=i)]))))
    n_blocks = max(need_blocks(r, block_size) for r in reqs) + data.draw(st.integers(0, 24))
    budget = data.draw(st.sampled_from([None, n_slots + 3]))
    eng = ContinuousEngine(TINY, n_slots, kv="paged", block_size=block_size, kv_blocks=n_blocks,
                           prefix_cache=True, max_step_tokens=budget)
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
    eng = ContinuousEngine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
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
    ctx = len(first.prompt) + len(answer)               # in the cache after turn 1 (the last
    reusable = (ctx - 1) // 4 * 4                       # answer token was never computed)
    assert summary["cached_prompt_tokens"] == reusable
    assert summary["prefill_tokens"] == len(first.prompt) + len(second.prompt) - reusable
    assert sum(eng.cache.prefix.refs) == 0


def test_requests_admitted_together_compute_their_prefix_each():
    """Blocks are named when full and written, after the step: two newcomers of one step both
    compute a shared prefix (a block is never shared while it is being written)."""
    system = list(range(1, 17))
    reqs = [Request(system + [20 + i], 3) for i in range(2)]
    results, summary = run_continuous(TINY, reqs, 2, kv="paged", block_size=4, prefix_cache=True)
    assert_oracle(reqs, results)
    assert summary["cached_prompt_tokens"] == 0 and summary["prefill_tokens"] == 34


def test_prefix_cache_needs_a_paged_cache():
    with pytest.raises(ValueError, match="prefix_cache shares blocks of a paged cache"):
        EngineConfig(2, prefix_cache=True)
