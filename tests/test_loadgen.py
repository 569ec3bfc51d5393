"""Step 10 - the load generator: its figures count right, and it measures any OpenAI-compatible
server: tinyllm's, and `transformers serve` on the same bundled checkpoint (the peer)."""

import asyncio
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import free_port
from tests.test_server import Running
from tinyllm.build import make_engine
from tinyllm.checkpoints.checkpoint import resolve
from tinyllm.serving import loadgen

pytestmark = pytest.mark.slow  # servers, each with its engine process


def test_percentile_and_summary_count_right():
    xs = [0.3, 0.1, 0.2, 0.4, 0.9]
    for p in (0, 50, 90, 99, 100):
        assert loadgen.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    recs = [
        loadgen.Record(0.0, [0.1, 0.2, 0.3], 3),
        loadgen.Record(1.0, [1.5, 1.6], 2),
        loadgen.Record(2.0, error="APIConnectionError: refused"),
    ]
    out = loadgen.summarize(recs, duration=4.0, slo_ttft=200)
    assert (out["requests"], out["completed"], out["failed"]) == (3, 2, 1)
    assert out["request_throughput"] == 0.5 and out["output_tok_s"] == 5 / 4
    assert out["ttft_p50_ms"] == pytest.approx(300.0), "TTFTs 100 and 500 ms"
    assert out["tpot_mean_ms"] == pytest.approx((100 + 100) / 2)
    assert out["itl_p99_ms"] == pytest.approx(100.0), "every gap 100 ms"
    assert out["goodput"] == 1 / 4, "one request met a TTFT of 200 ms"


@pytest.fixture(scope="module")
def served(bundled):
    model, tok = bundled
    srv = Running(make_engine(model, 4), tok)
    yield srv
    srv.stop()


def test_loadgen_measures_the_tinyllm_server(served):
    prompts = [("Ham.\nTo be, or not", 12), ("Rom.\nBut soft", 8), ("Lear.\n", 16)] * 3
    records, duration = asyncio.run(loadgen.run_load(served.url, prompts, rate=20.0))
    assert all(r.error is None for r in records), [r.error for r in records]
    assert all(r.chunks and 0 < r.tokens <= n for r, (_, n) in zip(records, prompts))
    out = loadgen.summarize(records, duration)
    assert (
        out["completed"] == 9 and out["ttft_p50_ms"] > 0 and out["e2e_p99_ms"] >= out["e2e_p50_ms"]
    )
    records, _ = asyncio.run(loadgen.run_load(served.url, prompts, concurrency=2))
    assert all(r.error is None for r in records)
    assert served.wait_idle() == (0, 0)


def test_loadgen_command_line(served, capsys):
    loadgen.main(
        ["--url", served.url, "--rate", "inf,50", "--requests", "4", "--workload", "eos", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert list(out["runs"]) == ["all at once", "50 req/s"]
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in out["runs"].values())
    with pytest.raises(SystemExit):
        loadgen.main(["--url", served.url, "--rate", "fast"])
    assert "--rate takes numbers" in capsys.readouterr().err


def test_loadgen_ignore_eos_runs_each_request_to_its_max_tokens(served, capsys):
    """--ignore-eos (vLLM's field, which guidellm sends too): the eos workload's speeches, which
    end at the model's <|endoftext|> after a line or so, each run to its max_tokens."""
    prompts = [("Lear.\n", 40), ("Fool.\n", 30)] * 2
    records, _ = asyncio.run(loadgen.run_load(served.url, prompts, concurrency=2, ignore_eos=True))
    assert [r.tokens for r in records] == [n for _, n in prompts], [r.error for r in records]
    flags = ["--url", served.url, "--requests", "4", "--workload", "eos", "--json"]
    loadgen.main([*flags, "--concurrency", "2", "--ignore-eos"])
    run = json.loads(capsys.readouterr().out)["runs"]["concurrency 2"]
    assert run["completed"] == 4
    assert run["output_tok_s"] * run["duration_s"] == pytest.approx(4 * 256)
    assert served.wait_idle() == (0, 0)


def test_loadgen_measures_transformers_serve_on_the_bundled_checkpoint(tmp_path):
    """The peer: transformers' own OpenAI-compatible server, on the same weights, serving with
    its continuous batching. That gets an explicit small KV cache, as in the peers' benchmark:
    sized by default, it fills most of the machine's free memory before its first token (half a
    minute here)."""
    cli = Path(sys.executable).parent / "transformers"
    try:
        for name in ("accelerate", "fastapi", "uvicorn"):  # transformers[serving]
            importlib.import_module(name)
    except ImportError as e:
        pytest.skip(f"transformers[serving] is not installed ({e}); the dev extra installs it")
    if not cli.exists() and shutil.which("transformers") is None:
        pytest.skip("the transformers command is not installed")
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            str(cli if cli.exists() else "transformers"),
            "serve",
            str(resolve("default")),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--continuous-batching",
            "--cb-num-blocks",
            "64",
            "--cb-block-size",
            "32",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        t0 = time.time()
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() - t0 < 180, (
                "transformers serve did not come up: "
                f"{(tmp_path / 'serve.log').read_text()[-2000:]}"
            )
            time.sleep(1)
        prompts = [
            ("Ham.\nTo be, or not", 8),
            ("Rom.\nBut soft", 8),
            ("Lear.\n", 8),
            ("Jul.\nO", 8),
        ]
        records, duration = asyncio.run(
            loadgen.run_load(f"http://127.0.0.1:{port}/v1", prompts, rate=None)
        )
        assert all(r.error is None for r in records), [r.error for r in records]
        out = loadgen.summarize(records, duration)
        assert out["completed"] == 4 and out["output_tok_s"] > 0
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
