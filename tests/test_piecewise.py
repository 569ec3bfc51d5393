"""Step 13 - the decode step compiled in pieces: on any cache, with any weights (float, int8,
int4) and with speculation, every request gets its solo tokens; the pieces compile once for all
the layers; the settings that cannot go with them are refused by name."""

import pickle
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MIXED_REQUESTS as REQS
from tests.conftest import free_port, make_tiny, run_serve
from tests.test_fused_layer import RANDOM_ENGINES, requests_st
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.generate import solo
from tinyllm.core.parts import DecodeStep
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.ext import piecewise
from tinyllm.ext.piecewise import PiecewiseDecoder
from tinyllm.ext.quant import quantize

pytestmark = pytest.mark.slow  # torch.compile's compiles

MODELS = {
    "float": quantize(make_tiny(seed=21), "float"),
    "int8": quantize(make_tiny(seed=21), "int8"),
    "int4": quantize(make_tiny(seed=21), "int4"),
}


def serve(model, reqs, **kw) -> tuple[list[list[int]], ContinuousEngine]:
    eng = make_engine(model, 2, decoder="pieces", **kw)  # programs for 1 and 2 rows
    rids = [eng.add_request(r) for r in reqs]
    while eng.has_work():
        eng.step()
        assert eng.cache.check_integrity() is None
    assert eng.cache.check_integrity(idle=True) is None and not eng._seqs
    return [eng.results.pop(rid).tokens for rid in rids], eng


@pytest.mark.parametrize("weights", sorted(MODELS))
@pytest.mark.parametrize(
    "kw",
    [
        dict(kv="slots"),
        dict(kv="paged", block_size=4, kv_blocks=7),  # a tight pool: preemptions
        dict(kv="paged", block_size=4, prefix_cache=True, max_step_tokens=5),
    ],
    ids=["slots", "paged-tight", "paged-prefix-chunked"],
)
def test_the_engine_in_pieces_gives_the_solo_tokens(weights, kw):
    model = MODELS[weights]
    want = [solo(model, r).tokens for r in REQS]
    got, eng = serve(model, REQS, **kw)
    assert got == want, f"{weights}, {kw}"
    assert isinstance(eng.decoder, PiecewiseDecoder)
    assert "kv_blocks" not in kw or eng.stats.preemptions > 0, "the tight pool preempts"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=requests_st,
    weights=st.sampled_from(sorted(MODELS)),
    kind=st.sampled_from(list(RANDOM_ENGINES)),
)
def test_random_workloads_through_the_engine_in_pieces_are_solo(requests, weights, kind):
    """Greedy and seeded sampled requests of random lengths, each kind of weights, on slots, a
    tight paged pool (preemptions) and a prefix cache with a token budget: each request's solo
    tokens (the pieces held to the eager step on the same random workloads)."""
    model = MODELS[weights]
    want = [solo(model, r).tokens for r in requests]
    got, _ = serve(model, requests, **RANDOM_ENGINES[kind])
    assert got == want, f"{weights}, {kind}"


def test_speculation_verifies_eagerly_beside_the_pieces():
    model = MODELS["float"]
    greedy = [r for r in REQS if r.sampling is None]
    want = [solo(model, r).tokens for r in greedy]
    got, eng = serve(model, greedy, speculate="ngram", spec_tokens=3)
    assert got == want and eng.stats.spec_proposed > 0


@pytest.mark.parametrize("overrides", [{}, dict(head_dim=32)], ids=["square", "wide-heads"])
def test_a_decode_step_in_pieces_equals_the_models(overrides):
    """One step of three rows, from the same cache state: the pieces' logits are the model's
    (float64: the order of additions is all that may differ), also where n_heads * head_dim
    is not d_model (4 * 32 = 128 against 64)."""
    model = make_tiny(seed=22, **overrides)
    cfg = model.cfg
    caches = [
        SlotKVCache(cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim, 32, torch.float64)
        for _ in range(2)
    ]
    prompt = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 1], [2, 2, 3, 3]])
    out = []
    for cache, forward in zip(caches, [model, PiecewiseDecoder(model)]):
        for s in range(3):
            cache.admit(s, 8)
        cache.plan_step([0, 1, 2], [4, 4, 4])
        with torch.no_grad():
            model(prompt, cache=cache)
            cache.plan_step([0, 1, 2], [1, 1, 1])
            out.append(forward(torch.tensor([[1], [2], [3]]), cache=cache)[0])
    torch.testing.assert_close(out[1], out[0], rtol=1e-12, atol=1e-12)


def test_settings_that_cannot_go_with_the_pieces_are_named():
    EngineConfig(2, kv="paged", decoder="pieces", speculate="ngram")  # both fine
    EngineConfig(2, kv="paged", decoder="fused", speculate="ngram")
    with pytest.raises(ValueError, match="use decoder='eager', 'pieces' or 'fused'"):
        EngineConfig(2, decoder="compiled", speculate="ngram")


def test_warm_up_compiles_every_bucket_ahead():
    """After warm_up(3) (buckets of 1, 2 and 4 rows: before, between and last for each), an
    engine's steps of 1 to 3 rows compile nothing, and its decoder shares the programs."""
    model = quantize(make_tiny(seed=23, d_ff=96), "float")
    want = [solo(model, r).tokens for r in REQS[:3]]
    PiecewiseDecoder(model).warm_up(3)
    programs = dict(piecewise.PROGRAMS[model])
    assert sorted(rows for _, rows in programs) == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    eng = make_engine(model, 3, decoder="pieces")
    rids = [eng.add_request(r) for r in REQS[:3]]
    while eng.has_work():
        eng.step()
    assert [eng.results[r].tokens for r in rids] == want
    assert piecewise.PROGRAMS[model] == programs, "a step compiled"


def test_a_bucket_not_compiled_yet_runs_eager_and_compiles_when_asked():
    """With eager_until_compiled, a step whose bucket has no programs runs the model's eager
    step (the solo tokens, nothing compiled during the steps); compile_next then compiles the
    missing buckets, smallest first, one a call, and says None when none is left."""
    model = make_tiny(seed=25)  # float64: the eager step's tokens are the pieces' too
    want = [solo(model, r).tokens for r in REQS[:3]]
    eng = make_engine(model, 3, decoder="pieces")  # buckets of 1, 2 and 4 rows
    decoder = eng.decoder
    assert decoder.buckets() == [1, 2, 4] and decoder.compile_next()[0] == 1
    decoder.eager_until_compiled = True
    before = dict(piecewise.PROGRAMS[model])
    rids = [eng.add_request(r) for r in REQS[:3]]
    while eng.has_work():
        eng.step()
    assert [eng.results[r].tokens for r in rids] == want
    assert piecewise.PROGRAMS[model] == before, "a step compiled"
    assert [decoder.compile_next()[0], decoder.compile_next()[0]] == [2, 4]
    assert decoder.compile_next() is None and all(decoder.compiled(b) for b in (1, 2, 4))


def test_a_decoder_sent_to_another_process_leaves_its_programs_behind():
    """The server's engine process gets the decoder pickled: the model goes, the programs (this
    process's) do not, and the copy compiles its own on first use."""
    model = make_tiny(seed=24)
    decoder = PiecewiseDecoder(model)
    decoder.warm_up(1)
    copy = pickle.loads(pickle.dumps(decoder))
    assert copy.model is not model and copy.model not in piecewise.PROGRAMS
    x = torch.zeros(1, 1, model.cfg.d_model, dtype=torch.float64)
    cos = sin = torch.zeros(1, 1, 1, model.cfg.head_dim, dtype=torch.float64)
    with torch.no_grad():
        copy.pieces(x, cos, sin, lambda block, q, k, v: torch.zeros_like(q))
    assert len(piecewise.PROGRAMS[copy.model]) == 3


def test_a_second_process_finds_the_programs_in_torchinductors_cache():
    """A program compiled once is filed in TorchInductor's cache of compiled graphs, so that
    the next process (a server started again) loads it instead of generating its code again:
    a copy of the model compiles its three pieces as three hits. Without a tracing context of
    the program's own, TorchInductor skips that cache (it took 5.5 of a cold start's 13
    CPU-seconds on SmolLM2)."""
    from torch._dynamo.utils import counters

    model = make_tiny(seed=26)
    PiecewiseDecoder(model).warm_up(1)
    copy = pickle.loads(pickle.dumps(model))  # another model: programs of its own
    hits = counters["inductor"]["fxgraph_cache_hit"]
    PiecewiseDecoder(copy).warm_up(1)
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == 3, dict(counters["inductor"])


ROOT = Path(__file__).parents[1]


def test_serve_pieces_serves_at_once_and_compiles_while_it_serves():
    """`serve --decoder pieces` says "serving" with nothing compiled, after one line that says
    its buckets of 1 and 2 rows compile while it serves; the first request then waits for no
    compilation (its steps run eager until their bucket is compiled)."""
    port = free_port()
    proc = run_serve(["--decoder", "pieces", "--slots", "2", "--port", str(port)])
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving")):
            lines.append(proc.stdout.readline())
            assert lines[-1], f"serve ended before it served: {''.join(lines)}"
        said = [line.strip() for line in lines[1:]]
        assert len(said) == 2, said
        assert said[0].startswith(
            "the decode step (--decoder pieces) compiles for 1, 2 rows while it serves"
        ), said
        body = {"prompt": "Ham.\nTo be", "max_tokens": 4, "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        first = time.perf_counter() - t0
        assert r.status_code == 200 and first < 5, (r.status_code, first)
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert "stopping" in out and "Traceback" not in out, out


def test_serve_pieces_without_a_cxx_compiler_says_so_in_one_line(tmp_path):
    """Where TorchInductor finds no C++ compiler ($CXX pointing nowhere, a fresh cache), `serve
    --decoder pieces` ends at once with one line that says so and what to do, status 2 (it
    printed 115 lines of Inductor's traceback after it said it served)."""
    env = {"CC": "/nonexistent", "CXX": "/nonexistent", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    proc = run_serve(["--decoder", "pieces", "--port", "9"], **env)
    try:
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    said = out.strip().splitlines()
    assert proc.returncode == 2 and len(said) == 1, said
    assert "--decoder pieces" in said[0] and "no C++ compiler" in said[0], said
    assert said[0].endswith("or serve with --decoder eager"), said


class Buckets(DecodeStep):
    """A decoder that compiles its buckets 2 and 4 one a call, noting them (compile_next's)."""

    compiles_later = True

    def __init__(self):
        self.left, self.done = [2, 4], []

    def compile_next(self):
        if not self.left:
            return None
        self.done.append(self.left.pop(0))
        return self.done[-1], 0.0


def test_the_other_buckets_compile_after_the_engines_first_step(monkeypatch):
    """serve's engine compiles the buckets left for later once its first step is reported
    (`served`), so the first requests' tokens do not wait on them; with no step within
    REST_AFTER_S it compiles them anyway."""
    from types import SimpleNamespace

    from tinyllm.serving import engine_core

    engine, served = SimpleNamespace(decoder=Buckets()), threading.Event()
    thread = engine_core.compile_rest(engine, served)
    time.sleep(0.3)
    assert engine.decoder.done == [], "it compiled before the first step"
    served.set()
    thread.join(10)
    assert engine.decoder.done == [2, 4]
    monkeypatch.setattr(engine_core, "REST_AFTER_S", 0.1)
    engine = SimpleNamespace(decoder=Buckets())
    engine_core.compile_rest(engine, threading.Event()).join(10)
    assert engine.decoder.done == [2, 4]


class CannotCompile(Buckets):
    """A decoder whose compiler is missing: compile_next raises as TorchInductor does."""

    def compile_next(self):
        raise RuntimeError(
            "InvalidCxxCompiler: No working C++ compiler found\n  and 100 more lines"
        )


def test_a_bucket_that_cannot_compile_says_so_in_one_line_and_the_steps_stay_eager(capsys):
    """The thread that compiles while the engine serves, where a bucket cannot compile, says so
    in one line on stderr (no traceback) and ends; the steps stay eager."""
    from types import SimpleNamespace

    from tinyllm.serving import engine_core

    decoder = CannotCompile()
    decoder.eager_until_compiled = True
    engine = SimpleNamespace(decoder=decoder, config=SimpleNamespace(decoder="pieces"))
    engine_core.compile_rest(engine).join(10)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "(--decoder pieces) could not compile" in said[0], said
    assert said[0].endswith("its steps stay eager") and decoder.eager_until_compiled
