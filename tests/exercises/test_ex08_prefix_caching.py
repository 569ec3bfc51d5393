"""Exercise 08 - prefix caching: your block hashes and prefix match inside
ContinuousEngine(kv="paged", prefix_cache=True)."""

import functools
import hashlib
import random
from array import array

import pytest
import torch

from tinyllm.check import divergence, explained, leaks
from tinyllm.continuous import ContinuousEngine
from tinyllm.generate import generate
from tinyllm.requests import Request
from tinyllm.sampling import Sampling
from tests.conftest import make_tiny

EXERCISE = "ex08_prefix_caching"
TINY = make_tiny(seed=9)


def sha(parent: bytes, block: list[int]) -> bytes:
    """The documented name of a block: sha256 of its parent's name and its tokens as int64."""
    return hashlib.sha256(parent + array("q", block).tobytes()).digest()


# ---- block_hashes ----------------------------------------------------------------------------
def hashed(impl, tokens, block_size, parent=None):
    got = impl.block_hashes(list(tokens), block_size) if parent is None else \
        impl.block_hashes(list(tokens), block_size, parent)
    assert isinstance(got, list) and all(isinstance(h, bytes) for h in got), \
        f"block_hashes returns a list of bytes (sha256 digests), got {got!r}"
    return got


@pytest.mark.parametrize("n_tokens, block_size, want", [(8, 4, 2), (7, 2, 3), (3, 4, 0), (5, 1, 5), (0, 4, 0)])
def test_one_hash_per_full_block(impl, n_tokens, block_size, want):
    """Only full blocks are named: a last partial block is still being written."""
    got = hashed(impl, range(1, n_tokens + 1), block_size)
    assert len(got) == want, (f"{n_tokens} tokens in blocks of {block_size}: {n_tokens} // {block_size} "
                              f"= {want} full blocks, so {want} hashes (a partial block gets none), got {len(got)}")


def test_block_hashes_are_the_documented_sha256_chain(impl):
    """Block 0: sha256(b"" + its tokens as int64); block i: sha256(block i-1's hash + its
    tokens). The engine's books and the tests compare these very bytes."""
    tokens = [5, 17, 3, 88, 40, 2, 61, 7, 9]
    h0 = sha(b"", [5, 17, 3, 88])
    h1 = sha(h0, [40, 2, 61, 7])
    got = hashed(impl, tokens, 4)
    assert got[:1] == [h0], ("block 0 of [5, 17, 3, 88, ...]: expected hashlib.sha256(b'' + "
                             "array('q', [5, 17, 3, 88]).tobytes()).digest(), got another digest")
    assert got[1:2] == [h1], ("block 1 is named by sha256(block 0's hash + array('q', [40, 2, 61, 7])"
                              ".tobytes()): the chain's second link differs")
    assert len(got) == 2, f"9 tokens in blocks of 4: 2 hashes (the last token's partial block has none), got {len(got)}"


def test_the_same_block_after_another_prefix_has_another_hash(impl):
    """A block's keys depend on every token before it: [3, 4] after [1, 2] and after [9, 9]
    are different prefixes, so different hashes; equal prefixes give equal hashes."""
    a = hashed(impl, [1, 2, 3, 4], 2)
    b = hashed(impl, [9, 9, 3, 4], 2)
    assert a[1] != b[1], ("block [3, 4] after [1, 2] and after [9, 9] got the same hash: a block's "
                          "hash must chain in the hash of the block before it")
    c = hashed(impl, [1, 2, 3, 4, 5], 2)
    assert c == a, (f"[1, 2, 3, 4] and [1, 2, 3, 4, 5] share their two full blocks, so the same 2 hashes: "
                    f"got {len(a)} and {len(c)} hashes" + ("" if len(c) != len(a) else ", not equal"))
    d = hashed(impl, [3, 4, 3, 4], 2)
    assert d[0] != d[1], "block [3, 4] at position 0 and again after [3, 4] holds another prefix: different hashes"


def test_parent_continues_a_chain(impl):
    """Hashing the next blocks from the last known hash (parent) gives what hashing the
    whole list would: the engine names a slot's blocks as they fill up, a few at a time."""
    whole = hashed(impl, list(range(10, 22)), 4)
    tail = hashed(impl, list(range(14, 22)), 4, parent=whole[0])
    assert tail == whole[1:], ("tokens 14..21 hashed from parent = the hash of block [10..13] must "
                               "give blocks 1 and 2 of the whole list's hashes: start the chain at parent")


# ---- match_prefix ----------------------------------------------------------------------------
CTX = list(range(1, 13))                # 12 tokens: 3 blocks of 4, and their documented hashes
H = [sha(b"", CTX[:4])]
H.append(sha(H[0], CTX[4:8]))
H.append(sha(H[1], CTX[8:12]))


def matched(impl, context, cached):
    got = impl.match_prefix(list(context), 4, dict(cached))
    assert isinstance(got, list), f"match_prefix returns the cached blocks as a list of block ids, got {got!r}"
    kinds = sorted({type(b).__name__ for b in got})
    assert all(isinstance(b, int) for b in got), \
        f"match_prefix returns block ids (cached's values, ints), not hashes: got a list of {', '.join(kinds)}"
    return got


def test_match_prefix_returns_the_cached_blocks_in_order(impl):
    """Every leading block cached: their block ids (cached's values), in order."""
    got = matched(impl, CTX + [13], {H[0]: 7, H[1]: 3, H[2]: 5})
    assert got == [7, 3, 5], (f"13 tokens, its 3 full blocks cached as blocks 7, 3, 5: expected "
                              f"[7, 3, 5], got {got}")


def test_match_prefix_stops_at_the_first_miss(impl):
    """Blocks 0 and 2 cached, block 1 not: only block 0 is reused; block 2's keys mean nothing
    without block 1's in front of them."""
    got = matched(impl, CTX + [13], {H[0]: 7, H[2]: 5})
    assert got == [7], f"block 1 is not cached: stop there, expected [7], got {got}"
    got = matched(impl, CTX + [13], {H[1]: 3, H[2]: 5})
    assert got == [], f"block 0 is not cached: a block is only reused after its parents, expected [], got {got}"
    got = matched(impl, CTX + [13], {})
    assert got == [], f"an empty cache: expected [], got {got}"


def test_match_prefix_never_covers_the_last_token(impl):
    """A context of exactly 3 full blocks, all cached: the last block holds its last token,
    which the request must compute to sample from, so only 2 are reused."""
    cached = {H[0]: 7, H[1]: 3, H[2]: 5}
    got = matched(impl, CTX, cached)
    assert got == [7, 3], (f"12 tokens = 3 full blocks, all cached: reusing block 2 would cover the "
                           f"last token, leaving nothing to compute; expected [7, 3], got {got}")
    got = matched(impl, CTX[:5], cached)
    assert got == [7], f"5 tokens: block 0 is reused, the last token is computed; expected [7], got {got}"
    got = matched(impl, CTX[:4], cached)
    assert got == [], f"4 tokens = 1 full block: reusing it would cover the last token; expected [], got {got}"


def test_match_prefix_of_a_context_shorter_than_a_block(impl):
    """Fewer tokens than a block: no full block, nothing to reuse."""
    got = matched(impl, [1, 2, 3], {H[0]: 7})
    assert got == [], f"3 tokens, blocks of 4: no full block to reuse, expected [], got {got}"


# ---- the engine ------------------------------------------------------------------------------
def solo(model, req: Request) -> list[int]:
    s = req.sampling or Sampling()
    g = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
    return generate(model, req.prompt, req.max_new_tokens, eos_id=req.eos_id,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, generator=g)


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
        reqs.append(Request(system + question, rng.randint(1, 12), eos_id=rng.choice([None, 5]),
                            sampling=rng.choice([None, Sampling(0.9, 20, None, seed=i)])))
    return reqs


@functools.cache
def solo_tokens(n: int, seed: int) -> list[list[int]]:
    """Solo generate's tokens for requests(n, seed), computed once for the module."""
    return [solo(TINY, r) for r in requests(n, seed)]


def drive(eng, reqs, seed: int, abort_odds: int = 0):
    """Add 0 to 2 requests between steps (random.Random(seed) decides), abort some, step until
    done. Returns the rids, the aborted indices and every block hash that was ever cached."""
    rng = random.Random(seed)
    rids, aborted, seen, step = [], set(), set(), 0
    with explained("the prefix-cached engine with your functions"):
        while len(rids) < len(reqs) or eng.has_work():
            for _ in range(rng.randint(0, 2) if step else 1):
                if len(rids) < len(reqs):
                    rids.append(eng.add_request(reqs[len(rids)]))
            if abort_odds and rng.randrange(abort_odds) == 0:
                i = rng.randrange(len(rids))
                if eng.abort(rids[i]):
                    aborted.add(i)
            if eng.has_work():
                eng.step()
            seen |= set(eng.cache.prefix.cached)
            step += 1
            assert step < 5_000, ("the engine never finishes: a request is never admitted, or "
                                  "is left with nothing to compute (a match that covers its last token?)")
    return rids, aborted, seen


@pytest.mark.parametrize("block_size, n_blocks, budget", [(4, 14, None), (2, 26, 5), (4, None, None)])
def test_shared_prompts_arriving_between_steps_match_solo(plug, block_size, n_blocks, budget):
    """Requests sharing system prompts arrive between steps (so earlier ones' blocks are cached
    when later ones are admitted), greedy and seeded, some aborted, in pools from tight (cached
    blocks are evicted, requests preempted) to ample: every finished request gets its solo
    tokens, and nothing is held at the end."""
    plug()
    reqs = requests(14, 0)
    where = f"blocks of {block_size}, {n_blocks or 'ample'} of them, max_step_tokens {budget}"
    eng = ContinuousEngine(TINY, 3, kv="paged", block_size=block_size, kv_blocks=n_blocks,
                           prefix_cache=True, max_step_tokens=budget)
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
    assert summary["cached_prompt_tokens"] > 0, f"{where}: later requests reuse the cached blocks of a shared prefix"
    if n_blocks is not None:
        assert seen - set(eng.cache.prefix.cached), f"{where}: the pool is small enough that cached blocks are evicted"
    msg = leaks(eng)
    assert msg is None, msg


def test_the_cache_serves_exactly_the_shared_full_blocks(plug):
    """Blocks of 4, a 16-token system prompt cached by a first request; then, one a step: the
    system prompt and a question (4 blocks reused), its first 10 tokens (2), the system prompt
    alone (3: the 4th holds its last token), its blocks 1-3 after another first block (0), and
    its block 0 three times over (1: the same tokens after another prefix are another prefix)."""
    plug()
    system = [(5 * j) % 96 + 1 for j in range(16)]
    reqs = [Request(system + [50], 4), Request(system + [51, 52], 4), Request(system[:10] + [60], 4),
            Request(list(system), 4), Request([90, 91, 92, 93] + system[4:] + [70], 4),
            Request(system[:4] * 3 + [71], 4)]
    reused = [0, 16, 8, 12, 0, 4]
    eng = ContinuousEngine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
    rids, step = [], 0
    with explained("the prefix-cached engine with your functions"):
        for r in reqs:
            rids.append(eng.add_request(r))
            eng.step()                                  # its blocks are named after this step
        while eng.has_work():
            eng.step()
            step += 1
            assert step < 1_000, ("the engine never finishes: a request is left with nothing to "
                                  "compute (a match that covers its last token?)")
    for i, (r, rid) in enumerate(zip(reqs, rids)):
        msg = divergence(f"request {i}", solo(TINY, r), eng.results[rid].tokens)
        assert msg is None, msg
    summary = eng.stats.summary([])
    assert summary["cached_prompt_tokens"] == sum(reused), \
        (f"the requests can reuse {reused} prompt tokens, {sum(reused)} in all; the cache served "
         f"{summary['cached_prompt_tokens']}")
    assert summary["prefill_tokens"] == sum(len(r.prompt) for r in reqs) - sum(reused), \
        f"the engine computed {summary['prefill_tokens']} prompt tokens, expected the rest of the prompts"
    assert sum(eng.cache.prefix.refs) == 0, f"after every request ended some block is still referenced: refs {eng.cache.prefix.refs}"
    msg = leaks(eng)
    assert msg is None, msg


def test_a_match_ends_at_an_evicted_block(plug):
    """Request A caches a 12-token system prompt (3 blocks of 4); then the pool takes back A's
    block 0 (evicted, as a dry pool does). Blocks 1 and 2 are still cached, but their keys
    belong after block 0: request C, the system prompt and a question, must reuse nothing."""
    plug()
    system = [(5 * j) % 96 + 1 for j in range(12)]
    a, c = Request(system + [40], 3), Request(system + [41], 4)
    eng = ContinuousEngine(TINY, 1, kv="paged", block_size=4, kv_blocks=8, prefix_cache=True)
    with explained("the prefix-cached engine with your functions"):
        rids = [eng.add_request(a)]
        while eng.has_work():
            eng.step()
        pc = eng.cache.prefix
        assert len(pc.cached) == 3, f"A's 3 full blocks should be cached, {len(pc.cached)} are"
        first = [blk for h, blk in pc.cached.items() if h == reference_hashes(system, 4)[0]]
        assert first, "A's block 0 is not in the cache under the reference hash of its tokens"
        evict(pc, first[0])
        rids.append(eng.add_request(c))
        while eng.has_work():
            eng.step()
    for i, r in ((0, a), (1, c)):
        msg = divergence(f"request {'AC'[i]}", solo(TINY, r), eng.results[rids[i]].tokens)
        assert msg is None, msg
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached == 0, (f"the system prompt's block 0 was evicted, so the match of request C stops "
                         f"there (blocks 1 and 2 hold keys that belong after it): expected 0 tokens "
                         f"reused, the cache served {cached}")
    msg = leaks(eng)
    assert msg is None, msg


def reference_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The package's own block names (not yours), to find a block in the cache."""
    from tinyllm import seams
    return seams.reference("08")["block_hashes"](tokens, block_size)


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
    eng = ContinuousEngine(TINY, 2, kv="paged", block_size=4, prefix_cache=True)
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
    ctx = len(first.prompt) + len(answer) - 1           # turn 1's cache: its last token was never computed
    reusable = ctx // 4 * 4
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached == reusable, \
        (f"turn 1 left {ctx} tokens in its slot ({len(first.prompt)} prompt + {len(answer)} answer - "
         f"the last, never computed): {ctx // 4} full blocks, so turn 2 should reuse {reusable} "
         f"tokens; the cache served {cached}")
    msg = leaks(eng)
    assert msg is None, msg


def test_bundled_model_with_your_functions(plug, bundled64):
    """The bundled model (float64), speeches that share Polonius's question (18 tokens: 4 full
    blocks of 4), arriving one a step into 2 slots: each later one reuses the shared blocks,
    gets its solo tokens up to EOS, and nothing is held at the end."""
    model, tok = bundled64
    shared = "Pol.\nWhat do you read, my lord?\n\nHam.\n"
    texts = [shared + x for x in ["", "Words", "Words, words, words.\n\nPol.\n", "Slanders, sir",
                                  "Between who?\n\nHam.\n"]]
    reqs = [Request(tok.encode(t), 40, eos_id=tok.eos_id) for t in texts]
    plug()                          # solo generate calls no seam of this exercise
    eng = ContinuousEngine(model, 2, kv="paged", block_size=4, prefix_cache=True)
    with explained("the prefix-cached engine with your functions"):
        rids = []
        for _ in range(5000):
            if len(rids) < len(reqs):
                rids.append(eng.add_request(reqs[len(rids)]))
            if not eng.has_work() and len(rids) == len(reqs):
                break
            eng.step()
    assert not eng.has_work(), "the engine never finished: a request is left with nothing to compute?"
    expected = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    assert sum(e[-1] == tok.eos_id for e in expected) >= 3, "the prompts are chosen so that EOS fires"
    for i, (e, rid) in enumerate(zip(expected, rids)):
        assert rid in eng.results, f"request {i} ({texts[i]!r}) never finished (no Result)"
        msg = divergence(f"request {i} ({texts[i]!r})", e, eng.results[rid].tokens)
        assert msg is None, msg
    cached = eng.stats.summary([])["cached_prompt_tokens"]
    assert cached >= 16 * (len(reqs) - 1), \
        (f"each of the {len(reqs) - 1} later speeches finds at least the 4 full blocks of the shared "
         f"18-token prefix, {16 * (len(reqs) - 1)} tokens in all; the cache served {cached}")
    msg = leaks(eng)
    assert msg is None, msg
