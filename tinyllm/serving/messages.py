"""Step 10 - the messages between the server and its engine process.

The HTTP side (`server.EngineLoop`) and the engine's own process (`server.engine_process`)
speak over one pipe, in small frozen dataclasses that the pipe pickles: `Add`, `Abort` and
`Stop` go to the engine; `Ready`, one `StepReport` per step, and `Failed` come back. Each side
matches on the message's type. A request is called by its key, a number the HTTP side gives it
and both sides know; a request of n choices is n sequences, keys key, key + 1, ..., each with
tokens of its own. The engine's own request ids never leave its process. Logprobs cross as the
engine's `TokenLogprobs`, frozen dataclasses too.
"""

from dataclasses import dataclass, field

from tinyllm.requests import Request, TokenLogprobs


# ---- to the engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    """Queue `request` under `key`, its choice i (of request.sampling.n) under key + i; the
    engine takes it, or refuses each of its choices in its next report."""

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


# ---- from the engine ----------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine process has started and waits for requests."""


@dataclass(frozen=True)
class StepReport:
    """One engine step's news, and the engine's state after it.

    tokens: (key, token, finish_reason) for each token the step made, finish_reason None while
    the request goes on, else "stop" or "length"; refused: (key, message) for each choice the
    engine would not take; taken: the sequences (choices) of the Adds it read before the step;
    request_counts: its (waiting, running) after the step; kv_used: the KV positions in use /
    reserved; integrity: the KV cache's verdict on its books when the engine was last idle
    (`check_integrity(idle=True)`): None when they are sound, else one sentence; logprobs:
    {index in tokens: (the token's TokenLogprobs or None, the prompt's list or None)} for the
    tokens of requests that ask for them (the prompt's on a request's first token);
    speculation: the engine's totals so far (rows verified by a target pass, guesses proposed,
    guesses accepted, tokens those rows made), all 0 without speculation (step 11)."""

    tokens: list[tuple[int, int, str | None]]
    refused: list[tuple[int, str]]
    taken: int
    request_counts: tuple[int, int]
    kv_used: float
    integrity: str | None
    logprobs: dict[int, tuple[TokenLogprobs | None, list | None]] = field(default_factory=dict)
    speculation: tuple[int, int, int, int] = (0, 0, 0, 0)


@dataclass(frozen=True)
class Failed:
    """The engine cannot go on, for the reason `why`; its process ends."""

    why: str


ToEngine = Add | Abort | Stop
FromEngine = Ready | StepReport | Failed
