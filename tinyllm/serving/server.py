"""Step 10 - serving: the continuous engine behind the OpenAI API, streamed.

    python -m tinyllm serve [--model DIR] [--port 8000] [--slots 16] [--kv paged] ...  # launch.py

`POST /v1/completions` and `POST /v1/chat/completions` (streamed as server-sent events, or one JSON
body), `POST /tokenize` and `POST /detokenize` (as vLLM has them), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus) and at `GET /` the live page (live.py), on FastAPI and uvicorn. As in
vLLM, the engine runs in a process of its own, held through an `EngineLoop` (engine_loop.py). Each
HTTP request is one coroutine: it reads the body (a 413 past max_body bytes), checks it as api.py
says (a 400 naming the field), has its constraint checked (checks.py), tokenizes its prompt off the
event loop, submits one `Request` (a 429 when max_waiting sequences would wait), reads its queue
(`Answer`) and streams the text as server-sent events (`sse_events`) or collects one body
(responses.py). A client that goes away aborts its request; a request the engine fails on fails
alone. `/health` answers at once whether the engine serves, is busy, restarts or has failed; every
error is an OpenAI-style JSON body. Seam: `sse_events` (exercise 10).
"""

import asyncio
import gc
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.requests import Event
from tinyllm.serving.api import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    MAX_BODY,
    TOKENIZE,
    APIError,
    Asked,
    check_body,
    check_model,
    check_token_ids,
    constraint_of,
    longest_token_chars,
    parse_json,
    prompt_ids,
    to_request,
    usage_of,
)
from tinyllm.serving.checks import ConstraintChecks
from tinyllm.serving.engine_loop import EngineLoop, Ticket, next_event
from tinyllm.serving.live import MAX_PAGES, Pages, page_file
from tinyllm.serving.logprobs import TokenTexts, vllm_prompt_logprobs
from tinyllm.serving.responses import (
    Piece,
    Spelling,
    answer_body,
    choice_events,
    echo_first,
    joined,
    sse_event,
)
from tinyllm.serving.responses import usage as usage  # the exercise's files take it from here
from tinyllm.serving.served import NO_DEFAULTS, ModelDefaults, describe
from tinyllm.serving.textstream import TextStream
from tinyllm.serving.watchdog import ENGINE_TIMEOUT_S


@dataclass
class Served:
    """What the server serves: the engine loop, the tokenizer (with the model's chat template
    and its EOS ids), the model's name, the positions a request may use, the most characters
    one token stands for (a longer prompt is refused by its size before it is tokenized), the
    largest body it reads, in bytes, the model's vocabulary size (None: the tokenizer's), its
    tokens' texts as logprobs spell them, the grammar backend that checks a constraint before
    it goes to the engine (the engine's own, LLGuidance; None: a constraint is refused), the
    model's sampling defaults for the fields a request leaves out (served.ModelDefaults), what
    the engine is made of (served.describe: /health says it), the open pages of the live
    view (live.Pages), and the constraint checks that ask the grammar backend, each in a worker
    process (checks.ConstraintChecks)."""

    loop: EngineLoop
    tok: object
    name: str
    max_len: int
    metrics: object = None
    token_chars: int = 1
    max_body: int = MAX_BODY
    vocab_size: int | None = None
    texts: TokenTexts | None = None
    grammars: object = None
    defaults: ModelDefaults = NO_DEFAULTS
    about: dict = field(default_factory=dict)
    pages: Pages | None = None
    checks: ConstraintChecks | None = None

    def limit(self) -> tuple[int, int]:
        """(positions a request may use, characters a token stands for at most)."""
        return self.max_len, self.token_chars


class Metrics:
    """The server's Prometheus metrics, in a registry of its own: requests running and
    waiting, KV cache use and whether the KV cache's books are sound (read at each scrape),
    prompt and generated tokens, finished requests by finish reason, histograms of TTFT,
    inter-token latency and end-to-end latency, and with speculation (11) the guesses proposed
    and accepted (vLLM's spec_decode counters), the acceptance rate and the tokens a request
    makes per target pass; the requests answered 429, the engine's steps, a paged pool's
    blocks held and cached, the frames the engine built for the live page (live.py), the
    engine's restarts and the age of its running step."""

    def __init__(self, loop: EngineLoop):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.loop, r = loop, CollectorRegistry()
        self.registry = r
        self.running = Gauge("tinyllm_requests_running", "requests in a slot", registry=r)
        self.waiting = Gauge("tinyllm_requests_waiting", "requests waiting for a slot", registry=r)
        self.kv_used = Gauge(
            "tinyllm_kv_cache_usage_ratio", "KV positions in use / reserved", registry=r
        )
        self.kv_sound = Gauge(
            "tinyllm_kv_cache_integrity_ok",
            "1 when the KV cache's books were sound when the engine was last idle, else 0",
            registry=r,
        )
        self.prompt = Counter("tinyllm_prompt_tokens", "prompt tokens received", registry=r)
        self.generated = Counter("tinyllm_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter(
            "tinyllm_requests_finished", "requests finished", ["finish_reason"], registry=r
        )
        secs = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        seconds = lambda name, doc: Histogram(name, doc, buckets=secs, registry=r)
        self.ttft = seconds("tinyllm_time_to_first_token_seconds", "time to first token")
        self.itl = seconds("tinyllm_inter_token_latency_seconds", "gap between two tokens")
        self.e2e = seconds("tinyllm_e2e_request_latency_seconds", "arrival to last token")
        spec = "tinyllm_spec_decode_"
        self.spec = [
            Counter(spec + "num_drafts", "rows verified by a target pass", registry=r),
            Counter(spec + "num_draft_tokens", "guesses proposed", registry=r),
            Counter(spec + "num_accepted_tokens", "guesses accepted", registry=r),
        ]
        self.spec_seen, self.restarts_seen = (0, 0, 0, 0), 0
        self.acceptance = Gauge(spec + "acceptance_rate", "accepted / proposed", registry=r)
        self.per_pass = Gauge(
            spec + "tokens_per_pass", "a request's new tokens per target pass", registry=r
        )
        self.rejected = Counter(
            "tinyllm_requests_rejected", "requests answered 429: too many waited", registry=r
        )
        self.steps = Gauge("tinyllm_engine_steps", "steps the engine has taken", registry=r)
        self.blocks = Gauge(
            "tinyllm_kv_blocks",
            "a paged pool's blocks: held by block tables, or cached and held by none",
            ["state"],
            registry=r,
        )
        self.frames = Gauge(
            "tinyllm_live_frames", "frames the engine built for the live page", registry=r
        )
        self.restarts = Counter(
            "tinyllm_engine_restarts", "engines the server started again", registry=r
        )
        self.step_age = Gauge(
            "tinyllm_engine_step_age_seconds",
            "how long the engine's running step has run",
            registry=r,
        )

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        waiting, running = self.loop.request_counts()
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_used.set(self.loop.kv_used)
        self.kv_sound.set(self.loop.integrity is None)
        now = self.loop.speculation
        rows, proposed, accepted, tokens = now
        for counter, total, seen in zip(self.spec, now, self.spec_seen):
            counter.inc(total - seen)
        self.spec_seen = now
        self.acceptance.set(accepted / proposed if proposed else 0.0)
        self.per_pass.set(tokens / rows if rows else 0.0)
        self.steps.set(self.loop.steps)
        self.frames.set(self.loop.frames)
        self.restarts.inc(self.loop.restarts - self.restarts_seen)
        self.restarts_seen = self.loop.restarts
        self.step_age.set(self.loop.health().step_s)
        if self.loop.blocks is not None:
            for state, n in zip(("held", "cached"), self.loop.blocks):
                self.blocks.labels(state).set(n)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Answer:
    """One request's answer as its choices' events come: each choice's tokens become text a
    settled piece at a time (TextStream, with the request's stop strings), and `pieces()`
    yields them as Pieces, with their tokens' logprobs when asked. A choice ends at its last
    event, or at a stop string, which aborts it in the engine; the prompt's logprobs come
    with choice 0's first event, and when they are asked no piece goes out before them. The
    choices left are aborted if the consumer stops early (a client that went away)."""

    def __init__(self, served: Served, tickets: list[Ticket], asked: Asked, n_prompt: int):
        self.served, self.tickets, self.asked, self.n_prompt = served, tickets, asked, n_prompt
        n, sampling = len(tickets), asked.request.sampling
        self.streams = [TextStream(served.tok.decode, asked.stops) for _ in range(n)]
        self.over = [False] * n
        self.tokens: list[list] = [[] for _ in range(n)]  # each choice's since its last piece
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.wants_logprobs = sampling.logprobs is not None
        self.wants_prompt = sampling.prompt_logprobs is not None
        self.prompt_logprobs: list | None = None  # the prompt's, once they came
        self.t0, self.started = time.perf_counter(), False
        self.last = [None] * n  # when each choice's last token came

    def live(self) -> list[Ticket]:
        return [t for t, over in zip(self.tickets, self.over) if not over]

    async def pieces(self):
        """Yield the choices' Pieces as their events come; each choice's last has its
        finish_reason."""
        self.served.metrics.prompt.inc(self.n_prompt)
        held = []
        try:
            while not all(self.over):
                ev = await next_event(self.served.loop, self.live())
                if isinstance(ev, APIError):
                    raise ev
                if (piece := self.take(ev)) is not None:
                    held.append(piece)
                if not self.wants_prompt or self.prompt_logprobs is not None or all(self.over):
                    while held:
                        yield held.pop(0)
        finally:
            self.served.loop.abort(*self.live())

    def take(self, ev: Event) -> Piece | None:
        """One event of choice ev.rid - the first key: its piece, if it settles one."""
        i = ev.rid - self.tickets[0].key
        ticket, stream = self.tickets[i], self.streams[i]
        lp, prompt = (ticket.logprobs.popleft() if ticket.logprobs else None) or (None, None)
        if self.over[i]:
            return None  # a late token of a choice that a stop string ended
        if prompt is not None:
            self.prompt_logprobs = prompt
        self.observe(i)
        text = stream.push(ev.token)
        self.tokens[i].append(ev.token)
        self.logprobs[i].append(lp)
        if not (stream.stopped or ev.done):
            return self.piece(i, text, None) if text else None
        self.over[i] = True
        reason = "stop" if stream.stopped else ev.finish_reason
        if not stream.stopped:
            text += stream.finish()
        elif not ev.done:
            self.served.loop.abort(ticket)  # the stop string ended it first
        self.served.metrics.finished.labels(reason).inc()
        if all(self.over):
            self.served.metrics.e2e.observe(time.perf_counter() - self.t0)
        return self.piece(i, text, reason)

    def observe(self, i: int) -> None:
        """A token of choice i came: the request's first is its TTFT, a choice's next ones the
        gaps between its tokens."""
        m, now = self.served.metrics, time.perf_counter()
        if not self.started:
            m.ttft.observe(now - self.t0)
            self.started = True
        elif self.last[i] is not None:
            m.itl.observe(now - self.last[i])
        self.last[i] = now
        m.generated.inc()

    def piece(self, i: int, text: str, reason: str | None) -> Piece:
        tokens, self.tokens[i] = self.tokens[i], []
        logprobs, self.logprobs[i] = self.logprobs[i], []
        n_out = len(self.streams[i].tokens)
        return Piece(i, text, reason, n_out, tokens, logprobs if self.wants_logprobs else None)

    def echo(self, i: int) -> Piece:
        """Choice i's echoed prompt: its text, its tokens, their logprobs when asked."""
        lps = self.prompt_logprobs if self.wants_logprobs else None
        return Piece(i, self.asked.echo, None, 0, list(self.asked.request.prompt), lps)


def as_api_error(e: Exception) -> APIError:
    """The error the client is told of: an APIError as it is; any other, a 500 that says what
    failed."""
    if isinstance(e, APIError):
        return e
    return APIError(
        500, f"the server failed on this request: {type(e).__name__}: {e}", kind="server_error"
    )


async def failing_plainly(awaitable):
    """Await it; an error that is not the client's becomes a 500 that says what failed."""
    try:
        return await awaitable
    except APIError:
        raise
    except Exception as e:
        raise as_api_error(e) from e


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
    # one plain choice's stream, as responses.choice_events writes any (n choices, logprobs,
    # an echo): the server calls this seam for a plain choice, choice_events for the others

    async def as_pieces():
        async for text, reason, n_out in pieces:
            yield Piece(0, text, reason, n_out)

    async for event in choice_events(as_pieces(), kind, head, n_prompt, include_usage):
        yield event


async def errors_as_events(events):
    """A stream's events; an error once the stream has begun (its status, 200, is sent) ends it
    with one more event, `data: {"error": {...}}`, as OpenAI's API does, which clients raise."""
    try:
        async for e in events:
            yield e
    except Exception as err:
        yield sse_event(as_api_error(err).body())


async def starting_with(first, rest):
    """first, then the items of the async iterator rest."""
    yield first
    async for item in rest:
        yield item


def health(loop: EngineLoop, about: dict | None = None) -> tuple[int, dict]:
    """GET /health: (status code, body), the engine's state as the loop says it
    (EngineLoop.health). 200 while the engine serves: {"status": "ok", "kv_cache": "ok"};
    "busy" while a step runs longer than usual, with "step_s", its age, and "engine", what is
    slow or stopped (a slow engine is a live one); "degraded" with the sentence that says what
    is wrong with the KV cache's books when they were last checked (the engine still serves,
    on fewer blocks than it should). 503 while the engine restarts ({"status": "restarting",
    "engine": why}) and once it has failed for good ({"status": "failed", "engine": why}), as
    vLLM and SGLang answer when their engine is gone; "restarts" counts the restarts so far,
    "processes" names the engine's processes the server watches (name -> pid).
    Each with "serving": about, what the engine is made of (served.describe), when given."""
    verdict, serving = loop.health(), {} if about is None else {"serving": about}
    said = {"restarts": loop.restarts, "processes": loop.processes(), **serving}
    if verdict.status in ("starting", "restarting", "failed"):
        return 503, {"status": verdict.status, "engine": verdict.why, **said}
    busy = {"step_s": round(verdict.step_s, 1), "engine": verdict.why} if verdict.why else {}
    if loop.integrity is not None:
        return 200, {"status": "degraded", "kv_cache": loop.integrity, **busy, **said}
    return 200, {"status": verdict.status, "kv_cache": "ok", **busy, **said}


async def json_body(http, limit: int) -> object:
    """The HTTP request's body, parsed (parse_json: a 400 when it is not JSON or nests too
    deep); a 413 when it is over limit bytes, as its Content-Length says or as it is read, a
    chunk at a time: a huge body is refused without being held."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    data = bytearray()
    async for chunk in http.stream():
        data += chunk
        if len(data) > limit:
            raise too_large(limit)
    return await asyncio.to_thread(parse_json, bytes(data))  # a big one takes a while


def too_large(limit: int) -> APIError:
    return APIError(413, f"the body is over {limit:,} bytes, the most this server reads")


async def serve_completion(served: Served, http, kind: str):
    """POST /v1/completions (kind "completions") or /v1/chat/completions ("chat"): the body
    checked, its prompt tokenized off the event loop, its Request submitted (its n choices one
    ticket each, sharing one queue), and the answer streamed as server-sent events, or
    collected into one JSON body."""
    body = check_body(await json_body(http, served.max_body), kind)
    check_model(body, served.name)
    if (constraint := constraint_of(body)) is not None:  # the grammar backend's word first
        await served.checks.check(*constraint, http.is_disconnected)
    ids = await asyncio.to_thread(prompt_ids, served.tok, body, kind, served.limit())
    constrained = constraint[1] if constraint is not None else None
    asked = to_request(
        body,
        kind,
        ids,
        served.tok,
        served.max_len,
        served.vocab_size,
        constrained,
        served.defaults.values,
    )
    n, queue = asked.request.sampling.n, asyncio.Queue()
    tickets = [Ticket(asked.request, events=queue) for _ in range(n)]
    served.loop.submit(tickets)
    head = {
        "id": ("cmpl-" if kind == COMPLETIONS else "chatcmpl-") + uuid.uuid4().hex[:24],
        "object": {COMPLETIONS: "text_completion", CHAT: "chat.completion"}[kind],
        "created": int(time.time()),
        "model": served.name,
    }
    answer = Answer(served, tickets, asked, len(ids))
    pieces = answer.pieces()
    if asked.echo is not None:
        pieces = echo_first(pieces, answer.echo)
    spell = Spelling(served.texts, kind, asked.request.sampling.logprobs, n)
    if not body.get("stream"):
        return await collected(http, pieces, answer, kind, head, spell)
    from fastapi.responses import StreamingResponse

    if kind == CHAT:
        head["object"] += ".chunk"
    usage_too, every_chunk = usage_of(body)
    # the stream starts with its first piece: a refusal before it is still a plain error
    pieces = starting_with(await failing_plainly(pieces.__anext__()), pieces)
    if asked.plain and not every_chunk:  # the exercise's seam: one plain choice's stream
        triples = ((p.text, p.finish_reason, p.n_out) async for p in pieces)
        events = sse_events(triples, kind, head, len(ids), usage_too)
    else:
        events = choice_events(pieces, kind, head, len(ids), usage_too, n, spell, every_chunk)
    return StreamingResponse(errors_as_events(events), media_type="text/event-stream")


async def serve_tokenize(served: Served, http):
    """POST /tokenize, as vLLM has it: {"prompt": text, "add_special_tokens": true} or
    {"messages": [...], "add_generation_prompt": true} -> {"count", "max_model_len",
    "tokens", "token_strs"} (the tokens' strings with "return_token_strs": true, else null).
    A prompt of any size is counted, and its answer written, off the event loop."""
    body = check_body(await json_body(http, served.max_body), TOKENIZE)
    check_model(body, served.name)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise APIError(400, "send a prompt or messages (one of them)", "prompt")
    if body.get("prompt") is not None and not isinstance(body["prompt"], str):
        raise APIError(400, "prompt must be a string", "prompt")
    return json_response(await asyncio.to_thread(tokenized, served, body))


def tokenized(served: Served, body: dict) -> bytes:
    """/tokenize's answer to a checked body, as JSON."""
    kind = COMPLETIONS if body.get("prompt") is not None else CHAT
    ids = prompt_ids(served.tok, body, kind, None)
    strs = [served.tok.id_to_token(t) for t in ids] if body.get("return_token_strs") else None
    return json.dumps(
        {"count": len(ids), "max_model_len": served.max_len, "tokens": ids, "token_strs": strs}
    ).encode()


async def serve_detokenize(served: Served, http):
    """POST /detokenize, as vLLM has it: {"tokens": [...]} -> {"prompt": their text}, special
    tokens and all; a 400 naming tokens when one is no token id. Off the event loop."""
    body = check_body(await json_body(http, served.max_body), DETOKENIZE)
    check_model(body, served.name)
    return json_response(await asyncio.to_thread(detokenized, served.tok, body["tokens"]))


def detokenized(tok, tokens: list) -> bytes:
    """/detokenize's answer to a body's tokens, as JSON."""
    check_token_ids(tokens, "tokens", tok.vocab_size)
    return json.dumps({"prompt": tok.decode(tokens, False)}).encode()


def json_response(content: bytes, status: int = 200):
    from fastapi.responses import Response

    return Response(content, status_code=status, media_type="application/json")


async def collected(http, pieces, answer: Answer, kind: str, head: dict, spell: Spelling):
    """A non-streamed answer: its pieces joined into one JSON body (answer_json), written off
    the event loop; a client that goes away meanwhile aborts its request and gets a 499."""
    from fastapi.responses import Response

    async def collect():
        return [piece async for piece in pieces]

    task = asyncio.ensure_future(collect())
    while not (await asyncio.wait([task], timeout=0.25))[0]:
        if await http.is_disconnected():  # the client went away: abort
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody hears it
            return Response(status_code=499)
    got = await failing_plainly(task)
    return json_response(await asyncio.to_thread(answer_json, got, answer, kind, head, spell))


def answer_json(got: list[Piece], answer: Answer, kind: str, head: dict, spell: Spelling) -> bytes:
    """A collected answer's pieces as one JSON body (answer_body), vLLM's prompt_logprobs in it
    when asked: a prompt's logprobs make a big one, some MB to spell."""
    k, prompt = answer.asked.prompt_logprobs, None
    if k is not None and answer.prompt_logprobs is not None:
        prompt = vllm_prompt_logprobs(answer.prompt_logprobs, answer.served.texts, k)
    choices = joined(got, len(answer.tickets))
    return json.dumps(answer_body(kind, head, choices, answer.n_prompt, spell, prompt)).encode()


def error_response(e: APIError):
    """An error's JSON response, every character escaped: a message may quote a client's
    text, lone surrogates and all."""
    return json_response(json.dumps(e.body()).encode(), e.status)


def model_list(served: Served) -> dict:
    """GET /v1/models: the one model this server serves, with the positions a request may use
    and its sampling defaults for the fields a request leaves out, with where they come from
    ("checkpoint", "llama-server", "none" or a generation_config.json's path)."""
    model = {"id": served.name, "object": "model", "created": 0, "owned_by": "tinyllm"}
    values, source = served.defaults
    model |= {"max_model_len": served.max_len, "sampling_defaults": values}
    return {"object": "list", "data": [{**model, "sampling_defaults_from": source}]}


@asynccontextmanager
async def lifespan(served: Served):
    """What runs while the app does: the engine loop, and the constraint checks' workers."""
    if not served.loop.started:  # launch.py starts it first, to say how it goes
        await served.loop.start()
    served.checks.start()
    gc.collect()  # what lives now lives as long as the server: freezing it spares every
    gc.freeze()  # later full collection the walk over it (vLLM and SGLang freeze it too)
    yield
    served.checks.stop()
    await served.loop.stop()


def make_app(served: Served):
    """The FastAPI app serving `served`; its engine loop runs while the app does (`lifespan`)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse

    app = FastAPI(title="tinyllm", lifespan=lambda app: lifespan(served))

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        served.metrics.rejected.inc(exc.status == 429)  # counts the 429s of a full server
        return error_response(exc)

    @app.exception_handler(Exception)  # the server's fault: still a JSON 500
    async def server_error(request, exc: Exception):
        return error_response(as_api_error(exc))

    @app.get("/health")
    async def get_health():
        status, body = health(served.loop, served.about)
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models():
        return model_list(served)

    @app.get("/metrics")
    async def metrics():
        text, ctype = served.metrics.exposition()
        return PlainTextResponse(text, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await serve_completion(served, http, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        return await serve_completion(served, http, CHAT)

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        return await serve_tokenize(served, http)

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        return await serve_detokenize(served, http)

    live_routes(app, served)
    return app


def live_routes(app, served: Served) -> None:
    """The live view (live.py): the page at / and /engine, its script and style, and the
    server-sent events of the engine's frames at /engine/events (a 503 past MAX_PAGES)."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import Response, StreamingResponse

    def page(name: str):
        content, media_type = page_file(name)
        return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})

    app.get("/", include_in_schema=False)(lambda: page("index.html"))
    app.get("/engine", include_in_schema=False)(lambda: page("index.html"))
    app.get("/engine/page.js", include_in_schema=False)(lambda: page("page.js"))
    app.get("/engine/page.css", include_in_schema=False)(lambda: page("page.css"))

    @app.get("/engine/events", include_in_schema=False)
    async def engine_events(http: HTTPRequest):
        if (page := served.pages.open()) is None:  # the cap, taken as the page is counted
            raise APIError(
                503,
                f"{MAX_PAGES} pages watch already, the most this server feeds",
                kind="server_error",
            )
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            served.pages.events(http, page), media_type="text/event-stream", headers=headers
        )


def build(
    engine: ContinuousEngine,
    tok,
    name: str,
    max_waiting: int = 64,
    max_body: int = MAX_BODY,
    engine_timeout: float = ENGINE_TIMEOUT_S,
    defaults: ModelDefaults | tuple = NO_DEFAULTS,
    show_prompts: bool = False,
) -> Served:
    """What make_app serves: an engine loop around engine (not started), with its metrics and
    its live view's pages (show_prompts: the page shows each slot's prompt and answer); a
    body over max_body bytes is refused, an engine's turn older than engine_timeout seconds with
    no CPU is hung (watchdog.py), and the engine restarted; the
    sampling fields a request leaves out take the model's defaults (served.model_defaults' for
    `python -m tinyllm serve`; none by default: OpenAI's). The engine's grammar backend (its
    `grammars`) checks each constraint on this side too, in a worker process of the checks'
    (started with the app, or by the first check): the engine process gets a copy of its own."""
    loop = EngineLoop(engine, max_waiting, engine_timeout)
    chars, vocab = longest_token_chars(tok), engine.model.cfg.vocab_size
    texts, grammars = TokenTexts(tok), engine.grammars
    served = Served(
        loop,
        tok,
        name,
        engine.max_len,
        Metrics(loop),
        chars,
        max_body,
        vocab,
        texts,
        grammars,
        ModelDefaults(*defaults),
        describe(engine),
    )
    served.pages = Pages(served, show_prompts)
    served.checks = ConstraintChecks(grammars)
    loop.on_frame = served.pages.publish
    return served
