"""Step 10 - the messages between the server and its engine process, and how they cross.

The HTTP side (`engine_loop.EngineLoop`) and the engine's process (`engine_core.engine_process`)
speak over two ZeroMQ sockets, as vLLM's engine core and SGLang's scheduler speak to their front
ends. The messages are small frozen dataclasses: `Add`, `Abort`, `Watch` and `Stop` go to the
engine; `Warming` lines, `Ready`, one `StepReport` per step and `Failed` come back. No message
says that the engine lives (watchdog.py watches its processes). A request is called by its key,
a number both sides know; a request of n choices is n sequences, keys key, key + 1, ... The
engine's own request ids never leave its process; logprobs cross as `TokenLogprobs`. A message
crosses pickled (`dumps`), as one ZeroMQ message, which ZeroMQ delivers whole. A message to the
engine is two frames (`to_engine`): the keys it concerns, then the message, so that an Add the
engine cannot unpickle still fails its own request, and nothing else. A `Watch` says that pages
of the live view are open (live.py): only then does a report carry a frame of the engine.
"""

import copyreg
import io
import pickle
from dataclasses import dataclass, field
from typing import NamedTuple

from tinyllm.core.requests import Request, TokenLogprobs


# ---- to the engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    """Queue `request` under `key`, its choice i (of request.sampling.n) under key + i; the
    engine takes it, or refuses or fails each of its choices in its next report."""

    key: int
    request: Request


@dataclass(frozen=True)
class Abort:
    """Drop the choice of `key` wherever it is (its client went away, or a stop string ended
    it): its slot and blocks are free before the next step."""

    key: int


@dataclass(frozen=True)
class Stop:
    """End the engine process."""


@dataclass(frozen=True)
class Watch:
    """Pages of the live view are open (every_s seconds: a report carries a frame of the
    engine's state at most that often, live.py), or none is (every_s None: the engine builds
    no frame). texts: frames carry the token ids of each slot's prompt and answer, for a
    server that shows them (serve --show-prompts)."""

    every_s: float | None
    texts: bool = False


# ---- from the engine ----------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine process has started and waits for requests; children: the processes it
    started, pid -> name (a split model's ranks, step 14), which the server watches too."""

    children: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Warming:
    """The engine process compiles its decode step before it is Ready: one line of how it goes
    (a bucket compiled, and in how long)."""

    line: str


class SpeculationCounts(NamedTuple):
    """A speculating engine's totals so far (step 11), all 0 without speculation: the rows a
    target pass verified, the guesses proposed, the guesses accepted, and the tokens those
    rows made."""

    rows: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class StepReport:
    """One engine step's news, and the engine's state after it.

    tokens: (key, token, finish_reason) for each token the step made, finish_reason None while
    the request goes on, else "stop" or "length"; refused: (key, message) for each choice the
    engine would not take (the request's fault); taken: the sequences (choices) of the Adds it
    read before the step; request_counts: its (waiting, running) after the step; kv_used: the
    KV positions in use / reserved; integrity: the KV cache's verdict on its books when the
    engine was last idle (`check_integrity(idle=True)`): None when they are sound, else one
    sentence; logprobs: {index in tokens: (the token's TokenLogprobs or None, the prompt's
    list or None)} for the tokens of requests that ask for them (the prompt's on a request's
    first token); speculation: the engine's speculation totals so far (SpeculationCounts, step
    11); failed: (key, why) for each choice the engine failed on (it could not read its
    Add, adding it raised, or the step that held it raised): that request's alone; steps: the steps
    the engine has taken so far; blocks: a paged pool's (blocks held by block tables, cached
    blocks nobody holds), None for a cache without blocks; frames: the live frames the engine
    has built so far, and live: this report's frame (live.py), None unless a page watches and
    one is due."""

    tokens: list[tuple[int, int, str | None]]
    refused: list[tuple[int, str]]
    taken: int
    request_counts: tuple[int, int]
    kv_used: float
    integrity: str | None
    logprobs: dict[int, tuple[TokenLogprobs | None, list | None]] = field(default_factory=dict)
    speculation: SpeculationCounts = SpeculationCounts()
    failed: list[tuple[int, str]] = field(default_factory=list)
    steps: int = 0
    blocks: tuple[int, int] | None = None
    frames: int = 0
    live: dict | None = None


@dataclass(frozen=True)
class Failed:
    """The engine cannot go on, for the reason `why`; its process ends. taken: the sequences of
    the Adds it read in its last turn (as StepReport's)."""

    why: str
    taken: int = 0


ToEngine = Add | Abort | Stop | Watch
FromEngine = Ready | Warming | StepReport | Failed


# ---- how they cross -----------------------------------------------------------------------
# A TokenLogprobs is rebuilt by a call of its class, whose __init__ is Python code: unpickling
# a report of many of them in a thread then lets go of Python's lock every few milliseconds,
# and the HTTP side's event loop runs meanwhile (rebuilt field by field, in C, it would not)
PICKLING = copyreg.dispatch_table | {
    TokenLogprobs: lambda lp: (TokenLogprobs, (lp.token, lp.logprob, lp.top))
}


def dumps(message) -> bytes:
    """A message, pickled."""
    data = io.BytesIO()
    pickler = pickle.Pickler(data, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = PICKLING
    pickler.dump(message)
    return data.getvalue()


loads = pickle.loads


def to_engine(message: ToEngine) -> list[bytes]:
    """A message to the engine as its two frames: the keys of the request it concerns,
    b"key n" (an Add of n choices) or b"" (any other message), then the message pickled.
    Example: Add(7, a request of 2 choices) -> [b"7 2", dumps(message)]."""
    if isinstance(message, Add):
        n = getattr(message.request.sampling, "n", 1)
        return [b"%d %d" % (message.key, n), dumps(message)]
    return [b"", dumps(message)]


def keys_of(head: bytes) -> list[int]:
    """The keys a message's first frame names: b"7 2" -> [7, 8]; b"" -> []."""
    if not head:
        return []
    key, n = map(int, head.split())
    return list(range(key, key + n))
