"""Exercise 12 - structured output: your walk and token_mask give a hand-written grammar's
mask over the vocabulary (equal to llguidance's for the same regular expression), your
apply_bitmask applies a batch of masks; plugged into ContinuousEngine among free requests,
every request gets the tokens of its run with the package's own functions, and every
constrained answer matches its grammar."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from tests.test_structured import PERSON
from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.course import seams
from tinyllm.course.check import divergence, explained, leaks
from tinyllm.ext.structured import DFA, Constraint, DFAGrammars, LLGuidance

EXERCISE = "ex12_structured_output"
DIGITS = "0123456789"
UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
X = DFA.sequence("x=", (DIGITS, 1, 3))  # the docstrings' grammar: x=[0-9]{1,3}
# hand-written grammars and the same regular expressions, for llguidance
HAND = {
    Constraint("regex", "[A-Z]{3,10}:"): DFA.sequence((UPPER, 3, 10), ":"),
    Constraint("regex", "[0-9]{1,3}"): DFA.sequence((DIGITS, 1, 3)),
    Constraint("regex", "[a-z ]{2,12}[.!?]"): DFA.sequence(
        ("abcdefghijklmnopqrstuvwxyz ", 2, 12), (".!?", 1, 1)
    ),
}


def after(dfa: DFA, text: bytes) -> int:
    """The state after text, by the automaton's own moves."""
    state = dfa.start
    for b in text:
        state = dfa.moves[state, b]
    return state


def unpack(bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """(B, W) int32 -> (B, V) bool by numpy's own bit order, the low bit first."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :V]).bool()


# ---- walk ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "start, piece, want, why",
    [
        (b"", b"x=4", b"x=4", "the docstring's example: the state after one digit"),
        (b"", b"x4", None, "x must be followed by =: no move for 4"),
        (b"x=", b"123", b"x=123", "three digits, from the state after x="),
        (b"x=12", b"34", None, "a fourth digit has no move: None, not the state after 3"),
        (b"x=1", b"", b"x=1", "no bytes: the state stays where it is"),
        (b"x=123", b"4", None, "after three digits nothing more is allowed"),
        (b"", b"=", None, "the text must begin with x"),
    ],
)
def test_walk_follows_the_moves_byte_by_byte(impl, start, piece, want, why):
    state = after(X, start)
    got = impl.walk(X, state, piece)
    expected = None if want is None else after(X, want)
    assert got == expected, (
        f"for x=[0-9]{{1,3}}, walk from the state after {start!r} over {piece!r} should be "
        f"{'None' if want is None else f'the state after {want!r} ({expected})'} ({why}), "
        f"got {got}"
    )


def test_walk_on_random_automata(impl):
    """Random sequences of parts and random pieces: walk agrees with the reference."""
    ref = seams.reference("12")["walk"]
    rng = random.Random(0)
    for _ in range(100):
        dfa = DFA.sequence(("ab", rng.randint(1, 3), 4), "-", ("cd", 1, rng.randint(1, 3)))
        states = sorted({dfa.start, *dfa.moves.values()})
        for _ in range(20):
            state = rng.choice(states)
            piece = bytes(rng.choice(b"abcd-") for _ in range(rng.randint(0, 5)))
            want = ref(dfa, state, piece)
            got = impl.walk(dfa, state, piece)
            assert got == want, f"walk(state {state}, {piece!r}) should be {want}, got {got}"


# ---- token_mask ------------------------------------------------------------------------------
PIECES = [b"x", b"=", b"3", b"4", b"45", b"456", b"", b"x=1", b"a", b"", b""]
EOS = (6, 10)  # tokens 6 and 10 end a text (a model may have several end-of-text ids, as
# Llama 3 and SmolLM2's chat models do); token 9 is another special token (no bytes)


@pytest.mark.parametrize(
    "text, want, why",
    [
        (b"x=1", [2, 3, 4, 6, 10], "the docstring's example: 3, 4, 45 and EOS (456 is 4 digits)"),
        (b"", [0, 7], "x and x=1: a token may be several symbols of the grammar"),
        (b"x", [1], "only =; EOS is not allowed where the text may not end"),
        (b"x=", [2, 3, 4, 5], "one to three digits; EOS not yet"),
        (b"x=12", [2, 3, 6, 10], "one more digit (45 would be 4 of them) or EOS"),
        (b"x=123", [6, 10], "a complete text: EOS is all that is left"),
    ],
)
def test_token_mask_on_a_small_vocabulary(impl, text, want, why):
    got = impl.token_mask(X, after(X, text), list(PIECES), EOS)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bool, (
        f"token_mask should return a bool tensor, got {got!r}"
    )
    assert got.shape == (len(PIECES),), f"token_mask should have shape ({len(PIECES)},)"
    allowed = got.nonzero().flatten().tolist()
    names = lambda ids: [PIECES[i] if i not in EOS else f"EOS {i}" for i in ids]  # noqa: E731
    assert allowed == want, (
        f"for x=[0-9]{{1,3}} after {text!r}, the tokens {names(want)} should be allowed "
        f"({why}); yours allow {names(allowed)} (a special token, b'', only as EOS; every "
        f"id of eos_ids {EOS} is an EOS)"
    )


def llguidance_masks(grammars, hand, c, tok, V, rng):
    """Yield (text so far, llguidance's mask, the hand-written backend's matcher) along a
    random allowed path of constraint c."""
    lib, mine = grammars.matcher(c), hand.matcher(c)
    text = b""
    for _ in range(14):
        want = unpack(lib.bitmask()[None], V)[0]
        yield text, want, mine
        t = rng.choice(want.nonzero().flatten().tolist())
        if t in tok.eos_ids:
            return
        assert lib.consume(t) and mine.consume(t)
        text += hand.pieces[t]


def test_token_mask_equals_llguidance_on_the_bundled_vocabulary(impl, plug, bundled):
    """Over the bundled model's 2,048 tokens, your mask (through DFAGrammars' matcher) is the
    one llguidance computes for the same regular expression, at every state of random paths."""
    model, tok = bundled
    V = model.cfg.vocab_size
    plug("walk", "token_mask")
    grammars, hand = LLGuidance(tok, V), DFAGrammars(tok, V, HAND)
    rng = random.Random(12)
    for c in HAND:
        for _ in range(3):
            for text, want, mine in llguidance_masks(grammars, hand, c, tok, V, rng):
                with explained(f"your token_mask for {c.spec!r} after {text!r}"):
                    got = unpack(mine.bitmask()[None], V)[0]
                diff = (got != want).nonzero().flatten().tolist()
                assert not diff, (
                    f"for {c.spec!r} after {text!r}: your mask allows {int(got.sum())} tokens, "
                    f"llguidance's {int(want.sum())}; they differ at "
                    f"{[tok.id_to_token(i) for i in diff[:6]]}"
                )


# ---- apply_bitmask ---------------------------------------------------------------------------
def test_apply_bitmask_the_docstrings_example(impl):
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    got = impl.apply_bitmask(logits, torch.tensor([[5]], dtype=torch.int32))
    want = torch.tensor([[1.0, float("-inf"), 3.0]])
    assert got is not None and torch.equal(got, want), (
        f"logits [[1, 2, 3]] with bitmask [[5]] (0b101: tokens 0 and 2) should be {want}, got {got}"
    )


def test_apply_bitmask_reads_the_sign_bit_and_ignores_padding(impl):
    """Token 31 is bit 31, the word's sign: an int32 word -2**31 allows token 31 alone; with
    V = 35 the second word's bits past token 34 are padding."""
    logits = torch.arange(35, dtype=torch.float64)[None]
    bitmask = torch.tensor([[-(2**31), -1]], dtype=torch.int32)  # token 31; tokens 32 .. 63
    got = impl.apply_bitmask(logits, bitmask)
    assert got is not None and got.shape == (1, 35), (
        f"logits (1, 35) with a bitmask (1, 2) should give (1, 35), got "
        f"{None if got is None else tuple(got.shape)} (the bits past V are padding)"
    )
    allowed = (got > float("-inf")).nonzero()[:, 1].tolist()
    assert allowed == [31, 32, 33, 34], (
        f"word 0 = -2**31 sets bit 31 only (token 31), word 1 = -1 sets tokens 32 to 63, of "
        f"which 32 to 34 exist: allowed should be [31, 32, 33, 34], yours {allowed}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apply_bitmask_on_random_batches(impl, dtype):
    """Random logits and bits, batches of 1 to 6 rows: each allowed logit is kept bit for bit,
    the others are -inf, the input is unchanged."""
    gen = torch.Generator().manual_seed(0)
    for V in (1, 31, 32, 33, 100, 2048):
        for B in (1, 6):
            logits = torch.randn(B, V, generator=gen, dtype=dtype)
            W = (V + 31) // 32
            bitmask = torch.randint(-(2**31), 2**31, (B, W), generator=gen).int()
            before = logits.clone()
            got = impl.apply_bitmask(logits, bitmask)
            want = logits.masked_fill(~unpack(bitmask, V), float("-inf"))
            assert torch.equal(logits, before), "apply_bitmask changed its input logits"
            assert got is not None and got.dtype == dtype and torch.equal(got, want), (
                f"{B} rows of V = {V} ({dtype}): your masked logits differ from the bits' "
                f"at {0 if got is None else int((got != want).sum())} places"
            )


# ---- end to end ------------------------------------------------------------------------------
PROMPTS = ["Ham.\n", "Oph.\nMy lord,", "King.\n", "Hor.\nWhat", "Pol.\n"]


def workload(tok, seed: int, constraints: list) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(8):
        c = rng.choice(constraints + [None])  # free requests among the constrained ones
        temp = rng.choice([0.0, 0.9])
        s = Sampling(temperature=temp, seed=rng.randrange(1000) if temp else None, constraint=c)
        prompt = tok.encode(rng.choice(PROMPTS))
        reqs.append(Request(prompt, rng.randint(12, 40), eos_id=tok.eos_id, sampling=s))
    return reqs


def run(model, grammars, reqs, **kw):
    eng = make_engine(model, 3, kv="paged", block_size=4, grammars=grammars, **kw)
    rids = [eng.add_request(r) for r in reqs]
    while eng.has_work():
        eng.step()
    return [eng.results.pop(rid) for rid in rids], leaks(eng)


@pytest.mark.parametrize("backend", ["hand", "llguidance"])
def test_the_engine_with_your_functions_equals_solo(impl, plug, bundled64, backend):
    """Constrained and free requests, greedy and seeded, in a paged engine with a tight pool
    (preemption) and a token budget, your functions plugged in: every request gets the tokens
    of its solo run with the package's own functions, every constrained answer matches its
    grammar (a regex, or a JSON schema with llguidance), nothing is left behind."""
    model, tok = bundled64
    V = model.cfg.vocab_size
    if backend == "hand":
        grammars = DFAGrammars(tok, V, HAND)
        constraints = list(HAND)
    else:
        grammars = LLGuidance(tok, V)
        constraints = [Constraint.json_schema(PERSON), Constraint("regex", "[A-Z]{3,10}:")]
    reqs = workload(tok, 12, constraints)
    expected = [solo(model, r, grammars=grammars).tokens for r in reqs]
    plug()
    with explained(f"ContinuousEngine with your functions ({backend} grammars)"):
        results, left = run(model, grammars, reqs, kv_blocks=14, max_step_tokens=16)
    for i, (r, want, got) in enumerate(zip(reqs, expected, results)):
        why = divergence(f"request {i} ({r.sampling.constraint or 'free'})", want, got.tokens)
        assert why is None, why
        c = r.sampling.constraint
        text = tok.decode(got.tokens)
        if c is not None and got.finish_reason == "stop" and c.kind == "regex":
            assert re.fullmatch(c.spec, text), f"request {i}: {text!r} does not match {c.spec}"
        if c is not None and got.finish_reason == "stop" and c.kind == "json_schema":
            jsonschema.validate(json.loads(text), json.loads(c.spec))
    assert left is None, f"after every request finished: {left}"
