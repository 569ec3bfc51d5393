"""Exercise 10 - serving: your next_piece inside the server's text stream (every streamed
answer equals the decoded solo generate() tokens, cut at its stop string, no character split)
and your percentile inside the load generator's figures."""

import random

import httpx
import numpy as np
import pytest

from tinyllm import loadgen
from tinyllm.check import explained
from tinyllm.textstream import REPLACEMENT, TextStream
from tests.test_server import NAME, PROMPTS, Running, solo_text

EXERCISE = "ex10_serving"


# ---- next_piece ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, sent, stops, final, expected, why", [
    ("Good morrow", 0, [], False, ("Good morrow", False), "all of it is settled"),
    ("Good morrow", 5, [], False, ("morrow", False), "only what was not sent yet"),
    ("caf" + REPLACEMENT, 0, [], False, ("caf", False), "an unfinished character waits"),
    ("caf" + REPLACEMENT * 2, 0, [], False, ("caf", False), "every unfinished byte waits"),
    ("café", 3, [], False, ("é", False), "and comes once its bytes have all come"),
    ("Good\n", 0, ["\n\n"], False, ("Good", False), "the start of a stop string waits"),
    ("Good\nNay", 4, ["\n\n"], False, ("\nNay", False), "and comes when it was not one"),
    ("Good\n\nNay", 0, ["\n\n"], False, ("Good", True), "a stop string ends the answer before it"),
    ("Good\n\n", 4, ["\n\n"], False, ("", True), "nothing of the stop string is sent"),
    ("ab END cd STOP", 0, ["STOP", "END"], False, ("ab ", True), "the earliest stop string"),
    ("I say no", 0, ["no more"], False, ("I say ", False), "the longest start of a stop string waits"),
    ("Good\n", 0, ["\n\n"], True, ("Good\n", False), "at the end nothing waits"),
    ("caf" + REPLACEMENT, 0, [], True, ("caf" + REPLACEMENT, False), "at the end nothing waits"),
])
def test_next_piece(impl, text, sent, stops, final, expected, why):
    got = impl.next_piece(text, sent, stops, final)
    assert isinstance(got, tuple) and len(got) == 2, \
        f"next_piece returns (new text, stopped), got {got!r}"
    assert tuple(got) == expected, (f"next_piece({text!r}, sent={sent}, stops={stops}, "
                                    f"final={final}): {why}: expected {expected}, got {got}")


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
        stops = rng.sample(["\n\n", "thou", "Ro", "z"], rng.randint(0, 2))
        ts = TextStream(byte_decode(table), stops)
        pieces = []
        for t in range(len(table)):
            pieces.append(ts.push(t))
            if ts.stopped:
                break
        pieces.append(ts.finish())
        found = [text.find(s) for s in stops if s in text]
        expected = text[:min(found)] if found else text
        assert "".join(pieces) == expected, \
            f"trial {trial}: text {text!r}, stops {stops}: pieces {pieces} add up to " \
            f"{''.join(pieces)!r}, expected {expected!r}"
        assert all(REPLACEMENT not in p for p in pieces[:-1]), f"trial {trial}: a split character {pieces}"


# ---- percentile ------------------------------------------------------------------------------
def test_percentile_matches_numpy(impl):
    rng = random.Random(1)
    for n in [1, 2, 3, 10, 101]:
        xs = [rng.random() for _ in range(n)]
        for p in [0, 50, 90, 99, 100]:
            got = impl.percentile(list(xs), p)
            assert got == pytest.approx(float(np.percentile(xs, p))), \
                f"percentile of {n} values at p={p}: expected {np.percentile(xs, p):.6f}, got {got!r}"
    assert impl.percentile([], 50) == 0.0, "no values: 0.0"
    xs = [3.0, 1.0, 2.0]
    impl.percentile(xs, 50)
    assert xs == [3.0, 1.0, 2.0], "percentile must not reorder the caller's list"


def test_loadgen_figures_use_your_percentile(impl, plug):
    plug("percentile")
    recs = [loadgen.Record(0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05], 2) for i in range(10)]
    with explained("summarize with your percentile"):
        out = loadgen.summarize(recs, duration=2.0)
    assert out["ttft_p50_ms"] == pytest.approx(550.0) and out["ttft_p90_ms"] == pytest.approx(910.0), \
        f"TTFTs 100..1000 ms: p50 550, p90 910, got {out['ttft_p50_ms']}, {out['ttft_p90_ms']}"


# ---- the server with your next_piece ---------------------------------------------------------
@pytest.fixture(scope="module")
def running(bundled64):
    from tinyllm.continuous import ContinuousEngine
    model, tok = bundled64
    srv = Running(ContinuousEngine(model, 4), tok)
    yield srv
    srv.stop()


def test_streamed_answers_with_stop_strings_equal_solo(impl, plug, running):
    """Bundled model, float64: each streamed answer is its solo text, cut before the stop."""
    plug("next_piece")
    cl = running.client()
    tried = 0
    for i, prompt in enumerate(PROMPTS):
        full = solo_text(running, prompt, 40)
        if len(full) < 12:                              # an answer too short to cut
            continue
        tried += 1
        stop = full[len(full) // 3:len(full) // 3 + 2 + i % 3]
        expected = full[:full.index(stop)]
        with explained(f"the server with your next_piece (prompt {prompt!r}, stop {stop!r})"):
            stream = cl.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                           stop=[stop], stream=True)
            chunks = [c.choices[0] for c in stream]
        text = "".join(c.text for c in chunks)
        assert text == expected, f"prompt {prompt!r}, stop {stop!r}: streamed {text!r}, expected {expected!r}"
        assert chunks[-1].finish_reason == "stop", f"a stop string ends it with finish_reason 'stop'"
        plain = cl.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
        assert plain.choices[0].text == full, f"without a stop string: {plain.choices[0].text!r}, expected {full!r}"
    assert tried >= 4 and running.wait_idle() == (0, 0)
