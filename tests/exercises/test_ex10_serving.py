"""Exercise 10 - serving: your next_piece inside the server's text stream, your dispatch between
the engine's process and the requests, your sse_events on the wire, and your percentile inside
the load generator. Every answer, streamed through the official `openai` client, equals the
decoded solo generate() tokens, cut at its earliest stop string, no character split. Your
apply_penalties inside a paged engine gives every request with penalties its solo() tokens."""

import asyncio
import json
import random

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.conftest import make_tiny
from tests.test_server import NAME, PROMPTS, Running, solo_text
from tinyllm.build import make_engine
from tinyllm.core.generate import generate, solo
from tinyllm.core.logits_processors import penalize_row
from tinyllm.core.requests import Event, Request
from tinyllm.core.sampling import Sampling
from tinyllm.course.check import divergence, explained
from tinyllm.serving import loadgen
from tinyllm.serving.server import APIError, Ticket
from tinyllm.serving.textstream import REPLACEMENT, TextStream

EXERCISE = "ex10_serving"


# ---- next_piece ----------------------------------------------------------------------------
PIECE_CASES = [
    ("Good morrow", 0, [], False, ("Good morrow", False), "all of it is settled"),
    ("Good morrow", 5, [], False, ("morrow", False), "only what was not sent yet"),
    ("caf" + REPLACEMENT, 0, [], False, ("caf", False), "an unfinished character waits"),
    ("caf" + REPLACEMENT * 2, 0, [], False, ("caf", False), "every unfinished byte waits"),
    ("café", 3, [], False, ("é", False), "and comes once its bytes have all come"),
    (
        "a" + REPLACEMENT + "b",
        0,
        [],
        False,
        ("a" + REPLACEMENT + "b", False),
        "a replacement character that is not at the end is settled (its bytes were not UTF-8)",
    ),
    ("Good\n", 0, ["\n\n"], False, ("Good", False), "the start of a stop string waits"),
    ("Good\nNay", 4, ["\n\n"], False, ("\nNay", False), "and comes when it was not one"),
    (
        "Good\n\nNay",
        0,
        ["\n\n"],
        False,
        ("Good", True),
        "a stop string ends the answer before it",
    ),
    ("Good\n\n", 4, ["\n\n"], False, ("", True), "nothing of the stop string is sent"),
    ("ab END cd STOP", 0, ["STOP", "END"], False, ("ab ", True), "the earliest stop string"),
    (
        "ab STOP cd END",
        0,
        ["END", "STOP"],
        False,
        ("ab ", True),
        "the earliest stop string in the text, whatever the order of the list",
    ),
    (
        "I say no",
        0,
        ["no more"],
        False,
        ("I say ", False),
        "the longest start of a stop string waits",
    ),
    (
        "ab",
        0,
        ["bc", "ac"],
        False,
        ("a", False),
        "only the end of the text that begins a stop string waits: 'b' may begin 'bc', "
        "but 'a' is not the end of the text",
    ),
    (
        "xyz",
        0,
        ["yzq", "zq"],
        False,
        ("x", False),
        "the longest end that begins any one stop string waits, not the sum of them",
    ),
    ("Good\n", 0, ["\n\n"], True, ("Good\n", False), "at the end nothing waits"),
    (
        "caf" + REPLACEMENT,
        0,
        [],
        True,
        ("caf" + REPLACEMENT, False),
        "at the end nothing waits, an unfinished character neither",
    ),
]


@pytest.mark.parametrize(
    "text, sent, stops, final, expected, why", PIECE_CASES, ids=[case[-1] for case in PIECE_CASES]
)
def test_next_piece(impl, text, sent, stops, final, expected, why):
    given = list(stops)
    got = impl.next_piece(text, sent, given, final)
    assert isinstance(got, tuple) and len(got) == 2, (
        f"next_piece returns (new text, stopped), got {got!r}"
    )
    assert tuple(got) == expected, (
        f"next_piece({text!r}, sent={sent}, stops={stops}, "
        f"final={final}): {why}: expected {expected}, got {got}"
    )
    assert given == stops, f"next_piece changed the caller's stop strings: {stops} -> {given}"


def byte_decode(table: dict[int, bytes]):
    """A decode like a byte-level tokenizer's: half a character decodes to U+FFFD."""
    return lambda ids: b"".join(table[i] for i in ids).decode("utf-8", errors="replace")


def test_a_stream_never_splits_a_character(impl, plug):
    plug("next_piece")
    decode = byte_decode({0: b"Ay, ", 1: b"\xc3", 2: b"\xa9", 3: b"t\xc3", 4: b"\xa9!"})
    ts = TextStream(decode)
    pieces = [ts.push(t) for t in [0, 1, 2, 3, 4]] + [ts.finish()]
    assert all(REPLACEMENT not in p for p in pieces), f"a piece holds half a character: {pieces}"
    assert "".join(pieces) == "Ay, été!", f"the pieces {pieces} should make 'Ay, été!'"


def test_a_random_stream_adds_up_to_its_text(impl, plug):
    """Random texts with accents, random stop strings: the pieces add up to the text cut at the
    earliest stop (or all of it), and no piece ever holds any of a stop string's text."""
    plug("next_piece")
    rng = random.Random(0)
    words = ["O ", "Romeo", ", ", "é", "\n", "\n\n", "thou", " art", "ü"]
    for trial in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        data = text.encode()
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 6))))
        table = {i: data[a:b] for i, (a, b) in enumerate(zip([0] + cuts, cuts + [len(data)]))}
        stops = rng.sample(["\n\n", "thou", "Ro", "z", "u a", "ou"], rng.randint(0, 3))
        ts = TextStream(byte_decode(table), stops)
        pieces = []
        for t in range(len(table)):
            pieces.append(ts.push(t))
            if ts.stopped:
                break
        pieces.append(ts.finish())
        found = [text.find(s) for s in stops if s in text]
        expected = text[: min(found)] if found else text
        assert "".join(pieces) == expected, (
            f"trial {trial}: text {text!r}, stops {stops}: pieces {pieces} add up to "
            f"{''.join(pieces)!r}, expected {expected!r}"
        )
        assert all(REPLACEMENT not in p for p in pieces[:-1]), (
            f"trial {trial}: a split character {pieces}"
        )


# ---- dispatch --------------------------------------------------------------------------------
def queued(ticket: Ticket) -> list:
    out = []
    while not ticket.events.empty():
        out.append(ticket.events.get_nowait())
    return out


def test_dispatch_hands_each_token_to_its_request(impl):
    a, b, c = Ticket(None, 4), Ticket(None, 7), Ticket(None, 8)
    tickets = {4: a, 7: b, 8: c}
    tokens = [(4, 11, None), (7, 12, "stop"), (9, 13, None), (4, 14, None)]
    with explained(
        "dispatch(tickets {4, 7, 8}, tokens for 4, 7 and 9, the request of key 9 aborted)"
    ):
        impl.dispatch(tickets, tokens, [])
    assert queued(a) == [Event(4, 11, False, None), Event(4, 14, False, None)], (
        "request 4's queue gets its two tokens, in order, as Events that are not done"
    )
    assert queued(b) == [Event(7, 12, True, "stop")], (
        "request 7's last token is an Event that is done, with its finish_reason"
    )
    assert queued(c) == [], "request 8 made no token this step: its queue gets nothing"
    assert tickets == {4: a, 8: c}, (
        "a finished request leaves tickets, the others stay: expected keys [4, 8], got "
        f"{sorted(tickets)}"
    )


def test_dispatch_refuses_with_a_400_and_forgets_the_request(impl):
    a, b = Ticket(None, 1), Ticket(None, 2)
    tickets = {1: a, 2: b}
    with explained("dispatch with a refused request"):
        impl.dispatch(
            tickets, [(2, 5, "length")], [(1, "prompt of 90 tokens never fits"), (3, "gone")]
        )
    got = queued(a)
    assert len(got) == 1 and isinstance(got[0], APIError), (
        f"a refused request's queue gets one APIError, got {got}"
    )
    assert (got[0].status, got[0].message, got[0].param) == (
        400,
        "prompt of 90 tokens never fits",
        "prompt",
    ), "APIError(400, the engine's message, 'prompt'): the client learns why"
    got = queued(b)
    assert got == [Event(2, 5, True, "length")], (
        f"request 2's last token (finish_reason 'length') is an Event that is done, got {got}"
    )
    assert tickets == {}, f"both requests are over: tickets should be empty, got {sorted(tickets)}"


# ---- sse_events ------------------------------------------------------------------------------
HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": NAME}


def events_of(impl, pieces, kind, include_usage, n_prompt=5) -> list[str]:
    async def gen():
        for p in pieces:
            yield p

    async def run():
        return [e async for e in impl.sse_events(gen(), kind, dict(HEAD), n_prompt, include_usage)]

    with explained(f"sse_events of {len(pieces)} {kind} pieces"):
        return asyncio.run(run())


def parsed(events: list[str]) -> list:
    """Each event as the client reads it: its JSON, or '[DONE]'."""
    out = []
    for i, e in enumerate(events):
        assert isinstance(e, str), f"event {i} is a {type(e).__name__}: each event is a str"
        assert e.startswith("data: "), f"event {i} {e!r} must start with 'data: '"
        assert e.endswith("\n\n") and "\n\n" not in e[:-2], (
            f"event {i} {e!r} must end with one blank line ('\\n\\n'): "
            "a client reads an event up to it"
        )
        body = e[len("data: ") : -2]
        if body == "[DONE]":
            out.append(body)
            continue
        try:
            out.append(json.loads(body))
        except json.JSONDecodeError as err:
            raise AssertionError(f"event {i}: {body!r} is not JSON ({err})") from None
    return out


def choice(**kw) -> dict:
    return {"index": 0, **kw, "logprobs": None}


def test_sse_events_of_a_completion(impl):
    got = parsed(
        events_of(impl, [("Good", None, 1), (" morrow", "length", 2)], "completions", False)
    )
    expected = [
        {**HEAD, "choices": [choice(text="Good", finish_reason=None)]},
        {**HEAD, "choices": [choice(text=" morrow", finish_reason="length")]},
        "[DONE]",
    ]
    assert got == expected, (
        f"the events of two pieces, then [DONE]:\nexpected {expected}\ngot      {got}"
    )


def test_sse_events_of_a_chat_with_usage(impl):
    got = parsed(events_of(impl, [("Nay", None, 2), ("", "stop", 3)], "chat", True, n_prompt=9))
    expected = [
        {
            **HEAD,
            "choices": [choice(delta={"role": "assistant", "content": ""}, finish_reason=None)],
        },
        {**HEAD, "choices": [choice(delta={"content": "Nay"}, finish_reason=None)]},
        {**HEAD, "choices": [choice(delta={}, finish_reason="stop")]},
        {
            **HEAD,
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
        },
        "[DONE]",
    ]
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"chat event {i}: expected {e}, got {g}"
    assert len(got) == len(expected), (
        f"a chat stream with usage is 5 events (role, 2 pieces, usage, [DONE]), got {len(got)}"
    )
    assert got[3]["usage"]["completion_tokens"] == 3, (
        "completion_tokens counts the answer's tokens (the last piece's n_out), not its pieces"
    )


# ---- percentile ------------------------------------------------------------------------------
def test_percentile_matches_numpy(impl):
    rng = random.Random(1)
    for n in [1, 2, 3, 10, 101]:
        xs = [rng.random() for _ in range(n)]
        for p in [0, 50, 90, 99, 100]:
            got = impl.percentile(list(xs), p)
            assert got == pytest.approx(float(np.percentile(xs, p))), (
                f"percentile of {n} values at p={p}: expected {np.percentile(xs, p):.6f}, got "
                f"{got!r}"
            )
    try:
        empty = impl.percentile([], 50)
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(
            f"percentile([], 50) raised {type(e).__name__}: {e}; with no values "
            f"it returns 0.0 (a run in which no request finished)"
        ) from None
    assert empty == 0.0, f"no values: 0.0, got {empty!r}"
    xs = [3.0, 1.0, 2.0]
    impl.percentile(xs, 50)
    assert xs == [3.0, 1.0, 2.0], (
        f"percentile must not reorder the caller's list: [3.0, 1.0, 2.0] became {xs}"
    )


def test_loadgen_figures_use_your_percentile(impl, plug):
    plug("percentile")
    recs = [loadgen.Record(0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05], 2) for i in range(10)]
    with explained("summarize with your percentile"):
        out = loadgen.summarize(recs, duration=2.0)
    assert out["ttft_p50_ms"] == pytest.approx(550.0) and out["ttft_p90_ms"] == pytest.approx(
        910.0
    ), f"TTFTs 100..1000 ms: p50 550, p90 910, got {out['ttft_p50_ms']}, {out['ttft_p90_ms']}"


# ---- apply_penalties -------------------------------------------------------------------------
def penalties_of(impl, logits, counts, seen, presence, frequency, repetition, what: str):
    """impl.apply_penalties on plain lists, its answer checked for shape and dtype."""
    logits = torch.tensor(logits, dtype=torch.float64)
    args = (
        torch.tensor(counts),
        torch.tensor(seen),
        *(torch.tensor(x, dtype=torch.float64) for x in (presence, frequency, repetition)),
    )
    with explained(f"apply_penalties ({what})"):
        got = impl.apply_penalties(logits, *args)
    assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
        f"apply_penalties returns new logits of the logits' shape {tuple(logits.shape)}, got "
        f"{got!r}"
    )
    assert got.dtype == logits.dtype, (
        f"apply_penalties returns logits of the input's dtype {logits.dtype}, got {got.dtype}"
    )
    return got


def first_difference(got, want, tol: float = 0.0, row: int = 0) -> str | None:
    """'row 1, token 7: expected -3.0, got -2.0' for the first value off by more than tol
    (relative, at least 1 in absolute), None when every value agrees; rows numbered from
    `row`."""
    got, want = torch.as_tensor(got).tolist(), torch.as_tensor(want).tolist()
    for b, (g_row, w_row) in enumerate(zip(got, want), start=row):
        for t, (g, w) in enumerate(zip(g_row, w_row)):
            if not (g == w or abs(g - w) <= tol * max(1.0, abs(w))):
                return f"row {b}, token {t}: expected {w!r}, got {g!r}"
    return None


def test_apply_penalties_worked_example(impl):
    """The docstring's example: repetition first (token 0 halved, token 1 doubled away from
    zero), then frequency and presence on the generated token 1; token 2 was never seen."""
    got = penalties_of(
        impl,
        [[2.0, -1.0, 0.5]],
        [[0, 2, 0]],
        [[True, True, False]],
        [[0.5]],
        [[0.25]],
        [[2.0]],
        "the docstring's example",
    )
    msg = first_difference(got, [[1.0, -3.0, 0.5]])
    assert msg is None, (
        f"logits [[2., -1., 0.5]], counts [[0, 2, 0]], seen [[True, True, False]], presence "
        f"0.5, frequency 0.25, repetition 2: expected [[1., -3., 0.5]] (token 1: -1 * 2 = -2, "
        f"then - 0.25 * 2 - 0.5), {msg}"
    )


def test_repetition_divides_positive_logits_and_multiplies_the_others(impl):
    """Repetition pushes every seen token's logit towards less likely: a positive one is
    divided by it, a negative one multiplied (a penalty below 1 does the opposite); a token
    never seen keeps its logit, and repetition alone never touches counts."""
    logits = [[3.0, -3.0, 0.0, 1.5, -0.5]] * 2
    seen = [[True, True, True, False, False]] * 2
    got = penalties_of(
        impl,
        logits,
        [[0] * 5] * 2,
        seen,
        [[0.0], [0.0]],
        [[0.0], [0.0]],
        [[1.5], [0.5]],
        "repetition alone",
    )
    want = [[2.0, -4.5, 0.0, 1.5, -0.5], [6.0, -1.5, 0.0, 1.5, -0.5]]
    msg = first_difference(got, want)
    assert msg is None, (
        f"logits [3, -3, 0, 1.5, -0.5], tokens 0..2 seen, repetition 1.5 (row 0) and 0.5 "
        f"(row 1): a positive logit / penalty, a negative one * penalty, an unseen one as it "
        f"was: expected {want}, {msg}"
    )


def test_presence_and_frequency_come_from_the_counts(impl):
    """frequency * count, and presence once for every token generated at least once; a token
    seen only in the prompt (count 0) is not charged; negative penalties encourage."""
    counts = [[0, 1, 3, 0, 2]] * 2
    seen = [[False, True, True, True, True]] * 2  # token 3: in the prompt only
    got = penalties_of(
        impl,
        [[0.0] * 5] * 2,
        counts,
        seen,
        [[0.5], [-1.0]],
        [[0.25], [-0.5]],
        [[1.0], [1.0]],
        "presence and frequency",
    )
    want = [[0.0, -0.75, -1.25, 0.0, -1.0], [0.0, 1.5, 2.5, 0.0, 2.0]]
    msg = first_difference(got, want)
    assert msg is None, (
        f"logits 0, counts {counts[0]} (token 3 seen in the prompt only): row 0 presence 0.5, "
        f"frequency 0.25; row 1 presence -1, frequency -0.5: expected {want}, {msg}"
    )


def test_each_row_has_its_own_penalties(impl):
    """One batch, three rows with the same logits and history but their own penalties: a
    row's result comes from its own (B, 1) penalties alone."""
    rows = [(0.5, 0.25, 2.0), (0.0, 1.0, 1.0), (1.0, 0.0, 0.5)]
    got = penalties_of(
        impl,
        [[2.0, -1.0, 0.5, 1.0]] * 3,
        [[0, 2, 0, 1]] * 3,
        [[True, True, False, True]] * 3,
        [[p] for p, _, _ in rows],
        [[f] for _, f, _ in rows],
        [[r] for _, _, r in rows],
        "three rows, each its own penalties",
    )
    want = [[1.0, -3.0, 0.5, -0.25], [2.0, -3.0, 0.5, 0.0], [4.0, -1.5, 0.5, 1.0]]
    for b, (p, f, r) in enumerate(rows):
        msg = first_difference(got[b : b + 1], want[b : b + 1], row=b)
        assert msg is None, (
            f"row {b} (presence {p}, frequency {f}, repetition {r}) of logits [2, -1, 0.5, 1], "
            f"counts [0, 2, 0, 1]: expected {want[b]}, got {got[b].tolist()} ({msg})"
        )


def random_rows(n: int, vocab: int, seed: int):
    """n rows of random float64 logits and histories, with random penalties (row 1 none)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    counts = torch.zeros(n, vocab, dtype=torch.long)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    rows = []
    for b in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(vocab // 2) for _ in range(rng.randint(0, 20))]
        for t in output:
            counts[b, t] += 1
        seen[b, prompt + output] = True
        pen = (
            (0.0, 0.0, 1.0)
            if b == 1
            else (rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.3, 3.0))
        )
        rows.append((prompt, output, pen))
    column = lambda k: torch.tensor([[pen[k]] for _, _, pen in rows], dtype=torch.float64)
    return logits, counts, seen, column(0), column(1), column(2), rows


def test_a_row_without_penalties_keeps_its_logits_bit_for_bit(impl):
    """Presence 0, frequency 0, repetition 1 change nothing, to the last bit, whatever the
    history and whatever the rows beside it do: solo generate() never passes such a row
    through the penalties at all."""
    logits, counts, seen, presence, frequency, repetition, _ = random_rows(4, 40, 1)
    with explained("apply_penalties on four random rows"):
        got = impl.apply_penalties(logits, counts, seen, presence, frequency, repetition)
    msg = first_difference(got[1:2], logits[1:2], row=1)
    assert msg is None, (
        f"row 1 has presence 0, frequency 0, repetition 1: its logits must come back bit for "
        f"bit, {msg}"
    )


def test_apply_penalties_leaves_its_inputs_unchanged(impl):
    """A new tensor comes back; the logits, counts, seen and the penalties are as they were
    (the engine reads the raw logits again for the logprobs)."""
    args = random_rows(4, 40, 2)[:6]
    before = [a.clone() for a in args]
    with explained("apply_penalties on four random rows"):
        impl.apply_penalties(*args)
    for name, a, b in zip(
        ["logits", "counts", "seen", "presence", "frequency", "repetition"], before, args
    ):
        if not torch.equal(a, b):
            i, t = (a != b).nonzero()[0].tolist()
            raise AssertionError(
                f"apply_penalties changed its input {name} in place (row {i}, token {t} was "
                f"{a[i, t].item()!r}, is now {b[i, t].item()!r}): compute new logits "
                f"(torch.where, or a clone first), never write into the arguments"
            )


def test_batched_penalties_equal_one_row_at_a_time(impl):
    """Eight random float64 rows, each with its own history and penalties, in one call: each
    row equals the rule applied to that row alone, token by token (penalize_row), to 1e-12."""
    logits, counts, seen, presence, frequency, repetition, rows = random_rows(8, 50, 3)
    wants = [penalize_row(logits[b], *row[:2], *row[2]) for b, row in enumerate(rows)]
    with explained("apply_penalties on eight random rows"):
        got = impl.apply_penalties(logits, counts, seen, presence, frequency, repetition)
    assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
        f"new logits of shape {tuple(logits.shape)}, got {got!r}"
    )
    for b, ((prompt, output, (p, f, r)), want) in enumerate(zip(rows, wants)):
        msg = first_difference(got[b : b + 1], want[None], tol=1e-12, row=b)
        assert msg is None, (
            f"row {b} (presence {p:.3f}, frequency {f:.3f}, repetition {r:.3f}; prompt "
            f"{prompt}, generated {output}) against the same rule on that row alone: {msg}"
        )


PENALTY_MODEL = make_tiny(seed=10)  # float64


def penalized_requests(n: int, seed: int) -> list[Request]:
    """Random prompts, each request with penalties (most), some with a logit bias or
    min_tokens, greedy or sampled with its own seed (so its solo run is defined)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        s = Sampling(
            temperature=rng.choice([0.0, 0.0, 0.9]),
            seed=i,
            presence_penalty=rng.choice([0.0, 0.6, 1.5, -0.5]),
            frequency_penalty=rng.choice([0.0, 0.4, 1.0]),
            repetition_penalty=rng.choice([1.0, 1.3, 2.0, 0.8]) if i % 4 else 1.5,
            logit_bias=rng.choice([{}, {}, {7: 2.0}]),
            min_tokens=rng.choice([0, 0, 3]),
        )
        prompt = [rng.randrange(97) for _ in range(rng.randint(1, 20))]
        reqs.append(Request(prompt, rng.randint(4, 28), rng.choice([None, 5]), s))
    return reqs


def settings_of(s: Sampling) -> str:
    return (
        f"temperature {s.temperature}, presence {s.presence_penalty}, frequency "
        f"{s.frequency_penalty}, repetition {s.repetition_penalty}"
    )


def test_the_paged_engine_with_your_penalties_matches_solo(impl, plug):
    """Twelve requests with penalties (greedy and seeded sampling, some with a logit bias or
    min_tokens) through 3 paged slots and a pool small enough to preempt, on a tiny float64
    model: each request's tokens are those solo() gives it with the reference penalties."""
    model, reqs = PENALTY_MODEL, penalized_requests(12, 0)
    expected = [solo(model, r).tokens for r in reqs]  # the reference: before plugging
    plain = [solo(model, Request(r.prompt, r.max_new_tokens, r.eos_id)).tokens for r in reqs]
    assert sum(e != p for e, p in zip(expected, plain)) >= 4, (
        "the requests are chosen so that penalties change their answers"
    )
    plug("apply_penalties")
    need = max(-(-(len(r.prompt) + r.max_new_tokens) // 4) for r in reqs)
    eng = make_engine(model, 3, kv="paged", block_size=4, kv_blocks=need + 6)
    with explained("the paged engine with your apply_penalties"):
        rids = [eng.add_request(r) for r in reqs]
        for _ in range(2000):
            if not eng.has_work():
                break
            eng.step()
    assert not eng.has_work(), "the engine never finished its requests"
    for i, (e, rid, r) in enumerate(zip(expected, rids, reqs)):
        msg = divergence(f"request {i} ({settings_of(r.sampling)})", e, eng.results[rid].tokens)
        assert msg is None, msg
    assert eng.stats.preemptions > 0, "the pool is small enough that someone is preempted"


# ---- the server with your functions ------------------------------------------------------------
@pytest.fixture(scope="module")
def running(bundled64):
    """A paged engine of 4 slots and 24 blocks of 4 positions: busy enough to preempt, and a
    request of more than 96 positions is one the engine refuses."""

    model, tok = bundled64
    srv = Running(make_engine(model, 4, kv="paged", block_size=4, kv_blocks=24), tok)
    yield srv
    srv.stop()


class SplitCharacters:
    """The bundled tokenizer, but its decode writes an 'é' after every token whose id is a
    multiple of 3, its two bytes split between that token and the next: an answer's text then
    holds characters that arrive in two tokens, and may end with half of one."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids) -> str:
        data, carry = b"", b""
        for t in ids:
            data += carry + self.tok.decode([t]).encode()
            carry = b""
            if t % 3 == 0:
                data, carry = data + b"\xc3", b"\xa9"
        return data.decode("utf-8", errors="replace")


def stream_text(running, prompt, n, **kw) -> tuple[str, str]:
    cl = running.client()
    with explained(f"the server with your functions (prompt {prompt!r}, {kw})"):
        chunks = [
            c.choices[0]
            for c in cl.completions.create(
                model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True, **kw
            )
        ]
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def test_streamed_answers_with_stop_strings_equal_solo(impl, plug, running):
    """Bundled model, float64: each streamed answer is its solo text, cut before the earliest of
    its stop strings."""
    plug()
    tried = 0
    for i, prompt in enumerate(PROMPTS):
        full = solo_text(running, prompt, 40)
        if len(full) < 16:  # an answer too short to cut
            continue
        tried += 1
        early = full[len(full) // 4 : len(full) // 4 + 2 + i % 2]
        late = full[len(full) // 2 : len(full) // 2 + 3]
        expected = full[: min(full.index(early), full.index(late))]
        text, reason = stream_text(running, prompt, 40, stop=[late, early])
        assert text == expected, (
            f"prompt {prompt!r}, stop strings {[late, early]}: streamed "
            f"{text!r}, expected {expected!r} (cut before the earliest)"
        )
        assert reason == "stop", f"a stop string ends it with finish_reason 'stop', got {reason!r}"
        text, _ = stream_text(running, prompt, 40)
        assert text == full, f"prompt {prompt!r} without a stop string: {text!r}, expected {full!r}"
    assert tried >= 4 and running.wait_idle() == (0, 0)


def test_split_characters_and_the_final_flush(impl, plug, running, monkeypatch):
    """Through a decode that splits characters across tokens: every answer is its solo text;
    a stop string whose start ends the answer never completes, so what waited for it is sent
    when the answer is over (the final flush), and so is a last half character."""
    plug()
    monkeypatch.setattr(running.served, "tok", SplitCharacters(running.tok))
    dec = running.served.tok.decode
    model, tok = running.engine.model, running.tok
    for prompt in PROMPTS[:5]:
        toks = generate(model, tok.encode(prompt), 30, eos_id=tok.eos_id)
        full = dec(toks)
        text, reason = stream_text(running, prompt, 30)
        assert text == full, f"prompt {prompt!r}: streamed {text!r}, expected {full!r}"
        tail = full[-2:] + "\x00never"  # its start ends the answer
        text, reason = stream_text(running, prompt, 30, stop=[tail])
        assert text == full, (
            f"prompt {prompt!r}, stop {tail!r}, which never comes: streamed "
            f"{text!r}, expected all of {full!r}: once the answer is over, "
            f"what waited is sent"
        )
        assert reason == ("stop" if toks[-1] == tok.eos_id else "length"), (
            f"prompt {prompt!r}: finish_reason {reason!r}, the engine's"
        )
    assert running.wait_idle() == (0, 0)


def test_concurrent_streams_an_abort_and_a_refusal(impl, plug, running):
    """Twelve concurrent streams, chat and completions, some with usage: each equals its solo
    answer, whatever its neighbours do; a client that goes away meanwhile frees its request; a
    request the engine refuses (more than its 96 positions) gets a 400, and the rest go on."""
    plug()

    async def one(cl, i):
        prompt, n = PROMPTS[i % len(PROMPTS)], 6 + (7 * i) % 25
        if i == 5:
            return await cl.completions.create(
                model=NAME, prompt=prompt, max_tokens=120, temperature=0
            )
        if i % 3 == 1:
            stream = await cl.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant", (
                "a chat stream opens with the role"
            )
            assert chunks[-1].usage is not None and not chunks[-1].choices, (
                "the usage comes last, alone"
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1].usage.completion_tokens
        stream = await cl.completions.create(
            model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream]), None

    async def goes_away():
        body = {
            "model": NAME,
            "prompt": PROMPTS[0],
            "max_tokens": 60,
            "temperature": 0,
            "stream": True,
        }
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", running.url + "/completions", json=body) as resp:
                async for n, _ in aenumerate(resp.aiter_lines()):
                    if n == 2:
                        return

    async def all_of_them():
        cl = openai.AsyncOpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(
            *(one(cl, i) for i in range(12)), goes_away(), return_exceptions=True
        )

    out = asyncio.run(all_of_them())
    refused = out[5]
    assert isinstance(refused, openai.BadRequestError), (
        f"a request of {PROMPTS[5]!r} and 120 new tokens never fits 96 positions: a 400, got "
        f"{refused!r}"
    )
    assert refused.body["param"] == "prompt", refused.body
    model, tok = running.engine.model, running.tok
    for i, got in enumerate(out[:12]):
        if i == 5:
            continue
        if isinstance(got, Exception):
            raise AssertionError(f"stream {i} failed: {type(got).__name__}: {got}")
        text, n_usage = got
        prompt, n = PROMPTS[i % len(PROMPTS)], 6 + (7 * i) % 25
        if i % 3 == 1:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}]).removeprefix(
                "<|endoftext|>"
            )
        toks = generate(model, tok.encode(prompt), n, eos_id=tok.eos_id)
        assert text == tok.decode(toks), f"stream {i}: {text!r}, expected {tok.decode(toks)!r}"
        assert n_usage in (None, len(toks)), (
            f"stream {i}: usage says {n_usage} completion tokens, the answer has {len(toks)}"
        )
    assert not isinstance(out[12], Exception), f"the client that went away: {out[12]!r}"
    assert running.wait_idle() == (0, 0), "the request of a client that went away still runs"


async def aenumerate(items):
    n = 0
    async for item in items:
        yield n, item
        n += 1
