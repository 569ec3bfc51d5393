"""Exercise 05 - the paged KV cache: your allocator, block-table lookup and preemption choice
inside the paged engine."""

import random

import pytest
import torch

from tinyllm.check import divergence
from tinyllm.continuous import run_continuous
from tinyllm.generate import generate
from tinyllm.requests import Request
from tests.conftest import make_tiny

EXERCISE = "ex05_paged_kv"
TINY = make_tiny(seed=6)


def test_allocate_takes_blocks_off_the_end_of_the_free_list(impl):
    """Blocks come off the end of the free list, in pop order, and are marked allocated."""
    free, allocated = [3, 2, 1, 0], [False] * 4
    got = impl.allocate_blocks(free, allocated, 2)
    assert got == [0, 1], f"the free list [3, 2, 1, 0] hands out 0 then 1, got {got}"
    assert free == [3, 2], f"0 and 1 leave the free list, which is now {free}"
    assert allocated == [True, True, False, False], f"0 and 1 are marked allocated: {allocated}"


def test_allocate_more_than_is_free_changes_nothing(impl):
    """Asking for more blocks than are free gives None and takes nothing; asking for 0 gives []."""
    free, allocated = [3, 2], [True, True, False, False]
    assert impl.allocate_blocks(free, allocated, 3) is None, "3 blocks asked, 2 free: None"
    assert free == [3, 2] and allocated == [True, True, False, False], "and nothing taken"
    assert impl.allocate_blocks(free, allocated, 0) == [], "no block asked: none given"


def test_free_gives_blocks_back(impl):
    """Freed blocks return to the free list with their flags cleared, ready to be handed out."""
    free, allocated = [3], [True, True, True, False]
    impl.free_blocks(free, allocated, [1, 0])
    assert sorted(free) == [0, 1, 3], f"0 and 1 are free again, free list {free}"
    assert allocated == [False, False, True, False], f"their flags are cleared: {allocated}"
    assert sorted(impl.allocate_blocks(free, allocated, 3)) == [0, 1, 3]


@pytest.mark.parametrize("blocks", [[0], [2, 2], [2, 7]])
def test_double_free_is_refused_and_changes_nothing(impl, blocks):
    """A free block, a block given twice or one outside the pool: ValueError, nothing changed."""
    free, allocated = [1, 0], [False, False, True, True]
    with pytest.raises(ValueError, match="block"):
        impl.free_blocks(free, allocated, blocks)
    assert free == [1, 0] and allocated == [False, False, True, True], \
        f"freeing {blocks} must fail before changing anything"


def test_slot_mapping_follows_the_block_table(impl):
    """Position p of a row is pool row table[p // block_size] * block_size + p % block_size."""
    tables = torch.tensor([[5, 2], [7, 0]])
    positions = torch.tensor([[0, 3, 4, 7], [1, 5, 0, 2]])
    got = impl.slot_mapping(tables, positions, 4)
    want = torch.tensor([[20, 23, 8, 11], [29, 1, 28, 30]])
    assert torch.equal(got, want), (f"block size 4: position p of a row lives in pool row "
                                    f"table[p // 4] * 4 + p % 4; want {want.tolist()}, got {got.tolist()}")


def test_the_youngest_request_is_preempted(impl):
    """The slot whose request arrived last gives up its memory."""
    assert impl.choose_victim({0: 3, 2: 9, 5: 1}) == 2, "slot 2 holds the request that arrived last"
    assert impl.choose_victim({4: 0}) == 4


def requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(97) for _ in range(rng.randint(1, 20))], rng.randint(1, 30),
                    eos_id=rng.choice([None, 5])) for _ in range(n)]


def test_paged_engine_with_your_functions_matches_solo(plug):
    """A pool too small for everyone at once: requests are preempted and recomputed, and
    still each gets exactly its solo tokens, and every block comes back."""
    plug()
    reqs = requests(12, 0)
    expected = [generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    for block_size, n_blocks in ((4, 14), (1, 52), (8, 7)):
        results, summary = run_continuous(TINY, reqs, 4, kv="paged", block_size=block_size,
                                          kv_blocks=n_blocks)
        for i, (e, r) in enumerate(zip(expected, results)):
            msg = divergence(f"request {i} (blocks of {block_size})", e, r.tokens)
            assert msg is None, msg
        assert summary["preemptions"] > 0, \
            f"blocks of {block_size}, {n_blocks} of them: the pool is small enough that someone is preempted"
        assert summary["kv_allocated_at_end"] == 0, \
            f"every block is freed at the end, {summary['kv_allocated_at_end']} positions are still allocated"
