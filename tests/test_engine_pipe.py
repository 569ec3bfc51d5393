"""Step 10 - the server's engine pipe and its supervisor: messages of several MB cross whole
both ways, and /health answers within 100 ms meanwhile; a request that fails on its way, in the
engine or on its way back fails alone; an engine paused for seconds is busy, not dead; one that
dies, or hangs past its timeout, is started again: the requests it held fail with a 500 that
says why, those it never took are served by the new one; an engine whose server is gone ends by
itself."""

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import NAME, PROMPTS, Running
from tinyllm.build import make_engine
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.generate import solo
from tinyllm.core.parts import DecodeStep
from tinyllm.core.requests import Request, TokenLogprobs
from tinyllm.core.sampling import Sampling
from tinyllm.ext.structured import LLGuidance
from tinyllm.serving import engine_loop, messages, server

pytestmark = pytest.mark.slow  # servers, each with its engine process

BULK = 1000  # alternatives BulkyEngine adds to each prompt token's top: about 14 bytes each
FAILS = 13  # max_new_tokens of a request whose add raises in BulkyEngine


def bulked(lp: TokenLogprobs | None, i: int) -> TokenLogprobs | None:
    """lp with BULK more alternatives after its own, each a new pair (pickled in full)."""
    if lp is None:
        return None
    return TokenLogprobs(lp.token, lp.logprob, lp.top + tuple((t, -99.0 - i) for t in range(BULK)))


class BulkyEngine(ContinuousEngine):
    """The continuous engine (pickled to the engine process by class name), but each prompt
    token's logprobs carry BULK alternatives after the real ones (a report of several MB; the
    API spells the k first), and adding a request of max_new_tokens FAILS raises."""

    def add_request(self, req: Request) -> int:
        if req.max_new_tokens == FAILS:
            raise RuntimeError("the grammar compiler crashed")
        return super().add_request(req)

    def step(self):
        return [
            ev
            if ev.prompt_logprobs is None
            else dataclasses.replace(
                ev, prompt_logprobs=[bulked(lp, i) for i, lp in enumerate(ev.prompt_logprobs)]
            )
            for ev in super().step()
        ]


class SlowEngine(ContinuousEngine):
    """The continuous engine, 20 ms a step: a request of 200 tokens is in flight for seconds."""

    def step(self):
        time.sleep(0.02)
        return super().step()


@pytest.fixture(scope="module")
def bulky(bundled64):
    model, tok = bundled64
    grammars = LLGuidance(tok, model.cfg.vocab_size)
    srv = Running(make_engine(model, 4, grammars=grammars, engine=BulkyEngine), tok)
    yield srv
    srv.stop()


PROBE = """
import sys, threading, time, httpx
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=10) as client:
    while not done.is_set():
        t0 = time.perf_counter()
        status = client.get(sys.argv[1]).status_code
        print(status, time.perf_counter() - t0, flush=True)
        time.sleep(0.02)
"""


class HealthWatch:
    """/health probed every 20 ms while it runs, from a process of its own (a pause of the
    whole server process counts too): each answer's status and time."""

    def __init__(self, srv):
        self.url, self.answers = srv.url[:-3] + "/health", []

    def __enter__(self):
        cmd = [sys.executable, "-c", PROBE, self.url]
        self.probe = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first = self.probe.stdout.readline()  # probing has begun
        return self

    def __exit__(self, *exc):
        out, _ = self.probe.communicate(timeout=10)  # its stdin closed: it ends
        for line in [self.first, *out.splitlines()]:
            status, seconds = line.split()
            self.answers.append((int(status), float(seconds)))

    def slowest(self) -> float:
        return max(t for _, t in self.answers)


def long_prompt(tok, n: int = 400) -> list[int]:
    """n token ids of the test prompts, repeated."""
    return (tok.encode(" ".join(PROMPTS)) * n)[:n]


def post(srv, body: dict | bytes, path: str = "/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=60)


def check_prompt_logprobs(srv, ids: list[int], got: httpx.Response) -> None:
    """A completion of 5 greedy tokens with prompt_logprobs 20 over ids is solo's: its text, and
    per prompt token its 20 likeliest alternatives and their ranks."""
    assert got.status_code == 200, got.text
    tok, model = srv.tok, srv.engine.model
    res = solo(model, Request(ids, 5, tok.eos_ids or None, Sampling(prompt_logprobs=20)))
    choice = got.json()["choices"][0]
    assert choice["text"] == tok.decode(res.tokens)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids), f"{len(entries)} prompt logprobs for {len(ids)} tokens"
    for pos, (entry, e) in enumerate(zip(entries[1:], res.prompt_logprobs[1:]), 1):
        ranks = {int(t): v["rank"] for t, v in entry.items()}
        expected = {t: r for r, (t, _) in enumerate(e.top, 1)}
        assert ranks == expected | {e.token: expected.get(e.token)}, f"prompt token {pos}"


def big_report_size(srv, ids: list[int]) -> int:
    """The bytes of the report that brings BulkyEngine's prompt logprobs over ids."""
    tok, model = srv.tok, srv.engine.model
    res = solo(model, Request(ids, 1, tok.eos_ids or None, Sampling(prompt_logprobs=20)))
    lps = [bulked(lp, i) for i, lp in enumerate(res.prompt_logprobs)]
    report = messages.StepReport([(0, 1, None)], [], 1, (0, 1), 0.0, None, {0: (None, lps)})
    return len(messages.dumps(report))


def big_body(srv, size: int = 3_000_000) -> tuple[str, bytes]:
    """A greedy completion of 8 tokens in a body of `size` bytes (its `user` field, which OpenAI
    reads and this server takes), and the text solo gives it."""
    tok, model = srv.tok, srv.engine.model
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0}
    body["user"] = "x" * size
    res = solo(model, Request(tok.encode(PROMPTS[3]), 8, tok.eos_ids or None))
    return tok.decode(res.tokens), json.dumps(body).encode()


def check_stopped(got: httpx.Response, text: str) -> None:
    assert got.status_code == 200, got.text[:500]
    assert got.json()["choices"][0]["text"] == text


def on_loop(srv, coro, timeout: float = 60.0):
    """Run coro on the server's event loop (the HTTP side's); its result."""
    loop = srv.served.loop.listener.get_loop()
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


async def answer_of(loop: server.EngineLoop, request: Request) -> list[int] | Exception:
    """Submit request (one choice) to the engine loop: its tokens, or the error it got."""
    ticket = server.Ticket(request)
    try:
        loop.submit([ticket])
    except server.APIError as e:
        return e
    tokens = []
    while True:
        ev = await asyncio.wait_for(ticket.events.get(), 30)
        if isinstance(ev, Exception):
            return ev
        tokens.append(ev.token)
        if ev.done:
            return tokens


def greedy(srv, prompt: str, n: int) -> httpx.Response:
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0}
    return post(srv, body)


def check_greedy(srv, prompt: str = PROMPTS[0], n: int = 6) -> None:
    """The server still answers: a greedy completion equal to solo's."""
    check_answer(srv, greedy(srv, prompt, n), prompt, n)


# ---- messages of any size, both ways ------------------------------------------------------------
def test_a_report_of_several_mb_comes_back_whole(bulky):
    """prompt_logprobs 20 over 400 tokens with 1000 more alternatives each: a 5 MB report,
    read whole, three times; the next request is served."""
    ids = long_prompt(bulky.tok)
    size = big_report_size(bulky, ids)
    assert size > 4_000_000, f"the report is {size:,} bytes: not several MB"
    body = {"model": NAME, "prompt": ids, "max_tokens": 5, "prompt_logprobs": 20}
    for _ in range(3):
        check_prompt_logprobs(bulky, ids, post(bulky, {**body, "temperature": 0}))
    check_greedy(bulky)
    assert bulky.wait_idle() == (0, 0)


def test_a_request_of_several_mb_goes_in_whole(bulky):
    """A 3 MB body, twice, and an Add of 4 MB sent straight to the engine loop: each answered
    as asked; the next request is served."""
    text, body = big_body(bulky)
    assert len(body) > 3_000_000
    for _ in range(2):
        check_stopped(post(bulky, body), text)
    tok, model = bulky.tok, bulky.engine.model
    ids, eos = tok.encode(PROMPTS[1]), (tok.eos_id,) * 2_000_000
    request = Request(ids, 8, eos)
    assert len(messages.dumps(messages.Add(0, request))) > 3_500_000
    assert on_loop(bulky, answer_of(bulky.served.loop, request)) == solo(model, request).tokens
    check_greedy(bulky)
    assert bulky.wait_idle() == (0, 0)


def test_health_answers_within_100_ms_while_mbs_cross(bulky):
    """Two 5 MB reports and two 3 MB requests at once, /health probed every 20 ms meanwhile:
    it answers ok each time, the slowest within 100 ms."""
    ids = long_prompt(bulky.tok)
    report_body = {"model": NAME, "prompt": ids, "max_tokens": 5, "prompt_logprobs": 20}
    text, big = big_body(bulky)
    got = {}

    def ask(name, body):
        got[name] = post(bulky, body)

    asks = [
        threading.Thread(target=ask, args=(f"report {i}", {**report_body, "temperature": 0}))
        for i in range(2)
    ] + [threading.Thread(target=ask, args=(f"request {i}", big)) for i in range(2)]
    with HealthWatch(bulky) as watch:
        time.sleep(0.1)
        for t in asks:
            t.start()
        for t in asks:
            t.join(120)
        time.sleep(0.1)
    for i in range(2):
        check_prompt_logprobs(bulky, ids, got[f"report {i}"])
        check_stopped(got[f"request {i}"], text)
    statuses = {status for status, _ in watch.answers}
    print(f"/health: {len(watch.answers)} answers, slowest {watch.slowest() * 1000:.0f} ms")
    assert statuses == {200}, f"/health answered {statuses} while the messages crossed"
    assert len(watch.answers) >= 5, f"only {len(watch.answers)} answers from /health"
    assert watch.slowest() < 0.1, f"/health took {watch.slowest() * 1000:.0f} ms at worst"


# ---- a failure fails its own request ----------------------------------------------------------
class Unloadable:
    """Pickles, but cannot be unpickled (as a class the engine process cannot import)."""

    def __reduce__(self):
        return refuse, ()


def refuse():
    raise RuntimeError("no such class here")


class Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this")


def test_a_request_that_the_engine_cannot_add_fails_alone(bulky):
    """Adding it raises in the engine: a 500 that says so; the engine serves the next one."""
    got = greedy(bulky, PROMPTS[2], FAILS)
    assert got.status_code == 500, got.text
    says = got.json()["error"]["message"]
    assert says == "the engine failed on this request: RuntimeError: the grammar compiler crashed"
    check_greedy(bulky)
    assert httpx.get(bulky.url[:-3] + "/health").json()["status"] == "ok"
    assert bulky.wait_idle() == (0, 0)


def test_a_request_that_cannot_cross_fails_alone(bulky):
    """One the engine cannot unpickle, one this side cannot pickle: each gets a 500 that says
    why, nothing is left half-sent or in the books, and the next request is served."""
    loop, ids = bulky.served.loop, bulky.tok.encode(PROMPTS[3])
    unread = on_loop(bulky, answer_of(loop, Request(ids, 5, Unloadable())))
    assert isinstance(unread, server.APIError) and unread.status == 500, unread
    assert "could not be read: RuntimeError: no such class here" in unread.message, unread
    unsent = on_loop(bulky, answer_of(loop, Request(ids, 5, Unpicklable())))
    assert isinstance(unsent, server.APIError) and unsent.status == 500, unsent
    assert unsent.message == (
        "the request could not be sent to the engine: TypeError: cannot pickle this"
    )
    check_greedy(bulky)
    assert bulky.wait_idle() == (0, 0)


def test_a_report_this_side_fails_to_hand_out_fails_its_requests_alone(bulky, monkeypatch):
    """dispatch raises on the tokens of one request: that request gets a 500 that says so, and
    the engine serves the next one."""
    loop = bulky.served.loop

    def breaking(tickets, tokens, refused):
        if any(k in tickets and tickets[k].request.max_new_tokens == 7 for k, _, _ in tokens):
            raise KeyError("a ticket went missing")
        engine_loop.dispatch.__wrapped__(tickets, tokens, refused)

    breaking.__wrapped__ = engine_loop.dispatch
    monkeypatch.setattr(engine_loop, "dispatch", breaking)
    got = greedy(bulky, PROMPTS[4], 7)
    assert got.status_code == 500, got.text
    assert got.json()["error"]["message"] == (
        "the server failed on the engine's news of it: KeyError: 'a ticket went missing'"
    )
    check_greedy(bulky)
    assert loop.failed is None and bulky.wait_idle() == (0, 0)


POISON = 40  # max_new_tokens of a request whose decode raises in PoisonEngine while one waits


class PoisonEngine(ContinuousEngine):
    """The continuous engine, 20 ms a step, whose decode raises mid-step (slots and blocks
    taken, the step's prompt chunks written) when it holds a request of max_new_tokens POISON
    while another request waits."""

    def step(self):
        time.sleep(0.02)
        return super().step()

    def retire(self, plan, out):
        poisoned = any(s.request.max_new_tokens == POISON for s in plan.decodes)
        if self.request_counts()[0] and poisoned:
            raise RuntimeError("the kernel read past the cache")
        return super().retire(plan, out)


@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_a_step_that_raises_fails_the_requests_it_held_and_no_other(bundled64, kv):
    """Two slots: a request of 60 tokens and one of POISON run, a third waits, and the next
    step raises. The two it held get a 500 that says why; the one waiting gets its solo tokens,
    /health says ok, no slot or block is left, and the next request is served. The waiting one
    has the poisoned one's prompt: paged with a prefix cache, it shares the 3 full blocks of 16
    that the poisoned one wrote (60 tokens)."""
    model, tok = bundled64
    engine = make_engine(model, 2, kv=kv, prefix_cache=kv == "paged")
    engine.__class__ = PoisonEngine  # pickled to the engine process by class name
    srv = Running(engine, tok)
    got, shared = {}, " ".join(PROMPTS)

    def ask(name: str, prompt: str, n: int, running: tuple[int, int]) -> None:
        body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        asks.append(threading.Thread(target=lambda: got.update({name: post(srv, body)})))
        asks[-1].start()
        t0 = time.time()
        while srv.request_counts() != running:
            assert srv.served.loop.failed is None, f"the engine failed: {srv.served.loop.failed}"
            assert time.time() - t0 < 30, f"the engine runs {srv.request_counts()}, not {running}"
            time.sleep(0.005)

    asks = []
    try:
        ask("long", PROMPTS[1], 60, (0, 1))
        ask("poisoned", shared, POISON, (0, 2))
        ask("waiting", shared, 20, (0, 1))  # it waits, the step raises, it runs
        for t in asks:
            t.join(60)
        for name in ("long", "poisoned"):
            assert got[name].status_code == 500, (name, got[name].text)
            assert got[name].json()["error"]["message"] == (
                "the engine failed on this request: RuntimeError: the kernel read past the cache"
            ), got[name].text
        assert got["waiting"].status_code == 200, got["waiting"].text
        res = solo(model, Request(tok.encode(shared), 20))
        assert got["waiting"].json()["choices"][0]["text"] == tok.decode(res.tokens)
        assert httpx.get(srv.url[:-3] + "/health").json()["status"] == "ok"
        assert srv.wait_idle() == (0, 0)
        check_greedy(srv)
    finally:
        srv.stop()


# ---- /health tells the truth ------------------------------------------------------------------
def in_flight(srv, n: int) -> tuple[list, list[threading.Thread]]:
    """n requests of 200 greedy tokens sent from threads, once the engine runs them all: the
    list their responses go to, and the threads."""
    got = []
    asks = [
        threading.Thread(target=lambda i=i: got.append(greedy(srv, PROMPTS[i], 200)))
        for i in range(n)
    ]
    for t in asks:
        t.start()
    t0 = time.time()
    while srv.request_counts() != (0, n):
        assert time.time() - t0 < 30, f"the engine runs {srv.request_counts()}, not (0, {n})"
        time.sleep(0.01)
    return got, asks


def check_lost(got: list, asks: list[threading.Thread], why: str) -> None:
    """Every request in flight got a 500 that says why the engine failed, and that it
    restarts."""
    for t in asks:
        t.join(60)
    assert len(got) == len(asks), "a request in flight got no answer"
    for r in got:
        assert r.status_code == 500, r.text
        said = r.json()["error"]["message"]
        assert said.startswith(f"the engine failed: {why}"), said
        assert said.endswith("; the server restarts it"), said


def health_of(srv) -> httpx.Response:
    return httpx.get(srv.url[:-3] + "/health", timeout=30)


def serving_again(srv, restarts: int, within_s: float = 120.0) -> None:
    """/health says ok again (503 "restarting" meanwhile, never another failure), after
    `restarts` restarts."""
    t0 = time.time()
    while (health := health_of(srv)).status_code == 503:
        assert health.json()["status"] == "restarting", health.json()
        assert time.time() - t0 < within_s, f"not serving {within_s:.0f} s later: a slow machine?"
        time.sleep(0.1)
    assert health.json()["status"] == "ok" and health.json()["restarts"] == restarts


def test_an_engine_process_killed_is_started_again(bundled64):
    """SIGKILL the engine process while it runs two requests and a third waits in its socket:
    the two get a 500 that says the engine died and restarts, the third (which the engine never
    took) is served by the new engine, its solo text; /health says restarting, then ok with one
    restart; nothing is left held, and the next request equals solo."""
    model, tok = bundled64
    srv = Running(make_engine(model, 2, engine=SlowEngine), tok)
    try:
        got, asks = in_flight(srv, 2)
        process = srv.served.loop.engine.process
        os.kill(process.pid, signal.SIGSTOP)  # it reads nothing: the third stays in its socket
        third = []
        asking = threading.Thread(target=lambda: third.append(greedy(srv, PROMPTS[2], 6)))
        asking.start()
        t0 = time.time()
        while srv.served.loop.outbox.sequences() == 0:
            assert time.time() - t0 < 30, "the third request was not sent in 30 s: a slow machine?"
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
        check_lost(got, asks, "its process ended (exit code -9)")
        asking.join(60)
        check_answer(srv, third[0], PROMPTS[2], 6)
        serving_again(srv, restarts=1)
        assert srv.wait_idle() == (0, 0)
        check_greedy(srv)
        metrics = httpx.get(srv.url[:-3] + "/metrics").text
        assert "tinyllm_engine_restarts_total 1.0" in metrics
    finally:
        srv.stop()
    assert not os.path.exists(srv.served.loop.engine.dir), "the sockets' directory is left"


def test_an_engine_paused_for_seconds_is_busy_then_serves_on(bundled64):
    """SIGSTOP the engine process for 6 s, then SIGCONT: /health says busy meanwhile (a 200,
    naming the stopped process), never 503; the requests in flight then end with their solo
    texts, and nothing was restarted."""
    model, tok = bundled64
    srv = Running(make_engine(model, 2, engine=SlowEngine), tok)
    process = srv.served.loop.engine.process
    try:
        got, asks = in_flight(srv, 2)
        os.kill(process.pid, signal.SIGSTOP)
        t0, said = time.time(), []
        while time.time() - t0 < 6:
            health = health_of(srv)
            assert health.status_code == 200, f"{health.json()} {time.time() - t0:.1f} s in"
            said.append(health.json())
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGCONT)
        busy = [h for h in said if h["status"] == "busy"]
        assert busy, said
        assert f"the engine's process (pid {process.pid}) is stopped" in busy[-1]["engine"]
        assert busy[-1]["step_s"] >= 4, busy[-1]
        for t in asks:
            t.join(60)
        for i, r in enumerate(got):
            assert r.status_code == 200, r.text
        assert health_of(srv).json()["restarts"] == 0
        assert srv.wait_idle() == (0, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        srv.stop()


def test_an_engine_stopped_past_its_timeout_is_hung_and_started_again(bundled64):
    """SIGSTOP the engine process with an engine timeout of 3 s: /health says busy, then the
    engine is hung (no CPU for 3 s), ended and started again; the requests it held get a 500
    that names the stopped process, and the next request equals solo."""
    model, tok = bundled64
    srv = Running(make_engine(model, 2, engine=SlowEngine), tok, engine_timeout=3.0)
    process = srv.served.loop.engine.process
    try:
        got, asks = in_flight(srv, 2)
        os.kill(process.pid, signal.SIGSTOP)
        check_lost(got, asks, "its step has run ")
        assert f"the engine's process (pid {process.pid}) is stopped" in got[0].text
        assert "with no CPU for 3 s (--engine-timeout)" in got[0].text
        serving_again(srv, restarts=1)
        process.join(10)
        assert not process.is_alive(), "the stopped engine was not ended"
        check_greedy(srv)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        srv.stop()


def check_answer(srv, got: httpx.Response, prompt: str, n: int) -> None:
    """A greedy completion of n tokens of prompt, equal to solo's."""
    assert got.status_code == 200, f"{got.status_code}: {got.text}"
    tok = srv.tok
    res = solo(srv.engine.model, Request(tok.encode(prompt), n, tok.eos_ids or None))
    assert got.json()["choices"][0]["text"] == tok.decode(res.tokens)


# ---- a decoder that compiles: before Ready, said as it goes -----------------------------------
class SlowDecoder(DecodeStep):
    """A decoder whose warm-up compiles three buckets of WARM_S each (it sleeps), saying each;
    its steps are the model's own."""

    WARM_S = 0.8
    compiles = True

    def __init__(self, model, fails: bool = False):
        self.model, self.fails = model, fails

    def warm_up(self, progress=None):
        for rows in (1, 2, 4):
            time.sleep(self.WARM_S)
            if self.fails and rows == 2:
                raise RuntimeError(
                    "InvalidCxxCompiler: No working C++ compiler found in "
                    "torch._inductor.config.cpp.cxx: (None, '/nonexistent')\n  and 100 more lines"
                )
            if progress is not None:
                progress(rows, self.WARM_S)

    def __call__(self, idx, cache):
        return self.model(idx, cache=cache)


async def start_then_ask(loop, tok, lines: list, idle_s: float = 0.0):
    """Start the loop (its Warming lines into lines), ask one token, stay idle_s, stop ->
    (seconds to Ready, seconds to the token, the tokens)."""
    t0 = time.perf_counter()
    await loop.start(lines.append)
    started = time.perf_counter() - t0
    t1 = time.perf_counter()
    tokens = await answer_of(loop, Request(tok.encode(PROMPTS[0]), 1))
    first = time.perf_counter() - t1
    await asyncio.sleep(idle_s)
    await loop.stop()
    return started, first, tokens


def test_a_decoder_compiles_before_the_engine_is_ready_saying_each_bucket(bundled64):
    """The engine loop starts once the decoder's warm-up is over, handing a line for each
    bucket to its progress (the serve command prints them); the first request then waits for
    no compilation."""
    model, tok = bundled64
    loop, lines = server.EngineLoop(make_engine(model, 2, decoder=SlowDecoder(model))), []
    started, first, tokens = asyncio.run(start_then_ask(loop, tok, lines))
    assert started >= 3 * SlowDecoder.WARM_S, f"ready after {started:.1f} s, before its warm-up"
    assert first < 2 * SlowDecoder.WARM_S, f"the first token took {first:.1f} s"
    assert len(tokens) == 1, tokens
    assert lines[0].startswith("compiling the decode step") and len(lines) == 5, lines
    assert [line.split(":")[0].strip() for line in lines[1:4]] == [
        "bucket of 1",
        "bucket of 2",
        "bucket of 4",
    ], lines
    assert lines[4].startswith("the decode step is compiled"), lines


class LaterDecoder(SlowDecoder):
    """A decoder that compiles its buckets of 1, 2 and 4 rows later (compile_next, WARM_S
    each), writing each bucket it compiles to a file: the engine process's own record."""

    def __init__(self, model, record):
        super().__init__(model)
        self.record, self.done = record, []
        self.compiles_later, self.eager_until_compiled = True, False

    def buckets(self):
        return [1, 2, 4]

    def compiled(self, rows):
        return rows in self.done

    def compile_next(self):
        rows = next((r for r in self.buckets() if r not in self.done), None)
        if rows is None:
            return None
        time.sleep(self.WARM_S)
        self.done.append(rows)
        with open(self.record, "a") as f:
            f.write(f"{rows} {int(self.eager_until_compiled)}\n")
        return rows, self.WARM_S


def test_a_decoder_that_compiles_later_is_ready_at_once_and_compiles_while_it_serves(
    bundled64, tmp_path
):
    """A decoder that can compile later (13's pieces) compiles nothing before Ready and says
    that its buckets compile while the engine serves; they do, in a thread, smallest first,
    its steps eager until then, and the first request waits for none of them."""
    model, tok = bundled64
    record = tmp_path / "compiled.txt"
    engine = make_engine(model, 4, decoder=LaterDecoder(model, record))
    loop, lines = server.EngineLoop(engine), []
    _, first, tokens = asyncio.run(start_then_ask(loop, tok, lines, 4 * LaterDecoder.WARM_S))
    assert first < LaterDecoder.WARM_S, f"the first token took {first:.1f} s"
    assert len(tokens) == 1, tokens
    assert len(lines) == 1 and "compiles for 1, 2, 4 rows while it serves" in lines[0], lines
    assert record.read_text().split("\n")[:3] == ["1 1", "2 1", "4 1"], "compiled before Ready"


def test_a_decoder_that_cannot_compile_stops_the_start_in_one_line(bundled64):
    """A warm-up that fails (TorchInductor without a C++ compiler) ends the start with one
    sentence: what failed, the error's first line, and what to do; the engine process is gone."""
    model, _ = bundled64
    engine = make_engine(model, 2, decoder=SlowDecoder(model, fails=True))
    loop = server.EngineLoop(engine)
    with pytest.raises(RuntimeError) as e:
        asyncio.run(loop.start())
    why = str(e.value)
    assert "\n" not in why and why.startswith("the engine could not start: its decode step"), why
    assert "No working C++ compiler" in why and "serve with --decoder eager" in why, why
    assert not loop.engine.process.is_alive()


ENGINE_ALONE = """
import asyncio, tinyllm
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.build import make_engine
from tinyllm.serving.engine_loop import EngineLoop

async def main():
    loop = EngineLoop(make_engine(tinyllm.load(device="cpu")[0], 2))
    await loop.start()
    print(loop.engine.process.pid, loop.engine.dir, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def ended(pid: int) -> bool:
    """Whether process pid has ended (gone, or a zombie that nobody has reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(not os.path.exists("/proc"), reason="reads a process's state in /proc")
def test_an_engine_whose_server_is_gone_ends_by_itself():
    """SIGKILL a server's process (its engine loop alone): its engine process ends in 2 s."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    http = subprocess.Popen([sys.executable, "-c", ENGINE_ALONE], stdout=subprocess.PIPE, env=env)
    said = http.stdout.readline().split()  # the engine's pid, its sockets' directory
    try:
        assert len(said) == 2, "the server did not start: its error is above"
        engine = int(said[0])
        assert not ended(engine), "the engine process ended before its server"
        http.kill()
        http.wait(10)
        t0 = time.time()
        while not ended(engine):
            assert time.time() - t0 < 2, "the engine process outlived its server by 2 s"
            time.sleep(0.05)
    finally:
        http.kill()
        if len(said) == 2:  # nobody else removes it
            shutil.rmtree(said[1], ignore_errors=True)


def test_the_messages_cross_whole():
    """Every message survives messages.dumps and loads; a message to the engine names its
    request's keys in its first frame."""
    report = messages.StepReport(
        [(3, 11, None)],
        [(5, "too long")],
        2,
        (0, 1),
        0.5,
        None,
        {0: (TokenLogprobs(11, -0.5, ((11, -0.5), (7, -1.25))), [None, TokenLogprobs(2, -3.0)])},
        (1, 2, 1, 2),
        [(6, "RuntimeError: no")],
    )
    ready, failed = messages.Ready({123: "rank 1"}), messages.Failed("RuntimeError: no", 2)
    for message in (ready, report, failed):
        assert messages.loads(messages.dumps(message)) == message, message
    add = messages.Add(7, Request([1, 2], 4, sampling=Sampling(n=2, temperature=1.0)))
    head, data = messages.to_engine(add)
    assert messages.keys_of(head) == [7, 8] and messages.loads(data) == add
    head, data = messages.to_engine(messages.Abort(7))
    assert messages.keys_of(head) == [] and messages.loads(data) == messages.Abort(7)
