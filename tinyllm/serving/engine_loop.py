"""Step 10 - the engine loop: the HTTP side's handle on the engine's process, and its supervisor.

The engine runs in a process of its own (engine_core.py), as vLLM's engine core does, joined to
the HTTP side by two ZeroMQ sockets that carry messages.py's messages: `Add(key, request)` and
`Abort(key)` go in; after each step one `StepReport` comes back. The HTTP side's sockets are
asyncio sockets (pyzmq's), so a large message never blocks the event loop. `EngineProcess`
starts the process, holds the sockets and judges it (watchdog.py: ok, busy, hung or dead).
`EngineLoop` keeps each request's choices as `Ticket`s: it sends them in, and its listening
task hands each step's tokens to their requests' queues (`dispatch`). A request that cannot be
sent, read or added fails alone; a step that raises fails the requests it held. When the engine
fails as a whole, hangs or dies, the requests it held fail with a 500 that says why, a new
engine process starts, and the requests it had not taken yet (`Outbox`) go to it; after
MAX_RESTARTS restarts that brought no token it gives up (a 503 from then on).

Seam: `dispatch` (exercise 10).
"""

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.multiprocessing
import zmq
import zmq.asyncio

from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.requests import Event, Request
from tinyllm.serving.api import APIError
from tinyllm.serving.engine_core import engine_process
from tinyllm.serving.messages import (
    Abort,
    Add,
    Failed,
    Ready,
    SpeculationCounts,
    StepReport,
    Stop,
    Warming,
    Watch,
    loads,
    to_engine,
)
from tinyllm.serving.watchdog import ENGINE_TIMEOUT_S, StepClock, Verdict, Watchdog

MAX_RESTARTS = 5  # restarts in a row with no token between them, before the loop gives up


def say(line: str) -> None:
    """A line of the supervisor's on the server's terminal."""
    print(f"tinyllm: {line}", file=sys.stderr, flush=True)


@dataclass
class Ticket:
    """One choice of a submitted request, as the HTTP side knows it: its Request, its key (the
    id both processes call it by), the queue its events arrive on (an Event each, or an
    APIError if the engine refused it or failed; the choices of one request share one queue),
    and its tokens' logprobs, in the order of its events: (the token's TokenLogprobs, the
    prompt's list) or None for each, as the step reports bring them."""

    request: Request
    key: int = -1
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    logprobs: deque = field(default_factory=deque)


class Outbox:
    """The requests on their way into the engine: each request's tickets, in the order their
    Adds were sent (or wait to be sent while the engine restarts), until a report says the
    engine took them (`taken`: its count of sequences). An engine that dies takes none of those
    left: `resend` gives them to the next one, each request to two engines at most (one that
    dies as it reads a request may die of it)."""

    def __init__(self):
        self.adds: deque[tuple[list[Ticket], int]] = deque()  # (tickets, engines sent to)

    def sequences(self) -> int:
        return sum(len(tickets) for tickets, _ in self.adds)

    def keys(self) -> set[int]:
        return {t.key for tickets, _ in self.adds for t in tickets}

    def put(self, tickets: list[Ticket], sent: bool) -> None:
        self.adds.append((tickets, int(sent)))

    def taken(self, sequences: int) -> None:
        while sequences > 0 and self.adds:
            sequences -= len(self.adds.popleft()[0])

    def resend(self, engine: "EngineProcess", live: dict[int, Ticket]) -> list[Ticket]:
        """Send every Add left to engine (a new one), its choices that left `live` (aborted
        meanwhile) aborted after it -> the tickets of those that went to two engines already,
        which leave the outbox unsent."""
        adds, self.adds, refused = self.adds, deque(), []
        for tickets, tries in adds:
            alive = [t for t in tickets if t.key in live]
            if alive and tries >= 2:
                refused += alive
            elif alive:
                engine.send(Add(tickets[0].key, tickets[0].request))
                for t in tickets:
                    if t.key not in live:
                        engine.send(Abort(t.key))
                self.adds.append((tickets, tries + 1))
        return refused


class EngineProcess:
    """The engine's own process (engine_core.engine_process), the two ZeroMQ sockets that join
    it to the HTTP side, over ipc:// in a directory of the server's own, and its `watchdog`:
    an `Add` or an `Abort` goes in per request (`send`); one `StepReport` per step comes out
    (`receive`). ZeroMQ moves each message whole, and its asyncio sockets (pyzmq's zmq.asyncio)
    send and receive without blocking the event loop, whatever the size: a report of several MB
    crosses while /health answers. The watchdog judges the process and the processes it started
    (a split model's ranks) from the system and a shared StepClock: a hung one is one whose turn
    outlived timeout_s (0: none) with no CPU."""

    def __init__(self, engine: ContinuousEngine, timeout_s: float = ENGINE_TIMEOUT_S):
        self.engine, self.timeout_s = engine, timeout_s
        self.process = self.zmq = self.watchdog = None
        self.ready = False

    async def start(self, progress=None) -> None:
        """Bind the sockets, start the engine process and wait until it is Ready: a decoder
        that compiles has compiled by then, each Warming line handed to progress (None: kept
        quiet). The engine goes to it pickled: its tensors move to shared memory, so the weights
        are not copied. A fresh interpreter imports torch there: a few seconds. An engine that
        cannot start (its process ends, says Failed, or hangs) raises RuntimeError, one
        sentence of why."""
        self.dir = tempfile.mkdtemp(prefix="tinyllm-")  # its sockets: only this user's
        addresses = f"ipc://{self.dir}/requests", f"ipc://{self.dir}/reports"
        self.zmq = zmq.asyncio.Context()
        self.requests, self.reports = self.zmq.socket(zmq.PUSH), self.zmq.socket(zmq.PULL)
        self.requests.bind(addresses[0])
        self.reports.bind(addresses[1])
        ctx = torch.multiprocessing.get_context("spawn")
        clock = StepClock(ctx)
        clock.tick()  # the start is a turn: busy while it lasts, hung if it waits for nothing
        self.process = ctx.Process(
            target=engine_process,
            name="tinyllm-engine",
            daemon=True,
            args=(self.engine, addresses, torch.get_num_threads(), clock),
        )
        self.process.start()
        self.watchdog = Watchdog(self.process, clock, self.timeout_s)
        try:
            message = await self.first_message(progress)
        except BaseException:
            await self.stop()
            raise
        if not isinstance(message, Ready):
            await self.stop()
            if isinstance(message, Failed):
                raise RuntimeError(f"the engine could not start: {message.why}")
            raise RuntimeError(f"the engine process said {message!r} before it was Ready")
        self.watchdog.children, self.ready = message.children, True

    async def first_message(self, progress=None):
        """The engine process's first message but Warming lines (each handed to progress); a
        RuntimeError if its process ends first, or hangs (watchdog)."""
        while True:
            while not await self.reports.poll(250):
                verdict = self.watchdog.judge()
                if verdict.status == "dead":
                    raise RuntimeError(
                        f"the engine process failed to start (exit code "
                        f"{self.process.exitcode}); its error is above"
                    )
                if verdict.status == "hung":
                    raise RuntimeError(f"the engine process did not start: {verdict.why}")
            message = loads(await self.reports.recv())
            if not isinstance(message, Warming):
                return message
            if progress is not None:
                progress(message.line)

    async def stop(self, kill: bool = False) -> None:
        """Stop the engine process: a Stop, and killed if it has not ended 10 s later; killed
        at once with kill, or before it was Ready (it reads no Stop while it compiles), and the
        processes it started with it. Then close the sockets and remove their directory."""
        if self.process is not None and self.process.is_alive() and self.ready and not kill:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.requests.send_multipart(to_engine(Stop())), 1.0)
            await asyncio.to_thread(self.process.join, 10)
        if self.process is not None and self.process.is_alive():
            for pid in self.watchdog.children:  # they end with it: stopped ones too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        if self.zmq is not None:
            self.zmq.destroy(linger=0)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.zmq = None

    def send(self, message) -> None:
        """A message to the engine, queued at once: ZeroMQ sends it whole."""
        self.requests.send_multipart(to_engine(message))

    async def receive(self):
        """The engine's next message, unpickled (a big one off the event loop: it lets go of
        Python's lock every few ms meanwhile, see messages.PICKLING); None when nothing came
        in a quarter of a second."""
        if not await self.reports.poll(250):
            return None
        data = await self.reports.recv()
        return loads(data) if len(data) < 2**16 else await asyncio.to_thread(loads, data)


class RequestBooks:
    """The HTTP side's books of the requests in flight: each request's choices as tickets, sent
    to the engine (`engine`, an EngineProcess), and each step's report handed out to them
    (`take`), with the engine's state as the reports say it.

    A request of n choices is n sequences in the engine, n tickets here (keys key, key + 1,
    ...) and one Add. At most max_waiting sequences wait for a slot at once; a request that
    would make more is refused with a 429, one that could never fit with a 400. A report also
    brings the engine's load and steps, its KV cache's integrity (None when its books are
    sound, else what is wrong) and, while a page watches, a frame of its state (to `on_frame`,
    live.Pages.publish). The engine's totals (steps, frames, speculation) run on across the
    engines a restart makes (`before`). Messages go to the engine only while it `serves`; else
    an Add waits in the outbox."""

    def __init__(self, engine: "EngineProcess", max_waiting: int = 64):
        self.engine, self.max_waiting, self.serves = engine, max_waiting, False
        self.tickets: dict[int, Ticket] = {}  # key -> ticket, while it runs
        self.outbox, self.next_key = Outbox(), 0
        self.reported, self.kv_used = (0, 0), 0.0  # the engine's (waiting, running), KV use
        self.integrity: str | None = None  # the KV cache's books, last checked idle
        self.speculation = SpeculationCounts()  # the engines' totals (11)
        self.steps, self.frames, self.blocks, self.on_frame = 0, 0, None, None  # see StepReport
        self.before = (0, 0, SpeculationCounts())  # the totals of the engines before this one
        self.failed: str | None = None  # why the engine failed for good

    def request_counts(self) -> tuple[int, int]:
        """(requests waiting, counting those not yet in the engine; requests running), as of
        the engine's last report."""
        waiting, running = self.reported
        return waiting + self.outbox.sequences(), running

    def submit(self, tickets: list[Ticket]) -> None:
        """Send one request, its choices' tickets in order (one Add, their keys consecutive;
        kept in the outbox until the engine takes it). A request that cannot be pickled gets a
        500 that says why, and nothing is sent."""
        if self.failed is not None:
            raise APIError(500, f"the engine failed: {self.failed}", kind="server_error")
        waiting, n = self.request_counts()[0], len(tickets)
        if n > self.max_waiting:
            raise APIError(
                400,
                f"n={n} choices are more than the {self.max_waiting} sequences that may wait "
                f"for a slot on this server (serve --max-waiting): ask for {self.max_waiting} "
                f"at most",
                "n",
            )
        if waiting + n > self.max_waiting:
            raise APIError(
                429,
                f"the server is full: {waiting} sequences already wait for a slot, of "
                f"{self.max_waiting} at most"
                + (f", and this request's {n} choices would be {n} more" if n > 1 else "")
                + "; retry later",
                kind="rate_limit_error",
            )
        try:
            frames = to_engine(Add(self.next_key, tickets[0].request))
        except Exception as e:
            raise APIError(
                500,
                f"the request could not be sent to the engine: {type(e).__name__}: {e}",
                kind="server_error",
            ) from e
        for i, ticket in enumerate(tickets):
            ticket.key = self.next_key + i
            self.tickets[ticket.key] = ticket
        self.next_key += n
        self.outbox.put(tickets, sent=self.serves)
        if self.serves:  # queued at once; ZeroMQ sends it whole
            self.engine.requests.send_multipart(frames)

    def abort(self, *tickets: Ticket) -> None:
        """The client went away (or a stop string ended a choice): drop these choices wherever
        they are (an outbox waiting for a new engine leaves them out)."""
        for ticket in tickets:
            if self.tickets.pop(ticket.key, None) is not None and self.serves:
                self.engine.send(Abort(ticket.key))

    def take(self, report: StepReport) -> None:
        """One step's report: the engine's state as it says, its tokens to their requests. A
        failure here fails the requests the report speaks of, and no other."""
        self.outbox.taken(report.taken)
        steps, frames, spec = self.before
        self.reported, self.kv_used = report.request_counts, report.kv_used
        self.integrity, self.blocks = report.integrity, report.blocks
        self.speculation = SpeculationCounts(*map(sum, zip(spec, report.speculation)))
        self.steps, self.frames = steps + report.steps, frames + report.frames
        try:
            self.drop(report.failed, "the engine failed on this request: ")
            for i, (key, _, _) in enumerate(report.tokens):  # logprobs first, then their tokens
                if (ticket := self.tickets.get(key)) is not None:
                    ticket.logprobs.append(report.logprobs.get(i))
            dispatch(self.tickets, report.tokens, report.refused)
        except Exception as e:
            why = f"the server failed on the engine's news of it: {type(e).__name__}: {e}"
            keys = {key for key, *_ in report.tokens + report.refused + report.failed}
            for key in keys & self.tickets.keys():  # their slots are free before the next step
                self.engine.send(Abort(key))
            self.drop([(key, why) for key in keys], "")
        if report.live is not None and self.on_frame is not None:
            self.on_frame(report.live)

    def drop(self, failed: list[tuple[int, str]], says: str) -> None:
        """These choices fail, each with a 500 that says why: (key, why) for each."""
        for key, why in failed:
            if (ticket := self.tickets.pop(key, None)) is not None:
                ticket.events.put_nowait(APIError(500, says + why, kind="server_error"))

    def end(self, tickets: list[Ticket], error: APIError) -> None:
        """These choices end with error (their requests' queues get it)."""
        for ticket in tickets:
            self.tickets.pop(ticket.key, None)
            ticket.events.put_nowait(error)

    def end_all(self, error: APIError) -> None:
        """Every choice in flight, and every one on its way in, ends with error."""
        self.end(list(self.tickets.values()), error)
        self.outbox = Outbox()

    def new_engine(self, engine: "EngineProcess") -> None:
        """The engine was replaced: the old one's totals kept, its state forgotten."""
        self.engine, self.before = engine, (self.steps, self.frames, self.speculation)
        self.reported, self.kv_used, self.integrity = (0, 0), 0.0, None


class EngineLoop(RequestBooks):
    """The HTTP side's handle on the engine: the requests' books (RequestBooks), a listening
    task on the event loop that hands the engine's news to them (`listen`), and the engine's
    supervisor: when the engine fails, hangs or dies, `restart` replaces it. timeout_s: a turn
    of the engine older than this, with no CPU, is hung (watchdog.py; 0: never)."""

    def __init__(
        self, engine: ContinuousEngine, max_waiting: int = 64, timeout_s: float = ENGINE_TIMEOUT_S
    ):
        super().__init__(EngineProcess(engine, timeout_s), max_waiting)
        self.restarting: str | None = None  # why the engine restarts, while it does
        self.restarts, self.in_a_row = 0, 0  # starts, and those since the last step
        self.watching: Watch | None = None  # the live view's, said again to a new engine
        self.listener = None

    @property
    def started(self) -> bool:
        return self.listener is not None

    async def start(self, progress=None) -> None:
        """Start the engine's process (its decoder compiled, each line of how it goes handed to
        progress: EngineProcess.start), then listen to it."""
        await self.engine.start(progress)
        self.serves, self.listener = True, asyncio.create_task(self.listen())

    async def stop(self) -> None:
        """Requests in flight end with a 503 (a stream with an error event), then the engine's
        process."""
        if self.listener is not None:
            self.listener.cancel()
        self.serves = False
        self.end_all(APIError(503, "the server is stopping", kind="server_error"))
        await self.engine.stop()

    def health(self) -> Verdict:
        """The engine's state as /health says it: ok or busy (watchdog.Verdict: its turn's age,
        and what is stopped), starting, restarting or failed, with why."""
        if self.failed is not None:
            return Verdict("failed", self.failed)
        if self.restarting is not None:
            return Verdict("restarting", self.restarting)
        if not self.engine.ready:
            return Verdict("starting")
        verdict = self.engine.watchdog.judge()
        return Verdict("restarting", verdict.why) if verdict.status in ("hung", "dead") else verdict

    def processes(self) -> dict[str, int]:
        """The engine's processes, name -> pid (its own, its ranks'), while it serves."""
        dog = self.engine.watchdog if self.serves else None
        return {} if dog is None else {name: pid for pid, name in dog.processes().items()}

    def watch(self, message: Watch) -> None:
        """Tell the engine (and each engine after it) whether pages of the live view watch."""
        self.watching = message
        if self.serves:
            self.engine.send(message)

    async def listen(self) -> None:
        """On the event loop while the server runs: the engine's messages to where they go
        (`hear`), and a new engine each time one fails, hangs or dies (`restart`)."""
        while self.failed is None:
            await self.restart(await self.hear())

    async def hear(self) -> str:
        """Each message from the engine, in order, to where it goes, and the watchdog's verdict
        whenever the engine is silent, until the engine fails, hangs or dies -> why."""
        while True:
            try:
                message = await self.engine.receive()
            except Exception as e:  # its news is lost, and with it the books of its requests
                return f"its news could not be read: {type(e).__name__}: {e}"
            match message:
                case None:
                    if (verdict := self.engine.watchdog.judge()).status in ("hung", "dead"):
                        return verdict.why
                case StepReport() as report:
                    self.take(report)
                    self.engine.watchdog.turned()
                    self.in_a_row = 0 if report.tokens else self.in_a_row
                case Failed(why, taken):
                    self.outbox.taken(taken)
                    return why
                case _:
                    return f"it sent {message!r}, which is no report"
            await asyncio.sleep(0)  # a flood of reports still lets the HTTP requests run

    async def restart(self, why: str) -> None:
        """The engine failed, hung or died (why): its processes end, every request it had taken
        fails with a 500 that says why, and a new engine process starts with the same engine;
        the requests it had not taken go to the new one (Outbox). A start that fails is tried
        again, 1, 2, 4, ... s later. The loop fails for good instead (`fail`) after MAX_RESTARTS
        restarts in a row with no token between them, or at once for a model whose ranks
        torchrun started (they cannot be started again from here)."""
        self.serves, t0, wait, engine = False, time.monotonic(), 1.0, self.engine.engine
        await self.engine.stop(kill=True)
        while True:
            if torchrun_ranks(engine):
                return self.fail(f"{why}; its ranks were started by torchrun, not by the server")
            if self.in_a_row >= MAX_RESTARTS:
                return self.fail(
                    f"{why}; the server gave up after {self.in_a_row} restarts with no token"
                )
            self.in_a_row, self.restarts, self.restarting = (
                self.in_a_row + 1,
                self.restarts + 1,
                why,
            )
            say(f"the engine failed: {why}; restarting it (restart {self.restarts})")
            lost = APIError(
                500, f"the engine failed: {why}; the server restarts it", kind="server_error"
            )
            self.end(
                [self.tickets[k] for k in sorted(self.tickets.keys() - self.outbox.keys())], lost
            )
            self.new_engine(EngineProcess(engine, self.engine.timeout_s))
            try:
                await self.engine.start()
                break
            except RuntimeError as e:
                why = str(e)
                await asyncio.sleep(wait)
                wait *= 2
        self.serves, self.restarting = True, None
        self.end(self.outbox.resend(self.engine, self.tickets), lost)
        if self.watching is not None:
            self.engine.send(self.watching)
        say(f"the engine serves again ({time.monotonic() - t0:.0f} s after it failed)")

    def fail(self, why: str) -> None:
        """The engine failed for good: every request in flight gets a 500 that says why, and so
        does every request after."""
        self.failed, self.restarting, self.serves = why, None, False
        say(f"the engine failed for good: {why}")
        self.end_all(APIError(500, f"the engine failed: {why}", kind="server_error"))


def torchrun_ranks(engine: ContinuousEngine) -> bool:
    """Whether the engine's model is split over ranks that torchrun started (step 14)."""
    from tinyllm.ext.ranks import launched_by_torchrun

    return engine.config.tensor_parallel_size > 1 and launched_by_torchrun()


def dispatch(
    tickets: dict[int, Ticket],
    tokens: list[tuple[int, int, str | None]],
    refused: list[tuple[int, str]],
) -> None:
    """One engine step's news, each piece to the request it belongs to.

    tickets: key -> Ticket of every request in flight (a ticket's `events` is its queue);
    tokens: (key, token, finish_reason) for each token the step made, finish_reason None
    while the request goes on, else "stop" or "length"; refused: (key, message) for each
    request the engine would not take.
    - a token goes to its ticket's queue as an Event(key, token, done, finish_reason), done
      when it carries a finish_reason; a finished request's ticket leaves `tickets`;
    - a refused request gets APIError(400, message, "prompt") in its queue and leaves `tickets`;
    - news for a key that is not in `tickets` (its client went away and aborted it, while
      the engine still stepped it) is dropped.
    Example: tickets {4: a, 7: b}, tokens [(4, 11, None), (7, 12, "stop"), (9, 13, None)] ->
    a's queue gets Event(4, 11, False, None), b's Event(7, 12, True, "stop"); tickets {4: a}."""
    for key, message in refused:
        if (ticket := tickets.pop(key, None)) is not None:
            ticket.events.put_nowait(APIError(400, message, "prompt"))
    for key, token, reason in tokens:
        ticket = tickets.get(key)
        if ticket is not None:
            ticket.events.put_nowait(Event(key, token, reason is not None, reason))
            if reason is not None:
                del tickets[key]


async def next_event(loop: EngineLoop, tickets: list[Ticket]):
    """The next event of these choices' shared queue (an Event or an APIError). Choices that
    all left the loop's books without their last event (dispatch forgot them) fail with a 500,
    rather than wait for ever."""
    events = tickets[0].events
    if not events.empty():
        return events.get_nowait()
    while True:
        try:
            return await asyncio.wait_for(events.get(), 1.0)
        except asyncio.TimeoutError:
            gone = all(t.key not in loop.tickets for t in tickets)
            if gone and events.empty() and not loop.failed:
                raise APIError(
                    500,
                    "the request left the engine loop's books before its last "
                    "token came (see dispatch)",
                    kind="server_error",
                ) from None
