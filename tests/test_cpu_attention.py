"""Step 13 - attention in C where the cache keeps the keys (cpu_attention.py): installed on a
model, its decode steps and its packed steps' short rows attend in one decode_attention call a
layer, and every row's logits are the plain model's, on random ragged steps of slot and paged
caches; the engine's steps call it as often as they should, and give the solo tokens."""

import copy
import threading
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import MIXED_REQUESTS, make_tiny
from tests.test_ragged import MODEL, RAGGED_DRAWS, RAGGED_SETTINGS, ragged_steps
from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.core.model import Attention
from tinyllm.core.requests import Request
from tinyllm.ext import cpu_attention, cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no C compiler: the kernels cannot be built"
)
C_MODEL = cpu_attention.install(copy.deepcopy(MODEL))
REQS = MIXED_REQUESTS[:4]


@RAGGED_SETTINGS
@given(split=st.booleans(), **RAGGED_DRAWS)
def test_ragged_steps_in_c_match_the_plain_model(seqs, kind, n_slots, k, split, data):
    """Random rows bringing 1..k tokens a step, in random slots and order (test_ragged's
    workload): with the C attention every real column's logits are the plain model's full
    forward pass (float64) and every greedy token solo generate()'s. Every row's tokens attend
    in the kernel (rows of at most QUERY_ROWS tokens), or split: the rows of one token in the
    kernel, the longer ones in the library (QUERY_ROWS 1)."""
    with mock.patch("tinyllm.ext.cpu_attention.QUERY_ROWS", 1) if split else mock.MagicMock():
        ragged_steps(seqs, kind, n_slots, k, data, model=C_MODEL)


def test_install_shares_the_weights_and_is_done_once():
    """install puts a CAttention in each layer, holding the same projections; twice is once."""
    model = make_tiny(seed=5)
    q = model.layers[0].self_attn.q_proj
    assert cpu_attention.install(model) is model
    attn = model.layers[0].self_attn
    assert isinstance(attn, cpu_attention.CAttention) and attn.q_proj is q
    cpu_attention.install(model)
    assert model.layers[0].self_attn is attn
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in make_tiny(seed=5).parameters()
    )
    assert isinstance(attn, Attention), "it takes Attention's place: every cache still works"


def test_a_servers_model_attends_as_the_model_while_the_kernels_build(monkeypatch):
    """Installed with wait_for_kernels=False (serve's model), a step where the kernels are not
    built yet starts their build in a thread and attends as the model does (the solo tokens,
    no kernel call); once built, the steps attend in the kernel."""
    calls, built, ops = [], threading.Event(), cpu_kernels.library()
    kernel = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(cpu_kernels, "_built", None)
    monkeypatch.setattr(cpu_kernels, "_builder", None)
    monkeypatch.setattr(cpu_kernels, "loads_now", lambda: False)  # as where nothing is built
    monkeypatch.setattr(cpu_kernels, "library", lambda: built.wait(10) and ops)
    model = cpu_attention.install(make_tiny(seed=4), wait_for_kernels=False)
    want = [solo(make_tiny(seed=4), r).tokens for r in REQS]
    for building in (True, False):
        eng = make_engine(model, 2)
        rids = [eng.add_request(r) for r in REQS]
        while eng.has_work():
            eng.step()
        assert [eng.results[r].tokens for r in rids] == want
        assert bool(calls) != building and cpu_kernels._builder.is_alive() == building
        built.set()
        cpu_kernels._builder.join(10)


@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_every_decode_step_attends_in_the_c_kernel_on_slot_and_paged_caches(kv, monkeypatch):
    """On a CPU in float32 and float64, the engine's steps attend in decode_attention, a call
    a layer: its decodes, and a packed step (prompts of different lengths, or a newcomer's
    prompt beside the decodes, in one pass: a query row per new token); prompts of one length,
    whole rows with no padding, go to the library. Its tokens are the solo ones."""
    calls = []
    kernel = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a: calls.append(1) or kernel(*a))
    same = [Request([1, 2, 3], 5, eos_id=0), Request([4, 5, 6], 7, eos_id=0)]
    for dtype in (torch.float32, torch.float64):
        model = cpu_attention.install(make_tiny(seed=4, dtype=dtype))
        kw = dict(kv=kv, block_size=4) if kv == "paged" else dict(kv=kv)
        for reqs, whole in ((REQS[:3], 0), (same, 1)):  # REQS[2] joins beside a decode
            eng = make_engine(model, 2, **kw)
            mixed, prefill = [], eng.runner.prefill

            def counted(chunks, decodes=(), prefill=prefill, mixed=mixed):
                mixed.append(bool(decodes))
                return prefill(chunks, decodes)

            eng.runner.prefill = counted
            rids = [eng.add_request(r) for r in reqs]
            steps = 0
            while eng.has_work():
                eng.step()
                steps += 1
            got = [eng.results.pop(r).tokens for r in rids]
            assert got == [solo(model, r).tokens for r in reqs]
            assert mixed == [False, True][: len(reqs) - 1], "a newcomer joins beside a decode"
            assert len(calls) == (steps - whole) * model.cfg.n_layers, f"{dtype}: {len(calls)}"
            calls.clear()
