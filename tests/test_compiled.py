"""Step 06 on a CPU - the compiled decoder (torch.compile of the bucketed decode step) gives each
request its solo generate() tokens: exactly in float64 and float32, up to near-ties in bf16,
where every path is checked (the compiled one in float32 in mode max-autotune, where it is
exact). Compilation is slow, so every test shares a few small shapes."""

import pickle
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.conftest import make_tiny
from tests.test_engine import TINY, V, assert_oracle, requests_st, solo
from tinyllm.core.compiled import CompiledDecoder, CompiledSteps
from tinyllm.core.generate import generate
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.prefix_cache import PrefixCache
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.core.static import run_static
from tinyllm.course.check import divergence, near_tie
from tinyllm.engine import Request, make_engine, run_continuous

pytestmark = pytest.mark.slow  # torch.compile's compiles

BUCKETS = (16,)  # over slots of 48 positions: above 16 the step runs eagerly


@pytest.fixture(scope="module")
def compiled():
    """A compiled decoder of 3 slots over the tiny float64 model, shared by the tests below
    (a decoder passed to an engine is reused with its compiled steps)."""
    cfg = TINY.cfg
    slots = SlotKVCache(cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim, 48, torch.float64)
    return CompiledDecoder(TINY, slots, BUCKETS)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_st)
def test_compiled_decoder_matches_solo(compiled, requests):
    """Random workloads (several EOS ids, slots joining and leaving, windows in the bucket and
    above it) through the compiled decode step: each request's solo tokens, and the slots
    free afterwards."""
    results, summary = run_continuous(TINY, requests, 3, decoder=compiled)
    assert_oracle(requests, results)
    assert not any(compiled.slots.active) and compiled.slots.lens == [0, 0, 0], "a slot leaked"
    assert summary["occupancy"] == summary["row_util"], "the compiled step computes every slot"


@pytest.fixture(scope="module", params=[False, True], ids=["paged", "paged+prefix"])
def compiled_paged(request):
    """A compiled decoder over a tight paged pool of 3 slots (16 blocks of 4, room for the
    largest request and a little more), with or without a prefix cache."""
    cfg = TINY.cfg
    pool = PagedKVCache(
        cfg.n_layers,
        3,
        cfg.n_kv_heads,
        cfg.head_dim,
        16,
        4,
        48,
        torch.float64,
        prefix_cache=PrefixCache if request.param else None,
    )
    return CompiledDecoder(TINY, pool, BUCKETS)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_st)
def test_compiled_decoder_over_a_paged_pool_matches_solo(compiled_paged, requests):
    """The compiled step over a paged pool (its block tables a static input, 06), the engine's
    settings taken from the decoder's pool: random workloads that may preempt, each request's
    solo tokens, the books sound and every block back at the end."""
    pool = compiled_paged.slots
    results, summary = run_continuous(TINY, requests, 3, decoder=compiled_paged)
    assert_oracle(requests, results)
    why = pool.check_integrity(idle=True)
    assert why is None, why
    if pool.prefix is None:
        assert pool.allocated_tokens() == 0, "a block leaked"
    else:
        assert sum(pool.prefix.refs) == 0, "a block is still referenced"
    assert summary["occupancy"] == summary["row_util"], "the compiled step computes every slot"
    assert set(compiled_paged.compile_s) <= set(BUCKETS)


def test_each_bucket_compiles_once_and_is_replayed(compiled):
    """The steps start in the bucket and the long requests pass it (run alone too: the bucket
    is compiled here if no test before compiled it); a second run of the same work compiles
    nothing new (a recompilation per step would cost seconds a step), and its tokens are the
    same."""
    reqs = [Request([1, 2, 3], 40), Request([4] * 5, 20), Request([5], 6, eos_id=(3, 11))]
    first, _ = run_continuous(TINY, reqs, 3, decoder=compiled)
    assert set(compiled.compile_s) == set(BUCKETS), f"compiled {sorted(compiled.compile_s)}"
    assert all(s > 0 for s in compiled.compile_s.values())
    before = unique_graphs()
    second, _ = run_continuous(TINY, reqs, 3, decoder=compiled)
    assert unique_graphs() == before, "the second run compiled again"
    assert [r.tokens for r in first] == [r.tokens for r in second] == [solo(r) for r in reqs]


def test_a_process_compiles_more_decoders_than_torch_compiles_limit(monkeypatch):
    """Found by the oracle over every setting: each (decoder, bucket) is one compiled entry of
    the same code, and past torch.compile's recompile limit a step compiled with fullgraph
    fails. Every new decoder lifts the limit by its buckets, so a process (a long-running
    notebook, a benchmark of many engines) may make as many as it likes."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = len(_debug_get_cache_entry_list(CompiledDecoder.run_eager.__code__))
    monkeypatch.setattr("tinyllm.core.compiled.RECOMPILE_LIMIT", 1)  # room for one entry more
    cfg, req = TINY.cfg, Request([1, 2, 3], 3)
    with torch._dynamo.config.patch(recompile_limit=entries + 1):
        for W in (8, 9, 10):  # a bucket of its own each: one more compiled entry each
            slots = SlotKVCache(cfg.n_layers, 1, cfg.n_kv_heads, cfg.head_dim, W, torch.float64)
            decoder = CompiledDecoder(TINY, slots, (W,))
            results, _ = run_continuous(TINY, [req], 1, decoder=decoder)
            assert results[0].tokens == solo(req) and decoder.compile_s


def test_a_compiled_decoder_travels_without_its_compiled_steps(compiled):
    """Pickled (the server sends its engine to another process), a compiled decoder leaves its
    compiled steps behind, which belong to this process, and keeps its cache and settings."""
    compiled.warm_up()
    copy = pickle.loads(pickle.dumps(compiled))
    assert isinstance(copy.graphs, CompiledSteps) and not copy.graphs and copy.compile_s == {}
    assert copy.graphs.decoder is copy and copy.buckets == compiled.buckets
    assert torch.equal(copy.slots.k[0], compiled.slots.k[0]) and copy.mode == compiled.mode


def test_compiled_decoder_settings_are_checked(compiled):
    with pytest.raises(ValueError, match="decoder must be one of 'eager', 'graphs', 'compiled'"):
        make_engine(TINY, 2, decoder="fast")
    with pytest.raises(TypeError, match="cuda_graph"):  # one keyword per idea: decoder=
        make_engine(TINY, 2, cuda_graph=True)
    with pytest.raises(
        ValueError, match="compile_mode must be one of 'default', 'max-autotune', got 'fast'"
    ):
        make_engine(TINY, 2, decoder="compiled", compile_mode="fast")
    with pytest.raises(ValueError, match="compile_mode is the compiled decoder's"):
        make_engine(TINY, 2, compile_mode="max-autotune")
    with pytest.raises(ValueError, match="compiled in mode 'default'"):
        make_engine(TINY, 3, decoder=compiled, compile_mode="max-autotune")
    with pytest.raises(ValueError, match="mode must be one of"):
        CompiledDecoder(TINY, compiled.slots, mode="max_autotune")
    with pytest.raises(KeyError, match="not a bucket"):
        compiled.graphs[12]
    eng = make_engine(TINY, 3, decoder=compiled)
    assert eng.config.decoder == "compiled" and eng.decoder is compiled
    eng.add_request(Request([1, 2], 5))
    eng.step()
    with pytest.raises(ValueError, match="while they are free"):
        compiled.warm_up()
    eng.abort(0)


# ---- float32 exactly, bf16 up to near-ties (the tiny model in each dtype) -----------------------
@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def low(request):
    """The tiny model (the same weights) in float32 or bf16, and a workload for it: random
    prompts, several EOS ids, answers long enough to pass the 32-position bucket. Its matrix
    products are all 64 x 64 but the output's (as many KV heads as query heads, d_ff = d_model),
    so that max-autotune generates one GEMM kernel for them, not five: it compiles in half the
    time."""
    model = make_tiny(seed=3, dtype=request.param, d_ff=64, n_kv_heads=4)
    rng = random.Random(1)
    reqs = [
        Request(
            [rng.randrange(V) for _ in range(rng.randint(1, 20))],
            rng.randint(8, 40),
            eos_id=rng.choice([None, 5, (3, 11)]),
        )
        for _ in range(12)
    ]
    return model, reqs


@pytest.mark.parametrize("path", ["static", "continuous", "paged", "graphs", "compiled"])
def test_float32_is_exact_and_bf16_parts_only_at_near_ties(low, path):
    """Every path in float32 gives solo float32 generate()'s tokens exactly (the compiled step,
    here in mode max-autotune, with frozen weights and inductor's own GEMM kernels, computes
    logits that differ from eager ones by rounding, about 1e-7 here, far below any gap between
    two candidate tokens); in bf16 (a documented choice on the CPU, faster where it computes in
    bf16) every path gives solo bf16 generate()'s tokens, or parts from them only where solo
    stood at a near-tie (the compiled step in the default mode: one compilation less)."""
    model, reqs = low
    dtype = next(model.parameters()).dtype
    if path == "static":
        results = run_static(model, reqs, 3)[0]
    else:
        kw = (
            dict(kv="paged")
            if path == "paged"
            else dict(decoder=path, max_len=64, buckets=(32,))
            if path != "continuous"
            else {}
        )
        if path == "compiled" and dtype == torch.float32:
            kw["compile_mode"] = "max-autotune"
        results = run_continuous(model, reqs, 3, **kw)[0]
    for i, (r, res) in enumerate(zip(reqs, results)):
        expected = generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id)
        if dtype == torch.float32:
            msg = divergence(f"{path}, request {i}", expected, res.tokens)
            assert msg is None, msg
        else:
            ok, what = near_tie(model, r.prompt, expected, res.tokens)
            assert ok, f"{path} in bf16, request {i}: {what}"
