"""Steps 03-08 - the benchmark entry point and the pictures: they run and count right.
(Speed is never asserted here: the benchmark measures it.)"""

import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from tinyllm import workloads  # noqa: E402
from tinyllm.course import bench, viz  # noqa: E402
from tinyllm.cuda_graph import SlotGraphDecoder  # noqa: E402
from tinyllm.engine import Request, Trace, run_continuous, run_static  # noqa: E402
from tests.conftest import make_tiny  # noqa: E402


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_workloads_are_well_formed(bundled, name):
    model, tok = bundled
    reqs, arrivals = workloads.workload(name, tok, n=20, seed=1)
    assert len(reqs) == len(arrivals) == 20
    assert all(0 < len(r.prompt) and all(0 <= t < tok.vocab_size for t in r.prompt) for r in reqs)
    assert all(len(r.prompt) + r.max_new_tokens <= model.cfg.max_seq_len for r in reqs)
    assert (arrivals == sorted(arrivals)) and (max(arrivals) > 0) == (name in ("poisson", "shared-prefix"))
    if name == "shared-prefix":
        shared = [sum(1 for a, b in zip(r.prompt, reqs[0].prompt) if a == b) for r in reqs[1:]]
        assert min(shared) >= 0.9 * len(reqs[0].prompt), "90% of every prompt is the system prompt"
    if name == "long-prompt":
        long = [i for i, r in enumerate(reqs) if len(r.prompt) > 400]
        assert long == [15], f"every 16th request has a long prompt: {long}"
    if name == "longtail":
        lens = sorted(r.max_new_tokens for r in reqs)
        assert lens[-1] > 3 * lens[len(lens) // 2], f"not long-tailed: {lens}"
    assert workloads.workload(name, tok, n=20, seed=1)[0] == reqs, "a workload is fixed by its seed"


def test_bench_json_compares_engines_on_the_same_work(bundled, capsys, monkeypatch):
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(["--workload", "longtail", "--requests", "6", "--batch", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    runs = out["runs"]
    assert set(runs) == {"static", "continuous"}
    assert runs["static"]["useful_tokens"] == runs["continuous"]["useful_tokens"]
    for summary in runs.values():
        assert summary["requests"] == 6 and 0 <= summary["decode_overhead"] < 1


def test_bench_table_and_bad_names(bundled, capsys, monkeypatch):
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(["--workload", "eos", "--requests", "3", "--batch", "2", "--engines", "continuous"])
    text = capsys.readouterr().out
    assert "row_util" in text and "continuous" in text
    with pytest.raises(ValueError, match="offline"):
        bench.run(model, tok, "poisson", "static", 2, n=2)
    with pytest.raises(ValueError, match="unknown engine"):
        bench.run(model, tok, "uniform", "vllm", 2, n=2)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.workload("bursty", tok)
    for bad, why in [("static+chunked", "static batching has no token budget"),
                     ("continuous+prefix", "use paged\\+prefix"), ("paged+fast", "unknown engine")]:
        with pytest.raises(ValueError, match=why):
            bench.run(model, tok, "uniform", bad, 2, n=2)
    with pytest.raises(SystemExit):
        bench.main(["--engines", "paged+fast"])
    assert "unknown engine 'paged+fast'" in capsys.readouterr().err


def test_engine_names_carry_steps_07_and_08():
    assert bench.engine_settings("continuous") == ("continuous", {})
    assert bench.engine_settings("continuous+chunked") == ("continuous", {"max_step_tokens": 64})
    assert bench.engine_settings("paged+prefix+chunked", 32) == \
        ("paged", {"max_step_tokens": 32, "prefix_cache": True})
    assert bench.engine_settings("continuous", 32) == ("continuous", {}), \
        "beside a +chunked engine the budget is its own"
    assert bench.engine_settings("continuous", 32, budget_for_all=True) == \
        ("continuous", {"max_step_tokens": 32})
    assert bench.engine_settings("paged", prefix_cache=True) == ("paged", {"prefix_cache": True})
    assert bench.engine_settings("static", 32, True, True) == ("static", {}), "the flags skip static"


def test_chunked_and_prefix_engines_serve_the_same_tokens(bundled, capsys, monkeypatch):
    """The step 07-08 engines make the same tokens as the plain one; the prefix cache computes
    fewer prompt tokens; --json keeps its shape."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(["--workload", "shared-prefix", "--requests", "4", "--batch", "2", "--json",
                "--engines", "paged,paged+prefix,continuous+chunked", "--block-size", "8"])
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert list(runs) == ["paged", "paged+prefix", "continuous+chunked"]
    assert len({r["useful_tokens"] for r in runs.values()}) == 1
    assert runs["paged"]["prefill_tokens"] == runs["paged"]["prompt_tokens"] == 4 * 400
    assert runs["paged+prefix"]["prefill_tokens"] + runs["paged+prefix"]["cached_prompt_tokens"] \
        == 4 * 400


def test_paged_and_graph_engines_and_the_decode_step_table(bundled, capsys, monkeypatch):
    """The step 05-06 engines serve the same workload (same tokens made), and --decode-steps
    prints one row per batch size."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    runs = {e: bench.run(model, tok, "longtail", e, 3, n=6, paged_slots=6, kv_blocks=12)
            for e in ("continuous", "paged", "graphs")}
    assert len({r["useful_tokens"] for r in runs.values()}) == 1
    assert runs["paged"]["peak_active"] > 3 and runs["paged"]["kv_allocated_at_end"] == 0
    rows = bench.decode_step_times(model, batch_sizes=(1, 2), iters=2, compiled=False)
    assert [r["batch"] for r in rows] == [1, 2] and all(r["eager_ms"] > 0 for r in rows)
    assert "bucketed_ms" in rows[0], "no CUDA here: the graph decoder's eager bucketed step"


def test_the_compiled_decoder_in_the_bench(tiny, monkeypatch):
    """--decoder names the continuous engines' decode step; the compiled engine names itself;
    --decode-steps times the compiled step (compilation apart, in the mode asked for) and says
    when it is repaid. The compiled decoder's place in the step table is taken by the graph
    decoder's eager step: the table is what is tested here; the compiled step is
    test_compiled's (and notebook 06 times the real one)."""
    modes = []

    class EagerStandIn(SlotGraphDecoder):
        def __init__(self, model, slots, mode):
            super().__init__(model, slots)
            modes.append(mode)

        def warm_up(self, buckets):
            return {W: 0.5 for W in buckets}
    monkeypatch.setattr(bench, "CompiledDecoder", EagerStandIn)
    assert bench.engine_settings("continuous", decoder="compiled") == \
        ("continuous", {"decoder": "compiled"})
    assert bench.engine_settings("compiled") == ("compiled", {"decoder": "compiled"})
    assert bench.engine_settings("compiled", compile_mode="max-autotune") == \
        ("compiled", {"decoder": "compiled", "compile_mode": "max-autotune"})
    assert bench.engine_settings("continuous", compile_mode="max-autotune") == ("continuous", {}), \
        "the compile mode is the compiled decoder's alone"
    assert bench.engine_settings("paged", decoder="compiled") == ("paged", {}), \
        "a paged engine keeps its eager step: the bucketed decoders read slots"
    rows = bench.decode_step_times(tiny, batch_sizes=(2, 3), context=20, iters=3,
                                   compile_mode="max-autotune")
    assert modes == ["max-autotune"] * 2, "one compiled decoder per batch size, in the mode asked"
    assert [r["batch"] for r in rows] == [2, 3]
    assert set(rows[0]) == {"batch", "eager_ms", "bucketed_ms", "compiled_ms", "compile_s"}
    assert rows[0]["compile_s"] == 0.5 and rows[0]["compiled_ms"] > 0
    text = bench.decode_steps_table([{**rows[0], "eager_ms": 2.0, "compiled_ms": 1.5,
                                      "compile_s": 3.0}])
    assert "6000 steps" in text, text
    assert "never" in bench.decode_steps_table([{**rows[0], "eager_ms": 1.0, "compiled_ms": 1.5}])


def test_progress_is_told_of_every_request():
    class Count:
        n = 0

        def update(self, k):
            self.n += k
    tiny = make_tiny(seed=7)
    reqs = [Request([1, 2], n) for n in (1, 4, 2, 6, 3)]
    for runner in (run_static, run_continuous):
        c = Count()
        runner(tiny, reqs, 2, progress=c)
        assert c.n == len(reqs)


def test_timeline_colours_each_cell_by_its_request():
    trace = Trace()
    trace.record([0, 1], 0.5)
    trace.record([0, None], 0.25)
    ax = viz.timeline(trace, n_requests=2)
    grid = ax.images[0].get_array()
    assert grid[0].tolist() == [0, 0] and grid[1, 0] == 1 and np.ma.is_masked(grid[1, 1])
    assert "25% of rows wasted" in ax.get_title()
    assert viz.kv_usage({"run": trace}).lines[0].get_ydata().tolist() == [0.5, 0.25]


def test_block_pool_colours_exactly_the_allocated_blocks():
    """Step 05's picture: a block is coloured by the request holding it, a free one is white."""
    from tinyllm.paged_kv import PagedKVCache
    cache = PagedKVCache(1, 3, 1, 2, n_blocks=6, block_size=2, max_len=8)
    for s, n_tokens in ((0, 3), (2, 1)):                # blocks for the context + 1: 2, then 1
        cache.admit(s, n_tokens)
        cache.lens[s] = n_tokens
    ax = viz.block_pool(cache, holders=[4, None, 7])
    grid = ax.images[0].get_array()                         # (1, 6 blocks * 2 positions)
    owners = [None if np.ma.is_masked(grid[0, 2 * b]) else int(grid[0, 2 * b]) for b in range(6)]
    assert cache.tables == [[0, 1], [], [2]] and owners == [4, 4, 7, None, None, None]
    assert np.ma.getmaskarray(grid).reshape(6, 2).all(1).tolist() == [not a for a in cache.allocator.allocated]
    assert ax.get_title() == "3 of 6 blocks allocated"
