"""Step 10 - the engine's watchdog and the supervisor's outbox, alone: a process that computes
is busy however long its turn, one that waits for nothing past the timeout is hung, a stopped one
is named; the requests an engine never took go to the next engine, each to two engines at most."""

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from tinyllm.core.requests import Request
from tinyllm.serving import watchdog
from tinyllm.serving.engine_loop import Outbox, Ticket
from tinyllm.serving.messages import Abort, Add
from tinyllm.serving.watchdog import StepClock, Watchdog

SPIN = "while True: pass"
WAIT = "import time; time.sleep(600)"


class Child:
    """A process as the watchdog sees an engine's: its pid, whether it lives, its exit code."""

    def __init__(self, code: str):
        self.popen = subprocess.Popen([sys.executable, "-c", code])
        self.pid = self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.returncode


def stopped_by_now(pid: int) -> None:
    """Wait until the system shows pid stopped (a signal lands when the process is next
    scheduled: later on a busy machine)."""
    t0 = time.monotonic()
    while watchdog.process_stat(pid)[0] not in "Tt":
        assert time.monotonic() - t0 < 30, "not stopped 30 s after SIGSTOP: a slow machine?"
        time.sleep(0.01)


def judged_for(dog: Watchdog, seconds: float) -> list:
    """The watchdog's verdicts, every 50 ms for seconds."""
    verdicts, t0 = [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        verdicts.append(dog.judge())
        time.sleep(0.05)
    return verdicts


@pytest.mark.skipif(not os.path.exists("/proc"), reason="reads processes in /proc")
def test_a_turn_that_computes_is_busy_and_one_that_waits_for_nothing_is_hung():
    """Two turns 10 s old against a timeout of 1 s: the process that computes stays busy, the
    one that sleeps is hung once it has been watched for the timeout; a stopped one is named."""
    ctx = multiprocessing.get_context("spawn")
    spinning, waiting = Child(SPIN), Child(WAIT)
    try:
        dogs = []
        for child in (spinning, waiting):
            clock = StepClock(ctx)
            clock.values[0] = time.monotonic() - 10  # a turn 10 s old
            dogs.append(Watchdog(child, clock, timeout_s=1.0))
        time.sleep(0.5)  # the spinning one has the CPU by now
        busy, hung = (judged_for(dog, 1.5) for dog in dogs)
        assert {v.status for v in busy} == {"busy"}, busy[-1]
        assert busy[-1].why.startswith("its step has run 1") and busy[-1].step_s >= 10
        assert hung[0].status == "busy" and hung[-1].status == "hung", [v.status for v in hung]
        assert hung[-1].why.endswith("with no CPU for 1 s (--engine-timeout)"), hung[-1]
        os.kill(spinning.pid, signal.SIGSTOP)
        stopped_by_now(spinning.pid)
        stopped = judged_for(dogs[0], 1.5)
        assert f"the engine's process (pid {spinning.pid}) is stopped" in stopped[0].why
        assert stopped[-1].status == "hung", stopped[-1]
        spinning.popen.kill()
        spinning.popen.wait(10)
        assert dogs[0].judge().status == "dead" and "exit code -9" in dogs[0].judge().why
    finally:
        for child in (spinning, waiting):
            with contextlib.suppress(ProcessLookupError):
                child.popen.kill()
            child.popen.wait(10)


def test_a_loop_that_comes_round_is_ok_and_a_stopped_one_is_busy_whatever_its_turn(monkeypatch):
    """A clock ticked just now, or within BUSY_TIMES the usual turn, is ok; a process stopped
    between its turns is busy at once, naming itself."""
    ctx = multiprocessing.get_context("spawn")
    child = Child(WAIT)
    try:
        clock = StepClock(ctx)
        dog = Watchdog(child, clock)
        clock.tick()
        assert dog.judge().status == "ok"
        clock.values[1] = 2.0  # turns of 2 s are the usual ones here
        for _ in range(3):
            dog.turned()
        clock.values[0] = time.monotonic() - 5
        assert dog.judge().status == "ok", "5 s is within 4 usual turns of 2 s"
        clock.values[0] = time.monotonic() - 9
        assert dog.judge().status == "busy"
        if os.path.exists("/proc"):
            clock.tick()
            os.kill(child.pid, signal.SIGSTOP)
            stopped_by_now(child.pid)
            verdict = dog.judge()
            assert verdict.status == "busy" and "is stopped" in verdict.why, verdict
    finally:
        child.popen.kill()
        child.popen.wait(10)


class Pipe:
    """An engine process's socket as the outbox sees it: the messages sent."""

    def __init__(self):
        self.sent = []

    def send(self, message) -> None:
        self.sent.append(message)


def tickets(key: int, n: int) -> list[Ticket]:
    request = Request([1, 2, 3], 4)
    return [Ticket(request, key + i) for i in range(n)]


def test_the_outbox_keeps_what_the_engine_did_not_take_and_resends_it_twice_at_most():
    """Adds of 1, 2 and 1 choices: a report that took 3 sequences leaves the last; sent to a new
    engine, it goes again; a request whose choice was aborted meanwhile goes with that choice's
    Abort after it, and one whose choices all left goes nowhere; a request that two engines
    never took is given back unsent."""
    box = Outbox()
    a, b, c = tickets(0, 1), tickets(1, 2), tickets(3, 1)
    for t in (a, b, c):
        box.put(t, sent=True)
    assert box.sequences() == 4 and box.keys() == {0, 1, 2, 3}
    box.taken(3)
    assert box.keys() == {3}
    d, e = tickets(4, 2), tickets(6, 1)
    box.put(d, sent=False)  # while the engine restarts
    box.put(e, sent=False)
    live = {t.key: t for t in c + d[:1]}  # d's second choice aborted, e's only one too
    pipe = Pipe()
    assert box.resend(pipe, live) == []
    assert pipe.sent == [Add(3, c[0].request), Add(4, d[0].request), Abort(5)]
    assert box.keys() == {3, 4, 5}
    pipe = Pipe()
    assert box.resend(pipe, live) == c  # c went to two engines already: given back
    assert pipe.sent == [Add(4, d[0].request), Abort(5)] and box.keys() == {4, 5}
