"""Step 10 - the engine loop: the engine in a process of its own, and the HTTP side's handle on it.

The continuous engine is not thread-safe, and stepping it is Python work that would hold the
interpreter's lock against the HTTP side's: so, as vLLM's engine core does, it runs in a process
of its own (`engine_process`). Two ZeroMQ sockets join the two sides, as vLLM's engine core and
SGLang's scheduler are joined to theirs, in the typed messages of messages.py: `Add(key,
request)` and `Abort(key)` go in; after each step one `StepReport` comes back, with the step's
tokens (and the logprobs of those that ask for them), the requests refused or failed, the
engine's load, its KV use and its cache's verdict on its books (`check_integrity`, asked
whenever the engine is idle), and a frame of its state for the server's live page while one is
open (live.py); and a `Heartbeat` every half second says that the engine's process lives.
ZeroMQ moves a message whole, of any size, and the HTTP side's sockets are asyncio sockets
(pyzmq's): a message of several MB never blocks the event loop.

On the HTTP side, `EngineProcess` starts the process and holds the sockets, and `EngineLoop`
keeps each request's choices as `Ticket`s: it sends them in, and its listening task hands each
step's tokens to their requests' queues (`dispatch`). A failure stays as small as it can: a
request that cannot be sent, or that the engine cannot read or add, fails alone, and a step that
raises fails the requests it held (`step_alone`); the engine fails as a whole when it says so (a
step raised holding no request, or right after another), when its process ends, or when it is not
heard from. server.py builds the OpenAI API on this loop.

Seam: `dispatch` (exercise 10).
"""

import asyncio
import contextlib
import multiprocessing
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.multiprocessing
import zmq
import zmq.asyncio

from tinyllm.core.continuous import ContinuousEngine, compiles
from tinyllm.core.requests import Event, Request
from tinyllm.serving.api import APIError
from tinyllm.serving.live import Sampler, block_counts
from tinyllm.serving.messages import (
    BEAT_S,
    Abort,
    Add,
    Failed,
    Heartbeat,
    Ready,
    SpeculationCounts,
    StepReport,
    Stop,
    Warming,
    Watch,
    dumps,
    keys_of,
    loads,
    to_engine,
)


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


class EngineProcess:
    """The engine's own process, and the two ZeroMQ sockets that join it to the HTTP side.

    The engine is not thread-safe, and stepping it is Python work that would hold the
    interpreter's lock against the HTTP side's: so, as vLLM's engine core does, it runs in a
    process of its own (`engine_process`). Two ZeroMQ sockets join them, over ipc:// in a
    directory of the server's own, in the messages of messages.py: an `Add` or an `Abort` goes
    in per request (`send`); one `StepReport` per step comes out (`receive`), and a `Heartbeat`
    every BEAT_S. ZeroMQ moves each message whole, and its asyncio sockets (pyzmq's
    zmq.asyncio) send and receive without blocking the event loop, whatever the size: a report
    of several MB crosses while /health answers. `failure` says whether the engine still runs:
    not when its process ended, or when it was not heard from for silence_s (its process
    stopped or froze: it is ended then)."""

    def __init__(self, engine: ContinuousEngine, silence_s: float = 5.0):
        self.engine, self.silence_s = engine, silence_s
        self.heard = 0.0  # when the engine was last heard from (time.monotonic())
        self.process = self.zmq = None

    async def start(self, progress=None) -> None:
        """Bind the sockets, start the engine process and wait until it is Ready: a decoder
        that compiles has compiled by then, each Warming line handed to progress (None: kept
        quiet). The engine goes to it pickled: its tensors move to shared memory, so the weights
        are not copied. A fresh interpreter imports torch there: a few seconds. An engine that
        cannot start raises RuntimeError, one sentence of why."""
        self.dir = tempfile.mkdtemp(prefix="tinyllm-")  # its sockets: only this user's
        addresses = f"ipc://{self.dir}/requests", f"ipc://{self.dir}/reports"
        self.zmq = zmq.asyncio.Context()
        self.requests, self.reports = self.zmq.socket(zmq.PUSH), self.zmq.socket(zmq.PULL)
        self.requests.bind(addresses[0])
        self.reports.bind(addresses[1])
        ctx = torch.multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=engine_process,
            name="tinyllm-engine",
            daemon=True,
            args=(self.engine, addresses, torch.get_num_threads()),
        )
        self.process.start()
        try:
            message = await self.first_message(120.0, progress)
        except BaseException:
            await self.stop()
            raise
        if not isinstance(message, Ready):
            await self.stop()
            if isinstance(message, Failed):
                raise RuntimeError(f"the engine could not start: {message.why}")
            raise RuntimeError(f"the engine process said {message!r} before it was Ready")
        self.heard = time.monotonic()

    async def first_message(self, timeout: float, progress=None):
        """The engine process's first message but heartbeats and Warming lines (each handed to
        progress); a RuntimeError if its process ends first, or nothing at all comes for
        timeout seconds (heartbeats come while a decoder compiles, however long it takes)."""
        heard = time.monotonic()
        while True:
            while not await self.reports.poll(250):
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the engine process failed to start (exit code "
                        f"{self.process.exitcode}); its error is above"
                    )
                if time.monotonic() - heard > timeout:
                    raise RuntimeError(f"the engine process was silent for {timeout:.0f} s")
            message, heard = loads(await self.reports.recv()), time.monotonic()
            if isinstance(message, Warming) and progress is not None:
                progress(message.line)
            elif not isinstance(message, (Heartbeat, Warming)):
                return message

    async def stop(self) -> None:
        """Stop the engine process (a Stop; killed if it has not ended 10 s later, or at once
        before it was Ready: it reads no Stop while it compiles), close the sockets and remove
        their directory."""
        if self.process is not None and self.process.is_alive() and self.heard:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.requests.send_multipart(to_engine(Stop())), 1.0)
            await asyncio.to_thread(self.process.join, 10)
        if self.process is not None and self.process.is_alive():
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
        self.heard = time.monotonic()
        return loads(data) if len(data) < 2**16 else await asyncio.to_thread(loads, data)

    def failure(self) -> str | None:
        """Why the engine no longer runs (its process ended, or was not heard from for
        silence_s: the process is ended then), or None. While its messages wait to be read, it
        runs: the last of them may say why it ended."""
        unread = self.zmq is not None and self.reports.get(zmq.EVENTS) & zmq.POLLIN
        if self.process is None or unread:
            return None
        silent = time.monotonic() - self.heard
        if not self.process.is_alive():
            return f"its process ended (exit code {self.process.exitcode})"
        if silent > self.silence_s:
            self.process.kill()
            return (
                f"it was not heard from for {silent:.1f} s (its process stopped or froze), "
                f"so the server ended it"
            )
        return None


class EngineLoop:
    """The HTTP side's handle on the engine (its EngineProcess, `engine`): each request's
    choices as tickets, sent in, and each step's report handed out to them.

    A listening task on the event loop (`listen`) puts each token of a StepReport in its
    request's queue; a report also brings the engine's load and steps, its KV cache's integrity
    (None when its books are sound, else what is wrong) and, while a page watches, a frame of
    its state (to `on_frame`, live.Pages.publish). A request of n choices is n sequences in the
    engine, n tickets here (keys key, key + 1, ...) and one Add. At most max_waiting sequences
    wait for a slot at once; a request that would make more is refused with a 429.

    A failure stays as small as it can: a request that cannot be sent, that the engine cannot
    read or add, that a step raised on (step_alone), or whose report this side fails to hand
    out fails alone. The engine fails as a whole when it says so (`Failed`), or when it no
    longer runs (EngineProcess.failure): every request in flight gets a 500 that says why."""

    def __init__(self, engine: ContinuousEngine, max_waiting: int = 64, silence_s: float = 5.0):
        self.engine, self.max_waiting = EngineProcess(engine, silence_s), max_waiting
        self.tickets: dict[int, Ticket] = {}  # key -> ticket, while it runs
        self.next_key = 0
        self.submitted = 0  # adds sent, not yet taken by the engine
        self.reported, self.kv_used = (0, 0), 0.0  # the engine's (waiting, running), KV use
        self.integrity: str | None = None  # the KV cache's books, last checked idle
        self.speculation = SpeculationCounts()  # the engine's totals (11)
        self.steps, self.frames, self.blocks, self.on_frame = 0, 0, None, None  # see StepReport
        self.failed: str | None = None
        self.listener = None

    @property
    def started(self) -> bool:
        return self.listener is not None

    async def start(self, progress=None) -> None:
        """Start the engine's process (its decoder compiled, each line of how it goes handed to
        progress: EngineProcess.start), then listen to it."""
        await self.engine.start(progress)
        self.listener = asyncio.create_task(self.listen())

    async def stop(self) -> None:
        if self.listener is not None:
            self.listener.cancel()
        await self.engine.stop()

    def request_counts(self) -> tuple[int, int]:
        """(requests waiting, counting those not yet in the engine; requests running), as of
        the engine's last report."""
        waiting, running = self.reported
        return waiting + self.submitted, running

    def submit(self, tickets: list[Ticket]) -> None:
        """Send one request, its choices' tickets in order (one Add, their keys consecutive).
        A request that cannot be pickled gets a 500 that says why, and nothing is sent."""
        if self.check() is not None:
            raise APIError(500, f"the engine failed: {self.failed}", kind="server_error")
        waiting, n = self.request_counts()[0], len(tickets)
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
        self.submitted += n
        self.engine.requests.send_multipart(frames)  # queued at once; ZeroMQ sends it whole

    def abort(self, *tickets: Ticket) -> None:
        """The client went away (or a stop string ended a choice): drop these choices wherever
        they are."""
        for ticket in tickets:
            if self.tickets.pop(ticket.key, None) is not None and not self.failed:
                self.engine.send(Abort(ticket.key))

    async def listen(self) -> None:
        """On the event loop while the engine runs: each message from the engine, in order, to
        where it goes; whenever the engine is silent, a check that it still runs."""
        while self.failed is None:
            try:
                message = await self.engine.receive()
            except Exception as e:  # its news is lost, and with it the books of its requests
                self.fail(f"its news could not be read: {type(e).__name__}: {e}")
                return
            match message:
                case None:
                    self.check()
                case StepReport() as report:
                    self.take(report)
                case Heartbeat():
                    pass
                case Failed(why):
                    self.fail(why)
                case _:
                    self.fail(f"it sent {message!r}, which is no report")
            await asyncio.sleep(0)  # a flood of reports still lets the HTTP requests run

    def check(self) -> str | None:
        """None while the engine runs, else why not: the engine fails then, as `fail` says."""
        if self.failed is None and (why := self.engine.failure()) is not None:
            self.fail(why)
        return self.failed

    def take(self, report: StepReport) -> None:
        """One step's report: the engine's state as it says, its tokens to their requests. A
        failure here fails the requests the report speaks of, and no other."""
        self.submitted -= report.taken
        self.reported, self.kv_used = report.request_counts, report.kv_used
        self.integrity, self.speculation = report.integrity, report.speculation
        self.steps, self.blocks, self.frames = report.steps, report.blocks, report.frames
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

    def fail(self, why: str) -> None:
        """The engine failed: every request in flight gets a 500 that says why."""
        self.failed = why
        for ticket in self.tickets.values():
            ticket.events.put_nowait(
                APIError(500, f"the engine failed: {why}", kind="server_error")
            )
        self.tickets.clear()


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


def engine_process(engine: ContinuousEngine, addresses: tuple[str, str], n_threads: int) -> None:
    """The engine process: compile its decode step, if it compiles (`warm_up`, a Warming line
    a bucket; a Failed in one line if it cannot), say it is Ready, then read the Adds and
    Aborts, step while there is work, and send a StepReport after each step: its tokens as
    (key, token, finish_reason or None), the requests it refused or failed on, the Adds it
    took, its load, its KV use, and the cache's verdict on its books, asked whenever the engine
    is idle (`cache.check_integrity(idle=True)`: None when every request gave everything
    back). A thread sends a Heartbeat every BEAT_S from the start. It waits on its socket when
    there is no work, and ends at a Stop, when the HTTP side's process is gone, or with a
    Failed that says why (a step raised beyond its requests: step_alone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    torch.set_num_threads(n_threads)
    pipe = EnginePipe(*addresses)
    try:
        pipe.beat()
        try:  # a model split over processes (14) starts them before Ready
            start_ranks(engine, lambda line: pipe.send(Warming(line)))
        except Exception as e:
            pipe.send(Failed(f"its tensor-parallel ranks could not start: {e}"))
            return
        try:  # a decoder that compiles does it before Ready: no request waits for it
            warm_up(engine, lambda line: pipe.send(Warming(line)))
        except Exception as e:
            pipe.send(Failed(warm_up_failure(engine.config.decoder, e)))
            return
        pipe.send(Ready())
        served = threading.Event()
        compile_rest(engine, served)
        serve_engine(engine, pipe, served)
    finally:
        pipe.close()


def start_ranks(engine: ContinuousEngine, say) -> None:
    """A model split over ranks (14: tensor_parallel_size > 1) starts its other ranks' processes
    here, in the engine's process, whose they are, saying a line before and after."""
    size = engine.config.tensor_parallel_size
    if size == 1:
        return
    say(f"starting the model's {size} tensor-parallel ranks (--tensor-parallel-size {size})")
    t0 = time.perf_counter()
    engine.model.start()
    say(f"the {size} ranks hold their shards ({time.perf_counter() - t0:.0f} s)")


def warm_up(engine: ContinuousEngine, say) -> None:
    """A decoder that compiles (06's compiled step, 13's pieces) compiles now, saying a line
    (`say`) as it starts, after each bucket and when it is done; or, for a decoder that can
    compile later (13's pieces: `compile_next`), it says which buckets compile while it serves
    and leaves them to a thread of their own (compile_rest), their steps eager until then: a
    server's first token waits for no compiler."""
    kind, decoder = engine.config.decoder, engine.decoder
    if not compiles(decoder):
        return
    if hasattr(decoder, "compile_next"):
        decoder.eager_until_compiled = True
        rows = ", ".join(map(str, decoder.buckets()))
        say(
            f"the decode step (--decoder {kind}) compiles for {rows} rows while it serves, "
            f"from its first step on; until then its steps run eager"
        )
        return
    say(f"compiling the decode step (--decoder {kind}), a bucket at a time, before serving")
    t0 = time.perf_counter()
    unit = {"compiled": "position"}.get(kind, "")  # what a bucket holds

    def compiled(bucket: int, seconds: float) -> None:
        size = f"{bucket} {unit}{'s' * (bucket != 1)}" if unit else str(bucket)
        say(f"  bucket of {size}: {seconds:.1f} s")

    engine.warm_up(progress=compiled)
    say(f"the decode step is compiled ({time.perf_counter() - t0:.0f} s)")


REST_AFTER_S = 10.0  # the most compile_rest waits for a first step before it compiles


def compile_rest(
    engine: ContinuousEngine, served: threading.Event | None = None
) -> threading.Thread | None:
    """A decoder that left its buckets for later (warm_up) compiles them in a thread of its
    own, smallest first, while the engine serves: a step whose bucket is not compiled yet runs
    eager meanwhile, so no request waits for a compilation (the steps share the interpreter
    with it, and run slower while it lasts). It begins once `served` is set (serve_engine
    sets it after its first step: the first requests' tokens come before any compiling), or
    after REST_AFTER_S without one -> the thread, or None where nothing is left. A bucket that
    cannot compile is said in one line on stderr, and the steps stay eager."""
    compile_next = getattr(engine.decoder, "compile_next", None)
    if compile_next is None:
        return None

    def rest() -> None:
        if served is not None:
            served.wait(REST_AFTER_S)
        try:
            with torch.no_grad():
                while compile_next() is not None:
                    pass
        except Exception as e:
            why = warm_up_failure(engine.config.decoder, e)
            print(f"tinyllm: {why}; its steps stay eager", file=sys.stderr, flush=True)

    thread = threading.Thread(target=rest, name="compile-rest", daemon=True)
    thread.start()
    return thread


def warm_up_failure(kind: str, e: Exception) -> str:
    """Why a decoder's warm-up failed, in one line: the error's first line, and what to do
    where TorchInductor found no C++ compiler."""
    said = (str(e).strip().splitlines() or [""])[0]
    why = f"its decode step (--decoder {kind}) could not compile: {type(e).__name__}: {said}"
    if "C++ compiler" in said or "CxxCompiler" in said:
        why += (
            "; TorchInductor compiles it with a C++ compiler ($CXX, else g++ or clang++): "
            "install one, or serve with --decoder eager"
        )
    return why


def serve_engine(
    engine: ContinuousEngine, pipe: "EnginePipe", served: threading.Event | None = None
) -> None:
    """engine_process's loop: (1) the messages waiting, acted on; (2) a step, when there is
    work; (3) its report, with a frame of the engine's state when a page of the live view
    watches and one is due (live.Sampler); `served` set once a step's report is sent. Returns
    at a Stop, when the HTTP side is gone, or after a Failed."""
    keys, integrity, sampler, steps, raised = Keys(), None, Sampler(), 0, False
    while pipe.http_side_lives():
        if not engine.has_work() and not pipe.wait(BEAT_S):
            continue
        try:
            if (news := read_messages(engine, pipe, keys, sampler)) is None:
                return  # a Stop
            events, dropped = [], None
            if engine.has_work():
                sampler.before_step(engine)
                events, dropped = step_alone(engine, keys, raised)
                steps, raised = steps + 1, dropped is not None
            tokens, logprobs = keys.tokens_of(engine, events)
            if not engine.has_work():
                integrity = engine.cache.check_integrity(idle=True)
            live = sampler.after_step(engine, keys.key_of, steps)
        except Exception as e:  # the engine cannot go on: say why
            pipe.send(Failed(f"{type(e).__name__}: {e}"))
            return
        taken, refused, failed = news
        failed += dropped or []
        counts, kv_used = engine.request_counts(), engine.kv_used_frac()
        st = engine.stats
        spec = SpeculationCounts(st.spec_rows, st.spec_proposed, st.spec_accepted, st.spec_tokens)
        blocks = block_counts(engine.cache)
        pipe.send(
            StepReport(
                tokens,
                refused,
                taken,
                counts,
                kv_used,
                integrity,
                logprobs,
                spec,
                failed,
                steps,
                blocks,
                sampler.frames,
                live,
            )
        )
        if served is not None and steps and not served.is_set():
            served.set()


class EnginePipe:
    """The engine process's end of the two sockets (blocking ZeroMQ sockets: this process
    waits on nothing else): requests come in on one, news goes out on the other, and a thread
    of its own sends a Heartbeat to the same address on a third (a ZeroMQ socket belongs to
    one thread). It asks the HTTP side's process whether it lives (its parent's sentinel): an
    engine whose server is gone ends."""

    def __init__(self, requests: str, reports: str):
        self.zmq, self.address = zmq.Context(), reports
        self.requests, self.reports = self.zmq.socket(zmq.PULL), self.zmq.socket(zmq.PUSH)
        self.requests.connect(requests)
        self.reports.connect(reports)
        self.reports.setsockopt(zmq.SNDTIMEO, 1000)  # ms: then `send` asks if the server lives
        self.parent = multiprocessing.parent_process()  # the HTTP side's process
        self.stopped = threading.Event()  # the heartbeats' end

    def http_side_lives(self) -> bool:
        return self.parent is None or self.parent.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait up to timeout seconds for a message; whether one came."""
        return bool(self.requests.poll(timeout * 1000))

    def received(self):
        """The messages waiting, each as (its keys' frame, its pickle)."""
        while self.requests.poll(0):
            head, data = self.requests.recv_multipart()
            yield head, data

    def send(self, message) -> None:
        """Send one message, whole; while the server reads nothing (it queues up to a thousand),
        wait, as long as its process lives."""
        data = dumps(message)
        while True:
            try:
                return self.reports.send(data)
            except zmq.Again:
                if not self.http_side_lives():
                    return

    def beat(self) -> None:
        """Start the heartbeats: a Heartbeat every BEAT_S, from a thread, until close()."""
        threading.Thread(target=self.beats, name="heartbeat", daemon=True).start()

    def beats(self) -> None:
        """The heartbeats' thread, on a socket of its own. A beat sent as close() ends the
        context (its wait was over before the stop was set) ends the thread quietly."""
        with self.zmq.socket(zmq.PUSH) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            while not self.stopped.wait(BEAT_S):
                try:
                    sock.send(dumps(Heartbeat()), zmq.NOBLOCK)
                except zmq.Again:  # a server that reads nothing: it knows
                    continue
                except zmq.ContextTerminated:
                    return

    def close(self) -> None:
        """Stop the heartbeats, send what is left (1 s at most) and close the sockets."""
        self.stopped.set()
        self.requests.close(linger=0)
        self.reports.close(linger=1000)
        self.zmq.term()  # once the heartbeats' socket is closed too


@dataclass
class Keys:
    """The engine process's books: each request in flight by its key (the HTTP side's name
    for it) and by its engine id, both ways."""

    rid_of: dict[int, int] = field(default_factory=dict)  # key -> engine id
    key_of: dict[int, int] = field(default_factory=dict)  # engine id -> key

    def add(self, key: int, rid: int) -> None:
        self.rid_of[key], self.key_of[rid] = rid, key

    def pop(self, key: int) -> int | None:
        """The engine id of key, which leaves the books; None if it is not in them."""
        if (rid := self.rid_of.pop(key, None)) is not None:
            del self.key_of[rid]
        return rid

    def tokens_of(self, engine: ContinuousEngine, events) -> tuple[list, dict]:
        """A step's events as (key, token, finish_reason or None), and the logprobs of those
        that have them: {index in tokens: (TokenLogprobs or None, the prompt's or None)}. A
        finished request leaves the books, and its Result the engine's."""
        tokens, logprobs = [], {}
        for ev in events:
            key = self.key_of[ev.rid]
            if ev.logprobs is not None or ev.prompt_logprobs is not None:
                logprobs[len(tokens)] = (ev.logprobs, ev.prompt_logprobs)
            tokens.append((key, ev.token, ev.finish_reason if ev.done else None))
            if ev.done:
                self.pop(key)
                engine.results.pop(ev.rid, None)
        return tokens, logprobs


def read_messages(
    engine: ContinuousEngine, pipe: EnginePipe, keys: Keys, sampler: Sampler | None = None
) -> tuple[int, list[tuple[int, str]], list[tuple[int, str]]] | None:
    """Every message waiting, acted on: an Add queues its request, its n choices under keys
    key, key + 1, ... (the engine's ids rid, rid + 1, ...), or refuses them with the engine's
    reason (a ValueError or TypeError: the request's fault), or fails them (it cannot be
    unpickled, or adding it raised otherwise); an Abort drops one choice; a Watch tells the
    sampler whether pages of the live view are open. Returns (the
    sequences taken, the choices refused as (key, message), the choices failed as (key,
    why)), or None at a Stop. A message that fails concerns its own request only."""
    taken, refused, failed = 0, [], []
    for head, data in pipe.received():
        try:
            message = loads(data)
        except Exception as e:
            taken += len(keys_of(head))
            failed += [(k, f"it could not be read: {type(e).__name__}: {e}") for k in keys_of(head)]
            continue
        match message:
            case Add(key, request):
                n = getattr(request.sampling, "n", 1)
                taken += n
                try:
                    rid = engine.add_request(request)
                except (ValueError, TypeError) as e:
                    refused += [(key + i, str(e)) for i in range(n)]
                except Exception as e:
                    failed += [(key + i, f"{type(e).__name__}: {e}") for i in range(n)]
                else:
                    for i in range(n):
                        keys.add(key + i, rid + i)
            case Abort(key):
                if (rid := keys.pop(key)) is not None:
                    engine.abort(rid)
            case Watch() if sampler is not None:
                sampler.watch(message)
            case Stop():
                return None
            case _:  # no request of its own to fail: said, and left
                print(f"the engine got {message!r}, not a message of messages.py", file=sys.stderr)
    return taken, refused, failed


def step_alone(
    engine: ContinuousEngine, keys: Keys, raised_before: bool
) -> tuple[list[Event], list[tuple[int, str]] | None]:
    """One step of the engine: its events, and None, or for a step that raised, the choices it
    failed as (key, why). A step that raises fails the requests it held, and no other: those
    running when it raised (admitted by it or before) and those it finished each leave the
    engine (abort: their slots and blocks go back) and the books; those it preempted wait, as
    preemption left them. The engine goes on when its KV cache's books then hold. It raises (it
    fails as a whole) when they do not, when the step held no request, or when the step before
    raised too: a fault that follows the engine from step to step is the engine's, not a
    request's. A step that does not raise costs nothing more."""
    try:
        return engine.step(), None
    except Exception as e:
        held = {rid for rid in engine.holders() if rid is not None}
        held |= engine.results.keys() & keys.key_of.keys()  # finished in it: their news is lost
        if raised_before or not held:
            raise
        why = f"{type(e).__name__}: {e}"
        failed = []
        for rid in sorted(held):
            engine.abort(rid)
            engine.results.pop(rid, None)
            if (key := keys.key_of.get(rid)) is not None:
                keys.pop(key)
                failed.append((key, why))
        if (books := engine.cache.check_integrity(idle=not engine.has_work())) is not None:
            raise RuntimeError(f"{why}; after it the KV cache's books do not hold: {books}") from e
        return [], failed


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
