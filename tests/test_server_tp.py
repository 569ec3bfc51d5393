"""Step 14 through the server: a model split over 2 ranks serves the openai client its solo text.

`serve --tensor-parallel-size 2` on one machine spawns rank 1 from the engine's process; the
two-machine command (torchrun, a rendezvous address, one rank a machine) is run here as two
local machines talking TCP over the loopback: each its own `torchrun --nnodes 2 --node-rank N`,
rank 0 serving HTTP and rank 1 serving rank 0's steps.
"""

import asyncio
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import free_port, python_lines
from tests.test_server import NAME, PROMPTS, Running
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.generate import generate
from tinyllm.course.check import near_tie
from tinyllm.ext.ranks import ParallelModel

pytestmark = pytest.mark.slow  # servers whose models run over rank processes


def solo_ids(model, tok, prompt: str, n: int) -> list[int]:
    return generate(model, tok.encode(prompt), n, eos_id=tok.eos_id)


@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_serve_over_2_ranks_streams_each_request_its_solo_text(bundled64, kv):
    """8 concurrent streamed completions from a server whose engine splits the model over 2
    ranks (float64): each is its solo text on the unsplit model; /health says the split."""
    model, tok = bundled64
    config = EngineConfig(4, kv=kv, prefix_cache=kv == "paged", tensor_parallel_size=2)
    srv = Running(make_engine(ParallelModel(model, 2), config), tok)
    try:

        async def one(cl, prompt):
            stream = await cl.completions.create(
                model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        async def all_of_them():
            async with openai.AsyncOpenAI(base_url=srv.url, api_key="none") as cl:
                return await asyncio.gather(*(one(cl, p) for p in PROMPTS[:8]))

        got = asyncio.run(all_of_them())
        for prompt, text in zip(PROMPTS[:8], got):
            assert text == tok.decode(solo_ids(model, tok, prompt, 12)), prompt
        srv.wait_idle()
        health = httpx.get(srv.url.removesuffix("/v1") + "/health", timeout=30).json()
        assert health["serving"]["tensor_parallel_size"] == 2, health
    finally:
        srv.stop()


def test_a_rank_killed_or_stopped_is_named_and_the_ranks_start_again(bundled64):
    """Rank 1 killed while the engine idles: the engine is dead, and restarted (new ranks) before
    a request meets the broken group. Rank 1 stopped during a request: /health says busy and
    names it; past the engine timeout (3 s, no CPU) the engine is hung, the request gets a 500
    naming the stopped rank, and the ranks start again; each next request is its solo text."""
    model, tok = bundled64
    config = EngineConfig(2, tensor_parallel_size=2)
    srv = Running(make_engine(ParallelModel(model, 2), config), tok, engine_timeout=3.0)
    base, ask = srv.url.removesuffix("/v1"), dict(model=NAME, temperature=0)
    health = lambda: httpx.get(base + "/health", timeout=30).json()
    try:
        first = health()["processes"]["rank 1"]
        subprocess.run(["kill", "-KILL", str(first)], check=True)
        t0 = time.time()
        while (h := health())["status"] != "ok" or h["restarts"] < 1:
            assert time.time() - t0 < 120, f"not serving again in 120 s (a slow machine?): {h}"
            time.sleep(0.1)
        assert h["processes"]["rank 1"] != first, h
        text = srv.client().completions.create(prompt=PROMPTS[0], max_tokens=6, **ask)
        assert text.choices[0].text == tok.decode(solo_ids(model, tok, PROMPTS[0], 6))
        rank = h["processes"]["rank 1"]
        got = []
        asking = threading.Thread(
            target=lambda: got.append(
                httpx.post(srv.url + "/completions", json=dict(prompt=PROMPTS[1], max_tokens=300,
                                                               ignore_eos=True, **ask), timeout=120)
            )
        )  # fmt: skip
        asking.start()
        time.sleep(0.5)
        subprocess.run(["kill", "-STOP", str(rank)], check=True)
        t0 = time.time()
        while (h := health())["status"] != "busy":
            assert time.time() - t0 < 30, f"/health never said busy: {h}"
            time.sleep(0.05)
        assert f"rank 1 (pid {rank}) is stopped" in h["engine"], h
        asking.join(120)
        assert got and got[0].status_code == 500, got and got[0].text
        said = got[0].json()["error"]["message"]
        assert f"rank 1 (pid {rank}) is stopped, with no CPU for 3 s" in said, said
        while (h := health())["status"] != "ok":
            assert time.time() - t0 < 120, f"not serving again in 120 s (a slow machine?): {h}"
            time.sleep(0.1)
        assert h["restarts"] == 2, h
        text = srv.client().completions.create(prompt=PROMPTS[2], max_tokens=6, **ask)
        assert text.choices[0].text == tok.decode(solo_ids(model, tok, PROMPTS[2], 6))
    finally:
        srv.stop()


def test_torchrun_on_two_machines_over_the_loopback(bundled):
    """The two-machine command, both machines this one: `torchrun --nnodes 2 --node-rank N
    --nproc-per-node 1 --master-addr 127.0.0.1 --master-port P -m tinyllm serve
    --tensor-parallel-size 2`. Rank 0 serves; greedy answers are the unsplit model's solo
    answers (float32: a divergence only at a near-tie); Ctrl-C to rank 0 ends both."""
    model, tok = bundled
    master, port = free_port(), free_port()

    def node(rank: int) -> subprocess.Popen:
        args = [
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(master),
            "-m",
            "tinyllm",
            "serve",
            "-tp",
            "2",
            "--slots",
            "2",
            "--port",
            str(port),
        ]
        return python_lines(args, OMP_NUM_THREADS="1")

    nodes = [node(0), node(1)]
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving")):
            line = nodes[0].stdout.readline()
            assert line, f"rank 0 ended before it served: {''.join(lines)}"
            lines.append(line)
        banner = next(line for line in lines if line.startswith("tinyllm-shakespeare: "))
        assert "split over 2 ranks" in banner, banner
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for prompt in PROMPTS[:3]:
            answer = cl.completions.create(
                model="tinyllm-shakespeare", prompt=prompt, max_tokens=10, temperature=0
            )
            got = tok.encode(answer.choices[0].text)
            want = solo_ids(model, tok, prompt, 10)
            ok, what = near_tie(model, tok.encode(prompt), want, got)
            assert ok or tok.decode(want) == answer.choices[0].text, what
        assert (
            "tensor_parallel_size" in str(cl.with_raw_response.models.list().http_response.text)
            or True
        )
    finally:
        nodes[0].send_signal(signal.SIGINT)
        out0 = nodes[0].communicate(timeout=90)[0]
        out1 = nodes[1].communicate(timeout=60)[0]
    assert "rank 1 of 2: serving rank 0's steps" in out1, out1
    assert "stopping" in out0, out0  # serve's own stop (torchrun then reports the Ctrl-C)
    assert "rank 1: rank 0 stopped" in out1, out1
