"""Exercise 10 - serving: the settled pieces of a streamed answer, each step's tokens to their
requests, the server-sent events of a stream, the load generator's percentiles, and the token
stage's penalties.

Five seams of the reference package:
- `tinyllm.serving.textstream.next_piece`: after each token the server decodes the whole answer so
  far and sends only what is settled: never an unfinished character, never the text of a stop
  string, nor the start of one until the next tokens decide;
- `tinyllm.serving.engine_loop.dispatch`: the engine runs in a process of its own and sends,
  after every step, the tokens it made for all requests; the HTTP side hands each to its
  request's queue;
- `tinyllm.serving.server.sse_events`: a streamed answer goes out as server-sent events, the framing
  every OpenAI client reads (`data: {json}`, a blank line, and `data: [DONE]` at the end);
- `tinyllm.serving.loadgen.percentile`: the p-th percentile of the latencies a run measured;
- `tinyllm.core.logits_processors.apply_penalties`: the presence, frequency and repetition
  penalties of every row of a step at once, from each row's counts of its tokens, before the
  sampler picks (the token stage).

Check your work with `make check EX=10` (or `check_exercise("10")` in notebook 10). The tests
plug your functions into the server (and the load generator), stream answers through the
official `openai` client, and compare every answer with solo generate(); your apply_penalties
runs inside a paged engine, on requests with penalties, against solo().
"""

import math

import torch
from torch import Tensor

from tinyllm.core.requests import Event
from tinyllm.serving.engine_loop import Ticket
from tinyllm.serving.server import APIError, sse_event, usage
from tinyllm.serving.textstream import REPLACEMENT


def next_piece(text: str, sent: int, stops: list[str], final: bool = False) -> tuple[str, bool]:
    """The new text to send, and whether a stop string ended the answer.

    text is the whole answer decoded so far; its first `sent` characters are already sent.
    stops are the request's stop strings; final says the answer is over (no token follows).
    - A stop string in text ends the answer just before it: return the unsent text up to the
      earliest place where any stop string starts, and True. No text of a stop string is sent.
    - Otherwise return the unsent text that is settled, and False. The next tokens can still
      change the end of text in two ways: an unfinished character (REPLACEMENT, U+FFFD, at the
      end) may complete, and an end of text that begins a stop string may grow into it. Both
      wait; nothing waits when final.
    - Text before `sent` is never returned again, and the caller's arguments are not changed.
    Examples: ("Good\n", 0, ["\n\n"]) -> ("Good", False); then ("Good\nNay", 4, ["\n\n"])
    -> ("\nNay", False); ("ab END cd STOP", 0, ["STOP", "END"]) -> ("ab ", True);
    ("ab", 0, ["bc", "ac"]) -> ("a", False): "b" may begin "bc", and "a" here begins nothing;
    ("caf\ufffd", 0, []) -> ("caf", False), and with final=True ("caf\ufffd", False)."""
    raise NotImplementedError("exercise 10: the settled new text, cut at the earliest stop "
                              "string")


def dispatch(tickets: dict[int, Ticket], tokens: list[tuple[int, int, str | None]],
             refused: list[tuple[int, str]]) -> None:
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
    raise NotImplementedError("exercise 10: each token to its ticket's queue, a refusal as a "
                              "400")


async def sse_events(pieces, kind: str, head: dict, n_prompt: int, include_usage: bool):
    """The server-sent events of one streamed answer, as strings (each one sse_event).

    pieces: an async iterator of (text, finish_reason, n_out), the settled pieces of the
    answer (answer()); the last has its finish_reason ("stop" or "length"), the others None;
    n_out counts the tokens made so far. kind: "completions" or "chat". head: the fields every
    chunk repeats (id, object, created, model). Each chunk is head plus
    "choices": [{"index": 0, ..., "finish_reason": ..., "logprobs": None}]:
    - completions: a chunk per piece, {"text": piece};
    - chat: first a chunk {"delta": {"role": "assistant", "content": ""}}, then a chunk per
      piece, {"delta": {"content": piece}}, or {"delta": {}} for an empty last piece;
    - finish_reason is None in every chunk but the last piece's;
    - with include_usage, one more chunk: head, "choices": [] and "usage" (usage(n_prompt,
      n_out)); last of all the event `data: [DONE]`.
    Example, completions, pieces ("Good", None, 1), (" morrow", "length", 2): the events
    data: {..head, "choices": [{"index": 0, "text": "Good", "finish_reason": null, ...}]},
    data: {..head, "choices": [{"index": 0, "text": " morrow", "finish_reason": "length", ...}]},
    data: [DONE]."""
    raise NotImplementedError("exercise 10: the events of one streamed answer, then data: "
                              "[DONE]")


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0-100) of xs, as numpy's default (np.percentile(xs, p)): p=0 is
    the smallest value, p=100 the largest, p=50 the median; between two values it interpolates
    linearly. 0.0 for no values. The caller's list keeps its order.
    Examples: percentile([3.0, 1.0, 2.0], 50) -> 2.0; percentile([10, 20, 30, 40], 50) ->
    25.0; percentile([10, 20, 30, 40], 90) -> 37.0; percentile([], 99) -> 0.0."""
    raise NotImplementedError("exercise 10: numpy's percentile, without reordering xs")


def apply_penalties(logits: Tensor, counts: Tensor, seen: Tensor, presence: Tensor,
                    frequency: Tensor, repetition: Tensor) -> Tensor:
    """The penalties of every row at once, as vLLM applies them: logits (B, V); counts (B, V),
    how often each token is among the row's generated tokens; seen (B, V) bool, whether it is
    in the row's prompt or generated tokens; presence, frequency, repetition (B, 1), the rows'
    penalties. Returns new logits (B, V), the input unchanged:
    1) repetition: a seen token's logit is divided by the row's repetition penalty where it is
       positive, multiplied by it where it is not (1.0 changes nothing);
    2) then frequency and presence: logit - frequency * count - presence * (count > 0).
    Example: logits [[2., -1., 0.5]], counts [[0, 2, 0]], seen [[True, True, False]],
    presence [[0.5]], frequency [[0.25]], repetition [[2.]]
    -> [[1., -2. - 0.5 - 0.5, 0.5]] = [[1., -3., 0.5]]."""
    raise NotImplementedError("exercise 10: the penalties of every row at once, "
                              "repetition first, then frequency and presence")
