"""Step 04 - the ragged step (slot_cache.py): each busy slot brings its own number of new tokens
to one forward pass, and every row computes exactly what it would alone.

The slot caches are driven here directly, as the engine drives them and without it:
`admit(slot, n)`, `reserve(slot, q)`, `plan_step(rows, q_lens)`, then
`logits, _ = model(idx, cache=cache)` on idx (B, T) right-padded to T = max(q_lens), then
`rollback` and `release`. Prompts are fed in chunks, rows at different stages share a step,
rows come in any slot order; in float64 every row's logits equal the full forward pass of its
sequence and its greedy tokens equal solo generate()'s.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tests.test_paged_and_graphs import check_pool
from tinyllm.core.generate import generate
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.slot_cache import SlotKVCache

MODEL = make_tiny()
V = MODEL.cfg.vocab_size
MAX_LEN = 48
KINDS = [("slots", None), ("paged", 1), ("paged", 2), ("paged", 3), ("paged", 8), ("paged", 16)]


def make_cache(kind: str, block_size: int | None, n_slots: int, n_blocks: int | None = None):
    cfg = MODEL.cfg
    if kind == "slots":
        return SlotKVCache(
            cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, MAX_LEN, torch.float64
        )
    n_blocks = n_blocks or n_slots * math.ceil(MAX_LEN / block_size)  # room for every slot full
    return PagedKVCache(
        cfg.n_layers,
        n_slots,
        cfg.n_kv_heads,
        cfg.head_dim,
        n_blocks,
        block_size,
        MAX_LEN,
        torch.float64,
    )


def check_books(cache) -> None:
    """The paged pool's books balance (every block held once or free once, none lost)."""
    if isinstance(cache, PagedKVCache):
        check_pool(cache)


def state(cache) -> tuple:
    """Everything a planning error must leave as it was."""
    tables = None
    if isinstance(cache, PagedKVCache):
        tables = (
            [list(t) for t in cache.tables],
            list(cache.allocator.free_list),
            list(cache.allocator.allocated),
        )
    return list(cache.active), list(cache.lens), cache._plan, tables


def step(
    cache, rows: list[int], chunks: list[list[int]], pad: int = 0, model=MODEL
) -> torch.Tensor:
    """One ragged step of the model (by default the plain one): row i is slot rows[i] bringing
    the tokens chunks[i]. Returns the logits (B, T, V)."""
    T = max(map(len, chunks))
    idx = torch.tensor([c + [pad] * (T - len(c)) for c in chunks])  # (B, T)
    cache.plan_step(rows, [len(c) for c in chunks])
    with torch.no_grad():
        logits, _ = model(idx, cache=cache)  # (B, T, V)
    return logits


class Row:
    """One sequence: its prompt, its solo tokens, and how far it has been fed."""

    def __init__(self, prompt: list[int], max_new: int):
        self.prompt, self.max_new = prompt, max_new
        self.solo = generate(MODEL, prompt, max_new)
        with torch.no_grad():  # the oracle's logits at every position
            self.full = MODEL(torch.tensor([prompt + self.solo]))[0][0]  # (L, V)
        self.out: list[int] = []
        self.fed = 0  # tokens of the context in the cache
        self.slot: int | None = None

    def context(self) -> list[int]:
        return self.prompt + self.out

    def pending(self) -> list[int]:
        """Tokens known but not yet in the cache: the rest of the prompt, or the last token."""
        return self.context()[self.fed :]

    def take(self, logits: torch.Tensor, chunk: list[int]) -> None:
        """The step's logits (T, V) for this row, which brought chunk: every real column equals
        the full forward pass; the last column of the prompt's end picks the next token."""
        q = len(chunk)
        torch.testing.assert_close(
            logits[:q], self.full[self.fed : self.fed + q], rtol=0, atol=1e-10
        )
        self.fed += q
        if self.fed == len(self.context()):  # the last known token: a new one
            self.out.append(int(logits[q - 1].argmax()))
            assert self.out == self.solo[: len(self.out)], (
                f"prompt {self.prompt}: {self.out} vs solo {self.solo}"
            )

    def done(self) -> bool:
        return len(self.out) == self.max_new


seqs_st = st.lists(
    st.tuples(st.lists(st.integers(0, V - 1), min_size=1, max_size=20), st.integers(1, 12)),
    min_size=1,
    max_size=6,
)


RAGGED_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.large_base_example,
        HealthCheck.data_too_large,
    ],
)
RAGGED_DRAWS = dict(  # the random rows of a ragged run: who, in which cache, how many a step
    seqs=seqs_st,
    kind=st.sampled_from(KINDS),
    n_slots=st.integers(1, 4),
    k=st.integers(1, 6),
    data=st.data(),
)


@RAGGED_SETTINGS
@given(**RAGGED_DRAWS)
def test_ragged_steps_match_solo_generate(seqs, kind, n_slots, k, data):
    """Random rows, each bringing 1..k tokens per step (prompts in random chunks, then one token
    at a time), in random slots and random row order: every real column's logits equal the
    full forward pass, every greedy token equals solo generate(), the books balance. A step
    with padding is packed (its products on the new tokens alone), its rows attending in
    groups: the rows of one token, then the others, each over its own padded rows."""
    ragged_steps(seqs, kind, n_slots, k, data)


def ragged_steps(seqs, kind, n_slots, k, data, model=MODEL) -> None:
    """Random rows through ragged steps of the model (the plain model's own logits are the
    oracle, so a faster attention is held to them)."""
    cache = make_cache(*kind, n_slots)
    waiting = [Row(p, n) for p, n in seqs]
    running: list[Row] = []
    pad = data.draw(st.integers(0, V - 1), label="pad id")
    while waiting or running:
        free = cache.free_slots()
        n_admit = data.draw(st.integers(0 if running else 1, min(len(free), len(waiting))))
        for _ in range(n_admit):
            row = waiting.pop(0)
            row.slot = data.draw(st.sampled_from(cache.free_slots()))
            cache.admit(row.slot, len(row.prompt))
            assert cache.lens[row.slot] == 0
            running.append(row)
        stepping = data.draw(
            st.lists(st.sampled_from(running), min_size=1, max_size=len(running), unique_by=id)
        )
        chunks = [row.pending()[: data.draw(st.integers(1, k))] for row in stepping]
        for row, chunk in zip(stepping, chunks):
            assert cache.reserve(row.slot, len(chunk)), "the pool has room for every slot"
        logits = step(cache, [row.slot for row in stepping], chunks, pad, model)
        for b, (row, chunk) in enumerate(zip(stepping, chunks)):
            row.take(logits[b], chunk)
            assert cache.lens[row.slot] == row.fed
            if row.done():
                cache.release(row.slot)
                running.remove(row)
        check_books(cache)
    assert not any(cache.active) and cache.used_tokens() == 0
    if isinstance(cache, PagedKVCache):
        assert cache.allocated_tokens() == 0 and cache.allocator.n_free() == cache.n_blocks


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(
        st.tuples(st.lists(st.integers(0, V - 1), min_size=1, max_size=16), st.integers(1, 12)),
        min_size=1,
        max_size=3,
    ),
    kind=st.sampled_from(KINDS),
    data=st.data(),
)
def test_rollback_of_wrong_guesses_then_decoding_matches_solo(seqs, kind, data):
    """Speculation's step: a row brings its true next token and k junk guesses (k+1 tokens),
    keeps the first and rolls back k; decoding goes on with exactly the solo tokens, and the
    paged cache gives back every block left holding no token."""
    rows = [Row(p, n) for p, n in seqs]
    cache = make_cache(*kind, len(rows))
    for s, row in enumerate(rows):  # every prompt prefilled in one step
        row.slot = s
        cache.admit(s, len(row.prompt))
    logits = step(cache, [r.slot for r in rows], [r.prompt for r in rows])
    for b, row in enumerate(rows):
        row.take(logits[b], row.prompt)
        if row.done():
            cache.release(row.slot)
    live = [r for r in rows if not r.done()]
    while live:
        ks = [data.draw(st.integers(0, 5), label="junk guesses") for _ in live]
        chunks = [
            r.pending() + [data.draw(st.integers(0, V - 1)) for _ in range(kk)]
            for r, kk in zip(live, ks)
        ]
        for r, chunk in zip(live, chunks):
            assert len(r.pending()) == 1 and cache.reserve(r.slot, len(chunk))
        logits = step(cache, [r.slot for r in live], chunks)
        for b, (r, kk) in enumerate(zip(live, ks)):
            assert cache.lens[r.slot] == r.fed + 1 + kk
            r.take(logits[b], chunks[b][:1])  # only the first column is right
            cache.rollback(r.slot, kk)
            assert cache.lens[r.slot] == r.fed
            if isinstance(cache, PagedKVCache):
                assert len(cache.tables[r.slot]) == cache.blocks_for(r.fed), (
                    "the blocks holding no token went back to the pool"
                )
        check_books(cache)
        for r in [r for r in live if r.done()]:
            cache.release(r.slot)
            live.remove(r)
    for r in rows:
        assert r.out == r.solo
    check_books(cache)
    assert not any(cache.active)
    if isinstance(cache, PagedKVCache):
        assert cache.allocator.n_free() == cache.n_blocks, "nothing leaked"


@pytest.mark.parametrize("kind", KINDS[:3], ids=lambda k: f"{k[0]}-{k[1]}")
def test_bad_rollbacks_raise_and_change_nothing(kind):
    """Rolling back more than a row holds, or a free slot, raises ValueError naming the slot."""
    cache = make_cache(*kind, 3)
    cache.admit(1, 5)
    step(cache, [1], [[1, 2, 3, 4, 5]])
    before = state(cache)
    with pytest.raises(ValueError, match="cannot roll slot 1 back by 6: it holds 5 tokens"):
        cache.rollback(1, 6)
    with pytest.raises(ValueError, match="cannot roll slot 1 back by -1"):
        cache.rollback(1, -1)
    with pytest.raises(ValueError, match="cannot roll slot 0 back by 0"):
        cache.rollback(0, 0)
    assert state(cache) == before
    cache.rollback(1, 5)  # all of it: allowed, the slot stays busy
    assert cache.active[1] and cache.lens[1] == 0
    check_books(cache)
    cache.release(1)
    with pytest.raises(ValueError, match="cannot roll slot 1 back"):
        cache.rollback(1, 0)
    check_books(cache)


@pytest.mark.parametrize("kind", KINDS[:3], ids=lambda k: f"{k[0]}-{k[1]}")
def test_planning_errors_are_named_and_change_nothing(kind):
    """A free slot, a duplicate slot, q_len 0, no q_len, past the capacity, a batch of the
    wrong width, an end or a begin without a plan: each a ValueError naming the problem, and
    the cache as it was; the right step still runs after them."""
    cache = make_cache(*kind, 3)
    cache.admit(0, 3)
    cache.admit(2, 2)
    step(cache, [2, 0], [[7, 8], [1, 2, 3]])
    before = state(cache)
    cap = MAX_LEN if kind[0] == "slots" else 4  # paged: the blocks of 3 tokens + 1
    cases = [
        (([1], [1]), "slot 1 is free: admit a sequence before stepping it"),
        (([0, 0], [1, 1]), r"a step needs distinct slots and one q_len each, got \[0, 0\]"),
        (([0, 2], [1]), "a step needs distinct slots and one q_len each"),
        (([], []), "a step needs distinct slots"),
        (([0], [0]), "slot 0: a row brings q_len >= 1 new tokens, got 0"),
        (([2], [-1]), "slot 2: a row brings q_len >= 1 new tokens, got -1"),
        (
            ([0], [cap - 3 + 1]),
            f"slot 0 holds 3 tokens and has room for {cap}: it cannot take {cap - 3 + 1} more",
        ),
    ]
    for (rows, q_lens), words in cases:
        with pytest.raises(ValueError, match=words):
            cache.plan_step(rows, q_lens)
        assert state(cache) == before, (rows, q_lens)
    with pytest.raises(ValueError, match="no step planned: call plan_step"):
        cache.end_step()
    with pytest.raises(ValueError, match="no step planned: call plan_step"):
        MODEL(torch.tensor([[1]]), cache=cache)
    assert state(cache) == before
    cache.plan_step([0, 2], [1, 1])
    planned = state(cache)
    for T in (2, 3):
        with pytest.raises(
            ValueError, match=f"the step was planned for 1 columns, the batch has {T}"
        ):
            MODEL(torch.ones(2, T, dtype=torch.long), cache=cache)
        assert state(cache) == planned, "the plan still stands, nothing written counts"
    logits = step(cache, [0, 2], [[4], [9]])  # re-planned: the right step runs
    assert cache.lens[0] == 4 and cache.lens[2] == 3 and cache._plan is None
    with torch.no_grad():
        torch.testing.assert_close(
            logits[0, 0], MODEL(torch.tensor([[1, 2, 3, 4]]))[0][0, -1], rtol=0, atol=1e-10
        )
        torch.testing.assert_close(
            logits[1, 0], MODEL(torch.tensor([[7, 8, 9]]))[0][0, -1], rtol=0, atol=1e-10
        )
    check_books(cache)


def test_paged_step_past_the_blocks_needs_a_reserve():
    """Admission gives the paged cache blocks for the context and its next token; a step past
    them is refused until reserve() takes more blocks, which it gives back when it has none."""
    cache = make_cache("paged", 4, 2, n_blocks=3)
    cache.admit(0, 3)  # 3 tokens + 1: one block
    step(cache, [0], [[1, 2, 3]])
    assert cache.tables[0] and len(cache.tables[0]) == 1
    before = state(cache)
    with pytest.raises(
        ValueError, match="has room for 4: it cannot take 2 more \\(reserve first\\)"
    ):
        cache.plan_step([0], [2])
    assert state(cache) == before
    assert cache.reserve(0, 9) and len(cache.tables[0]) == 3 and cache.allocator.n_free() == 0
    assert not cache.reserve(0, 10), "the pool is dry"
    assert len(cache.tables[0]) == 3, "a refused reserve takes nothing"
    check_pool(cache)
    assert cache.never_fits(13) == "needs 4 blocks of 4, but the whole KV pool has 3"
    assert cache.never_fits(12) is None


def test_admit_starts_empty_and_refuses_what_cannot_fit():
    """admit claims a free slot at length 0; a busy slot, an empty or too long context, or a
    context of another length than n_tokens, is refused."""
    cache = make_cache("slots", None, 2)
    cache.admit(1, 5)
    assert cache.active == [False, True] and cache.lens == [0, 0]
    with pytest.raises(ValueError, match="slot 1 is already serving a request"):
        cache.admit(1, 2)
    for n in (0, MAX_LEN):
        with pytest.raises(
            ValueError, match=f"a context of {n} tokens does not fit a slot of {MAX_LEN}"
        ):
            cache.admit(0, n)
    with pytest.raises(
        ValueError,
        match=r"admit\(slot, 3, context\) was given a context of 2 "
        r"tokens",
    ):
        cache.admit(0, 3, [1, 2])
    with pytest.raises(ValueError, match="can_admit takes a context per length: 2 lengths, 1"):
        cache.can_admit([3, 4], [[1, 2, 3]])
    assert cache.can_admit([3], [[1, 2, 3]]), "a slot cache looks only at the lengths"
    paged = make_cache("paged", 4, 2, n_blocks=2)
    with pytest.raises(ValueError, match="a context of 8 tokens needs 3 blocks, 2 are free"):
        paged.admit(0, 8)
    assert paged.active == [False, False] and paged.allocator.n_free() == 2
    check_pool(paged)


def test_admit_of_a_slot_out_of_range_is_refused():
    """A slot number outside 0..n_slots-1 is refused, not read as a Python negative index."""
    cache = make_cache("slots", None, 3)
    for slot in (-1, 3, 1.0):
        with pytest.raises(ValueError, match=f"slot {slot!r} is not one of"):
            cache.admit(slot, 3)
    with pytest.raises(ValueError, match="slot 7 is not one of"):
        cache.plan_step([7], [1])
    assert cache.active == [False, False, False], "admit(-1) claimed a slot"


def test_a_batch_of_the_wrong_height_is_named():
    """A forward pass whose batch has another number of rows than the plan is a named error."""
    cache = make_cache("slots", None, 3)
    cache.admit(0, 2)
    cache.admit(1, 2)
    step(cache, [0, 1], [[1, 2], [3, 4]])
    cache.plan_step([0, 1], [1, 1])
    with pytest.raises(ValueError, match="rows"):
        MODEL(torch.ones(1, 1, dtype=torch.long), cache=cache)
