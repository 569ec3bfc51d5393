"""Exercise 04 - continuous batching: your admission and prefill move inside ContinuousEngine."""

import random

import torch

from tinyllm import continuous, kv_cache
from tinyllm.check import divergence
from tinyllm.engine import ContinuousEngine, Request, prefill_padded, run_continuous
from tinyllm.generate import generate
from tinyllm.kv_cache import SlotKVCache
from tests.conftest import make_tiny

EXERCISE = "ex04_continuous_batching"
TINY = make_tiny(seed=5)


def test_admission_is_first_come_first_served(impl):
    got = impl.choose_admissions([7, 3, 9, 4], 3, lambda rids: True)
    assert got == [7, 3, 9], f"3 free slots, everything fits: admit the first 3 in order, got {got}"


def test_admission_stops_at_the_first_request_that_does_not_fit(impl):
    fits = lambda rids: sum(rids) <= 10
    got = impl.choose_admissions([4, 5, 9, 1], 4, fits)
    assert got == [4, 5], (f"with fits = sum <= 10, queue [4, 5, 9, 1]: admit [4, 5] and stop at 9 "
                           f"(no overtaking: 1 waits behind 9), got {got}")


def test_admission_with_nothing_to_do(impl):
    assert impl.choose_admissions([], 4, lambda r: True) == []
    assert impl.choose_admissions([1, 2], 0, lambda r: True) == [], "no free slot: admit nobody"
    assert impl.choose_admissions([1, 2], 2, lambda r: False) == [], "the head does not fit: admit nobody"


def test_move_prefill_drops_padding_into_slots(impl):
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    _, pre, pad = prefill_padded(TINY, prompts, max_len=5)
    cfg = TINY.cfg
    slots = SlotKVCache(cfg.n_layers, 4, cfg.n_kv_heads, cfg.head_dim, 16, torch.float64, "cpu")
    target = [3, 0, 2]
    impl.move_prefill(slots.k, slots.v, pre, target, pad)
    for layer in range(cfg.n_layers):
        for i, (s, p) in enumerate(zip(target, pad)):
            n = 5 - p
            assert torch.equal(slots.k[layer][s, :, :n], pre.k[layer][i, :, p:]), \
                f"layer {layer}: slot {s} should hold prompt {i}'s {n} real keys at positions 0..{n - 1}"
            assert torch.equal(slots.v[layer][s, :, :n], pre.v[layer][i, :, p:]), \
                f"layer {layer}: slot {s} should hold prompt {i}'s {n} real values"
            assert (slots.k[layer][s, :, n:] == 0).all(), f"slot {s}: nothing past position {n - 1}"
        assert (slots.k[layer][1] == 0).all(), "slot 1 admitted nobody and must stay untouched"


def requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(97) for _ in range(rng.randint(1, 20))], rng.randint(1, 20),
                    eos_id=rng.choice([None, 5, 9])) for _ in range(n)]


def solo(reqs):
    return [generate(TINY, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]


def test_continuous_batching_with_your_functions_matches_solo(impl, monkeypatch):
    reqs = requests(14, 0)
    expected = solo(reqs)
    monkeypatch.setattr(continuous, "choose_admissions", impl.choose_admissions)
    monkeypatch.setattr(kv_cache, "move_prefill", impl.move_prefill)
    for n_slots in (1, 3, 6):
        results, summary = run_continuous(TINY, reqs, n_slots)
        for i, (e, r) in enumerate(zip(expected, results)):
            msg = divergence(f"request {i} ({n_slots} slots)", e, r.tokens)
            assert msg is None, msg
        assert summary["peak_active"] <= n_slots


def test_requests_arriving_while_others_decode(impl, monkeypatch):
    """Requests join mid-run, one every other step: still solo tokens, and every slot freed."""
    reqs = requests(10, 1)
    expected = solo(reqs)
    monkeypatch.setattr(continuous, "choose_admissions", impl.choose_admissions)
    monkeypatch.setattr(kv_cache, "move_prefill", impl.move_prefill)
    eng = ContinuousEngine(TINY, 3)
    rids, step = [], 0
    while len(rids) < len(reqs) or eng.has_work():
        if step % 2 == 0 and len(rids) < len(reqs):
            rids.append(eng.add_request(reqs[len(rids)]))
        eng.step()
        step += 1
    for i, rid in enumerate(rids):
        msg = divergence(f"request {i}", expected[i], eng.results[rid].tokens)
        assert msg is None, msg
    assert not any(eng.slots.active), "every slot is free at the end"
