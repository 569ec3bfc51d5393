"""Step 10 - the engine core: the engine's own process, stepping it and reporting each step.

The continuous engine is not thread-safe, and stepping it is Python work that would hold the
interpreter's lock against the HTTP side's: so, as vLLM's engine core does, it runs in a process
of its own (`engine_process`), which the HTTP side starts (engine_loop.EngineProcess). It
compiles its decode step if that compiles (`warm_up`; 13's pieces in a thread while it serves,
`compile_rest`), says Ready, then loops (`serve_engine`): the messages waiting acted on
(`read_messages`: Adds queued, Aborts dropped), a step when there is work (`step_alone`: a
step that raises fails the requests it held, and no other), and one `StepReport` of the step's
tokens and the engine's state. It marks each turn of its loop, and each idle wait's end, on a
shared clock (watchdog.StepClock), which the HTTP side reads to tell a busy engine from a hung
one; no message has to come in time. It ends at a Stop, when the HTTP side's process is gone,
or with a Failed that says why.
"""

import multiprocessing
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.requests import Event
from tinyllm.serving.live import Sampler, block_counts
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
    dumps,
    keys_of,
    loads,
)
from tinyllm.serving.watchdog import StepClock

WAIT_S = 0.5  # an idle engine asks this often whether the HTTP side still lives


def engine_process(
    engine: ContinuousEngine, addresses: tuple[str, str], n_threads: int, clock: StepClock
) -> None:
    """The engine process: start a split model's ranks (14) and compile its decode step, if it
    compiles (`warm_up`, a Warming line a bucket; a Failed in one line if it cannot), say it is
    Ready (naming the processes it started), then serve (`serve_engine`) until a Stop, the HTTP
    side's end, or a Failed that says why (a step raised beyond its requests: step_alone). The
    start is one turn of the clock (the HTTP side ticked it), each turn of the loop another."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C and SIGTERM are the server's to handle
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(n_threads)
    pipe = EnginePipe(*addresses)
    try:
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
        children = {
            p.pid: p.name.removeprefix("tinyllm-").replace("-", " ")
            for p in multiprocessing.active_children()
        }
        pipe.send(Ready(children))
        served = threading.Event()
        compile_rest(engine, served)
        serve_engine(engine, pipe, clock, served)
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
    if not decoder.compiles:
        return
    if decoder.compiles_later:
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
    if not engine.decoder.compiles_later:
        return None
    compile_next = engine.decoder.compile_next

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
    engine: ContinuousEngine,
    pipe: "EnginePipe",
    clock: StepClock,
    served: threading.Event | None = None,
) -> None:
    """engine_process's loop, the clock ticked each time round: (1) the messages waiting,
    acted on; (2) a step, when there is work; (3) its report, with a frame of the engine's
    state when a page of the live view watches and one is due (live.Sampler); `served` set
    once a step's report is sent. Returns at a Stop, when the HTTP side is gone, or after a
    Failed."""
    keys, integrity, sampler, steps, raised = Keys(), None, Sampler(), 0, False
    while pipe.http_side_lives():
        clock.tick()
        if not engine.has_work() and not pipe.wait(WAIT_S):
            continue
        clock.tick()  # a turn begins
        news = None
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
            pipe.send(Failed(f"{type(e).__name__}: {e}", news[0] if news else 0))
            return
        taken, refused, failed = news
        failed += dropped or []
        counts, kv_used = engine.request_counts(), engine.kv_used_frac()
        st = engine.stats
        spec = SpeculationCounts(st.spec_rows, st.spec_proposed, st.spec_accepted, st.spec_tokens)
        blocks = block_counts(engine.cache)
        clock.end()
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
    waits on nothing else): requests come in on one, news goes out on the other. It asks the
    HTTP side's process whether it lives (its parent's sentinel): an engine whose server is
    gone ends."""

    def __init__(self, requests: str, reports: str):
        self.zmq, self.address = zmq.Context(), reports
        self.requests, self.reports = self.zmq.socket(zmq.PULL), self.zmq.socket(zmq.PUSH)
        self.requests.connect(requests)
        self.reports.connect(reports)
        self.reports.setsockopt(zmq.SNDTIMEO, 1000)  # ms: then `send` asks if the server lives
        self.parent = multiprocessing.parent_process()  # the HTTP side's process

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

    def close(self) -> None:
        """Send what is left (1 s at most) and close the sockets."""
        self.requests.close(linger=0)
        self.reports.close(linger=1000)
        self.zmq.term()


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
