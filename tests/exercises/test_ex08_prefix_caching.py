"""Exercise 08 - prefix caching: your block names, prefix match, reference counts and eviction
inside make_engine(kv="paged", prefix_cache=True)."""

import functools
import random

import pytest
import torch

from tests.conftest import make_tiny
from tests.exercises.conftest import run_engine
from tinyllm.build import make_engine
from tinyllm.core import prefix_cache
from tinyllm.core.generate import generate
from tinyllm.core.paged_kv import BlockAllocator
from tinyllm.core.prefix_cache import PrefixCache
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.course import seams
from tinyllm.course.check import divergence, explained, leaks

EXERCISE = "ex08_prefix_caching"
TINY = make_tiny(seed=9)


def reference_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The package's own block names (not yours)."""
    return seams.reference("08")["block_hashes"](tokens, block_size, parent)


# ---- block_hashes ----------------------------------------------------------------------------
def hashed(impl, tokens, block_size, parent=None):
    got = (
        impl.block_hashes(list(tokens), block_size)
        if parent is None
        else impl.block_hashes(list(tokens), block_size, parent)
    )
    assert isinstance(got, list) and all(isinstance(h, bytes) for h in got), (
        f"block_hashes returns a list of bytes (sha256 digests), got {got!r}"
    )
    return got


@pytest.mark.parametrize(
    "n_tokens, block_size, want", [(8, 4, 2), (7, 2, 3), (3, 4, 0), (5, 1, 5), (0, 4, 0)]
)
def test_one_hash_per_full_block(impl, n_tokens, block_size, want):
    """Only full blocks are named: a last partial block is still being written."""
    got = hashed(impl, range(1, n_tokens + 1), block_size)
    assert len(got) == want, (
        f"{n_tokens} tokens in blocks of {block_size}: {n_tokens} // "
        f"{block_size} = {want} full blocks, so {want} hashes (a partial "
        f"block gets none), got {len(got)}"
    )


def test_names_are_digests_that_depend_on_the_tokens_alone(impl):
    """A name is bytes (a hashlib digest), the same for the same tokens in any call, and
    another for other tokens: the engine names blocks in one call and looks them up in another."""
    a = hashed(impl, [5, 17, 3, 88, 40, 2, 61, 7, 9], 4)
    assert all(len(h) >= 16 for h in a), (
        f"names of {[len(h) for h in a]} bytes: use a cryptographic digest (hashlib), "
        "16 bytes or more"
    )
    assert hashed(impl, [5, 17, 3, 88, 40, 2, 61, 7, 9], 4) == a, (
        "the same tokens, another call: the same names"
    )
    b = hashed(impl, [5, 17, 3, 88, 40, 2, 61, 8], 4)
    assert b[0] == a[0] and b[1] != a[1], (
        "[40, 2, 61, 7] and [40, 2, 61, 8] after the same block 0 are different prefixes: block "
        "1's names differ"
    )
    c = hashed(impl, [5, 17, 88, 3], 4)
    assert c[0] != a[0], (
        "[5, 17, 3, 88] and [5, 17, 88, 3] hold the same tokens in another order: other names"
    )
    d = hashed(impl, [1, 23], 2)
    e = hashed(impl, [12, 3], 2)
    assert d != e, (
        "[1, 23] and [12, 3] must have different names: tokens written as text side "
        "by side ('123') collide; give each token its own bytes"
    )


def test_random_prefixes_have_names_as_distinct_as_they_are(impl):
    """Many random token lists, some sharing starts: two blocks share a name exactly when
    they close the same prefix."""
    rng = random.Random(3)
    base = [rng.randrange(0, 50) for _ in range(12)]
    lists = [
        base[: rng.randint(0, 12)] + [rng.randrange(0, 50) for _ in range(rng.randint(0, 8))]
        for _ in range(60)
    ]
    names: dict[bytes, tuple] = {}
    for t in lists:
        for i, h in enumerate(hashed(impl, t, 3)):
            prefix = tuple(t[: (i + 1) * 3])
            assert names.setdefault(h, prefix) == prefix, (
                f"the prefixes {list(names[h])} and {list(prefix)} got the same name"
            )
    assert len(set(names.values())) == len(names)


def test_the_same_block_after_another_prefix_has_another_hash(impl):
    """A block's keys depend on every token before it: [3, 4] after [1, 2] and after [9, 9]
    are different prefixes, so different hashes; equal prefixes give equal hashes."""
    a = hashed(impl, [1, 2, 3, 4], 2)
    b = hashed(impl, [9, 9, 3, 4], 2)
    assert a[1] != b[1], (
        "block [3, 4] after [1, 2] and after [9, 9] got the same hash: a block's "
        "hash must chain in the hash of the block before it"
    )
    c = hashed(impl, [1, 2, 3, 4, 5], 2)
    assert c == a, (
        "[1, 2, 3, 4] and [1, 2, 3, 4, 5] share their two full blocks, so the same 2 "
        f"hashes: got {len(a)} and {len(c)} hashes" + ("" if len(c) != len(a) else ", not equal")
    )
    d = hashed(impl, [3, 4, 3, 4], 2)
    assert d[0] != d[1], (
        "block [3, 4] at position 0 and again after [3, 4] holds another prefix: different hashes"
    )


def test_parent_continues_a_chain(impl):
    """Hashing the next blocks from the last known hash (parent) gives what hashing the
    whole list would: the engine names a slot's blocks as they fill up, a few at a time."""
    whole = hashed(impl, list(range(10, 22)), 4)
    tail = hashed(impl, list(range(14, 22)), 4, parent=whole[0])
    assert tail == whole[1:], (
        "tokens 14..21 hashed from parent = the hash of block [10..13] must "
        "give blocks 1 and 2 of the whole list's hashes: "
        "start the chain at parent"
    )


# ---- match_prefix ----------------------------------------------------------------------------
CTX = list(range(1, 13))  # 12 tokens: 3 blocks of 4, and the package's names for them
H = reference_hashes(CTX, 4)


def matched(impl, context, cached):
    got = impl.match_prefix(list(context), 4, dict(cached))
    assert isinstance(got, list), (
        f"match_prefix returns the cached blocks as a list of block ids, got {got!r}"
    )
    kinds = sorted({type(b).__name__ for b in got})
    assert all(isinstance(b, int) for b in got), (
        "match_prefix returns block ids (cached's values, ints), not hashes: got a list of "
        f"{', '.join(kinds)}"
    )
    return got


def test_match_prefix_returns_the_cached_blocks_in_order(impl):
    """Every leading block cached: their block ids (cached's values), in order."""
    got = matched(impl, CTX + [13], {H[0]: 7, H[1]: 3, H[2]: 5})
    assert got == [7, 3, 5], (
        f"13 tokens, its 3 full blocks cached as blocks 7, 3, 5: expected [7, 3, 5], got {got}"
    )


def test_match_prefix_stops_at_the_first_miss(impl):
    """Blocks 0 and 2 cached, block 1 not: only block 0 is reused; block 2's keys mean nothing
    without block 1's in front of them."""
    got = matched(impl, CTX + [13], {H[0]: 7, H[2]: 5})
    assert got == [7], f"block 1 is not cached: stop there, expected [7], got {got}"
    got = matched(impl, CTX + [13], {H[1]: 3, H[2]: 5})
    assert got == [], (
        f"block 0 is not cached: a block is only reused after its parents, expected [], got {got}"
    )
    got = matched(impl, CTX + [13], {})
    assert got == [], f"an empty cache: expected [], got {got}"


def test_match_prefix_never_covers_the_last_token(impl):
    """A context of exactly 3 full blocks, all cached: the last block holds its last token,
    which the request must compute to sample from, so only 2 are reused."""
    cached = {H[0]: 7, H[1]: 3, H[2]: 5}
    got = matched(impl, CTX, cached)
    assert got == [7, 3], (
        "12 tokens = 3 full blocks, all cached: reusing block 2 would cover "
        "the last token, leaving nothing to compute; expected [7, 3], got "
        f"{got}"
    )
    got = matched(impl, CTX[:5], cached)
    assert got == [7], (
        f"5 tokens: block 0 is reused, the last token is computed; expected [7], got {got}"
    )
    got = matched(impl, CTX[:4], cached)
    assert got == [], (
        f"4 tokens = 1 full block: reusing it would cover the last token; expected [], got {got}"
    )


def test_match_prefix_of_a_context_shorter_than_a_block(impl):
    """Fewer tokens than a block: no full block, nothing to reuse."""
    got = matched(impl, [1, 2, 3], {H[0]: 7})
    assert got == [], f"3 tokens, blocks of 4: no full block to reuse, expected [], got {got}"


# ---- take_blocks, share_blocks, release_blocks -------------------------------------------------
def pool(n_blocks=8, named=()) -> PrefixCache:
    """A PrefixCache over a fresh pool; `named` blocks are taken by one table, given names,
    and released (so they wait, evictable, in that order)."""
    pc = PrefixCache(BlockAllocator(n_blocks), 4)
    for b in named:
        pc.allocator.free_list.remove(b)
        pc.allocator.allocated[b] = True
        pc.refs[b] = 1
        pc.register(b, bytes([b]) * 32)
    for b in named:
        pc.refs[b] = 0
        pc.evictable[b] = None
    return pc


def books(pc: PrefixCache) -> tuple:
    return (
        list(pc.refs),
        dict(pc.cached),
        dict(pc.hash_of),
        list(pc.evictable),
        sorted(pc.allocator.free_list),
    )


def test_take_blocks_takes_free_blocks_first(impl):
    pc = pool(8, named=[2, 6])
    with explained("take_blocks(pc, 3) from 6 free blocks and 2 evictable ones"):
        got = impl.take_blocks(pc, 3)
    assert isinstance(got, list) and len(got) == 3 and len(set(got)) == 3, (
        f"take_blocks(pc, 3) returns a list of 3 distinct blocks, got {got!r}"
    )
    assert not {2, 6} & set(got), (
        f"6 blocks are free: take those, and keep the cached blocks 2 and 6 cached; got {got}"
    )
    assert all(pc.refs[b] == 1 for b in got), (
        f"each block taken is held by one table: refs {[pc.refs[b] for b in got]}, expected 1 each"
    )
    assert list(pc.evictable) == [2, 6] and set(pc.cached.values()) == {2, 6}, (
        "blocks 2 and 6 stay cached and evictable"
    )


def test_take_blocks_evicts_the_least_recently_released(impl):
    pc = pool(4, named=[2, 0, 3])  # released in that order: 2 is the oldest
    free = list(pc.allocator.free_list)  # block 1
    with explained("take_blocks(pc, 2) from 1 free block and evictable 2, 0, 3"):
        got = impl.take_blocks(pc, 2)
    assert got is not None and sorted(got) == sorted(free + [2]), (
        f"1 free block ({free[0]}) and evictable blocks 2, 0, 3 (2 released first): take "
        f"{free[0]}, then the least recently released, 2; got {got}"
    )
    assert bytes([2]) * 32 not in pc.cached and 2 not in pc.hash_of, (
        "block 2 is about to be overwritten: its name must leave pc.cached and pc.hash_of"
    )
    assert list(pc.evictable) == [0, 3] and pc.refs[2] == 1, (
        f"0 and 3 stay evictable, 2 is held once: evictable {list(pc.evictable)}, refs[2] "
        f"{pc.refs[2]}"
    )


def test_take_blocks_takes_nothing_when_too_few(impl):
    pc = pool(4, named=[1])
    before = books(pc)
    try:
        got = impl.take_blocks(pc, 5)
    except (KeyError, IndexError, ValueError) as e:
        pytest.fail(
            f"take_blocks(pc, 5) with 4 blocks to be had (pc.n_free()) raised "
            f"{type(e).__name__}: {e}. Check the room first: with fewer than n blocks free or "
            f"evictable, return None and change nothing (a table half taken would leak blocks)"
        )
    assert got is None, f"4 blocks in all, 5 asked for: None, got {got!r}"
    assert books(pc) == before, "take_blocks that cannot take n blocks changes nothing"


def test_share_blocks_counts_one_more_table(impl):
    pc = pool(6, named=[4, 5])
    pc.refs[3] = 2
    with explained("share_blocks(pc, [4, 3])"):
        impl.share_blocks(pc, [4, 3])
    assert (pc.refs[4], pc.refs[3]) == (1, 3), (
        f"each shared block is held once more: refs[4] 0 -> 1, refs[3] 2 -> 3, got {pc.refs[4]}, "
        f"{pc.refs[3]}"
    )
    assert list(pc.evictable) == [5], (
        "block 4 is in use again: it is no longer evictable (evictable should be [5], got "
        f"{list(pc.evictable)})"
    )


def test_release_blocks_keeps_named_blocks_cached_last_block_first(impl):
    pc = pool(12)
    table = pc.allocator.allocate(3)  # a table's three blocks
    for b in table:
        pc.refs[b] = 1
    pc.register(table[0], b"a" * 32)
    pc.register(table[1], b"b" * 32)
    shared = pc.allocator.allocate(1)[0]  # a block two tables hold
    pc.refs[shared] = 2
    with explained(f"release_blocks(pc, {table + [shared]})"):
        impl.release_blocks(pc, table + [shared])
    assert [pc.refs[b] for b in table] == [0, 0, 0] and pc.refs[shared] == 1, (
        f"each count falls by one: refs {[pc.refs[b] for b in table + [shared]]}, "
        "expected [0, 0, 0, 1]"
    )
    assert table[2] in pc.allocator.free_list and table[2] not in pc.evictable, (
        f"block {table[2]} has no name: the allocator takes it back"
    )
    assert list(pc.evictable) == [table[1], table[0]], (
        f"named blocks {table[:2]} stay cached, evictable from the table's end: expected "
        f"evictable [{table[1]}, {table[0]}], got {list(pc.evictable)}"
    )
    assert shared not in pc.evictable and shared not in pc.allocator.free_list, (
        f"block {shared} is still held by another table: it stays in use"
    )


@pytest.mark.parametrize("refused_first", [False, True], ids=["refused-last", "refused-first"])
def test_release_blocks_refuses_a_block_nobody_holds(impl, refused_first):
    """Atomic whichever place the refused block holds: the table's blocks are released from
    the last, so a check made on the way would miss the refused block at the table's start
    after the blocks behind it had been released."""
    pc = pool(6, named=[2])
    held = pc.allocator.allocate(1)[0]
    pc.refs[held] = 1
    table = [2, held] if refused_first else [held, 2]
    before = books(pc)
    with pytest.raises(ValueError) as e:
        impl.release_blocks(pc, table)
    assert "2" in str(e.value), f"the error names block 2, which nobody holds: {e.value}"
    assert books(pc) == before, (
        f"release_blocks(pc, {table}) is refused (nobody holds block 2), so it changes nothing, "
        f"not even block {held}'s count: check every block before releasing any"
    )


# ---- the engine ------------------------------------------------------------------------------
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


def system_prompts(seed: int) -> list[list[int]]:
    """Shared prefixes: a random one, one that repeats a block (so the same block stands after
    different prefixes), one that shares the first's start, and none."""
    rng = random.Random(seed)
    s1 = [rng.randrange(1, 97) for _ in range(13)]
    return [s1, [3, 1, 4, 1] * 3, s1[:8] + [rng.randrange(1, 97) for _ in range(6)], []]


def requests(n: int, seed: int) -> list[Request]:
    """Requests that start with a shared prefix and ask a question of their own; greedy and
    seeded, some with an EOS."""
    rng = random.Random(seed)
    systems = system_prompts(seed)
    reqs = []
    for i in range(n):
        system = rng.choice(systems)
        question = [rng.randrange(1, 97) for _ in range(rng.randint(0 if system else 1, 6))]
        reqs.append(
            Request(
                system + question,
                rng.randint(1, 12),
                eos_id=rng.choice([None, 5]),
                sampling=rng.choice([None, Sampling(0.9, 20, None, seed=i)]),
            )
        )
    return reqs


@functools.cache
def solo_tokens(n: int, seed: int) -> list[list[int]]:
    """Solo generate's tokens for requests(n, seed), computed once for the module."""
    return [solo(TINY, r) for r in requests(n, seed)]


def drive(eng, reqs, seed: int, abort_odds: int = 0):
    """Add 0 to 2 requests between steps (random.Random(seed) decides), abort some, step until
    done (the exercises' run_engine). Returns the rids, the aborted indices and every block
    hash that was ever cached."""
    rng, aborted, seen = random.Random(seed), set(), set()

    def abort(step, rids):
        if abort_odds and rng.randrange(abort_odds) == 0:
            i = rng.randrange(len(rids))
            if eng.abort(rids[i]):
                aborted.add(i)

    rids = run_engine(
        eng,
        reqs,
        "the prefix-cached engine with your functions",
        joining=lambda step: rng.randint(0, 2) if step else 1,
        before_step=abort,
        after_step=lambda step: seen.update(eng.cache.prefix.cached),
        stuck="a request is never admitted, or is left with nothing to compute (a match that "
        "covers its last token?)",
    )
    return rids, aborted, seen


@pytest.mark.parametrize(
    "block_size, n_blocks, budget", [(4, 14, None), (2, 26, 5), (4, None, None)]
)
def test_shared_prompts_arriving_between_steps_match_solo(plug, block_size, n_blocks, budget):
    """Requests sharing system prompts arrive between steps (so earlier ones' blocks are cached
    when later ones are admitted), greedy and seeded, some aborted, in pools from tight (cached
    blocks are evicted, requests preempted) to ample: every finished request gets its solo
    tokens, and nothing is held at the end."""
    plug()
    reqs = requests(14, 0)
    where = f"blocks of {block_size}, {n_blocks or 'ample'} of them, max_step_tokens {budget}"
    eng = make_engine(
        TINY,
        3,
        kv="paged",
        block_size=block_size,
        kv_blocks=n_blocks,
        prefix_cache=True,
        max_step_tokens=budget,
    )
    rids, aborted, seen = drive(eng, reqs, seed=block_size, abort_odds=9)
    expected = solo_tokens(14, 0)
    for i, rid in enumerate(rids):
        if i in aborted:
            continue
        assert rid in eng.results, f"request {i} ({where}) never finished (no Result)"
        msg = divergence(f"request {i} ({where})", expected[i], eng.results[rid].tokens)
        assert msg is None, msg
    assert len(aborted) < len(reqs) // 2, "only a few requests are aborted"
    summary = eng.stats.summary([])
    assert summary["cached_prompt_tokens"] > 0, (
        f"{where}: later requests reuse the cached blocks of a shared prefix"
    )
    if n_blocks is not None:
        assert seen - set(eng.cache.prefix.cached), (
            f"{where}: the pool is small enough that cached blocks are evicted"
        )
    msg = leaks(eng)
    assert msg is None, msg


def test_the_cache_serves_exactly_the_shared_full_blocks(plug):
    """Blocks of 4, a 16-token system prompt cached by a first request; then, one a step: the
    system prompt and a question (4 blocks reused), its first 10 tokens (2), the system prompt
    alone (3: the 4th holds its last token), its blocks 1-3 after another first block (0), and
    its block 0 three times over (1: the same tokens after another prefix are another prefix)."""
    plug()
    system = [(5 * j) % 96 + 1 for j in range(16)]
    reqs = [
        Request(system + [50], 4),
        Request(system + [51, 52], 4),
        Request(system[:10] + [60], 4),
        Request(list(system), 4),
        Request([90, 91, 92, 93] + system[4:] + [70], 4),
        Request(system[:4] * 3 + [71], 4),
    ]
    reused = [0, 16, 8, 12, 0, 4]
    eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    rids, step = [], 0
    with explained("the prefix-cached engine with your functions"):
        for r in reqs:
            rids.append(eng.add_request(r))
            eng.step()  # its blocks are named after this step
        while eng.has_work():
            eng.step()
            step += 1
            assert step < 1_000, (
                "the engine never finishes: a request is left with nothing to "
                "compute (a match that covers its last token?)"
            )
    for i, (r, rid) in enumerate(zip(reqs, rids)):
        msg = divergence(f"request {i}", solo(TINY, r), eng.results[rid].tokens)
        assert msg is None, msg
    summary = eng.stats.summary([])
    assert summary["cached_prompt_tokens"] == sum(reused), (
        f"the requests can reuse {reused} prompt tokens, {sum(reused)} in all; the cache served "
        f"{summary['cached_prompt_tokens']}"
    )
    assert summary["prefill_tokens"] == sum(len(r.prompt) for r in reqs) - sum(reused), (
        f"the engine computed {summary['prefill_tokens']} prompt tokens, "
        "expected the rest of the prompts"
    )
    assert sum(eng.cache.prefix.refs) == 0, (
        f"after every request ended some block is still referenced: refs {eng.cache.prefix.refs}"
    )
    msg = leaks(eng)
    assert msg is None, msg


def test_newcomers_of_one_step_share_their_prefix(plug):
    """Two requests with a 12-token system prompt (3 blocks of 4), added together, no token
    budget: each context is computed whole in its admission step, so the first's blocks are
    named as it is admitted and the second shares them in the same step. After that one step
    both are done, the second was served 12 prompt tokens, and both match solo."""
    plug()
    system = [(5 * j) % 96 + 1 for j in range(12)]
    reqs = [Request(system + [40 + i, 50 + i], 1) for i in range(2)]
    eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    with explained("the prefix-cached engine with your functions"):
        rids = [eng.add_request(r) for r in reqs]
        eng.step()
    assert not eng.has_work(), "one step prefills both and samples their one token"
    for i, (r, rid) in enumerate(zip(reqs, rids)):
        msg = divergence(f"request {i}", solo(TINY, r), eng.results[rid].tokens)
        assert msg is None, msg
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached == 12, (
        f"the second newcomer finds the first's 3 blocks, named at its "
        f"admission: 12 tokens; the cache served {cached}"
    )
    msg = leaks(eng)
    assert msg is None, msg


def test_a_match_ends_at_an_evicted_block(plug):
    """Request A caches a 12-token system prompt (3 blocks of 4); then the pool takes back A's
    block 0 (evicted, as a dry pool does). Blocks 1 and 2 are still cached, but their keys
    belong after block 0: request C, the system prompt and a question, must reuse nothing."""
    plug()
    system = [(5 * j) % 96 + 1 for j in range(12)]
    a, c = Request(system + [40], 3), Request(system + [41], 4)
    eng = make_engine(TINY, 1, kv="paged", block_size=4, kv_blocks=8, prefix_cache=True)
    with explained("the prefix-cached engine with your functions"):
        rids = [eng.add_request(a)]
        while eng.has_work():
            eng.step()
        pc = eng.cache.prefix
        assert len(pc.cached) == 3, f"A's 3 full blocks should be cached, {len(pc.cached)} are"
        first = [
            blk for h, blk in pc.cached.items() if h == prefix_cache.block_hashes(system, 4)[0]
        ]
        assert first, "A's block 0 is not in the cache under the name block_hashes gives its tokens"
        evict(pc, first[0])
        rids.append(eng.add_request(c))
        while eng.has_work():
            eng.step()
    for i, r in ((0, a), (1, c)):
        msg = divergence(f"request {'AC'[i]}", solo(TINY, r), eng.results[rids[i]].tokens)
        assert msg is None, msg
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached == 0, (
        "the system prompt's block 0 was evicted, so the match of request C "
        "stops there (blocks 1 and 2 hold keys that belong after it): expected 0 "
        f"tokens reused, the cache served {cached}"
    )
    msg = leaks(eng)
    assert msg is None, msg


def evict(pc, block: int) -> None:
    """Take a cached block nobody holds back into the free list, as a dry pool does."""
    del pc.cached[pc.hash_of.pop(block)]
    del pc.evictable[block]
    pc.allocator.free([block])


def test_the_second_turn_reuses_the_first_turns_prompt_and_answer(plug):
    """A conversation: turn 2's prompt is turn 1's prompt, its answer and a new question. Every
    full block turn 1 computed is found, its answer's blocks too (named as decoding filled
    them, each chained from the one before)."""
    plug()
    system = [(7 * j) % 96 + 1 for j in range(30)]
    first = Request(system + [7, 8, 9], 12)
    eng = make_engine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    with explained("the prefix-cached engine with your functions, turn 1"):
        rid = eng.add_request(first)
        while eng.has_work():
            eng.step()
    answer = eng.results.pop(rid).tokens
    second = Request(first.prompt + answer + [11, 12], 6)
    with explained("the prefix-cached engine with your functions, turn 2"):
        rid = eng.add_request(second)
        for _ in range(100):
            if not eng.has_work():
                break
            eng.step()
    assert not eng.has_work(), "turn 2 never finishes: is it left with nothing to compute?"
    got = eng.results.pop(rid).tokens
    msg = divergence("turn 1", solo(TINY, first), answer)
    assert msg is None, msg
    msg = divergence("turn 2", solo(TINY, second), got)
    assert msg is None, msg
    # turn 1's cache: its last token was never computed
    ctx = len(first.prompt) + len(answer) - 1
    reusable = ctx // 4 * 4
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached == reusable, (
        f"turn 1 left {ctx} tokens in its slot ({len(first.prompt)} prompt + {len(answer)} answer "
        f"- the last, never computed): {ctx // 4} full blocks, so turn 2 should reuse {reusable} "
        f"tokens; the cache served {cached}"
    )
    msg = leaks(eng)
    assert msg is None, msg


def test_bundled_model_with_your_functions(plug, bundled64):
    """The bundled model (float64), speeches that share Polonius's question (18 tokens: 4 full
    blocks of 4), arriving one a step into 2 slots: each later one reuses the shared blocks,
    gets its solo tokens up to EOS, and nothing is held at the end."""
    model, tok = bundled64
    shared = "Pol.\nWhat do you read, my lord?\n\nHam.\n"
    texts = [
        shared + x
        for x in [
            "",
            "Words",
            "Words, words, words.\n\nPol.\n",
            "Slanders, sir",
            "Between who?\n\nHam.\n",
        ]
    ]
    reqs = [Request(tok.encode(t), 40, eos_id=tok.eos_id) for t in texts]
    plug()  # solo generate calls no seam of this exercise
    eng = make_engine(model, 2, kv="paged", block_size=4, prefix_cache=True)
    with explained("the prefix-cached engine with your functions"):
        rids = []
        for _ in range(5000):
            if len(rids) < len(reqs):
                rids.append(eng.add_request(reqs[len(rids)]))
            if not eng.has_work() and len(rids) == len(reqs):
                break
            eng.step()
    assert not eng.has_work(), (
        "the engine never finished: a request is left with nothing to compute?"
    )
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, (
        "the prompts are chosen so that EOS fires"
    )
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i} ({texts[i]!r}) never finished (no Result)"
        msg = divergence(f"request {i} ({texts[i]!r})", e, eng.results[rid].tokens)
        assert msg is None, msg
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached >= 16 * (len(reqs) - 1), (
        f"each of the {len(reqs) - 1} later speeches finds at least the 4 full blocks of the "
        f"shared 18-token prefix, {16 * (len(reqs) - 1)} tokens in all; the cache served {cached}"
    )
    msg = leaks(eng)
    assert msg is None, msg


def test_a_tight_pool_keeps_what_the_reference_keeps(plug):
    """Requests sharing system prompts through a pool so small that cached blocks are evicted
    all the time: your books must serve exactly the prompt tokens the package's books serve
    (the same blocks evicted, in the same order), and hold nothing at the end."""
    reqs = requests(16, 5)

    def run():
        eng = make_engine(TINY, 2, kv="paged", block_size=2, kv_blocks=20, prefix_cache=True)
        rids, _, _ = drive(eng, reqs, seed=11)
        return eng, [eng.results[r].tokens for r in rids]

    ref, ref_tokens = run()
    plug()
    eng, tokens = run()
    for i, (e, g) in enumerate(zip(ref_tokens, tokens)):
        msg = divergence(f"request {i}", e, g)
        assert msg is None, msg
    want, got = (e.stats.summary([])["cached_prompt_tokens"] for e in (ref, eng))
    assert got == want, (
        f"the package's books serve {want} prompt tokens from the cache, yours "
        f"{got}: evict the least recently released block first, a table's last "
        f"block before its first, and only when no free block is left"
    )
    msg = leaks(eng)
    assert msg is None, msg
