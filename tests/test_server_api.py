"""Step 10 - the server speaks the API real clients send: every field OpenAI's and vLLM's APIs
define is taken where its value changes nothing and refused (a 400 naming it) where it would
ask for what the server does not do; chat content as text parts; /tokenize and /detokenize as
vLLM has them; vLLM's benchmark client's exact bodies; the faults a hostile body found: a
huge body or prompt, a lone surrogate, JSON nested deep, while /health stays fast; and bodies
drawn at random, each answered or refused, none leaving anything behind."""

import json
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.test_server import NAME, PROMPTS, Running, solo_text
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.generate import generate
from tinyllm.serving import api

pytestmark = pytest.mark.slow  # servers, each with its engine process


@pytest.fixture(scope="module")
def running(bundled64):
    model, tok = bundled64
    srv = Running(make_engine(model, 4), tok)
    yield srv
    srv.stop()


def post(running, path: str, body, **kw) -> httpx.Response:
    """POST a body (bytes as they are, else its JSON) to the server's root + path."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        running.url[:-3] + path,
        content=content,
        timeout=60,
        headers={"content-type": "application/json"},
        **kw,
    )


def refused(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI-style error of a refused request."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()["error"]


def sse_chunks(text: str) -> list:
    """A stream's events as vLLM's benchmark client reads them: split at blank lines, each
    `data: ` and its JSON, the last [DONE]."""
    messages = [m.strip() for m in text.split("\n\n") if m.strip()]
    assert messages[-1] == "data: [DONE]", messages[-1]
    return [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]


# ---- fields that change nothing, and those that would ------------------------------------------
NO_OP_COMPLETION = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logprobs": None,
    "echo": False,
    "n": 1,
    "best_of": 1,
    "logit_bias": {},
    "min_p": 0,
    "min_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": [],
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "suffix": None,
    "user": "ada",
    "seed": 3,
    "top_k": -1,
    "response_format": {"type": "text"},
    "use_beam_search": False,
    "length_penalty": 1,
    "bad_words": [],
    "priority": 0,
    "request_id": "r-1",
    "add_special_tokens": True,
    "top_p": 1.0,
}
NO_OP_CHAT = {
    "repetition_penalty": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logprobs": False,
    "top_logprobs": 0,
    "n": 1,
    "logit_bias": None,
    "min_p": 0.0,
    "user": "ada",
    "metadata": {"run": "7"},
    "store": False,
    "parallel_tool_calls": True,
    "response_format": {"type": "text"},
    "service_tier": "auto",
    "seed": 3,
    "tools": [],
    "tool_choice": "none",
    "modalities": ["text"],
    "top_k": 0,
    "chat_template_kwargs": {},
    "add_generation_prompt": True,
    "continue_final_message": False,
    "include_reasoning": True,
    "skip_special_tokens": True,
}


def test_fields_that_change_nothing_are_taken_and_change_nothing(running):
    """A body with every field a client sends at its default gets the answer it gets alone."""
    cl = running.client()
    expected = solo_text(running, PROMPTS[0], 12)
    r = cl.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body=NO_OP_COMPLETION
    )
    assert r.choices[0].text == expected
    messages = [{"role": "user", "content": "Who art thou?"}]
    plain = cl.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    stream = cl.chat.completions.create(
        model=NAME,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_OP_CHAT,
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == plain.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert running.wait_idle() == (0, 0)


def test_every_no_op_of_the_table_is_taken():
    """Each field of api.NO_OPS, at each value the table says changes nothing, passes
    check_body on each endpoint that knows it (a type: a value of that type)."""
    sample = {str: "x", dict: {}, bool: True}
    for name, (endpoints, noop, _) in api.NO_OPS.items():
        for value in (sample[noop],) if isinstance(noop, type) else (*noop, None):
            for kind in endpoints & api.GENERATE:
                need = {"prompt": "x"} if kind == "completions" else {"messages": []}
                assert api.check_body({**need, name: value}, kind), (name, value, kind)


@pytest.mark.parametrize(
    "kind, field, value",
    [
        ("completions", "skip_special_tokens", False),
        ("completions", "suffix", "end"),
        ("completions", "best_of", 2),
        ("completions", "response_format", {"type": "yaml"}),
        ("chat", "echo", True),
        ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("chat", "tool_choice", "required"),
        ("chat", "modalities", ["text", "audio"]),
        ("chat", "response_format", {"type": "json_schema", "json_schema": []}),
        ("chat", "user", 7),
        ("chat", "chat_template", "{{ messages }}"),
        ("chat", "best_of", 1),
        ("completions", "use_beam_search", True),
        ("completions", "allowed_token_ids", [1, 2]),
        ("completions", "bad_words", ["fie"]),
        ("chat", "guided_json", 7),
        ("chat", "guided_decoding_backend", "xgrammar"),
        ("chat", "logits_processors", ["m.f"]),
        ("chat", "prompt_embeds", "AAAA"),
        ("completions", "return_tokens_as_token_ids", True),
        ("completions", "top_logprobs", 2),
        ("completions", "max_completion_tokens", 5),
        ("completions", "wizardry", 1),
    ],
)
def test_a_field_that_would_change_the_answer_gets_a_400_naming_it(running, kind, field, value):
    body = {
        "model": NAME,
        "max_tokens": 4,
        field: value,
        **(
            {"prompt": PROMPTS[0]}
            if kind == "completions"
            else {"messages": [{"role": "user", "content": "Hi"}]}
        ),
    }
    error = refused(
        post(running, "/v1/completions" if kind == "completions" else "/v1/chat/completions", body)
    )
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert (
        "not supported" in error["message"]
        or "wrong type" in error["message"]
        or "unknown field" in error["message"]
    ), error["message"]
    assert running.request_counts() == (0, 0)


def test_a_constraint_to_a_server_without_a_grammar_backend_gets_a_400(running):
    """This server's engine has no grammar backend (`python -m tinyllm serve` gives it one):
    a constrained request is refused, naming the field that asks for it."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4}
    for field, value in [("response_format", {"type": "json_object"}), ("guided_regex", "a+")]:
        error = refused(post(running, "/v1/completions", {**body, field: value}))
        assert error["param"] == field and "no grammar backend" in error["message"], error
    assert running.request_counts() == (0, 0)


def test_stream_options_need_stream_and_max_completion_tokens_0_is_refused(running):
    """vLLM refuses stream_options without stream: true; OpenAI refuses max_completion_tokens
    below 1 (it was taken as 'not given')."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]}
    error = refused(
        post(running, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    )
    assert error["param"] == "stream_options" and "stream: true" in error["message"]
    error = refused(
        post(
            running,
            "/v1/completions",
            {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
        )
    )
    assert error["param"] == "stream_options"
    error = refused(
        post(running, "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"x": 1}})
    )
    assert error["param"] == "stream_options"
    error = refused(
        post(
            running,
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
        )
    )
    assert error["param"] == "stream_options.continuous_usage_stats"
    with pytest.raises(openai.BadRequestError) as e:
        running.client().chat.completions.create(
            model=NAME, max_completion_tokens=0, messages=chat["messages"]
        )
    assert e.value.body["param"] == "max_completion_tokens"
    assert "at least 1" in e.value.body["message"]


def test_ignore_eos_runs_to_max_tokens_as_solo_without_eos(running):
    """ignore_eos (vLLM's, which its benchmark sends) generates past EOS, as solo generate
    with no eos_id does."""
    model, tok = running.engine.model, running.tok
    ids = tok.encode(PROMPTS[5])
    expected = generate(model, ids, 60, eos_id=None)
    r = running.client().completions.create(
        model=NAME, prompt=PROMPTS[5], max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == tok.decode(expected)


# ---- chat content as parts -------------------------------------------------------------------
def test_chat_content_as_text_parts_is_joined_with_newlines(running):
    cl = running.client()
    parts = [{"type": "text", "text": "Who art"}, {"type": "text", "text": "thou?"}]
    as_parts = cl.chat.completions.create(
        model=NAME,
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "Speak as a king."}]},
            {"role": "user", "content": parts},
        ],
    )
    as_text = cl.chat.completions.create(
        model=NAME,
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "system", "content": "Speak as a king."},
            {"role": "user", "content": "Who art\nthou?"},
        ],
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "text", "text": 5},
        "just a string",
    ],
)
def test_a_part_that_is_not_text_gets_a_400_naming_the_content(running, part):
    body = {
        "model": NAME,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": "Speak."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]},
        ],
    }
    error = refused(post(running, "/v1/chat/completions", body))
    assert error["param"] == "messages[1].content", error


# ---- /tokenize and /detokenize ---------------------------------------------------------------
def test_tokenize_and_detokenize_as_vllm_has_them(running):
    tok = running.tok
    r = post(running, "/tokenize", {"model": NAME, "prompt": PROMPTS[0]})
    assert r.status_code == 200 and r.json() == {
        "count": len(tok.encode(PROMPTS[0])),
        "max_model_len": running.served.max_len,
        "tokens": tok.encode(PROMPTS[0]),
        "token_strs": None,
    }
    bare = post(
        running,
        "/tokenize",
        {"prompt": PROMPTS[0], "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert bare["tokens"] == tok.encode(PROMPTS[0], add_special_tokens=False)
    assert bare["token_strs"] == [tok.id_to_token(t) for t in bare["tokens"]]
    messages = [{"role": "user", "content": "Who art thou?"}]
    chat = post(running, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, tokenize=True)
    no_prompt = post(
        running, "/tokenize", {"messages": messages, "add_generation_prompt": False}
    ).json()
    assert no_prompt["tokens"] == tok.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True
    )
    r = post(running, "/detokenize", {"model": NAME, "tokens": chat["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(chat["tokens"], False)}
    assert (
        refused(post(running, "/detokenize", {"tokens": [1, tok.vocab_size]}))["param"] == "tokens"
    )
    assert refused(post(running, "/detokenize", {"tokens": [1, -1]}))["param"] == "tokens"
    assert refused(post(running, "/detokenize", {"tokens": ["a"]}))["param"] == "tokens"
    assert refused(post(running, "/tokenize", {"prompt": "x", "messages": messages}))
    assert refused(post(running, "/tokenize", {}))["param"] == "prompt"
    assert refused(post(running, "/tokenize", {"prompt": [1, 2]}))["param"] == "prompt"
    assert refused(post(running, "/tokenize", {"prompt": "x", "model": "gpt-9"}), 404)


# ---- vLLM's benchmark client -----------------------------------------------------------------
def vllm_bench_bodies(prompt: str, n: int) -> dict:
    """The bodies `vllm bench serve` sends (vllm/benchmarks/lib/endpoint_request_func.py): its
    openai backend (completions) and its openai-chat backend."""
    return {
        "/v1/completions": {
            "model": NAME,
            "prompt": prompt,
            "repetition_penalty": 1.0,
            "max_tokens": n,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "/v1/chat/completions": {
            "model": NAME,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": n,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    }


def stream_of(running, path: str, body: dict) -> tuple[str, dict]:
    """A streamed answer's text and usage, read as vLLM's benchmark client reads them."""
    r = post(running, path, body)
    assert r.status_code == 200, r.text
    text, usage = "", None
    for chunk in sse_chunks(r.text):
        if choices := chunk.get("choices"):
            text += (
                choices[0].get("text")
                if path == "/v1/completions"
                else choices[0]["delta"].get("content")
            ) or ""
        elif chunk.get("usage"):
            usage = chunk["usage"]
    return text, usage


def test_vllm_bench_serve_bodies_get_their_streams_and_usage(running):
    """Its exact bodies (sampled, as it sends no temperature; with --ignore-eos; with
    --temperature 0 in extra_body, compared with solo) stream their text and its usage."""
    tok = running.tok
    for path, body in vllm_bench_bodies(PROMPTS[1], 20).items():
        text, usage = stream_of(running, path, body)
        prompt_ids = (
            tok.encode(PROMPTS[1])
            if path == "/v1/completions"
            else tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], tokenize=True)
        )
        assert usage["prompt_tokens"] == len(prompt_ids), path
        assert (
            1 <= usage["completion_tokens"] <= 20
            and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        ), usage
        text, usage = stream_of(running, path, {**body, "ignore_eos": True})
        assert usage["completion_tokens"] == 20, (path, usage)
        text, usage = stream_of(running, path, {**body, "temperature": 0.0})
        expected = generate(running.engine.model, prompt_ids, 20, eos_id=tok.eos_id)
        assert text == tok.decode(expected) and usage["completion_tokens"] == len(expected), path
    assert running.wait_idle() == (0, 0)


# ---- guidellm -------------------------------------------------------------------------------
def guidellm_bodies(prompt: str, n: int) -> dict:
    """The bodies guidellm 0.8.1 sends (guidellm/backends/openai/request_handlers.py) for a
    streamed request of n output tokens: usage in every chunk, and exactly n tokens."""
    usage = {"include_usage": True, "continuous_usage_stats": True}
    common = {"model": NAME, "stream": True, "stream_options": usage, "stop": None}
    return {
        "/v1/completions": {**common, "max_tokens": n, "ignore_eos": True, "prompt": prompt},
        "/v1/chat/completions": {
            **common,
            "max_completion_tokens": n,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        },
    }


def test_guidellm_bodies_get_the_usage_in_every_chunk(running):
    """With stream_options' continuous_usage_stats (guidellm sends it on every streamed
    request), every chunk carries the usage so far, as vLLM's do: the prompt's tokens and the
    choice's tokens (0 in chat's role chunk), then the usage-only chunk of the totals; the text
    is the stream's without it."""
    tok = running.tok
    for path, body in guidellm_bodies(PROMPTS[1], 12).items():
        r = post(running, path, {**body, "temperature": 0})
        assert r.status_code == 200, (path, r.text[:300])
        chunks = sse_chunks(r.text)
        assert all("usage" in c for c in chunks), f"{path}: a chunk without its usage"
        *content, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12, last
        prompt = last["usage"]["prompt_tokens"]
        for c in chunks:
            u = c["usage"]
            assert u["prompt_tokens"] == prompt, (path, c)
            assert u["total_tokens"] == prompt + u["completion_tokens"], (path, c)
        counts = [c["usage"]["completion_tokens"] for c in content]
        assert counts == sorted(counts) and counts[-1] == 12, (path, counts)
        if path == "/v1/chat/completions":
            assert counts[0] == 0 and content[0]["choices"][0]["delta"]["role"] == "assistant"
        plain = {**body, "temperature": 0, "stream_options": {"include_usage": True}}
        text, usage = stream_of(running, path, plain)
        assert stream_of(running, path, {**body, "temperature": 0}) == (text, usage), path
        assert "usage" not in sse_chunks(post(running, path, plain).text)[0], path
    chat = [{"role": "user", "content": PROMPTS[1]}]
    assert prompt == len(tok.apply_chat_template(chat, tokenize=True))
    assert running.wait_idle() == (0, 0)


def test_continuous_usage_counts_each_choice_and_needs_include_usage(running):
    """Each choice's chunks count that choice's tokens (n choices, logprobs: the general
    stream); continuous_usage_stats without include_usage is taken and changes nothing, as
    vLLM takes it."""
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 8, "ignore_eos": True}
    body |= {"stream": True, "n": 2, "seed": 5, "logprobs": 1}
    every = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_chunks(post(running, "/v1/completions", {**body, "stream_options": every}).text)
    seen = {0: [], 1: []}
    for c in chunks[:-1]:
        seen[c["choices"][0]["index"]].append(c["usage"]["completion_tokens"])
    assert all(v == sorted(v) and v[-1] == 8 for v in seen.values()), seen
    assert chunks[-1]["usage"]["completion_tokens"] == 16, chunks[-1]
    alone = {"continuous_usage_stats": True}
    chunks = sse_chunks(post(running, "/v1/completions", {**body, "stream_options": alone}).text)
    assert not any("usage" in c for c in chunks), chunks[0]
    assert running.wait_idle() == (0, 0)


# ---- the faults a hostile body found ---------------------------------------------------------
class HealthWatch:
    """/health polled from a thread while it runs: the latency of each answer."""

    def __init__(self, running):
        self.url, self.latencies, self.done = running.url[:-3] + "/health", [], threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def poll(self):
        while not self.done.is_set():  # a new connection each time, as curl
            t0 = time.perf_counter()
            assert httpx.get(self.url, timeout=60).status_code == 200
            self.latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(60)


def test_a_10_mb_body_is_refused_while_health_stays_fast(running):
    """A 10 MB prompt is refused with a 413 (its Content-Length, or a chunked body read a chunk
    at a time), and /health answers at once meanwhile (it froze 141 s)."""
    big = json.dumps({"model": NAME, "prompt": "To be, or not " * 750_000}).encode()
    assert len(big) > 10_000_000
    with HealthWatch(running) as watch:
        time.sleep(0.1)
        error = refused(post(running, "/v1/completions", big), 413)
        assert "the most this server reads" in error["message"]
        chunks = (big[i : i + 2**16] for i in range(0, len(big), 2**16))
        r = httpx.post(running.url + "/completions", content=chunks, timeout=60)
        assert refused(r, 413)["type"] == "invalid_request_error"
        time.sleep(0.1)
    print(
        f"/health during the 10 MB requests: {len(watch.latencies)} answers, slowest "
        f"{max(watch.latencies) * 1000:.0f} ms"
    )
    assert len(watch.latencies) >= 3 and max(watch.latencies) < 1.0, watch.latencies


class Tokenizer:
    """The bundled tokenizer, but recording each text it encodes (and taking `slow` seconds to
    encode one, as a long prompt takes), and failing when told to."""

    def __init__(self, tok, slow: float = 0.0, fail: bool = False):
        self.tok_, self.slow, self.fail, self.lengths = tok, slow, fail, []

    def __getattr__(self, name):
        return getattr(self.tok_, name)

    def encode_batch(self, texts, add_special_tokens=True):
        self.lengths += [len(t) for t in texts]
        if self.fail:
            raise RuntimeError("the tokenizer broke")
        time.sleep(self.slow)
        return self.tok_.encode_batch(texts, add_special_tokens=add_special_tokens)


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(running, monkeypatch):
    tok = Tokenizer(running.tok)
    monkeypatch.setattr(running.served, "tok", tok)
    longest = api.longest_token_chars(running.tok)
    n = running.served.max_len * longest + 1
    error = refused(post(running, "/v1/completions", {"prompt": "a" * n, "max_tokens": 1}))
    assert error["param"] == "prompt" and "cannot fit" in error["message"], error
    error = refused(
        post(
            running,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * n}]}]},
        )
    )
    assert error["param"] == "messages" and "cannot fit" in error["message"], error
    assert tok.lengths == [], "the long prompts were tokenized before they were refused"
    text = "a" * (n - 1)  # may fit by its size: it is tokenized
    refused(post(running, "/v1/completions", {"prompt": text, "max_tokens": 1}))
    assert tok.lengths == [n - 1]


def test_tokenizing_runs_off_the_event_loop(running, monkeypatch):
    """While a prompt takes 1.5 s to tokenize, /health answers at once."""
    monkeypatch.setattr(running.served, "tok", Tokenizer(running.tok, slow=1.5))
    with HealthWatch(running) as watch:
        r = running.client().completions.create(
            model=NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0
        )
    assert r.choices[0].text == solo_text(running, PROMPTS[2], 5)
    # a liveness bound, not a speed claim: on the event loop the 1.5 s would stall every answer
    assert len(watch.latencies) >= 5 and max(watch.latencies) < 1.0, watch.latencies


def test_health_answers_while_a_long_prompt_is_counted(running):
    """/tokenize counts a prompt of any size: the real tokenizer takes seconds on 2 MB, in a
    thread, and lets go of Python's lock meanwhile, so /health answers at once."""
    text = "To be, or not " * 150_000
    with HealthWatch(running) as watch:
        r = post(running, "/tokenize", {"prompt": text})
    assert r.status_code == 200 and r.json()["count"] == len(running.tok.encode(text))
    print(
        f"/health while 2 MB is tokenized: {len(watch.latencies)} answers, slowest "
        f"{max(watch.latencies) * 1000:.0f} ms"
    )
    # a liveness bound: holding Python's lock, the tokenizer stalled /health for over 2 s here
    assert len(watch.latencies) >= 5 and max(watch.latencies) < 1.0, watch.latencies


def test_a_lone_surrogate_gets_a_400_naming_the_field(running):
    """ "\\ud800" is valid JSON but no text: it gave a plain-text 500 and a dropped
    connection."""
    lone = b'"To be \\ud800 or not"'
    for path, body, param in [
        ("/v1/completions", b'{"prompt": %s}' % lone, "prompt"),
        ("/v1/completions", b'{"prompt": [%s]}' % lone, "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": %s}]}' % lone,
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "Hi"}, '
            b'{"role": "user", "content": [{"type": "text", "text": %s}]}]}' % lone,
            "messages[1].content",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": %s, "content": "Hi"}]}' % lone,
            "messages[0].role",
        ),
        ("/tokenize", b'{"prompt": %s}' % lone, "prompt"),
    ]:
        error = refused(post(running, path, body))
        assert error["param"] == param and "surrogate" in error["message"], (body, error)
    error = refused(post(running, "/v1/completions", b'{"prompt": "x", "model": %s}' % lone), 404)
    assert "\\ud800" in error["message"]


def test_json_nested_too_deep_gets_a_400(running):
    """A body of arrays 100,000 deep gave a 500 (RecursionError)."""
    for body in (
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ):
        error = refused(post(running, "/v1/completions", body))
        assert "nested too deep" in error["message"], error
    deep = b'{"prompt": "x", "tools": ' + b"[" * 500 + b"]" * 500 + b"}"
    assert refused(post(running, "/v1/completions", deep))["param"] == "tools"


def test_a_fault_of_the_server_is_a_json_500_that_says_what_failed(running, monkeypatch):
    monkeypatch.setattr(running.served, "tok", Tokenizer(running.tok, fail=True))
    with pytest.raises(openai.InternalServerError) as e:
        running.client().completions.create(model=NAME, prompt="x", max_tokens=2)
    assert "RuntimeError: the tokenizer broke" in e.value.body["message"], e.value.body
    assert running.wait_idle() == (0, 0)


def test_the_bound_on_a_prompts_size_never_refuses_one_that_fits(bundled64):
    """No token of the bundled tokenizer stands for more characters than longest_token_chars:
    so a text longer than max_len times it needs more than max_len tokens."""
    tok = bundled64[1]
    longest = api.longest_token_chars(tok)
    decoded = max(len(tok.decode([t], skip_special_tokens=False)) for t in range(tok.vocab_size))
    assert decoded <= longest
    for text in ("a" * 5000, " " * 5000, "To be, or not " * 400, "é" * 3000, "\n" * 5000):
        assert len(tok.encode(text)) >= len(text) / longest, repr(text[:20])


# ---- random bodies ------------------------------------------------------------------------------
PATHS = {
    api.COMPLETIONS: "/v1/completions",
    api.CHAT: "/v1/chat/completions",
    api.TOKENIZE: "/tokenize",
    api.DETOKENIZE: "/detokenize",
}
ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
TOKEN_IDS = st.lists(st.integers(-1, 2050), max_size=12)
TEXT = st.text(max_size=40) | st.sampled_from(PROMPTS) | st.just("<|endoftext|>")
ERROR_TYPES = {"invalid_request_error", "not_found_error"}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXT}
)


def near(name: str) -> st.SearchStrategy:
    """Values about what the field takes: of its type, at and past its bounds; for a field that
    changes nothing, the values at which it does."""
    if name in api.NO_OPS and isinstance(api.NO_OPS[name][1], tuple) and api.NO_OPS[name][1]:
        return st.sampled_from(api.NO_OPS[name][1])
    own = {
        "prompt": TEXT | TOKEN_IDS,
        "messages": st.lists(MESSAGE, max_size=3),
        "tokens": TOKEN_IDS,
        "stop": TEXT | st.lists(st.text(max_size=3), max_size=3),
        "logit_bias": st.dictionaries(st.integers(-1, 2050).map(str), st.integers(-101, 101)),
        "stop_token_ids": TOKEN_IDS,
        "stream_options": st.fixed_dictionaries(
            {}, optional={k: st.booleans() for k in api.STREAM_OPTIONS}
        ),
        "response_format": st.sampled_from(
            [{"type": "text"}, {"type": "json_object"}, {"type": "regex"}]
        ),
    }
    if name in own:
        return own[name]
    types = api.FIELDS.get(name, (object,))[0]
    types = next(iter(types.values())) if isinstance(types, dict) else types
    if types is bool:
        return st.booleans()
    if types is int:
        return st.integers(-2, 25)
    if types == api.NUMBER:  # and the extremes: 5e-324 over a logit overflows
        return st.floats(-3, 3) | st.integers(-3, 3) | st.sampled_from([5e-324, 1e300, -0.0])
    return ANY_JSON


@st.composite
def bodies(draw) -> tuple[str, dict, bool]:
    """An endpoint, a body for it (its required field most often, a few fields of the API's
    own or an unknown one, each near what it takes or any JSON) and whether the client leaves
    a stream after its first event."""
    kind = draw(st.sampled_from(sorted(PATHS)))
    body = {}
    need = api.REQUIRED.get(kind, "prompt")
    if draw(st.integers(0, 9)):
        body[need] = draw(near(need))
    names = sorted(api.FIELDS) + sorted(api.NO_OPS) + ["best_effort"]
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        body[name] = draw(near(name) if draw(st.integers(0, 4)) else ANY_JSON)
    if kind in api.GENERATE:
        body.setdefault("max_tokens", draw(st.integers(1, 6)))
        body.setdefault("stream", draw(st.booleans()))
    return kind, body, draw(st.booleans())


OVERFLOW = {"repetition_penalty": 5e-324}  # a seen token's logit over it: +inf (a draw of id V)


def taken(body: dict) -> tuple[int, ...]:
    """The statuses a body may get: 200 or 400; 404 too where it names a model."""
    return (200, 400, 404) if "model" in body else (200, 400)


def test_random_bodies_get_an_answer_or_a_400_and_leave_the_engine_as_it_was(bundled64):
    """Bodies drawn at random, near what each field takes and past it, to every endpoint of a
    paged server with a prefix cache: each gets a 200 (a stream that ends in [DONE], unless
    the client leaves it early) or a 400 in OpenAI's shape; none gets a 500 or hangs. After
    them the engine is idle, holds no slot, block or ticket, and answers as solo does."""
    model, tok = bundled64
    srv = Running(make_engine(model, EngineConfig(4, kv="paged", prefix_cache=True)), tok)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=bodies())
    @example(case=(api.COMPLETIONS, {"prompt": "To be", "max_tokens": 4, **OVERFLOW}, False))
    def answered(case):
        kind, body, leave = case
        if body.get("stream") is True and leave:
            with httpx.stream("POST", srv.url[:-3] + PATHS[kind], json=body, timeout=60) as r:
                assert r.status_code in taken(body), (r.status_code, body, r.read()[:300])
                next(r.iter_lines(), None)  # the first event, then the client goes
            return
        r = post(srv, PATHS[kind], body)
        assert r.status_code in taken(body), (r.status_code, body, r.text[:300])
        if r.status_code != 200:
            error = r.json()["error"]
            assert error["message"] and error["type"] in ERROR_TYPES, error
        elif body.get("stream") is True:
            assert all("error" not in chunk for chunk in sse_chunks(r.text)), r.text[-300:]
        elif kind in api.GENERATE:
            assert r.json()["choices"], r.text[:300]

    try:
        answered()
        assert srv.wait_idle() == (0, 0)
        answer = srv.client().completions.create(
            model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0
        )
        assert answer.choices[0].text == solo_text(srv, PROMPTS[0], 16)
    finally:
        srv.stop()
