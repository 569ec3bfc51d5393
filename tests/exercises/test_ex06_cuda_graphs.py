"""Exercise 06 - CUDA graphs: your bucket choice and static-buffer copy inside the graph
decoder, run eagerly (capture=False), so on any machine."""

import random

import pytest
import torch

from tinyllm.check import divergence
from tinyllm.continuous import run_continuous
from tinyllm.generate import generate
from tinyllm.requests import Request
from tests.conftest import make_tiny

EXERCISE = "ex06_cuda_graphs"
TINY = make_tiny(seed=7)


@pytest.mark.parametrize("window, want", [(1, 32), (31, 32), (32, 32), (33, 64), (100, 128), (128, 128)])
def test_the_smallest_bucket_that_holds_the_window(impl, window, want):
    """The smallest bucket >= the window: an exact fit included."""
    got = impl.choose_bucket([32, 64, 128], window)
    assert got == want, f"buckets [32, 64, 128], window {window}: want {want}, got {got}"


def test_a_window_beyond_every_bucket_has_no_bucket(impl):
    """A window larger than every bucket: None, and the step runs eagerly."""
    got = impl.choose_bucket([32, 64, 128], 129)
    assert got is None, f"window 129 > every bucket: None (the step runs eagerly), got {got}"


def test_fill_static_writes_into_the_buffers(impl):
    """The static buffers get copies of the step's inputs, in their own memory."""
    static_tokens = torch.zeros(3, 1, dtype=torch.long)
    static_lens = torch.zeros(3, dtype=torch.long)
    where = (static_tokens.data_ptr(), static_lens.data_ptr())
    tokens, lens = torch.tensor([[7], [8], [9]]), torch.tensor([4, 0, 11])
    impl.fill_static(static_tokens, static_lens, tokens, lens)
    assert static_tokens.tolist() == [[7], [8], [9]] and static_lens.tolist() == [4, 0, 11], \
        "the static buffers hold the step's tokens and lengths"
    assert (static_tokens.data_ptr(), static_lens.data_ptr()) == where, "same memory"
    tokens[0, 0], lens[0] = 99, 99
    assert static_tokens[0, 0] == 7 and static_lens[0] == 4, \
        "the buffers hold copies: a graph must not read tensors the caller reuses"


def test_graph_decoder_with_your_functions_matches_solo(plug):
    """The graph decoder (run eagerly) with your functions: every request gets its solo tokens."""
    plug()
    rng = random.Random(0)
    reqs = [Request([rng.randrange(97) for _ in range(rng.randint(1, 20))], rng.randint(1, 40),
                    eos_id=rng.choice([None, 5])) for _ in range(10)]
    expected = [generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    for n_slots, buckets in ((3, (8, 16, 32)), (5, None)):
        results, summary = run_continuous(TINY, reqs, n_slots, cuda_graph=True, buckets=buckets)
        for i, (e, r) in enumerate(zip(expected, results)):
            msg = divergence(f"request {i} ({n_slots} slots, buckets {buckets})", e, r.tokens)
            assert msg is None, msg
