"""Step 10 - the OpenAI-compatible server, through the official `openai` client: every answer,
streamed or not, equals the decoded solo generate() tokens; a client that goes away frees its
slot; bad requests get a 400 naming the field, a full server a 429; /health and /metrics say
whether the KV cache's books are sound; the text stream never splits a character or sends a
stop string."""

import asyncio
import copy
import pickle
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.conftest import free_port, run_serve
from tinyllm.build import make_engine
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.generate import generate
from tinyllm.ext.quant import quantize
from tinyllm.serving import engine_loop, launch, server
from tinyllm.serving.textstream import REPLACEMENT, TextStream, next_piece

pytestmark = pytest.mark.slow  # servers, each with its engine process

NAME = "tinyllm-test"
PROMPTS = [
    "Ham.\nTo be, or not",
    "Rom.\nBut soft",
    "Lear.\nBlow, winds",
    "Jul.\nO Romeo",
    "Macb.\nIs this a dagger",
    "Fool.\n",
    "Oth.\nIt is the cause",
    "Nurse.\n",
]


class Running:
    """A server on a free loopback port (or on port), in a thread (its engine in a process),
    until stop()."""

    def __init__(self, engine, tok, port: int | None = None, **kw):
        self.engine, self.tok = engine, tok
        self.served = server.build(engine, tok, NAME, **kw)
        self.port = port or free_port()
        import uvicorn

        self.uv = uvicorn.Server(
            uvicorn.Config(
                server.make_app(self.served), host="127.0.0.1", port=self.port, log_level="warning"
            )
        )
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        # ready when uvicorn has started, which is after the engine process said it is ready;
        # a start that fails (EngineLoop.start waits for the engine 120 s at most) ends the thread
        while not self.uv.started:
            assert self.thread.is_alive(), "the server failed to start: its error is above"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, **kw)

    def stop(self):
        self.uv.should_exit = True
        self.served.pages.stop()  # the live page's streams end too
        self.thread.join(10)

    def request_counts(self) -> tuple[int, int]:
        """The engine's (waiting, running), as its process last reported them."""
        return self.served.loop.request_counts()

    def wait_idle(self, timeout=10.0) -> tuple[int, int]:
        """The load once the engine is idle (or timeout s have passed); an idle engine that
        still holds a slot or a block (its cache's check_integrity says so), or a request the
        HTTP side still holds, fails the test."""
        t0 = time.time()
        while self.request_counts() != (0, 0) and time.time() - t0 < timeout:
            time.sleep(0.01)
        loop = self.served.loop
        assert self.request_counts() != (0, 0) or loop.integrity is None, loop.integrity
        assert self.request_counts() != (0, 0) or not loop.tickets, (
            f"the engine is idle, yet the HTTP side still holds requests {sorted(loop.tickets)}: "
            f"a finished or refused request leaves EngineLoop.tickets"
        )
        return self.request_counts()


@pytest.fixture(scope="module")
def running(bundled64):
    model, tok = bundled64
    srv = Running(make_engine(model, 8), tok)
    yield srv
    srv.stop()


def solo_text(running, prompt: str, n: int, **sampling) -> str:
    model, tok = running.engine.model, running.tok
    seed = sampling.pop("seed", None)
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return tok.decode(
        generate(model, tok.encode(prompt), n, eos_id=tok.eos_id, generator=g, **sampling)
    )


def test_a_greedy_completion_equals_solo_streamed_or_not(running):
    cl = running.client()
    for prompt in PROMPTS[:3]:
        expected = solo_text(running, prompt, 40)
        r = cl.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == len(running.tok.encode(prompt))
        stream = cl.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[
            0
        ].finish_reason
    assert running.wait_idle() == (0, 0)


def test_chat_completion_uses_the_models_chat_template(running):
    cl = running.client()
    messages = [
        {"role": "system", "content": "Speak as a king."},
        {"role": "user", "content": "Who art thou?"},
    ]
    prompt = running.tok.apply_chat_template(messages)
    assert prompt == (
        "<|endoftext|>System.\nSpeak as a king.\n\nUser.\nWho art thou?\n\nAssistant.\n"
    )
    prompt = prompt.removeprefix("<|endoftext|>")  # solo_text's encode() puts it back
    expected = solo_text(running, prompt, 24)
    r = cl.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    stream = cl.chat.completions.create(
        model=NAME, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected


def test_32_concurrent_streams_each_equal_their_solo_answer(running):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    lengths = [8 + (5 * i) % 23 for i in range(32)]

    async def one(cl, prompt, n):
        stream = await cl.completions.create(
            model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        cl = openai.AsyncOpenAI(base_url=running.url, api_key="none", max_retries=0)
        return await asyncio.gather(*(one(cl, p, n) for p, n in zip(prompts, lengths)))

    texts = asyncio.run(all_of_them())
    for i, (p, n, text) in enumerate(zip(prompts, lengths, texts)):
        assert text == solo_text(running, p, n), f"stream {i}"
    assert running.wait_idle() == (0, 0)


def test_a_client_that_goes_away_frees_its_slot_at_once(running):
    body = {
        "model": NAME,
        "prompt": PROMPTS[0],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", running.url + "/completions", json=body, timeout=30) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:
                break
        assert running.request_counts() == (0, 1), "the request still runs while its client reads"
    assert running.wait_idle(timeout=2) == (0, 0), "the closed stream's request was not aborted"


def test_a_seeded_sampled_request_gives_the_same_text_twice(running):
    cl = running.client()
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=30, temperature=0.9, top_p=0.95, seed=7)
    a = cl.completions.create(**kw).choices[0].text
    b = cl.completions.create(**kw).choices[0].text
    assert a == b == solo_text(running, PROMPTS[1], 30, temperature=0.9, top_p=0.95, seed=7)


def test_a_stop_string_ends_the_answer_before_it(running):
    full = solo_text(running, PROMPTS[0], 40)
    stop = full[10:13]
    cl = running.client()
    r = cl.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    stream = cl.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == full[: full.index(stop)]
    assert running.wait_idle() == (0, 0), "the stopped request was aborted in the engine"


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(n=0), "n"),
        (dict(n=129), "n"),
        (dict(temperature=3), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=600), "prompt"),
        (dict(extra_body={"top_k": -2}), "top_k"),
        (dict(extra_body={"best_of": 2}), "best_of"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(prompt=[1, 2, 99999]), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(max_tokens="many"), "max_tokens"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(running, kw, param):
    kw = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 5, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        running.client().completions.create(**kw)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert running.request_counts() == (0, 0)


def test_bad_json_an_unknown_model_and_bad_messages(running):
    r = httpx.post(running.url + "/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        running.client().completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        running.client().chat.completions.create(
            model=NAME, max_tokens=2, messages=[{"role": "wizard", "content": "hi"}]
        )
    assert e.value.body["param"] == "messages"


def test_a_full_server_answers_429_and_serves_the_rest(bundled64):
    model, tok = bundled64
    srv = Running(make_engine(model, 1), tok, max_waiting=2)
    try:

        async def go():
            cl = openai.AsyncOpenAI(base_url=srv.url, api_key="none", max_retries=0)

            async def one(i):
                try:
                    r = await cl.completions.create(
                        model=NAME, prompt=PROMPTS[i % 8], max_tokens=30, temperature=0
                    )
                    return r.choices[0].text
                except openai.RateLimitError as e:
                    return e

            return await asyncio.gather(*(one(i) for i in range(8)))

        out = asyncio.run(go())
        refused = [o for o in out if isinstance(o, openai.RateLimitError)]
        served = [(i, o) for i, o in enumerate(out) if isinstance(o, str)]
        assert refused and served, f"{len(refused)} refused, {len(served)} served"
        assert "the server is full" in refused[0].body["message"]
        for i, text in served:
            assert text == tok.decode(
                generate(model, tok.encode(PROMPTS[i % 8]), 30, eos_id=tok.eos_id)
            )
        assert srv.wait_idle() == (0, 0)
    finally:
        srv.stop()


def test_models_health_and_metrics(running):
    assert running.client().models.list().data[0].id == NAME
    running.client().completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0)
    running.wait_idle()
    health = httpx.get(running.url[:-3] + "/health")
    assert health.status_code == 200
    assert {k: health.json()[k] for k in ("status", "kv_cache")} == {
        "status": "ok",
        "kv_cache": "ok",
    }
    text = httpx.get(running.url[:-3] + "/metrics").text
    for name in (
        "tinyllm_requests_running 0.0",
        "tinyllm_requests_waiting 0.0",
        "tinyllm_generation_tokens_total",
        "tinyllm_time_to_first_token_seconds_bucket",
        "tinyllm_inter_token_latency_seconds_count",
        "tinyllm_kv_cache_usage_ratio",
        "tinyllm_kv_cache_integrity_ok 1.0",
    ):
        assert name in text, name


BOOKS_GONE_WRONG = "blocks [3] are still referenced after every request finished: blocks leaked"


def books_gone_wrong(idle: bool = False) -> str:
    """A cache's check_integrity that finds its books wrong (module-level: it goes to the engine
    process pickled, with the cache it replaces the method of)."""
    return BOOKS_GONE_WRONG


def test_kv_cache_books_gone_wrong_show_in_health_and_metrics(bundled64, monkeypatch):
    """The engine asks its cache for its books when idle; a problem makes /health 'degraded'
    (the server still serves) with the cache's sentence, and the integrity gauge 0."""
    model, tok = bundled64
    engine = make_engine(model, 2, kv="paged")
    monkeypatch.setattr(engine.cache, "check_integrity", books_gone_wrong)
    srv = Running(engine, tok)
    try:
        r = srv.client().completions.create(
            model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0
        )
        assert r.choices[0].text == solo_text(srv, PROMPTS[0], 5), "the server still serves"
        t0 = time.time()
        while srv.served.loop.integrity is None and time.time() - t0 < 10:
            time.sleep(0.01)
        health = httpx.get(srv.url[:-3] + "/health")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded"
        assert health.json()["kv_cache"] == BOOKS_GONE_WRONG
        assert "tinyllm_kv_cache_integrity_ok 0.0" in httpx.get(srv.url[:-3] + "/metrics").text
    finally:
        srv.stop()


def test_the_pipes_messages_pickle():
    """Every message between the server and its engine process survives the pipe's pickling."""
    from tinyllm.core.requests import Request, TokenLogprobs
    from tinyllm.serving import messages as m

    for message in (
        m.Ready(),
        m.Add(3, Request([1, 2], 4)),
        m.Abort(3),
        m.Stop(),
        m.StepReport([(3, 11, None), (4, 12, "stop")], [(5, "too long")], 2, (0, 1), 0.25, None),
        m.StepReport(
            [(3, 11, None)],
            [],
            0,
            (0, 1),
            0.5,
            None,
            {
                0: (
                    TokenLogprobs(11, -0.5, ((11, -0.5), (7, -1.25))),
                    [None, TokenLogprobs(2, -3.0)],
                )
            },
        ),
        m.Failed("RuntimeError: out of memory"),
    ):
        assert pickle.loads(pickle.dumps(message)) == message, message


def test_serve_takes_the_engines_flags_from_engine_config():
    """`serve` parses EngineConfig's flags; a bad setting is named before any model loads."""
    from tinyllm.core.config import EngineConfig

    args = launch.serve_parser().parse_args(
        ["--port", "9", "--slots", "4", "--kv", "paged", "--prefix-cache", "--max-waiting", "3"]
    )
    assert (args.port, args.max_waiting) == (9, 3)
    assert EngineConfig.from_args(args) == EngineConfig(4, kv="paged", prefix_cache=True)
    with pytest.raises(SystemExit) as e:
        launch.serve_main(["--prefix-cache"])  # on slots: refused
    assert e.value.code == 2


# ---- what is served ------------------------------------------------------------------------------
def test_health_and_the_banner_say_what_is_served(running):
    """/health and the startup line say the weights (dtype, or --quant's mode), the decoder, the
    speculation, the KV cache (slots, or blocks, their size and a prefix cache) and the token
    budget a step: each setting changes what they say."""
    from tests.conftest import make_tiny
    from tinyllm.serving.served import NO_DEFAULTS, banner, describe

    health = httpx.get(running.url[:-3] + "/health").json()
    assert health["serving"] == describe(running.engine)
    assert health["serving"]["weights"] == "float64" and health["serving"]["decoder"] == "eager"
    assert health["serving"]["speculation"] == "none"
    assert health["serving"]["kv_cache"]["kind"] == "slots"
    assert health["serving"]["kv_cache"]["slots"] == 8
    tiny = make_tiny(seed=3)
    paged = dict(kv="paged", block_size=8, prefix_cache=True, max_step_tokens=64)
    engines = {
        "int8 per output channel": make_engine(quantize(make_tiny(seed=3), "int8"), 4),
        "ngram (prompt lookup, n 1-3), up to 2 guesses": make_engine(
            tiny, 4, speculate="ngram", spec_tokens=2, prompt_lookup_max=3, **paged
        ),
        "draft of 1 layers": make_engine(tiny, 2, speculate="draft", draft_layers=1),
        "decoder pieces": make_engine(tiny, 2, decoder="pieces"),
    }
    for said, engine in engines.items():
        line = banner(describe(engine), NO_DEFAULTS)
        assert said in line, (said, line)
    about = describe(engines["ngram (prompt lookup, n 1-3), up to 2 guesses"])
    assert about["kv_cache"] == {
        "kind": "paged",
        "slots": 4,
        "max_len": 96,
        "block_size": 8,
        "blocks": 48,
        "prefix_cache": True,
        "mib": about["kv_cache"]["mib"],
    }
    line = banner(about, NO_DEFAULTS)
    assert "48 blocks of 8, prefix cache" in line and "max_step_tokens 64" in line, line


def test_serve_says_what_it_serves_before_it_serves(tmp_path):
    """`python -m tinyllm serve` with int8 weights, n-gram speculation, a paged pool with a
    prefix cache and a token budget: its first line says each, /health says the same, and
    Ctrl-C stops it."""
    import signal

    port = free_port()
    flags = ["--quant", "int8", "--speculate", "ngram", "--kv", "paged", "--prefix-cache"]
    flags += ["--max-step-tokens", "64", "--slots", "2", "--port", str(port)]
    proc = run_serve(flags)
    try:
        lines = []
        while not (lines and lines[-1].startswith("serving")):
            line = proc.stdout.readline()
            assert line, f"serve ended before it served: {''.join(lines)}"
            lines.append(line)
        said = next(line for line in lines if line.startswith("tinyllm-shakespeare: "))
        for part in ("weights int8 per output channel", "decoder eager", "speculation ngram"):
            assert part in said, (part, said)
        assert "kv paged: 2 slots" in said and "prefix cache" in said, said
        assert "max_step_tokens 64" in said and "sampling defaults temperature 0.8" in said, said
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        assert health["serving"]["weights"] == "int8 per output channel", health
        assert health["serving"]["max_step_tokens"] == 64, health
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert "stopping" in out and "Traceback" not in out, out


def test_sigterm_ends_the_streams_in_flight_with_an_error_and_exits_0():
    """`python -m tinyllm serve` sent SIGTERM (what systemd, Docker and Kubernetes send) while a
    stream runs: the stream ends with an error event that says the server stops, and the
    command exits 0, as after Ctrl-C."""
    import signal

    port = free_port()
    proc = run_serve(["--slots", "2", "--port", str(port)])
    try:
        while not (line := proc.stdout.readline()).startswith("serving"):
            assert line, "serve ended before it served"
        body = {"model": "tinyllm-shakespeare", "prompt": PROMPTS[0], "max_tokens": 400}
        body |= {"ignore_eos": True, "stream": True}
        url, said = f"http://127.0.0.1:{port}/v1/completions", []
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not said:
                    proc.send_signal(signal.SIGTERM)
                said += [line] if line else []
        assert said[-1].startswith('data: {"error"'), said[-3:]
        assert '"the server is stopping"' in said[-1], said[-1]
        assert proc.wait(60) == 0, f"serve exited {proc.returncode} after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.communicate(timeout=30)[0]
    assert "stopping" in out and "Traceback" not in out, out


def test_more_choices_than_may_wait_is_a_400_naming_n(running):
    """n above the sequences that may wait for a slot (max_waiting, 64 here) can never be
    served: a 400 naming n and the limit, not a 429 that says retry later."""
    with pytest.raises(openai.BadRequestError) as e:
        running.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2, n=65)
    assert e.value.body["param"] == "n", e.value.body
    assert "n=65 choices are more than the 64 sequences" in e.value.body["message"]
    assert running.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=1, n=64)


# ---- the text stream (no server) -----------------------------------------------------------------


def test_next_piece_holds_back_split_characters_and_stop_prefixes():
    assert next_piece("Good morrow", 0, []) == ("Good morrow", False)
    assert next_piece("caf" + REPLACEMENT, 0, []) == ("caf", False), "an unfinished character waits"
    assert next_piece("café", 3, []) == ("é", False)
    assert next_piece("Good\n", 0, ["\n\n"]) == ("Good", False), "a stop string may begin here"
    assert next_piece("Good\n\nNay", 0, ["\n\n"]) == ("Good", True)
    assert next_piece("Good\nNay", 4, ["\n\n"]) == ("\nNay", False)
    assert next_piece("Good\n", 0, ["\n\n"], final=True) == ("Good\n", False)
    assert next_piece("ab END cd STOP", 0, ["STOP", "END"]) == ("ab ", True), "the earliest stop"


def test_text_stream_over_a_byte_level_decode():
    """A decode that, like a byte-level tokenizer, gives U+FFFD for half a character."""

    def decode(ids):  # é arrives as two tokens' bytes
        data = b"".join({0: b"H", 1: b"\xc3", 2: b"\xa9", 3: b"!"}[i] for i in ids)
        return data.decode("utf-8", errors="replace")

    ts = TextStream(decode, stops=["!"])
    assert [ts.push(t) for t in [0, 1, 2]] == ["H", "", "é"]
    assert ts.push(3) == "" and ts.stopped and ts.text == "Hé"


class FailingEngine(ContinuousEngine):
    """An engine whose every step fails before it holds a request (it is pickled to the engine
    process by class name)."""

    def step(self):
        raise RuntimeError("the model ran out of memory")


class FailingPass(ContinuousEngine):
    """An engine whose every step fails after its pass, its requests taken."""

    def retire(self, *args, **kwargs):
        raise RuntimeError("the model ran out of memory")


@pytest.mark.parametrize("engine", [FailingEngine, FailingPass])
def test_an_engine_that_fails_is_restarted_then_given_up(bundled64, engine, monkeypatch):
    """A step that raises holding no request, or right after a step that raised, fails the
    engine as a whole: its request gets a 500 that says why and the server starts the engine
    again; after MAX_RESTARTS restarts with no token between them it gives up: every later
    request a 500, /health a 503 "failed". FailingPass's first step, on each engine, fails its
    own request alone."""
    monkeypatch.setattr(engine_loop, "MAX_RESTARTS", 2)
    model, tok = bundled64
    srv = Running(make_engine(model, 2, engine=engine), tok)
    why = "RuntimeError: the model ran out of memory"
    restart = "the engine failed: " + why + "; the server restarts it"
    given_up = "the engine failed: " + why + "; the server gave up after 2 restarts with no token"
    alone = ["the engine failed on this request: " + why] if engine is FailingPass else []
    try:
        for says in (alone + [restart]) * 2 + alone + [given_up] * 2:
            with pytest.raises(openai.InternalServerError) as e:
                srv.client(timeout=60).completions.create(
                    model=NAME, prompt=PROMPTS[0], max_tokens=5
                )
            assert e.value.body["message"] == says
        assert srv.client().models.list().data[0].id == NAME, "the HTTP side still answers"
        health = httpx.get(srv.url[:-3] + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert health.json()["engine"] == given_up.removeprefix("the engine failed: ")
        assert health.json()["restarts"] == 2
    finally:
        srv.stop()


def streamed_text(cl, prompt: str, n: int) -> str:
    """A greedy completion of n tokens, streamed, its pieces joined."""
    stream = cl.completions.create(
        model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in stream if c.choices)


def test_a_speculating_server_streams_the_solo_text_and_counts_its_guesses(bundled64):
    """With speculation (11) a step may make several tokens of a request: the streams still
    carry solo's text, a stop string still ends it where solo's text has it, and /metrics
    counts the guesses proposed and accepted."""
    model, tok = bundled64
    for spec in ("ngram", "draft"):
        srv = Running(make_engine(model, 4, kv="paged", speculate=spec, spec_tokens=3), tok)
        try:
            cl = srv.client()
            for prompt in PROMPTS[:3]:
                expected = solo_text(srv, prompt, 40)
                assert streamed_text(cl, prompt, 40) == expected
            stop = expected[len(expected) // 2 : len(expected) // 2 + 3]
            r = cl.completions.create(
                model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[stop]
            )
            assert r.choices[0].text == expected[: expected.index(stop)], spec
            srv.wait_idle()
            text = httpx.get(srv.url[:-3] + "/metrics").text
            counts = {
                line.split()[0]: float(line.split()[1])
                for line in text.splitlines()
                if line.startswith("tinyllm_spec_decode_")
            }
            assert counts["tinyllm_spec_decode_num_draft_tokens_total"] > 0, (spec, counts)
            assert (
                0
                <= counts["tinyllm_spec_decode_num_accepted_tokens_total"]
                <= counts["tinyllm_spec_decode_num_draft_tokens_total"]
            )
            assert counts["tinyllm_spec_decode_tokens_per_pass"] >= 1
        finally:
            srv.stop()


def test_a_compiled_decoder_over_a_paged_pool_is_served(bundled64):
    """serve --kv paged --decoder compiled: the decoder goes to the engine's process without
    its compiled steps and compiles its bucket there before the first request; a stream carries
    solo's text, and the pool's books are sound when the server is idle."""
    model, tok = bundled64
    eng = make_engine(model, 3, kv="paged", decoder="compiled", max_len=96, buckets=(64,))
    srv = Running(eng, tok)
    try:
        cl = srv.client()
        for prompt in PROMPTS[:2]:
            assert streamed_text(cl, prompt, 24) == solo_text(srv, prompt, 24)
        assert srv.wait_idle() == (0, 0)
    finally:
        srv.stop()


@pytest.mark.parametrize("quant, decoder", [("int8", "pieces"), (None, "fused")])
def test_a_model_served_with_its_decoder_streams_its_solo_text(bundled64, quant, decoder):
    """serve --quant int8 --decoder pieces, serve --decoder fused: the model and its decoder go
    to the engine's process (the pieces compile there, the fused decoder finds the layers'
    weights again), and a stream carries solo's text on that model."""
    model, tok = bundled64
    if quant is not None:
        model = quantize(copy.deepcopy(model), quant)
    srv = Running(make_engine(model, 4, kv="paged", decoder=decoder), tok)
    try:
        cl = srv.client()
        for prompt in PROMPTS[:2]:
            assert streamed_text(cl, prompt, 24) == solo_text(srv, prompt, 24)
        srv.wait_idle()
    finally:
        srv.stop()
