"""Step 12 - constraint checks in a worker process of their own: a constraint over the size
limit is refused before any worker sees it, a refused one gets the backend's sentence as before,
one past the CPU budget, or that crashes the backend, is refused; a client that goes away ends
its check (its worker killed, a fresh one started), at most max_waiting checks wait (a 429 past
that), and a plain request is answered while checks of maximal constraints stall."""

import asyncio
import os
import select
import signal
import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import NAME, Running
from tinyllm.build import make_engine
from tinyllm.core.sampling import Constraint
from tinyllm.ext.structured import LLGuidance
from tinyllm.serving.api import MAX_CONSTRAINT, APIError, check_constraint, choice_grammar
from tinyllm.serving.checks import MAX_WAITING_CHECKS, ConstraintChecks

pytestmark = pytest.mark.slow  # constraint checks' worker processes, and a server

SLOW_S = 60.0  # a wait for what a working server does in a second: past it, the machine is slow
GOOD, BAD = Constraint("regex", "good"), Constraint("regex", "bad")
STALL, SPIN, CRASH = (Constraint("regex", s) for s in ("stall", "spin", "crash"))


@pytest.fixture(autouse=True)
def workers_at_our_priority(monkeypatch):
    """The workers run at the tests' own priority: on a busy machine a niced worker would get
    a tenth of a core, and its checks take that much longer."""
    monkeypatch.setattr("tinyllm.serving.checks.NICENESS", 0)


class Fake:
    """A grammar backend that takes "good" and refuses "bad"; on a constraint that holds
    "stall" it marks a file in marks (its check has begun) and sleeps an hour; on "spin" it
    spins the CPU for ever; on "crash" it aborts its process."""

    def __init__(self, marks: Path):
        self.marks = marks

    def check(self, c: Constraint) -> str | None:
        if "stall" in c.spec:
            tempfile.mkstemp(dir=self.marks)
            time.sleep(3600)
        if "spin" in c.spec:
            while True:
                pass
        if "crash" in c.spec:
            os.abort()
        return "it is bad" if "bad" in c.spec else None


async def never() -> bool:
    return False


def gone_when(flags: list, i: int):
    """An async gone() that says the client went away once flags[i] is true."""

    async def gone() -> bool:
        return flags[i]

    return gone


async def until(ok, what: str) -> None:
    """Wait until ok() (a check of what a working server does at once), SLOW_S at most."""
    deadline = time.monotonic() + SLOW_S
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen in {SLOW_S:.0f} s: the machine was too slow")
        await asyncio.sleep(0.02)


async def refusal(checks: ConstraintChecks, param: str, c: Constraint) -> APIError:
    """The APIError checks raises on c (SLOW_S at most: a check that never ends fails)."""
    with pytest.raises(APIError) as e:
        try:
            await asyncio.wait_for(checks.check(param, c, never), SLOW_S)
        except asyncio.TimeoutError:
            pytest.fail(f"no word on {c} in {SLOW_S:.0f} s: it never ends, or the machine was slow")
    return e.value


def run(test, grammars, **kw) -> None:
    """Run an async test on ConstraintChecks(grammars, **kw) of its own, stopped after it."""

    async def go():
        checks = ConstraintChecks(grammars, **kw)
        try:
            await test(checks)
        finally:
            checks.stop()

    asyncio.run(go())


def test_a_constraint_over_the_size_limit_is_refused_before_any_worker_starts(tmp_path):
    """A 400 naming the field, saying the size and the limit; no worker process was started."""
    big = choice_grammar([f"choice {i}" for i in range(MAX_CONSTRAINT // 10)])

    async def test(checks):
        e = await refusal(checks, "guided_choice", Constraint("lark", big))
        assert (e.status, e.param) == (400, "guided_choice"), e.message
        assert f"over the {MAX_CONSTRAINT:,}" in e.message, e.message
        assert all(w.process is None for w in checks.workers), "a worker started"

    run(test, Fake(tmp_path))


def test_a_refused_constraint_gets_the_backends_sentence_as_before(bundled64):
    """The worker's LLGuidance refuses a bad schema with the sentence check_constraint gives
    in the server's own process; a good one is taken."""
    model, tok = bundled64
    grammars = LLGuidance(tok, model.cfg.vocab_size)
    c = Constraint("json_schema", '{"type": "objectz"}')
    with pytest.raises(APIError) as here:
        check_constraint(grammars, "response_format", c)

    async def test(checks):
        e = await refusal(checks, "response_format", c)
        assert (e.status, e.param, e.message) == (400, "response_format", here.value.message)
        assert await checks.check("response_format", Constraint("json_object"), never) is None

    run(test, grammars)


def test_a_check_past_its_cpu_budget_is_refused_and_the_next_runs(tmp_path):
    """A check that spins past the budget (1 CPU-second) is ended by the kernel and refused,
    saying so; the next check runs on a fresh worker."""

    async def test(checks):
        e = await refusal(checks, "guided_regex", SPIN)
        assert (e.status, e.param) == (400, "guided_regex"), e.message
        assert "took more than 1 CPU-seconds to compile" in e.message, e.message
        assert (await refusal(checks, "guided_regex", BAD)).message.endswith("it is bad")

    run(test, Fake(tmp_path), budget_s=1)


def test_a_worker_that_crashes_on_a_constraint_refuses_it_and_the_next_runs(tmp_path):
    """The backend's process ends on a constraint (SIGABRT): a 400 naming the field says so,
    and a fresh worker checks the next."""

    async def test(checks):
        e = await refusal(checks, "guided_grammar", CRASH)
        assert (e.status, e.param) == (400, "guided_grammar"), e.message
        assert e.message.endswith("the grammar backend's process ended on it (SIGABRT)"), e
        assert await checks.check("guided_grammar", GOOD, never) is None

    run(test, Fake(tmp_path))


def test_a_client_gone_mid_check_kills_its_worker_and_a_fresh_one_checks_the_next(tmp_path):
    """The client goes away while its check runs: check raises a 499, the worker process is
    killed (not left to run its hour), and the next check is answered by a fresh one."""
    left = [False]

    async def test(checks):
        task = asyncio.create_task(checks.check("guided_regex", STALL, gone_when(left, 0)))
        await until(lambda: any(tmp_path.iterdir()), "the check began in the worker")
        old = checks.workers[0].process
        left[0] = True
        with pytest.raises(APIError) as e:
            await task
        assert e.value.status == 499, e.value.message
        await until(lambda: checks.workers[0].process is not old, "the worker killed, replaced")
        assert old.exitcode == -signal.SIGKILL, f"the worker was not killed: {old.exitcode}"
        assert await checks.check("guided_regex", GOOD, never) is None
        assert checks.workers[0].process.pid != old.pid

    run(test, Fake(tmp_path))


def test_a_check_past_max_waiting_gets_a_429_and_a_waiting_client_gone_leaves(tmp_path):
    """One check runs, one waits (max_waiting 1): a third gets a 429 at once. The waiting one's
    client goes away: it leaves the line (a 499) while the first still runs."""
    left = [False, False]

    async def test(checks):
        first = asyncio.create_task(checks.check("guided_regex", STALL, gone_when(left, 0)))
        await until(lambda: any(tmp_path.iterdir()), "the first check began in the worker")
        second = asyncio.create_task(checks.check("guided_regex", GOOD, gone_when(left, 1)))
        await until(lambda: checks.waiting == 1, "the second check waited")
        e = await refusal(checks, "guided_regex", GOOD)
        assert (e.status, e.kind) == (429, "rate_limit_error"), e.message
        left[1] = True
        with pytest.raises(APIError) as e:
            await second
        assert e.value.status == 499 and checks.waiting == 0 and not first.done()
        left[0] = True
        with pytest.raises(APIError):
            await first

    run(test, Fake(tmp_path), max_waiting=1)


def stalled_request(port: int) -> socket.socket:
    """A socket that sent a completion under a maximal guided_choice, each choice "stall ...":
    its check stalls until the socket is closed."""
    n = (MAX_CONSTRAINT - len("start: ")) // len('"stall 0000" | ')
    choices = [f"stall {i:04d}" for i in range(n)]
    assert len(choice_grammar(choices).encode()) <= MAX_CONSTRAINT
    body = httpx.Request(
        "POST",
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": NAME, "prompt": "Ham.", "max_tokens": 4, "guided_choice": choices},
    )
    head = ["POST /v1/completions HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    head += [f"{k}: {v}" for k, v in body.headers.items() if k.lower() != "host"]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body.read())
    return sock


def status_lines(socks: list[socket.socket]) -> list[bytes]:
    """The status lines of the answers on socks, once one came (SLOW_S at most)."""
    ready = select.select(socks, [], [], SLOW_S)[0]
    assert ready, f"no answer came in {SLOW_S:.0f} s: the machine was too slow"
    return [s.recv(65536).split(b"\r\n")[0] for s in ready]


def test_a_plain_request_is_answered_while_maximal_constraint_checks_stall(bundled64, tmp_path):
    """Through the server: one check of a maximal guided_choice stalls in the worker, as many as
    may wait behind it wait, one more gets a 429; a plain streamed request is answered all the
    same. Their clients close: every check ends, and the worker is killed."""
    model, tok = bundled64
    srv = Running(make_engine(model, 4, grammars=Fake(tmp_path)), tok)
    socks, checks = [], srv.served.checks
    try:
        for _ in range(MAX_WAITING_CHECKS + 2):
            socks.append(stalled_request(srv.port))
        assert status_lines(socks) == [b"HTTP/1.1 429 Too Many Requests"]
        asyncio.run(until(lambda: any(tmp_path.iterdir()), "the first check began"))
        assert checks.waiting == MAX_WAITING_CHECKS and len(list(tmp_path.iterdir())) == 1
        try:
            stream = srv.client(timeout=SLOW_S).completions.create(
                model=NAME, prompt="Ham.", max_tokens=4, stream=True
            )
            text = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as e:
            pytest.fail(f"the plain request got no answer ({e!r}): it waited behind the checks")
        assert text, "the plain request's answer is empty"
        old = checks.workers[0].process
        for sock in socks:
            sock.close()
        asyncio.run(until(lambda: checks.waiting == 0, "the waiting checks left"))
        asyncio.run(until(lambda: checks.workers[0].process is not old, "the worker replaced"))
        assert old.exitcode == -signal.SIGKILL, f"the worker was not killed: {old.exitcode}"
    finally:
        for sock in socks:
            sock.close()
        srv.stop()
