"""Steps 03-08 - the benchmark entry point and the pictures: they run and count right.
(Speed is never asserted here: the benchmark measures it.)"""

import json
import os
import time
from dataclasses import replace

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from tests.conftest import make_tiny  # noqa: E402
from tinyllm.build import make_engine  # noqa: E402
from tinyllm.core import cuda_graph, workloads  # noqa: E402
from tinyllm.core.config import EngineConfig  # noqa: E402
from tinyllm.core.cuda_graph import SlotGraphDecoder  # noqa: E402
from tinyllm.core.sampling import Sampling  # noqa: E402
from tinyllm.course import bench, viz  # noqa: E402
from tinyllm.engine import Request, Trace, run_continuous, run_static  # noqa: E402

pytestmark = pytest.mark.slow  # the benchmark's runs, and servers it launches


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_workloads_are_well_formed(bundled, name):
    model, tok = bundled
    reqs, arrivals = workloads.workload(name, tok, n=20, seed=1)
    assert len(reqs) == len(arrivals) == 20
    assert all(0 < len(r.prompt) and all(0 <= t < tok.vocab_size for t in r.prompt) for r in reqs)
    assert all(len(r.prompt) + r.max_new_tokens <= model.cfg.max_seq_len for r in reqs)
    assert arrivals == sorted(arrivals)
    assert (max(arrivals) > 0) == (name in ("poisson", "shared-prefix"))
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
    bench.main(["--workload", "longtail", "--requests", "6", "--slots", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    runs = out["runs"]
    assert set(runs) == {"static", "continuous"} and out["slots"] == 3
    assert runs["static"]["useful_tokens"] == runs["continuous"]["useful_tokens"]
    for summary in runs.values():
        assert summary["requests"] == 6 and 0 <= summary["decode_overhead"] < 1


def test_rounds_run_every_engine_in_turn_and_keep_each_ones_median(bundled, capsys, monkeypatch):
    """--rounds 3 runs static, continuous, static, continuous, ...; each engine's row is its
    round of median tokens per CPU-second (cpu_s: the process's CPU seconds in the run)."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    order, run = [], bench.run
    monkeypatch.setattr(bench, "run", lambda *a, **k: order.append(k["static"]) or run(*a, **k))
    argv = ["--requests", "4", "--slots", "2", "--rounds", "3", "--json"]
    bench.main(argv)
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert order == [True, False] * 3, "rounds interleave the engines"
    for summary in runs.values():
        assert summary["cpu_s"] > 0
        assert summary["tok_per_cpu_s"] == pytest.approx(
            summary["useful_tokens"] / summary["cpu_s"]
        )
    rounds = [{"tok_per_cpu_s": r, "round": i} for i, r in enumerate([5.0, 1.0, 3.0, 9.0])]
    assert bench.median_run(rounds[:3])["round"] == 2 and bench.median_run(rounds)["round"] == 2
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--rounds", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_bench_table_and_bad_names(bundled, capsys, monkeypatch):
    """The table prints; a static run refuses arrivals; a bad engine name, or a name whose
    settings do not hold together, is refused before any run."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(["--workload", "eos", "--requests", "3", "--slots", "2", "--engines", "continuous"])
    text = capsys.readouterr().out
    assert "row_util" in text and "continuous" in text
    with pytest.raises(ValueError, match="offline"):
        bench.run(model, tok, "poisson", EngineConfig(2), n=2, static=True)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.workload("bursty", tok)
    for bad, why in [
        ("static+chunked", "static batching has no token budget"),
        ("continuous+prefix", "use paged\\+prefix"),
        ("paged+fast", "unknown engine"),
        ("vllm", "unknown engine"),
    ]:
        with pytest.raises(ValueError, match=why):
            bench.engine_config(bad, flags())
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("a run began"))
    for argv, why in [
        (["--engines", "continuous,paged+fast"], "unknown engine 'paged+fast'"),
        (
            ["--engines", "continuous+chunked", "--slots", "128"],
            "max_step_tokens 64 is less than n_slots 128",
        ),
    ]:
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert why in capsys.readouterr().err
    for argv in (["--kv", "paged"], ["--batch", "8"]):  # the names pick the cache; --slots
        with pytest.raises(SystemExit):
            bench.parser().parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_the_greedy_requests_sample_as_the_flags_say_each_engine_alike(
    bundled, capsys, monkeypatch
):
    """--temperature (with --top-k, --top-p): the workload's greedy requests sample, each with a
    seed of its own, so that every engine draws the same tokens; a request with sampling of its
    own keeps it; a cut without a temperature, or a bad value, is refused by name."""
    model, tok = bundled
    s = Sampling(0.8, top_p=0.9)
    reqs, _ = workloads.workload("longtail", tok, n=4, seed=2, sampling=s)
    assert [r.sampling for r in reqs] == [replace(s, seed=2000 + i) for i in range(4)]
    assert workloads.workload("eos", tok, 2, 2, s) == workloads.workload("eos", tok, 2, 2)
    static, continuous = run_static(model, reqs, 2)[0], run_continuous(model, reqs, 2)[0]
    assert [r.tokens for r in static] == [r.tokens for r in continuous]
    greedy = run_static(model, workloads.workload("longtail", tok, n=4, seed=2)[0], 2)[0]
    assert [r.tokens for r in static] != [r.tokens for r in greedy], "they sample"
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(["--requests", "4", "--slots", "2", "--temperature", "0.8", "--top-p", "0.9",
                "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["sampling"] == "temperature 0.8, top_p 0.9"
    assert out["runs"]["static"]["useful_tokens"] == out["runs"]["continuous"]["useful_tokens"]
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("a run began"))
    for argv, why in [
        (["--top-k", "5"], "--top-k and --top-p cut what a request samples: give --temperature"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
    ]:
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert why in capsys.readouterr().err


def flags(*argv: str):
    """The command's flags, parsed as `python -m tinyllm bench` parses them."""
    return bench.parser().parse_args(list(argv))


def test_an_engine_name_parses_once_into_its_config():
    """`--slots` and the name make the EngineConfig: every engine's max_len is the workload's
    longest request; +chunked is a budget of --max-step-tokens or 64; static is a batch size."""
    plain = EngineConfig(16, max_len=100)
    assert bench.engine_config("continuous", flags(), 100) == ("continuous", plain)
    assert bench.engine_config("continuous", flags("--slots", "4", "--kv-mib", "8"), 100) == (
        "continuous",
        EngineConfig(4, max_len=100, kv_mib=8),
    )
    assert bench.engine_config("continuous+chunked", flags(), 100) == (
        "continuous",
        replace(plain, max_step_tokens=64),
    )
    assert bench.engine_config("paged+prefix+chunked", flags("--max-step-tokens", "32"), 100) == (
        "paged",
        replace(plain, kv="paged", kv_blocks=16 * 7, prefix_cache=True, max_step_tokens=32),
    )
    assert bench.engine_config(
        "static", flags("--slots", "8", "--max-step-tokens", "32", "--prefix-cache"), 100
    ) == ("static", EngineConfig(8)), "static batching reads its batch size alone"
    assert bench.engine_config("continuous", flags())[1].max_len is None, "run sizes it"


def test_the_budget_is_every_continuous_engines_unless_one_is_chunked():
    """With no +chunked engine named, --max-step-tokens gives every continuous engine (not
    static) that budget; beside a +chunked engine the budget is its own."""
    budgets = lambda names, *argv: {
        n: c.max_step_tokens for n, (_, c) in bench.engine_configs(names, flags(*argv), 100).items()
    }
    assert budgets(["static", "continuous", "paged"], "--max-step-tokens", "32") == {
        "static": None,
        "continuous": 32,
        "paged": 32,
    }
    assert budgets(["continuous", "continuous+chunked"], "--max-step-tokens", "32") == {
        "continuous": None,
        "continuous+chunked": 32,
    }
    assert budgets(["continuous", "paged"]) == {"continuous": None, "paged": None}


def test_paged_engines_get_their_slots_pool_and_prefix_cache():
    """paged: --paged-slots slots (default --slots) on a pool of --kv-blocks blocks (default:
    the memory of --slots slots of the longest request); --prefix-cache gives every paged
    engine a prefix cache, and no other; --no-kv-headroom drops every paged pool's headroom."""
    config = lambda name, *argv: bench.engine_config(name, flags(*argv), 100)[1]
    paged = config("paged", "--paged-slots", "64")
    assert (paged.kv, paged.n_slots, paged.kv_blocks, paged.block_size) == ("paged", 64, 112, 16)
    assert config("paged", "--block-size", "8").kv_blocks == 16 * 13, "16 slots of ceil(100 / 8)"
    assert config("paged", "--kv-blocks", "50", "--paged-slots", "64").kv_blocks == 50
    assert config("paged", "--slots", "4").n_slots == 4
    assert config("paged", "--prefix-cache").prefix_cache
    assert not config("paged").prefix_cache and config("paged+prefix").prefix_cache
    assert config("continuous", "--prefix-cache") == EngineConfig(16, max_len=100), (
        "a slot engine has no prefix cache"
    )
    assert config("paged").kv_headroom and not config("paged", "--no-kv-headroom").kv_headroom
    assert config("continuous", "--no-kv-headroom") == EngineConfig(16, max_len=100), (
        "a slot engine has no headroom to drop"
    )
    assert bench.engine_config("paged", flags())[1].kv_blocks is None, "no workload: the default"


def test_decoders_and_the_compile_mode_by_name_and_flag():
    """--decoder is the continuous engines' decode step, graphs and compiled name their own,
    paged keeps the eager step unless an option names one (+graphs, +compiled, +pieces,
    +fused); --compile-mode is the compiled decoder's alone."""
    step = lambda name, *argv: (lambda c: (c.decoder, c.compile_mode))(
        bench.engine_config(name, flags(*argv), 100)[1]
    )
    autotune = ("--compile-mode", "max-autotune")
    assert step("continuous", "--decoder", "compiled") == ("compiled", "default")
    assert step("continuous", "--decoder", "graphs", *autotune) == ("graphs", "default")
    assert step("graphs") == ("graphs", "default")
    assert step("compiled") == ("compiled", "default")
    assert step("compiled", *autotune) == ("compiled", "max-autotune")
    assert step("continuous", *autotune) == ("eager", "default")
    assert step("continuous", "--decoder", "compiled", *autotune) == ("compiled", "max-autotune")
    assert step("paged", "--decoder", "compiled", *autotune) == ("eager", "default")
    assert step("paged+graphs") == ("graphs", "default")
    assert step("paged+compiled", *autotune) == ("compiled", "max-autotune")
    assert step("paged+prefix+compiled") == ("compiled", "default")
    assert step("continuous+pieces", "--decoder", "compiled") == ("pieces", "default")
    assert (
        step("paged+prefix+fused")
        == step("continuous", "--decoder", "fused")
        == ("fused", "default")
    )
    for bad, why in [
        ("static+graphs", "static batching has no token budget, no prefix cache and no decode"),
        ("compiled+pieces", "a decode step of continuous or paged"),
        ("paged+graphs+pieces", "one decode step at a time"),
        ("static+fused", "static batching has no token budget"),
    ]:
        with pytest.raises(ValueError, match=why):
            bench.engine_config(bad, flags())


def test_chunked_and_prefix_engines_serve_the_same_tokens(bundled, capsys, monkeypatch):
    """The step 07-08 engines make the same tokens as the plain one; the prefix cache computes
    fewer prompt tokens; --json keeps its shape."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(
        [
            "--workload",
            "shared-prefix",
            "--requests",
            "4",
            "--slots",
            "2",
            "--json",
            "--engines",
            "paged,paged+prefix,continuous+chunked",
            "--block-size",
            "8",
        ]
    )
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert list(runs) == ["paged", "paged+prefix", "continuous+chunked"]
    assert len({r["useful_tokens"] for r in runs.values()}) == 1
    assert runs["paged"]["prefill_tokens"] == runs["paged"]["prompt_tokens"] == 4 * 400
    assert (
        runs["paged+prefix"]["prefill_tokens"] + runs["paged+prefix"]["cached_prompt_tokens"]
        == 4 * 400
    )


def test_paged_and_graph_engines_and_the_decode_step_table(bundled, capsys, monkeypatch):
    """The step 05-06 engines serve the same workload (same tokens made), and --decode-steps
    prints one row per batch size."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    engines = bench.engine_configs(
        ["continuous", "paged", "graphs"],
        flags("--slots", "3", "--paged-slots", "6", "--kv-blocks", "12"),
    )
    runs = {e: bench.run(model, tok, "longtail", config, n=6) for e, (_, config) in engines.items()}
    assert len({r["useful_tokens"] for r in runs.values()}) == 1
    assert runs["paged"]["peak_active"] > 3 and runs["paged"]["kv_allocated_at_end"] == 0
    rows = bench.decode_step_times(model, batch_sizes=(1, 2), iters=2, compiled=False)
    assert [r["batch"] for r in rows] == [1, 2] and all(r["eager_ms"] > 0 for r in rows)
    assert "bucketed_ms" in rows[0], "no CUDA here: the graph decoder's eager bucketed step"
    bench.main(["--decode-steps", "--batch-sizes", "1", "--json"])
    assert [r["batch"] for r in json.loads(capsys.readouterr().out)["rows"]] == [1]
    with pytest.raises(SystemExit):
        bench.main(["--decode-steps", "--batch-sizes", "1,two"])
    assert "numbers separated by commas, got '1,two'" in capsys.readouterr().err


def test_the_compiled_decoder_in_the_bench(bundled, tiny, monkeypatch):
    """A compiled engine's decoder is compiled before the clock starts and its seconds are the
    summary's compile_s; --decode-steps times the compiled step (compilation apart, in the
    mode asked for) and says when it is repaid. The compiled decoder's place is taken by the
    graph decoder's eager step: the run and the table are what is tested here; the compiled
    step is test_compiled's (and notebook 06 times the real one)."""
    modes, built = [], []

    class EagerStandIn(SlotGraphDecoder):
        def __init__(self, model, slots, mode):
            super().__init__(model, slots)
            modes.append(mode)

        def warm_up(self, buckets):
            return {W: 0.5 for W in buckets}

    def compiled_stand_in(model, config):
        decoder = make_engine(model, replace(config, decoder="graphs")).decoder
        decoder.compile_s = {W: 0.5 for W in decoder.buckets}
        built.append(config)
        return decoder

    monkeypatch.setattr(bench, "CompiledDecoder", EagerStandIn)
    monkeypatch.setattr(bench, "compiled_decoder", compiled_stand_in)
    model, tok = bundled
    _, config = bench.engine_config("compiled", flags("--slots", "2"))
    summary = bench.run(model, tok, "uniform", config, n=2)
    assert built == [replace(config, max_len=80)], "compiled for the workload, before the run"
    assert summary["compile_s"] == 0.5 * len(cuda_graph.default_buckets(80))
    text = bench.table({"continuous": {"tok_s": 1.0}, "compiled": {"tok_s": 2.0, "compile_s": 3.0}})
    assert text.splitlines()[-1].split() == ["compile_s", "-", "3.000"], text
    rows = bench.decode_step_times(
        tiny, batch_sizes=(2, 3), context=20, iters=3, compile_mode="max-autotune"
    )
    assert modes == ["max-autotune"] * 2, "one compiled decoder per batch size, in the mode asked"
    assert [r["batch"] for r in rows] == [2, 3]
    assert set(rows[0]) == {"batch", "eager_ms", "bucketed_ms", "compiled_ms", "compile_s"}
    assert rows[0]["compile_s"] == 0.5 and rows[0]["compiled_ms"] > 0
    text = bench.decode_steps_table(
        [{**rows[0], "eager_ms": 2.0, "compiled_ms": 1.5, "compile_s": 3.0}]
    )
    assert "6000 steps" in text, text
    assert "never" in bench.decode_steps_table([{**rows[0], "eager_ms": 1.0, "compiled_ms": 1.5}])


def test_llamacpp_batches_a_group_as_its_server_does():
    """peers.greedy_group (llama.cpp's batching, without llama.cpp): one call of every prompt,
    logits at each prompt's end, then one call a step of the sequences still running."""
    from tinyllm.course import peers

    calls = []
    group = [Request([5, 6, 7], 2), Request([8], 3)]
    tokens = peers.greedy_group(group, calls.append, lambda row: 100 * len(calls) + row)
    assert calls[0] == [(5, 0, 0, False), (6, 1, 0, False), (7, 2, 0, True), (8, 0, 1, True)]
    assert calls[1:] == [[(102, 3, 0, True), (103, 1, 1, True)], [(201, 2, 1, True)]]
    assert tokens == [[102, 200], [103, 201, 300]], "each stops at its max_new_tokens"


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
    from tinyllm.core.paged_kv import PagedKVCache

    cache = PagedKVCache(1, 3, 1, 2, n_blocks=6, block_size=2, max_len=8)
    for s, n_tokens in ((0, 3), (2, 1)):  # blocks for the context + 1: 2, then 1
        cache.admit(s, n_tokens)
        cache.lens[s] = n_tokens
    ax = viz.block_pool(cache, holders=[4, None, 7])
    grid = ax.images[0].get_array()  # (1, 6 blocks * 2 positions)
    owners = [None if np.ma.is_masked(grid[0, 2 * b]) else int(grid[0, 2 * b]) for b in range(6)]
    assert cache.tables == [[0, 1], [], [2]] and owners == [4, 4, 7, None, None, None]
    free = np.ma.getmaskarray(grid).reshape(6, 2).all(1).tolist()
    assert free == [not a for a in cache.allocator.allocated]
    assert ax.get_title() == "3 of 6 blocks allocated"


def test_a_proposer_is_named_by_the_engine_or_by_the_flag_for_all():
    """+ngram and +draft give that engine a proposer (11); with neither named, --speculate is
    every continuous engine's; both at once are refused."""
    specs = lambda names, *argv: {
        n: c.speculate for n, (_, c) in bench.engine_configs(names, flags(*argv), 100).items()
    }
    assert specs(["continuous", "continuous+ngram", "paged+draft"]) == {
        "continuous": None,
        "continuous+ngram": "ngram",
        "paged+draft": "draft",
    }
    assert specs(["continuous", "paged"], "--speculate", "ngram", "--spec-tokens", "3") == {
        "continuous": "ngram",
        "paged": "ngram",
    }
    with pytest.raises(ValueError, match="one proposer at a time"):
        bench.engine_config("continuous+ngram+draft", flags())


def test_an_engine_split_over_ranks_by_name_or_by_the_flag_for_all(bundled, capsys, monkeypatch):
    """+tpN splits that engine's model over N ranks (14); -tp N every continuous engine's; a
    split run counts its other ranks' CPU seconds and reports its all-reduces and gathers."""
    ranks = lambda names, *argv: {
        n: c.tensor_parallel_size
        for n, (_, c) in bench.engine_configs(names, flags(*argv), 100).items()
    }
    assert ranks(["continuous", "continuous+tp2", "paged+prefix+tp2"]) == {
        "continuous": 1,
        "continuous+tp2": 2,
        "paged+prefix+tp2": 2,
    }
    assert ranks(["continuous", "paged"], "-tp", "2") == {"continuous": 2, "paged": 2}
    with pytest.raises(ValueError, match=r"\+tpN"):
        bench.engine_config("continuous+tpx", flags())
    model, tok = bundled
    _, config = bench.engine_config("continuous+tp2", flags("--slots", "4"))
    run = bench.run(model, tok, "uniform", config, n=4)
    assert run["all_reduces"] >= 2 * model.cfg.n_layers * run["decode_steps"]
    assert run["gathers"] >= run["decode_steps"] and run["cpu_s"] > 0


def test_tp_layer_colours_each_ranks_rows_and_columns():
    """Step 14's picture: each rank's part of a weight is its rows (q, k, v, gate, up, the head)
    or its columns (o, down) as `shard` cuts them, 3 KV groups over 2 ranks unevenly."""
    model = make_tiny(seed=3, n_heads=6, n_kv_heads=3)  # q (96, 64), d_ff 160, vocabulary 97
    ax = viz.tp_layer(model, 2)
    texts = {t.get_text() for t in ax.texts}
    rank0 = {"rows 0-63", "rows 0-31", "cols 0-63", "rows 0-79", "cols 0-79", "rows 0-48"}
    rank1 = {"rows 64-95", "rows 32-47", "cols 64-95", "rows 80-159", "cols 80-159", "rows 49-96"}
    assert rank0 | rank1 <= texts
    assert any("KV groups 0-1" in t for t in texts) and any("KV group 2" in t for t in texts)
    bars = [t for t in ax.texts if t.get_text() == "all-reduce (T, 64)"]
    assert len(bars) == 2  # after o_proj and after down_proj


def test_prefill_times_each_prompt_length_on_each_engine(bundled, capsys, monkeypatch):
    """--prefill: one prompt of each length to its first token, on each continuous engine
    (static left out), the chunked one in steps of --max-step-tokens; a row each, its tokens a
    second the prompt's length over its TTFT."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    argv = ["--prefill", "24,80", "--engines", "static,continuous,continuous+chunked"]
    bench.main([*argv, "--max-step-tokens", "16", "--rounds", "2", "--json"])
    rows = json.loads(capsys.readouterr().out)["prefill"]
    assert [(r["tokens"], r["engine"]) for r in rows] == [
        (n, e) for n in (24, 80) for e in ("continuous", "continuous+chunked")
    ]
    for r in rows:
        assert r["tok_per_s"] == pytest.approx(r["tokens"] / r["ttft_s"]) and r["cpu_s"] > 0
    bench.main(argv[:2])
    assert "x first" in capsys.readouterr().out


def test_solo_times_one_requests_decode_on_each_engine_and_weights(bundled, capsys, monkeypatch):
    """--solo N: one request's N tokens after a 16-token prompt, its N - 1 decode steps timed
    on each continuous engine and each --quant; a row each, with the weights' bytes a token and
    their share of the memory's read speed."""
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    bench.main(["--solo", "12", "--engines", "continuous,paged", "--quant", "none,int8", "--json"])
    rows = json.loads(capsys.readouterr().out)["solo"]
    assert [r["engine"] for r in rows] == [
        f"{e} {q}" for q in ("none", "int8") for e in ("continuous", "paged")
    ]
    for r in rows:
        assert r["tokens"] == 11 and r["tok_per_cpu_s"] > 0 and r["tok_per_s"] > 0
        assert r["of_bound"] == pytest.approx(
            r["bytes_per_token"] * r["tok_per_cpu_s"] / (r["read_gb_per_s"] * 1e9)
        )
    assert rows[2]["bytes_per_token"] < rows[0]["bytes_per_token"] / 3  # int8 against float32
    bench.main(["--solo", "6", "--pages", "both", "--json"])
    rows = json.loads(capsys.readouterr().out)["solo"]
    assert [r["engine"] for r in rows] == ["continuous (2 MB pages)", "continuous (4 KB pages)"]


def test_serve_start_times_a_servers_launch_to_its_first_token(capsys, monkeypatch):
    """--serve-start: `serve` launched for real (the bundled model, 2 slots), one streamed
    request sent once /health answers; the clock read at Ready, the first token and the last,
    in wall seconds and the CPU-seconds of its processes; the server gone after each start.
    Nothing is loaded in the bench's own process."""
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: pytest.fail("the bench loaded a model"))
    before = set(os.listdir("/proc"))
    bench.main(["--serve-start", "--slots", "2", "--rounds", "2", "--json"])
    (row,) = json.loads(capsys.readouterr().out)["serve_start"]
    assert row["quant"] == "none" and row["decoder"] == "eager" and row["caches"] == "as they are"
    assert 0 < row["ready_s"] <= row["first_s"] <= row["last_s"], row
    assert 0 < row["ready_cpu_s"] <= row["first_cpu_s"], row
    left = lambda: [p for p in set(os.listdir("/proc")) - before if "tinyllm" in cmdline(p)]  # noqa: E731
    t0 = time.time()
    while left() and time.time() - t0 < 10:  # SIGKILL reaches a busy machine's processes late
        time.sleep(0.05)
    assert not left(), "a server outlived its start"


def cmdline(pid: str) -> str:
    """A process's command line ('' where it is none, or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", errors="replace") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
        return ""


@pytest.mark.parametrize("argv", [["--prefill", "10,4000"], ["--solo", "4000"]])
def test_one_request_longer_than_the_model_is_refused_before_any_run(
    bundled, capsys, monkeypatch, argv
):
    model, tok = bundled
    monkeypatch.setattr("tinyllm.load", lambda *a, **k: (model, tok))
    with pytest.raises(SystemExit):
        bench.main(argv)
    err = capsys.readouterr().err
    assert f"{argv[0]} 4000" in err and f"{model.cfg.max_seq_len}" in err
