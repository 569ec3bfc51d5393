"""Step 12 - structured output: a constrained request's output matches its grammar, and every
engine gives it exactly the tokens of its solo run under the same matcher, among free requests,
with preemption, chunks, prefix hits and speculation; free requests are untouched."""

import json
import math
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.core.logits_processors import unpack_bitmask
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.ext.structured import DFA, Constraint, DFAGrammars, LLGuidance

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint.json_schema(PERSON),
    Constraint("json_object"),
    Constraint("regex", r"(Ham|Oph)\. [a-z ]{3,20}\."),
    Constraint("lark", 'start: "yes" | "no" | /[0-9]{1,3}/'),
]
PROMPTS = ["Ham.\n", "Oph.\nMy lord,", "King.\n", "Hor.\nWhat"]


@pytest.fixture(scope="module")
def grammars(bundled64):
    model, tok = bundled64
    return LLGuidance(tok, model.cfg.vocab_size)


def test_a_constraint_is_checked_and_equal_schemas_are_one():
    assert Constraint.json_schema({"type": "object", "b": 1}) == Constraint.json_schema(
        '{"type": "object",  "b": 1}'
    ), "a schema as a dict or as its JSON text is one constraint"
    with pytest.raises(ValueError, match="min_tokens with a constraint"):
        Sampling(min_tokens=2, constraint=Constraint("json_object"))
    with pytest.raises(ValueError, match="constraint kind must be one of"):
        Constraint("yaml", "")
    with pytest.raises(ValueError, match="constraint must be a Constraint"):
        Sampling(constraint="json")


def test_the_backend_names_what_it_refuses_and_the_engine_is_unchanged(bundled64, grammars):
    model, tok = bundled64
    assert grammars.check(Constraint.json_schema({"type": "objectz"})) == "Invalid type: objectz"
    assert "unclosed group" in grammars.check(Constraint("regex", "(ab"))
    eng = make_engine(model, 2, kv="paged", block_size=4, grammars=grammars)
    bad = Sampling(constraint=Constraint.json_schema({"type": "objectz"}))
    with pytest.raises(ValueError, match="constraint: the json_schema is refused: Invalid type"):
        eng.add_request(Request(tok.encode("Ham.\n"), 8, sampling=bad))
    assert not eng.has_work() and eng.cache.check_integrity(idle=True) is None
    plain = make_engine(model, 2)
    with pytest.raises(ValueError, match="constraint: this engine has no grammar backend"):
        plain.add_request(Request([1, 2], 4, sampling=Sampling(constraint=CONSTRAINTS[1])))


def test_a_grammar_is_compiled_once(grammars):
    c = Constraint("regex", "[a-z]{2,5}")
    a, b = grammars.matcher(c), grammars.matcher(c)
    assert a is not b and list(grammars.compiled).count(c) == 1
    assert a.consume(grammars.llt.tokenize_str("ab")[0])
    assert not torch.equal(a.bitmask(), b.bitmask()), "each request has a matcher of its own"


def test_constrained_outputs_validate_and_end_with_their_grammar(bundled64, grammars):
    """The bundled model, sampled with 12 seeds under the schema: every output is JSON that
    the schema accepts, ended by EOS where the grammar completes ("stop")."""
    model, tok = bundled64
    eng = make_engine(model, 4, grammars=grammars)
    s = lambda seed: Sampling(0.9, seed=seed, constraint=CONSTRAINTS[0])
    rids = [
        eng.add_request(Request(tok.encode(PROMPTS[i % 4]), 60, tok.eos_id, s(i)))
        for i in range(12)
    ]
    while eng.has_work():
        eng.step()
    for rid in rids:
        r = eng.results.pop(rid)
        assert r.finish_reason == "stop" and r.tokens[-1] == tok.eos_id, tok.decode(r.tokens)
        jsonschema.validate(json.loads(tok.decode(r.tokens)), PERSON)


@st.composite
def workloads(draw, tok):
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        prompt = tok.encode(draw(st.sampled_from(PROMPTS)))
        s = Sampling(
            temperature=draw(st.sampled_from([0.0, 0.0, 0.8])),
            seed=i,
            presence_penalty=draw(st.sampled_from([0.0, 0.5])),
            logprobs=draw(st.sampled_from([None, 1])),
            ignore_eos=draw(st.sampled_from([False, False, True])),  # EOS alone past the end
            constraint=draw(st.sampled_from([None, *CONSTRAINTS])),
        )
        reqs.append(Request(prompt, draw(st.integers(1, 24)), tok.eos_id, s))
    return reqs


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_every_engine_gives_a_constrained_request_its_solo_masked_run(bundled64, grammars, data):
    """Constrained and free requests mixed, both caches, a tight pool (preemption), a budget
    (chunks), prefix hits and speculation (greedy requests then): each equals its solo run
    under the same grammar (free ones: plain solo), and nothing is left behind."""
    model, tok = bundled64
    reqs = data.draw(workloads(tok))
    speculate = data.draw(st.sampled_from([None, None, "ngram", "draft"]))
    if speculate:  # sampled requests under speculation keep the distribution, not the tokens
        reqs = [
            Request(
                r.prompt,
                r.max_new_tokens,
                r.eos_id,
                Sampling(**{**vars(r.sampling), "temperature": 0.0}),
            )
            for r in reqs
        ]
    n_slots = data.draw(st.integers(1, 3))
    kw = dict(kv=data.draw(st.sampled_from(["slots", "paged"])), speculate=speculate)
    if kw["kv"] == "paged":
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens + 1) / 4) for r in reqs)
        kw.update(
            block_size=4,
            kv_blocks=need + data.draw(st.integers(0, 3)),
            prefix_cache=data.draw(st.booleans()),
        )
    kw["max_step_tokens"] = data.draw(st.sampled_from([None, n_slots + 4]))
    eng = make_engine(model, n_slots, grammars=grammars, **kw)
    rids = [eng.add_request(r) for r in reqs]
    while eng.has_work():
        eng.step()
        assert eng.cache.check_integrity() is None
    assert eng.cache.check_integrity(idle=True) is None and not eng._seqs
    for i, (r, rid) in enumerate(zip(reqs, rids)):
        want, got = solo(model, r, grammars=grammars), eng.results.pop(rid)
        assert got.tokens == want.tokens, (
            f"request {i} ({r.sampling.constraint}): {tok.decode(got.tokens)!r}, "
            f"solo {tok.decode(want.tokens)!r} ({kw})"
        )
        for a, b in zip(want.logprobs or [], got.logprobs or []):
            assert abs(a.logprob - b.logprob) < 1e-9


def test_matchers_follow_their_requests_through_preemption_and_speculation(bundled64, grammars):
    """Six constrained requests (greedy) on a pool too small for them, with a draft guessing:
    requests are preempted and guesses fall, and every output is solo's under its grammar."""
    model, tok = bundled64
    reqs = [
        Request(tok.encode(PROMPTS[i % 4]), 30, tok.eos_id, Sampling(constraint=CONSTRAINTS[i % 4]))
        for i in range(6)
    ]
    for speculate in ("draft", "ngram"):
        eng = make_engine(
            model, 3, kv="paged", block_size=4, kv_blocks=10, speculate=speculate, grammars=grammars
        )
        rids = [eng.add_request(r) for r in reqs]
        while eng.has_work():
            eng.step()
        assert eng.stats.preemptions > 0 and eng.stats.spec_proposed > 0, speculate
        for i, (r, rid) in enumerate(zip(reqs, rids)):
            got = eng.results.pop(rid).tokens
            assert got == solo(model, r, grammars=grammars).tokens, f"request {i} ({speculate})"


# ---- a matcher's books: EOS counted, a refused token changes nothing -------------------------
YES_NO = Constraint("regex", "(yes|no)")


def allowed(m, V: int) -> list[int]:
    return unpack_bitmask(m.bitmask()[None], V)[0].nonzero().flatten().tolist()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_matcher_rolls_back_exactly_the_tokens_it_consumed(bundled64, grammars, data):
    """A matcher walked over tokens its mask allows (EOS too, again and again, as a request
    that ignores EOS makes them) and tokens it refuses, then rolled back n: a refused token
    changed nothing, and its mask is that of a fresh matcher walked over the tokens it kept
    but the last n."""
    model, tok = bundled64
    V = model.cfg.vocab_size
    c = data.draw(st.sampled_from([YES_NO, CONSTRAINTS[2], CONSTRAINTS[3]]))
    m, kept = grammars.matcher(c), []
    for _ in range(data.draw(st.integers(0, 10))):
        ok = allowed(m, V)
        refused = sorted(set(range(V)) - set(ok))[:50]
        if refused and data.draw(st.booleans()):
            t = data.draw(st.sampled_from(refused))
            assert not m.consume(t), f"{c.spec}: token {t} is not in the mask, yet consumed"
            assert allowed(m, V) == ok and not m.is_error(), "a refused token changed the matcher"
        else:
            t = (
                tok.eos_id
                if tok.eos_id in ok and data.draw(st.booleans())
                else data.draw(st.sampled_from(ok))
            )
            assert m.consume(t), f"{c.spec}: token {t} is in the mask, yet refused"
            kept.append(t)
    n = data.draw(st.integers(0, len(kept)))
    m.rollback(n)
    fresh = grammars.matcher(c)
    for t in kept[: len(kept) - n]:
        assert fresh.consume(t)
    assert allowed(m, V) == allowed(fresh, V), (
        f"{c.spec}: after {tok.decode(kept, skip_special_tokens=False)!r} rolled back {n}, "
        f"the mask is not that of {tok.decode(kept[: len(kept) - n], skip_special_tokens=False)!r}"
    )


def test_guesses_past_a_complete_grammar_under_ignore_eos_keep_solos_tokens(bundled64, grammars):
    """Greedy requests that ignore EOS, each proposer guessing: once the grammar is complete
    its EOS is all it allows, and a request goes on with EOS to its max_new_tokens exactly as
    solo does, its text the grammar's."""
    model, tok = bundled64
    reqs = [
        Request(tok.encode(p), 10, tok.eos_id, Sampling(ignore_eos=True, constraint=c))
        for p in ("Answer yes or no:", "Oph.\nMy lord,", "Ham.\n")
        for c in (YES_NO, CONSTRAINTS[3])
    ]
    for speculate in ("draft", "ngram"):
        eng = make_engine(model, 3, speculate=speculate, grammars=grammars)
        rids = [eng.add_request(r) for r in reqs]
        while eng.has_work():
            eng.step()
        for i, (r, rid) in enumerate(zip(reqs, rids)):
            want, got = solo(model, r, grammars=grammars), eng.results.pop(rid)
            assert got.tokens == want.tokens, (
                f"request {i} ({speculate}, {r.sampling.constraint.spec}): "
                f"{tok.decode(got.tokens, skip_special_tokens=False)!r}, "
                f"solo {tok.decode(want.tokens, skip_special_tokens=False)!r}"
            )
            if r.sampling.constraint == YES_NO:
                assert re.fullmatch("yes|no", tok.decode(got.tokens)), tok.decode(got.tokens)
                assert got.finish_reason == "length" and got.tokens[-1] == tok.eos_id


# ---- what llguidance takes and cannot enforce is refused up front --------------------------------
def string(pattern: str) -> dict:
    """A string schema with this pattern (a search: a match anywhere in the string)."""
    return {"type": "string", "pattern": pattern}


NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
}
REFUSED = [
    (Constraint("regex", "a{1000000}"), "llguidance fails on it while matching: lexer error"),
    (Constraint("regex", "x(a{1000000}|b)"), "too many expressions"),
    (Constraint("regex", "ab\\"), "ends in a lone backslash"),
    (Constraint("regex", "ab\\\\\\"), "ends in a lone backslash"),
    (Constraint.json_schema({"$ref": "#"}), "its $ref '#' always leads back to itself"),
    (
        Constraint.json_schema(
            {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
        ),
        "no finite JSON value matches it",
    ),
    (
        Constraint.json_schema(
            {"$defs": {"node": {**NODE, "required": ["next"]}}, "$ref": "#/$defs/node"}
        ),
        "'#/$defs/node' always leads back",
    ),
    (Constraint.json_schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1}), "'#'"),
    (  # a pattern is a search: the answer's first tokens never reach it
        Constraint.json_schema(string("a{1000000}")),
        "its pattern 'a{1000000}' is refused as a regular expression: llguidance fails on it",
    ),
    (
        Constraint.json_schema(
            {"type": "object", "properties": {"a": string("x(a{1000000}|b)")}, "required": ["a"]}
        ),
        "its pattern 'x(a{1000000}|b)' is refused",
    ),
    (Constraint.json_schema(string("ab\\")), "its pattern 'ab\\\\' is refused"),
]
TAKEN = [
    Constraint("regex", "ab\\\\"),  # an escaped backslash
    Constraint.json_schema(
        {"$defs": {"node": {**NODE, "required": ["v"]}}, "$ref": "#/$defs/node"}
    ),
    Constraint.json_schema({"type": "array", "items": {"$ref": "#"}}),  # [] ends it
    Constraint.json_schema(
        {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]}
    ),
    Constraint.json_schema(
        {"type": "object", "properties": {"a": string("[a-z]{3}")}, "required": ["a"]}
    ),
    Constraint.json_schema(string("^(Ham|Oph)\\. [a-z]{3}$")),
    Constraint.json_schema(  # a property named pattern, and examples: data, not patterns
        {"properties": {"pattern": string("[a-z]")}, "examples": [{"pattern": "a{1000000}"}]}
    ),
]


@pytest.mark.parametrize("c, says", REFUSED)
def test_a_constraint_llguidance_cannot_enforce_is_refused_up_front(bundled64, grammars, c, says):
    """A regex llguidance fails on while matching, one that ends in a lone backslash, a
    schema no finite value matches (a $ref that always leads back to itself) and a schema
    with a pattern refused as a regex are refused by the check, with why, and by the engine;
    nothing of them is kept."""
    model, tok = bundled64
    why = grammars.check(c)
    assert why is not None and says in why, f"{c.spec}: check says {why!r}, not {says!r}"
    eng = make_engine(model, 2, grammars=grammars)
    with pytest.raises(ValueError, match="constraint: the .* is refused"):
        eng.add_request(Request(tok.encode("Ham.\n"), 8, sampling=Sampling(constraint=c)))
    assert c not in grammars.compiled and not eng.has_work()


@pytest.mark.parametrize("c", TAKEN)
def test_recursive_schemas_with_an_end_escaped_backslashes_and_sound_patterns_are_taken(
    bundled64, grammars, c
):
    """A $ref back to itself that a value may leave out, an escaped backslash and a schema's
    sound pattern are taken: the solo answer of each matches it."""
    model, tok = bundled64
    assert grammars.check(c) is None, f"{c.spec} is refused: {grammars.check(c)}"
    r = solo(
        model,
        Request(tok.encode("Ham.\n"), 40, tok.eos_id, Sampling(constraint=c)),
        grammars=grammars,
    )
    if r.finish_reason == "stop" and c.kind == "json_schema":
        jsonschema.validate(json.loads(tok.decode(r.tokens)), json.loads(c.spec))


def test_a_matcher_llguidance_fails_on_mid_answer_allows_eos_alone(bundled64, grammars):
    """x(b|c{1000000}) passes the check (its first tokens match), and llguidance fails on it
    after a few 'cc', on a grammar compiled for that matcher alone: the matcher says so and
    allows EOS alone; rolled back over the token it failed on, it is the matcher it was; the
    next request's matcher is a fresh one."""
    model, tok = bundled64
    V, c = model.cfg.vocab_size, Constraint("regex", "x(b|c{1000000})")
    assert grammars.check(c) is None
    m = grammars.matcher(c)
    x, cc = grammars.llt.tokenize_str("x")[0], grammars.llt.tokenize_str("cc")[0]
    assert allowed(m, V) == [x] and m.consume(x)
    for n in range(1, 8):  # as an engine does: a mask, then a token
        before = allowed(m, V)
        assert m.consume(cc)
        if m.is_error():
            break
    assert m.is_error() and "too many expressions" in m.error(), f"no failure after {n} 'cc'"
    assert allowed(m, V) == [tok.eos_id], "a matcher in error allows EOS alone"
    assert not m.consume(cc), "a matcher in error takes no more text"
    assert m.consume(tok.eos_id) and m.consume(tok.eos_id)
    m.rollback(3)
    assert not m.is_error() and allowed(m, V) == before
    assert allowed(grammars.matcher(c), V) == [x], "the next matcher is not a fresh one"


def test_after_an_eos_both_backends_allow_eos_alone(bundled64, grammars):
    """[0-9]{1,3} after "1" and EOS: llguidance's matcher and a hand-written automaton's both
    allow EOS alone (a request that ignores EOS goes on with EOS, its text the grammar's), and
    rolled back over the EOS both allow digits again."""
    model, tok = bundled64
    V, c = model.cfg.vocab_size, Constraint("regex", "[0-9]{1,3}")
    hand = DFAGrammars(tok, V, {c: DFA.sequence(("0123456789", 1, 3))})
    one = grammars.llt.tokenize_str("1")[0]
    for m in (grammars.matcher(c), hand.matcher(c)):
        assert m.consume(one) and m.consume(tok.eos_id) and m.consume(tok.eos_id)
        assert allowed(m, V) == [tok.eos_id], f"{type(m).__name__}: more than EOS after an EOS"
        assert not m.consume(one), f"{type(m).__name__}: a digit after an EOS"
        m.rollback(2)
        assert one in allowed(m, V) and tok.eos_id in allowed(m, V), type(m).__name__
