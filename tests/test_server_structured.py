"""Step 12 - structured output through the server, with the official `openai` client: OpenAI's
response_format (json_schema, json_object), vLLM's structured_outputs and its legacy guided_*
fields. Every constrained answer matches its constraint and ends with it ("stop"), streamed or
not, and is token for token the engine's solo run under the same grammar; a constraint the
backend refuses (one it could not enforce too), two constraints in one body, another backend or
a whitespace pattern get a 400 naming the field, before anything reaches the engine. SmolLM2
answers a JSON request in its schema."""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from tests.test_server import NAME, Running
from tests.test_server_api import post, refused
from tests.test_structured import PERSON  # closed and bounded: the bundled model ends it
from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.ext.structured import Constraint, LLGuidance
from tinyllm.serving import api

pytestmark = pytest.mark.slow  # servers, each with its engine process

AS_PERSON = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Who art thou?"}]
ENDLESS = {  # every node holds the next one: no finite JSON value matches it
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
        }
    },
    "$ref": "#/$defs/node",
}
PROMPT = "Ham.\n"
LINE = r"(Ham|Oph)\. [a-z ]{3,20}\."
CHOICES = ["yes", "no", 'say "aye"']
ENDPOINTS = ("chat", "completions")


@pytest.fixture(scope="module")
def grammars(bundled64):
    model, tok = bundled64
    return LLGuidance(tok, model.cfg.vocab_size)


@pytest.fixture(scope="module")
def running(bundled64, grammars):
    model, tok = bundled64
    srv = Running(make_engine(model, 4, grammars=grammars), tok)
    yield srv
    srv.stop()


def ask(running, endpoint: str, max_tokens: int = 60, **kw) -> SimpleNamespace:
    """One answer's choice by the openai client (its text, finish_reason, logprobs and the
    usage): chat on MESSAGES (response_format as the client's own argument), completions on
    PROMPT (response_format in the body: the client has no argument for it there)."""
    cl, extra = running.client(), kw.pop("extra_body", {})
    if endpoint == "chat":
        r = cl.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=max_tokens, extra_body=extra, **kw
        )
        text = r.choices[0].message.content
    else:
        if "response_format" in kw:
            extra = {**extra, "response_format": kw.pop("response_format")}
        r = cl.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=max_tokens, extra_body=extra, **kw
        )
        text = r.choices[0].text
    c = r.choices[0]
    return SimpleNamespace(
        text=text, finish_reason=c.finish_reason, logprobs=c.logprobs, usage=r.usage
    )


def each_seed(running, endpoint: str, seeds=range(10), **kw) -> list:
    """The answers of these seeds, sampled (temperature 1), asked at once."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(
            pool.map(lambda s: ask(running, endpoint, seed=s, temperature=1.0, **kw), seeds)
        )


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_json_schema_answers_validate_for_every_seed(running, endpoint):
    """response_format json_schema, 10 seeds sampled: every answer is JSON the schema accepts,
    ended by its grammar ("stop"), its properties in the schema's order."""
    for choice in each_seed(running, endpoint, response_format=AS_PERSON):
        assert choice.finish_reason == "stop", choice.text
        answer = json.loads(choice.text)
        jsonschema.validate(answer, PERSON)
        assert list(answer) == ["name", "age"], choice.text
    assert running.wait_idle() == (0, 0)


def one_pair(tok) -> dict:
    """A logit_bias that ends the bundled model's JSON object after one pair: it writes pairs
    for ever, so no comma (',' and ',--' are the tokens that hold one), and shorter strings (a
    '"' likelier). The grammar's mask and the bias act together."""
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    return {**{str(i): -100 for s, i in vocab.items() if "," in s}, str(vocab['"']): 4}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_json_object_answers_parse_as_objects(running, endpoint):
    for choice in each_seed(
        running,
        endpoint,
        range(4),
        response_format={"type": "json_object"},
        logit_bias=one_pair(running.tok),
    ):
        assert choice.finish_reason == "stop", choice.text
        assert isinstance(json.loads(choice.text), dict), choice.text


def test_a_streamed_constrained_answer_validates_and_is_the_collected_one(running):
    """Streamed, the joined text of each seed's answer validates and is its collected one; so
    are n choices' (each its own matcher), and a completion's JSON object."""
    cl = running.client()
    for seed in range(3):
        kw = dict(model=NAME, messages=MESSAGES, max_tokens=60, seed=seed, temperature=1.0)
        plain = cl.chat.completions.create(**kw, response_format=AS_PERSON).choices[0]
        chunks = list(cl.chat.completions.create(**kw, response_format=AS_PERSON, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), PERSON)
        assert text == plain.message.content and chunks[-1].choices[0].finish_reason == "stop"
    kw = dict(kw, n=3, response_format=AS_PERSON)
    plain = [c.message.content for c in cl.chat.completions.create(**kw).choices]
    texts = ["", "", ""]
    for chunk in cl.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == plain
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    stream = cl.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=60,
        stream=True,
        logit_bias=one_pair(running.tok),
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads("".join(c.choices[0].text for c in stream)), dict)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_vllms_structured_outputs_regex_choice_and_grammar(running, endpoint):
    for choice in each_seed(
        running, endpoint, range(4), extra_body={"structured_outputs": {"regex": LINE}}
    ):
        assert re.fullmatch(LINE, choice.text) and choice.finish_reason == "stop", choice.text
    for choice in each_seed(
        running, endpoint, range(4), extra_body={"structured_outputs": {"choice": CHOICES}}
    ):
        assert choice.text in CHOICES and choice.finish_reason == "stop", choice.text
    lark = 'start: "Ay, " NUM " lords"\nNUM: /[0-9]{1,2}/'
    gbnf = 'root ::= "Ay, " [0-9] [0-9]? " lords"'  # llama.cpp's GBNF, as vLLM's xgrammar reads
    for grammar in (lark, gbnf):
        body = {"structured_outputs": {"grammar": grammar, "disable_fallback": True}}
        choice = ask(running, endpoint, extra_body=body, seed=1, temperature=1.0)
        assert re.fullmatch(r"Ay, [0-9]{1,2} lords", choice.text), choice.text


def test_vllms_legacy_guided_fields(running):
    """guided_json (a schema, or its JSON text), guided_regex, guided_choice and
    guided_grammar, with guided_decoding_backend naming this server's backend (or auto)."""
    for schema in (PERSON, json.dumps(PERSON)):
        body = {"guided_json": schema, "guided_decoding_backend": "guidance"}
        for choice in each_seed(running, "chat", range(4), extra_body=body):
            jsonschema.validate(json.loads(choice.text), PERSON)
    body = {
        "guided_regex": LINE,
        "guided_decoding_backend": "auto",
        "guided_whitespace_pattern": None,
    }
    assert re.fullmatch(LINE, ask(running, "completions", extra_body=body).text)
    body = {"guided_choice": CHOICES, "guided_decoding_backend": "llguidance"}
    assert ask(running, "chat", extra_body=body).text in CHOICES
    body = {"guided_grammar": 'start: "fie" | "foh"'}
    assert ask(running, "completions", extra_body=body).text in ("fie", "foh")


def chat_body(**fields) -> dict:
    return {"model": NAME, "messages": MESSAGES, "max_tokens": 8, **fields}


@pytest.mark.parametrize(
    "fields, param, says",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "objectz"}},
                }
            },
            "response_format",
            "the JSON schema is refused: Invalid type: objectz",
        ),
        ({"guided_json": {"type": "objectz"}}, "guided_json", "Invalid type: objectz"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "unclosed group"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "neither Lark nor GBNF"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"response_format": {"type": "json_schema"}}, "response_format", '"schema"'),
        ({"response_format": {"type": "structural_tag"}}, "response_format", '"json_schema"'),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "unknown"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs", "unknown field"),
        # taken by llguidance and not enforced: refused up front
        ({"guided_regex": "a{1000000}"}, "guided_regex", "fails on it while matching"),
        ({"structured_outputs": {"regex": "ab\\"}}, "structured_outputs", "lone backslash"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": ENDLESS}}},
            "response_format",
            "the JSON schema is refused: no finite JSON value matches it",
        ),
        ({"guided_json": {"$ref": "#"}}, "guided_json", "always leads back to itself"),
    ],
)
def test_a_constraint_the_server_refuses_gets_a_400_naming_the_field(running, fields, param, says):
    """A schema, regex or grammar the backend refuses (its sentence quoted), one it would take
    and not enforce (a regex llguidance fails on, one ending in a lone backslash, a schema no
    finite value matches), or a value that is no constraint, is refused before the engine
    sees it."""
    error = refused(post(running, "/v1/chat/completions", chat_body(**fields)))
    assert error["param"] == param and says in error["message"], error
    assert running.request_counts() == (0, 0)


TAKES_ONE = "a request takes one"
BACKENDS = 'takes only "auto" or "guidance" or "llguidance"'


@pytest.mark.parametrize(
    "fields, param, says",
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            TAKES_ONE,
        ),
        ({"guided_json": PERSON, "guided_choice": ["a"]}, "guided_choice", TAKES_ONE),
        ({"structured_outputs": {"json": PERSON, "regex": "a+"}}, "structured_outputs", TAKES_ONE),
        (
            {"guided_decoding_backend": "xgrammar", "guided_json": PERSON},
            "guided_decoding_backend",
            BACKENDS,
        ),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", BACKENDS),
        (
            {"guided_whitespace_pattern": r"[\n ]*", "guided_json": PERSON},
            "guided_whitespace_pattern",
            "a whitespace pattern",
        ),
        (
            {"structured_outputs": {"json": PERSON, "disable_additional_properties": True}},
            "structured_outputs.disable_additional_properties",
            "additionalProperties",
        ),
        ({"guided_json": PERSON, "min_tokens": 4}, "min_tokens", "grammar says where"),
    ],
)
def test_two_constraints_another_backend_or_a_whitespace_pattern_get_a_400(
    running, fields, param, says
):
    """Two constraints in one body, a backend other than this one (vLLM's names: xgrammar,
    outlines), a whitespace pattern, or min_tokens (a grammar ends the answer where it is
    complete) get a 400 naming the field."""
    error = refused(post(running, "/v1/chat/completions", chat_body(**fields)))
    assert error["param"] == param and says in error["message"], error
    assert running.request_counts() == (0, 0)


def test_a_server_without_a_grammar_backend_refuses_a_constraint():
    with pytest.raises(api.APIError) as e:
        api.check_constraint(None, "response_format", Constraint("json_object"))
    assert e.value.param == "response_format" and "no grammar backend" in e.value.message
    assert api.constraint_of({"response_format": {"type": "text"}}) is None


ORACLE = [
    ({"response_format": AS_PERSON}, Constraint("json_schema", json.dumps(PERSON))),
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"structured_outputs": {"regex": LINE}}, Constraint("regex", LINE)),
    ({"guided_choice": CHOICES}, Constraint("lark", 'start: "yes" | "no" | "say \\"aye\\""')),
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("fields, constraint", ORACLE)
def test_a_constrained_answer_is_solos_masked_run(running, grammars, endpoint, fields, constraint):
    """Greedy, each constraint on each endpoint: the answer's tokens (as its logprobs spell
    them), text, count and finish_reason are those of the engine's solo oracle under the same
    grammar."""
    model, tok = running.engine.model, running.tok
    ids = (
        tok.apply_chat_template(MESSAGES, tokenize=True)
        if endpoint == "chat"
        else tok.encode(PROMPT)
    )
    sampling = Sampling(logprobs=0, constraint=constraint)
    want = solo(model, Request(ids, 60, tok.eos_ids or None, sampling), grammars=grammars)
    logprobs = {"logprobs": True} if endpoint == "chat" else {"logprobs": 0}
    choice = ask(running, endpoint, temperature=0, extra_body=fields, **logprobs)
    spelled = [tok.decode([t], skip_special_tokens=False) for t in want.tokens]
    got = (
        [e.token for e in choice.logprobs.content] if endpoint == "chat" else choice.logprobs.tokens
    )
    assert got == spelled
    assert choice.text == tok.decode(want.tokens) and choice.finish_reason == want.finish_reason
    assert choice.usage.completion_tokens == len(want.tokens)


# ---- the real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    return smollm2_model


def test_smollm2_answers_a_json_request_in_its_schema(smollm2):
    """SmolLM2-135M-Instruct, asked for a name and an age in a schema, greedy and sampled:
    its answer validates, its grammar ending it ("stop")."""
    model, tok = smollm2
    schema = {
        **PERSON,
        "properties": {**PERSON["properties"], "name": {"type": "string", "maxLength": 20}},
    }
    srv = Running(make_engine(model, 2, grammars=LLGuidance(tok, model.cfg.vocab_size)), tok)
    try:
        as_person = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
        for temperature in (0.0, 0.7):
            r = srv.client().chat.completions.create(
                model=NAME,
                messages=[
                    {"role": "user", "content": "Give me a JSON object with a name and an age"}
                ],
                response_format=as_person,
                temperature=temperature,
                seed=0,
                max_tokens=60,
            )
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            assert r.choices[0].finish_reason == "stop"
    finally:
        srv.stop()


def test_the_readme_says_how_to_bound_an_answer_and_how_make_eval_agrees():
    """The README's server section says why the openai client's parse(response_format=Model)
    often ends in LengthFinishReasonError on SmolLM2 (a string without maxLength) and what to
    give, and that lm-eval through the server equals its hf model only with add_bos_token=True
    on both."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    server = readme[readme.index("The server speaks the OpenAI API") : readme.index("With conda")]
    for said in ("LengthFinishReasonError", "`maxLength`", "`max_tokens`", "`make eval`"):
        assert said in server, f"the server section does not say {said}"
    assert "`add_bos_token=True` in each one's" in server
