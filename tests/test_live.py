"""Step 10 - the server's live page: a server with no page open builds no frame; a page's frames
show the slots and blocks that /metrics shows at the same step; many pages at once each get
every frame, and one that closes leaves the others be; pages opened at once get exactly MAX_PAGES
places, the others a 503; a page that reads nothing is dropped and leaves its place; each frame
and beat is written once for all the pages; the stream carries no prompt or answer text unless
the server was started to show them; a page reconnects to a restarted server."""

import asyncio
import re
import socket
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.test_server import NAME, Running
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.serving import live
from tinyllm.serving.loadgen import run, run_load

pytestmark = pytest.mark.slow  # servers, each with its engine process

STEMS = ["Ham.\nTo be, or not to be, that is the question:\n", "Rom.\nBut soft, what light\n"]
PROMPTS = [stem + tail for stem in STEMS for tail in ("Whether", "Through", "It is", "Arise")]


def paged_engine(model, kind=None):
    """8 slots over a paged pool of blocks of 8 with a prefix cache (blocks held, shared and
    cached all show), as make_engine makes it, of class kind (default: ContinuousEngine)."""
    config = EngineConfig(8, kv="paged", block_size=8, prefix_cache=True)
    return make_engine(model, config, engine=kind or ContinuousEngine)


class SteadyEngine(ContinuousEngine):
    """The continuous engine, STEADY_S a step at least: /metrics, asked as a frame comes, is
    mostly still at the frame's step (the engine process imports this module to unpickle it)."""

    def step(self):
        time.sleep(STEADY_S)
        return super().step()


STEADY_S = 0.05


@pytest.fixture(scope="module")
def server(bundled):
    model, tok = bundled
    srv = Running(paged_engine(model), tok)
    yield srv
    srv.stop()


class Page:
    """An SSE client of /engine/events in a thread of its own, as a page's EventSource holds
    one: the raw text it got, its events as (name, data), the stream's retry field;
    on_frame(data) hears each frame as it comes."""

    def __init__(self, base: str, on_frame=None):
        self.url, self.on_frame = f"{base}/engine/events", on_frame
        self.raw, self.events, self.retry = [], [], None
        self.opened, self.ended = threading.Event(), threading.Event()
        self.response = None
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()
        assert self.opened.wait(10), "the page's stream did not open"

    def read(self) -> None:
        import json

        try:
            with httpx.Client(timeout=30) as client, client.stream("GET", self.url) as r:
                self.response, name = r, "message"
                self.opened.set()
                for line in r.iter_lines():
                    self.raw.append(line)
                    if line.startswith("retry:"):
                        self.retry = int(line[6:])
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data = json.loads(line[5:])
                        self.events.append((name, data))
                        if name == "frame" and self.on_frame is not None:
                            self.on_frame(data)
        except (httpx.HTTPError, RuntimeError):
            pass  # closed by close(), or the server went away
        finally:
            self.opened.set()
            self.ended.set()

    def frames(self) -> list[dict]:
        return [data for name, data in self.events if name == "frame"]

    def close(self) -> None:
        if self.response is not None:
            self.response.close()
        self.ended.wait(5)


def load(srv, prompts=PROMPTS, max_tokens=24) -> list:
    """The course's load generator sends every prompt at once, greedy, each to max_tokens;
    returns its records."""
    records, _ = run(run_load(srv.url, [(p, max_tokens) for p in prompts], ignore_eos=True))
    assert all(r.error is None for r in records), [r.error for r in records]
    return records


def metrics(srv) -> dict:
    """/metrics as {sample: value}, the samples this file reads."""
    text = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    return {k: float(v) for k, v in re.findall(r"^(tinyllm_\S+) (\S+)$", text, re.M)}


def server_loop(srv) -> asyncio.AbstractEventLoop:
    """The server's event loop, in its thread: where its Pages live."""
    return srv.served.loop.listener.get_loop()


def wait_for(condition, timeout=10.0) -> bool:
    t0 = time.time()
    while not condition() and time.time() - t0 < timeout:
        time.sleep(0.02)
    return condition()


def test_a_server_with_no_page_open_builds_no_frame(server):
    """With no page open, the engine steps and reports, and builds no frame: its count of
    frames stays as it was (0 on a fresh server), in its reports and in /metrics."""
    assert wait_for(lambda: not server.served.pages)
    before = server.served.loop.frames
    steps = server.served.loop.steps
    load(server)
    assert server.served.loop.steps > steps
    assert server.served.loop.frames == before, "a frame was built with no page open"
    assert metrics(server)["tinyllm_live_frames"] == before


def test_a_frame_shows_the_slots_and_blocks_metrics_show_at_its_step(bundled):
    """While the load generator runs, each frame's busy slots and held and cached blocks equal
    /metrics' running requests and blocks whenever /metrics reports the frame's step (fetched
    as the frame comes, from an engine of STEADY_S a step); a frame's blocks agree with its
    slots' block tables."""
    model, tok = bundled
    server, pairs = Running(paged_engine(model, SteadyEngine), tok), []
    page = Page(f"http://127.0.0.1:{server.port}", lambda f: pairs.append((f, metrics(server))))
    try:
        load(server, PROMPTS, 20)
        wait_for(lambda: server.served.loop.request_counts() == (0, 0))
        time.sleep(0.3)
    finally:
        page.close()
        server.stop()
    same = [(f, m) for f, m in pairs if m["tinyllm_engine_steps"] == f["steps"]]
    busy = [(f, m) for f, m in same if any(f["slots"])]
    assert len(busy) >= 3, f"{len(busy)} frames of a busy engine met /metrics at their step"
    for f, m in same:
        slots = sum(s is not None for s in f["slots"])
        held, cached = sum(b > 0 for b in f["blocks"]), sum(b < 0 for b in f["blocks"])
        at = f"at step {f['steps']}"
        assert slots == m["tinyllm_requests_running"], (at, slots, m)
        assert held == m['tinyllm_kv_blocks{state="held"}'], (at, held, m)
        assert cached == m['tinyllm_kv_blocks{state="cached"}'], (at, cached, m)
        tables = [b for s in f["slots"] if s is not None for b in s["table"]]
        assert sorted(set(tables)) == [b for b, n in enumerate(f["blocks"]) if n > 0], at
    assert any(f["step"] and f["step"]["chunk"] for f, _ in pairs), "no prefill chunk drawn"
    assert any(f["step"] and f["step"]["decode"] for f, _ in pairs), "no decode drawn"
    assert any(b > 1 for f, _ in pairs for b in f["blocks"]), "no shared block drawn"
    assert not any(pairs[-1][0]["slots"]), "the idle engine's frame still shows a busy slot"


def test_eight_pages_at_once_each_get_frames_and_one_closing_disturbs_none(server):
    """8 pages open at once each get the frames of a run; one closes, and the 7 others get the
    next run's; once all close, the engine builds no more frames."""
    pages = [Page(f"http://127.0.0.1:{server.port}") for _ in range(8)]
    try:
        assert wait_for(lambda: len(server.served.pages) == 8)
        load(server)
        assert all(len(p.frames()) >= 2 for p in pages), [len(p.frames()) for p in pages]
        pages[0].close()
        assert wait_for(lambda: len(server.served.pages) == 7)
        seen = [len(p.frames()) for p in pages]
        load(server)
        assert wait_for(lambda: all(len(p.frames()) > n for p, n in zip(pages[1:], seen[1:])))
        assert len(pages[0].frames()) == seen[0], "a closed page got frames"
    finally:
        for p in pages:
            p.close()
    assert wait_for(lambda: not server.served.pages), "a closed page's queue stayed"
    time.sleep(0.2)  # the engine reads the Watch(None)
    frames = server.served.loop.frames
    load(server)
    assert server.served.loop.frames == frames, "frames were built after every page closed"


MARKER = "Quixotry of Zanzibar"


def raw_stream_of_a_request(srv) -> tuple[str, str, list[dict]]:
    """The raw text a page got while a prompt holding MARKER was answered, the answer's text,
    and the page's frames."""
    page = Page(f"http://127.0.0.1:{srv.port}")
    body = {"model": NAME, "prompt": f"{MARKER}.\n", "max_tokens": 48, "temperature": 0}
    try:
        answer = httpx.post(f"{srv.url}/completions", json=body | {"ignore_eos": True}).json()
        time.sleep(0.3)
    finally:
        page.close()
    return "\n".join(page.raw), answer["choices"][0]["text"], page.frames()


def test_the_stream_carries_no_prompt_or_answer_text_by_default(server):
    """A prompt with a marker is answered while a page watches: neither the marker nor any
    piece of the answer is in the page's stream, which names requests by key."""
    raw, answer, frames = raw_stream_of_a_request(server)
    assert MARKER not in raw and MARKER.lower() not in raw.lower()
    words = [w for w in answer.split() if len(w) > 3]
    assert words and not any(w in raw for w in words), [w for w in words if w in raw]
    assert any(s for f in frames for s in f["slots"]), "no frame showed the request"
    assert not any("texts" in f for f in frames)


def test_the_stream_carries_prompts_and_answers_when_the_server_shows_them(bundled):
    """A server started to show prompts (serve --show-prompts) sends each slot's prompt and
    its answer so far as text: the marker, and a beginning of the answer."""
    model, tok = bundled
    srv = Running(paged_engine(model), tok, show_prompts=True)
    try:
        raw, answer, frames = raw_stream_of_a_request(srv)
    finally:
        srv.stop()
    assert MARKER in raw
    texts = [t for f in frames for t in f.get("texts", {}).values()]
    assert any(MARKER in prompt for prompt, _ in texts), texts
    said = [a for _, a in texts if a]
    assert said and all(answer.startswith(a) for a in said), (said, answer)


def test_a_page_reconnects_to_a_server_restarted_on_its_port(bundled):
    """The stream tells the page to retry within RETRY_MS; the server stops (the stream ends),
    a new one starts on the same port, and the page, retrying, gets its hello and frames."""
    model, tok = bundled
    first = Running(paged_engine(model), tok)
    page = Page(f"http://127.0.0.1:{first.port}")
    assert wait_for(lambda: any(n == "hello" for n, _ in page.events))
    assert page.retry == live.RETRY_MS
    first.stop()
    assert page.ended.wait(10), "the stream outlived its server"
    second = Running(paged_engine(model), tok, port=first.port)
    try:
        for _ in range(20):  # as EventSource does: wait retry ms, open again
            time.sleep(page.retry / 1000)
            again = Page(f"http://127.0.0.1:{first.port}")
            if again.response is not None:
                break
        assert again.response is not None, "the restarted server's stream did not open"
        assert wait_for(lambda: len(again.frames()) >= 1)
        load(second, PROMPTS[:2])
        assert wait_for(lambda: again.frames()[-1]["steps"] > 0)
        again.close()
    finally:
        second.stop()


def test_a_page_hears_that_the_engine_restarts_then_serves(bundled):
    """The engine's process dies while a page watches: the page's beats say the engine
    restarts, and why, then that it is ok; frames come again from the new engine."""
    model, tok = bundled
    srv = Running(paged_engine(model), tok)
    page = Page(f"http://127.0.0.1:{srv.port}")
    try:
        assert wait_for(lambda: any(n == "beat" for n, _ in page.events))
        srv.served.loop.engine.process.kill()
        beats = lambda state: [d for n, d in page.events if n == "beat" and d["engine"] == state]
        assert wait_for(lambda: beats("restarting"), 60), page.events[-3:]
        assert "process ended" in beats("restarting")[0]["why"], beats("restarting")[0]
        seen = len(page.events)
        ok = lambda: any(d["engine"] == "ok" for n, d in page.events[seen:] if n == "beat")
        assert wait_for(ok, 120), "no ok beat in 120 s: a slow machine?"
        load(srv, PROMPTS[:2], max_tokens=4)
        assert wait_for(lambda: any(n == "frame" for n, _ in page.events[seen:])), "no frame"
    finally:
        page.close()
        srv.stop()


def test_a_page_past_the_most_gets_a_503_and_the_page_files_are_served(server, monkeypatch):
    """The page and its script and style are served (no address of elsewhere in them); past
    MAX_PAGES a new stream is refused with a 503, and the pages open go on."""
    base = f"http://127.0.0.1:{server.port}"
    for path, kind in [("/", "text/html"), ("/engine", "text/html")]:
        r = httpx.get(base + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    for name in live.PAGE_TYPES:
        text = live.page_file(name)[0].decode()
        assert "http://" not in text and "https://" not in text, name
        assert httpx.get(f"{base}/engine/{name}").status_code == 200 or name == "index.html"
    monkeypatch.setattr(live, "MAX_PAGES", 1)
    page = Page(base)
    try:
        assert wait_for(lambda: len(server.served.pages) == 1)
        r = httpx.get(f"{base}/engine/events")
        assert r.status_code == 503, r.text
        load(server, PROMPTS[:2])
        assert wait_for(lambda: len(page.frames()) >= 2)
    finally:
        page.close()


async def watch_at_once(url: str, n: int) -> list[tuple[int, set[str]]]:
    """n page streams opened at once, each held open until all n have their status: each one's
    status and, when served, the names of the events it read (until a hello and a frame)."""
    statuses, answered = [], asyncio.Event()

    async def watch(client) -> tuple[int, set[str]]:
        async with client.stream("GET", url) as r:
            statuses.append(r.status_code)
            if len(statuses) == n:
                answered.set()
            names = set()
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    names |= {line[6:].strip()} if line.startswith("event:") else set()
                    if {"hello", "frame"} <= names:
                        break
            await answered.wait()
            return r.status_code, names

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n), timeout=60) as client:
        return await asyncio.gather(*(watch(client) for _ in range(n)))


def test_two_hundred_pages_at_once_get_exactly_the_most_served_and_the_rest_a_503(server):
    """200 pages open their streams at once, twice: each time exactly MAX_PAGES are served (a
    hello and a frame each) and the others refused with a 503; once all close, none counts
    and a new page is served."""
    base, n = f"http://127.0.0.1:{server.port}", 200
    assert wait_for(lambda: not server.served.pages)
    for _ in range(2):
        answers = asyncio.run(watch_at_once(f"{base}/engine/events", n))
        served = [names for status, names in answers if status == 200]
        refused = [status for status, _ in answers if status != 200]
        assert len(served) == live.MAX_PAGES and refused == [503] * (n - live.MAX_PAGES), (
            f"{len(served)} pages served, refused with {sorted(set(refused))}"
        )
        assert all({"hello", "frame"} <= names for names in served), served
        assert wait_for(lambda: not server.served.pages), f"{len(server.served.pages)} stay"
    page = Page(base)
    try:
        assert page.response.status_code == 200
        assert wait_for(lambda: any(name == "hello" for name, _ in page.events))
    finally:
        page.close()


def test_a_page_that_reads_nothing_is_dropped_and_leaves_its_place(server, monkeypatch):
    """A page opens its stream and reads nothing, its connection kept: frames of 1 MB fill
    what its connection holds, then its queue; DROP_S (0.5 s) after it last took one, the
    page is dropped, and (MAX_PAGES 1) a new page is served in its place."""
    monkeypatch.setattr(live, "DROP_S", 0.5)
    monkeypatch.setattr(live, "MAX_PAGES", 1)
    base, pages = f"http://127.0.0.1:{server.port}", server.served.pages
    assert wait_for(lambda: not pages)
    with socket.socket() as reads_nothing:
        reads_nothing.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reads_nothing.connect(("127.0.0.1", server.port))
        reads_nothing.sendall(b"GET /engine/events HTTP/1.1\r\nHost: tinyllm\r\n\r\n")
        assert wait_for(lambda: len(pages) == 1)
        for _ in range(200):  # a frame of 1 MB every 0.05 s until the page is dropped
            server_loop(server).call_soon_threadsafe(pages.publish, {"pad": "x" * 2**20})
            time.sleep(0.05)
            if not pages:
                break
        assert not pages, "a page that reads nothing still holds its place (or too slow a machine)"
        page = Page(base)
        try:
            assert page.response.status_code == 200
            assert wait_for(lambda: any(name == "hello" for name, _ in page.events))
        finally:
            page.close()


def test_a_page_counted_whose_stream_never_starts_leaves_its_place(server, monkeypatch):
    """A page counted as it opens (Pages.open, as the route does) whose stream never starts,
    as when its client goes before the body: beats fill its queue (BEAT_S 0.1 s), and DROP_S
    (0.5 s) after it opened it no longer counts."""
    monkeypatch.setattr(live, "DROP_S", 0.5)
    monkeypatch.setattr(live, "BEAT_S", 0.1)
    pages = server.served.pages
    assert wait_for(lambda: not pages)

    async def open_page():
        return pages.open()

    page = asyncio.run_coroutine_threadsafe(open_page(), server_loop(server)).result(10)
    assert page is not None and len(pages) == 1
    assert wait_for(lambda: not pages), "a page whose stream never started still holds its place"


def test_each_frame_and_beat_is_built_once_for_all_the_pages(server, monkeypatch):
    """16 pages watch a run, then an idle engine, a beat due every 0.1 s (BEAT_S): each frame
    and each beat is written once for all the pages, not once a page (fewer beats are built
    than twice those the page that heard most heard; once a page would be 16 times as many)."""
    monkeypatch.setattr(live, "BEAT_S", 0.1)
    built, sse = Counter(), live.sse
    monkeypatch.setattr(live, "sse", lambda event, data: built.update([event]) or sse(event, data))
    handed, on_frame = [], server.served.loop.on_frame  # the engine's frames, while watched
    watched = lambda frame: handed.append(bool(server.served.pages)) or on_frame(frame)
    monkeypatch.setattr(server.served.loop, "on_frame", watched)
    beats = lambda page: sum(name == "beat" for name, _ in page.events)
    assert wait_for(lambda: not server.served.pages)
    pages = [Page(f"http://127.0.0.1:{server.port}") for _ in range(16)]
    try:
        load(server, PROMPTS[:2])
        assert wait_for(lambda: built["frame"] == sum(handed) >= 2), (built, sum(handed))
        assert wait_for(lambda: all(beats(p) >= 5 for p in pages)), "the machine was too slow"
        heard, beats_built = max(beats(p) for p in pages), built["beat"]
    finally:
        for p in pages:
            p.close()
    assert beats_built < 2 * heard, f"{beats_built} beats built, a page heard {heard} at most"


def test_the_sampler_builds_frames_only_while_watched_and_names_each_phase(bundled):
    """In the engine's process: unwatched, no step is sampled and no frame built; watched, a
    frame a step (every_s 0) with each slot's phase (a prompt computed in chunks of the token
    budget, then decodes) and the sampled step's tokens by kind; a slot cache has no pool to
    draw; the engine's own trace is given back after each sampled step; an idle engine is
    drawn once, and the step that wakes it at once."""
    from tinyllm.core.requests import Request
    from tinyllm.serving.messages import Watch

    model, tok = bundled
    engine = make_engine(model, EngineConfig(2, max_step_tokens=8))
    sampler, frames = live.Sampler(), []
    rid = engine.add_request(Request(tok.encode(PROMPTS[0]), 3))
    key_of = {rid: 7}
    for steps in range(1, 30):
        if steps == 2:
            sampler.watch(Watch(0.0))
        sampler.before_step(engine)
        if steps == 1:
            assert engine.trace is None, "a step was sampled with no page watching"
        engine.step()
        frame = sampler.after_step(engine, key_of, steps)
        assert engine.trace is None, "the engine's trace was not given back"
        if steps == 1:
            assert frame is None
        elif frame is not None:
            frames.append(frame)
        if not engine.has_work():
            break
    assert sampler.frames == len(frames) == steps - 1
    assert all(f["blocks"] is None for f in frames)
    n = len(tok.encode(PROMPTS[0]))
    chunks = [f["step"]["chunk"] for f in frames if f["step"]["chunk"]]
    assert all(c == 8 for c in chunks[:-1]) and 0 < chunks[-1] <= 8, chunks
    assert 8 + sum(chunks) == n, "the unwatched first chunk and the drawn ones make the prompt"
    phases = [f["slots"][0]["phase"] for f in frames if f["slots"][0]]
    assert phases[0] == "prefill" and phases[-1] == "decode", phases
    assert frames[0]["slots"][0]["key"] == 7 and frames[0]["slots"][0]["did"] == 8
    assert frames[-1]["slots"] == [None, None] and frames[-1]["step"]["decode"] == 1
    sampler.watch(Watch(60.0))  # a frame a minute: the idle engine, then the step that wakes it
    assert sampler.after_step(engine, key_of, steps)["slots"] == [None, None]
    assert sampler.after_step(engine, key_of, steps) is None, "the idle engine drawn twice"
    engine.add_request(Request(tok.encode(PROMPTS[1]), 4))
    for drawn in (True, False):
        sampler.before_step(engine)
        engine.step()
        assert (sampler.after_step(engine, key_of, steps) is not None) == drawn
    sampler.watch(Watch(None))
    engine.add_request(Request(tok.encode(PROMPTS[1]), 2))
    while engine.has_work():
        sampler.before_step(engine)
        assert engine.trace is None
        engine.step()
        assert sampler.after_step(engine, key_of, steps) is None


def test_loadgen_watchers_hold_pages_open_during_the_run(server):
    """`loadgen --watchers 2` holds two pages of the live view open while it sends, and closes
    them after."""
    most = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            most.append(len(server.served.pages))
            time.sleep(0.01)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        prompts = [(p, 16) for p in PROMPTS]
        records, _ = run(run_load(server.url, prompts, ignore_eos=True, watchers=2))
    finally:
        stop.set()
        counter.join()
    assert all(r.error is None for r in records)
    assert max(most) == 2, max(most)
    assert wait_for(lambda: not server.served.pages)


def test_the_counters_percentiles_read_histogram_buckets_as_prometheus_does():
    """p50/p90/p99 from bucket counts, as Prometheus' histogram_quantile: linear within the
    bucket the rank falls in (from 0 in the first), the last finite bound past it."""
    inf = float("inf")
    bounds, cumulative = [0.01, 0.05, 0.1, inf], [2.0, 6.0, 8.0, 10.0]
    assert live.quantile(bounds, cumulative, 0.1) == pytest.approx(0.01 * 1 / 2)
    assert live.quantile(bounds, cumulative, 0.5) == pytest.approx(0.01 + 0.04 * 3 / 4)
    assert live.quantile(bounds, cumulative, 0.99) == 0.1  # in the +Inf bucket
    name = "h_bucket"
    now = {(name, le): c for le, c in zip(bounds, cumulative)}
    then = {(name, le): 1.0 for le in bounds}  # one observation under 10 ms before the window
    assert live.percentiles(now, then, "h")[0] == pytest.approx(1e3 * (0.01 + 0.04 * 3.5 / 4))
    assert live.percentiles(then, then, "h") is None
