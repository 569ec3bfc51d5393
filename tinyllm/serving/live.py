"""Step 10 - the engine drawn live: frames of its state, fanned out to the server's own page.

    python -m tinyllm serve --kv paged --prefix-cache    # then open http://127.0.0.1:8000/

The server's page (page/index.html, page.js, page.css) draws the engine as it serves, fed by
server-sent events (GET /engine/events) of frames the engine process builds from its own state,
read only. While no page is open the engine builds no frame (a `Watch` message says when pages
open and close); while pages watch, its `Sampler` builds one frame at most every EVERY_S
seconds, one more when the engine goes idle, and one of the step that wakes it. A frame
(`frame`) is a small dict, ready for JSON, riding on that step's report; the step lends it a
`StepPlan` through the engine's trace seam. `Pages` counts the open pages (MAX_PAGES at most,
the next one a 503) and fans each frame out to each as a bounded asyncio queue: a slow page
drops its oldest events, one that reads nothing is dropped after DROP_S. It adds counters from
the server's Prometheus metrics over WINDOW_S seconds. Token ids come only with --show-prompts.
"""

import asyncio
import json
import sys
import time
from collections import deque
from pathlib import Path

from tinyllm.core.paged_kv import held_counts
from tinyllm.serving.messages import Watch

EVERY_S = 0.1  # seconds between two frames at most: what a person can follow
TEXT_TOKENS = 48  # with --show-prompts: a prompt's first and an answer's last tokens a frame
WAITING_SHOWN = 32  # waiting requests a frame names (it counts them all)
MAX_PAGES = 64  # pages open at once; one more is answered 503
QUEUE_FRAMES = 4  # events a page may fall behind before its oldest are dropped
DROP_S = 10.0  # a page that takes nothing this long while its queue is full is dropped
BEAT_S = 1.0  # a page hears from the server at least this often
RETRY_MS = 1000  # EventSource's reconnection delay (the stream's `retry:` field)
WINDOW_S = 10.0  # the counters' window
COUNTERS_S = 0.5  # the window's figures are read again at most this often


# ---- the engine process's side ------------------------------------------------------------
class StepPlan:
    """The plan of one sampled step, lent to the engine as its trace (Trace's `record`): the
    tokens each slot computes, and the decoding slots among them; with the speculation counts
    and the clock before the step, for what the step verified and kept, and its time."""

    def __init__(self, engine):
        self.engine, self.computed, self.decodes = engine, [], set()
        st = engine.stats
        self.spec = (st.spec_proposed, st.spec_accepted)
        self.t0 = self.t1 = time.perf_counter()  # the step's start and end

    def record(self, holders, kv_used, kv_alloc=None, computed=None) -> None:
        """The engine's trace call, after its step's plan: computed[slot] tokens each slot
        computes (0: none). A slot that computes one token, with tokens made and no more of
        its context left, decodes; any other computes a prefill chunk."""
        running = self.engine.scheduler.running
        self.computed = list(computed or [])
        self.decodes = {
            s
            for s, n in enumerate(self.computed)
            if n == 1 and s in running and running[s].tokens and running[s].left() == 1
        }

    def summary(self) -> dict:
        """The step as the strip draws it: rows computed, prefill-chunk tokens, decode rows,
        guesses verified and kept (11), milliseconds."""
        st, (proposed, accepted) = self.engine.stats, self.spec
        chunk = sum(n for s, n in enumerate(self.computed) if s not in self.decodes)
        return {
            "rows": sum(n > 0 for n in self.computed),
            "chunk": chunk,
            "decode": len(self.decodes),
            "guesses": st.spec_proposed - proposed,
            "kept": st.spec_accepted - accepted,
            "ms": round(1e3 * (self.t1 - self.t0), 2),
        }


class Sampler:
    """The engine process's half of the live view: whether pages watch (`watch`, from the HTTP
    side's Watch messages), and the frames of its state, one at most every every_s seconds,
    one as the engine goes idle and one of the first step after. `before_step` lends the
    engine a StepPlan for a step whose frame is due; `after_step` builds the frame. Nothing is
    built while nobody watches."""

    def __init__(self):
        self.every_s, self.texts = None, False
        self.last, self.frames, self.plan = 0.0, 0, None
        self.lent = None  # the engine's own trace, given back after a sampled step
        self.idle_drawn = False

    def watch(self, message: Watch) -> None:
        """Pages opened (a frame is due at once) or all closed (none is built)."""
        self.every_s, self.texts = message.every_s, message.texts
        self.last, self.idle_drawn = 0.0, False

    def due(self) -> bool:
        return self.every_s is not None and time.monotonic() - self.last >= self.every_s

    def before_step(self, engine) -> None:
        """A step whose frame is due records its plan (StepPlan, as the engine's trace)."""
        if engine.has_work() and self.due():
            self.plan, self.lent = StepPlan(engine), engine.trace
            engine.trace = self.plan

    def after_step(self, engine, key_of: dict[int, int], steps: int) -> dict | None:
        """The frame of the engine's state after a sampled step, or after a turn that left the
        engine idle when the idle engine is not drawn yet; else None (a frame that falls due
        during a step waits for the next step, which is sampled). The first step after an idle
        frame is sampled: a page sees each burst of work begin."""
        plan, self.plan = self.plan, None
        if plan is not None:
            engine.trace, plan.t1 = self.lent, time.perf_counter()
        idle = not engine.has_work()
        if self.every_s is None or (plan is None and not (idle and not self.idle_drawn)):
            return None
        self.last, self.idle_drawn, self.frames = time.monotonic(), idle, self.frames + 1
        if idle:
            self.last = 0.0  # the next step, whenever it comes, is due
        return frame(engine, key_of, steps, plan, self.texts)


def frame(engine, key_of: dict[int, int], steps: int, plan: StepPlan | None, texts: bool) -> dict:
    """One frame of the engine's state, read only, as plain numbers and lists:
    steps: the engine's steps so far; slots: one entry a slot (slot_entry; None: free);
    waiting: the first WAITING_SHOWN waiting requests ({key, prompt, out}: its prompt's tokens,
    and the tokens it made before a preemption), n_waiting all of them, held: choices held
    until their first choice's prompt is computed; blocks: each pool block's holders (pool_of);
    step: the sampled step (StepPlan.summary; None: no step sampled); preemptions,
    prompt_tokens and cached_prompt_tokens: the engine's totals (a prefix cache's hits);
    kv_used: KV positions in use / reserved; texts (with texts only): {key: [the prompt's first
    TEXT_TOKENS token ids, the answer's last TEXT_TOKENS]}."""
    sched, st = engine.scheduler, engine.stats
    running = sched.running
    slots = [
        slot_entry(engine, s, running.get(s), key_of, plan) for s in range(engine.cache.n_slots)
    ]
    waiting = [
        {"key": key_of.get(q.rid, -1), "prompt": len(q.request.prompt), "out": len(q.tokens)}
        for q in list(sched.waiting)[:WAITING_SHOWN]
    ]
    out = {
        "steps": steps,
        "slots": slots,
        "waiting": waiting,
        "n_waiting": len(sched.waiting),
        "held": sum(len(h) for h in sched.held.values()),
        "blocks": pool_of(engine.cache),
        "step": None if plan is None else plan.summary(),
        "preemptions": st.preemptions,
        "prompt_tokens": st.prompt_tokens,
        "cached_prompt_tokens": st.cached_prompt_tokens,
        "kv_used": engine.kv_used_frac(),
    }
    if texts:
        out["texts"] = {
            key_of.get(q.rid, -1): [q.request.prompt[:TEXT_TOKENS], q.tokens[-TEXT_TOKENS:]]
            for q in list(running.values()) + list(sched.waiting)[:WAITING_SHOWN]
        }
    return out


def slot_entry(engine, slot: int, seq, key_of: dict[int, int], plan: StepPlan | None):
    """A busy slot as a frame draws it: key, phase (prefill: its context is being computed,
    recompute: the same after a preemption, decode, or speculate for a speculating engine's
    decode), prompt (tokens), computed (context tokens its slot holds), cached (of them, served
    by a prefix cache at admission), out and max_new (tokens made, and at most), did (tokens it
    computed in the sampled step), grammar (a constrained request, 12), and table (its block
    table, on a paged pool). None for a free slot."""
    if seq is None:
        return None
    if seq.left() > 1:
        phase = "recompute" if seq.tokens else "prefill"
    else:
        phase = "decode" if engine.config.speculate is None else "speculate"
    entry = {
        "key": key_of.get(seq.rid, -1),
        "phase": phase,
        "prompt": len(seq.request.prompt),
        "computed": seq.num_computed_tokens,
        "cached": seq.num_cached_tokens,
        "out": len(seq.tokens),
        "max_new": seq.request.max_new_tokens,
        "did": plan.computed[slot] if plan is not None and slot < len(plan.computed) else 0,
        "grammar": seq.matcher is not None,
    }
    if engine.cache.n_blocks is not None:
        entry["table"] = list(engine.cache.tables[slot])
    return entry


def pool_of(cache) -> list[int] | None:
    """A paged pool's blocks (05), each as the block tables holding it (0: free; 2 or more:
    shared by a prefix cache, 08), or -1 for a cached block nobody holds (evictable); None for
    a cache without blocks (04's slots)."""
    if cache.n_blocks is None:
        return None
    holders = held_counts(cache.tables, cache.n_blocks)
    if cache.prefix is not None:
        for b in cache.prefix.evictable:
            holders[b] = -1
    return holders


def block_counts(cache) -> tuple[int, int] | None:
    """A paged pool's (blocks held by block tables, cached blocks nobody holds), counted from
    its free lists at no cost; None for a cache without blocks."""
    if cache.n_blocks is None:
        return None
    cached = 0 if cache.prefix is None else len(cache.prefix.evictable)
    return cache.n_blocks - cache.allocator.n_free() - cached, cached


# ---- the HTTP side's: the fan-out to the open pages ---------------------------------------
class Page:
    """One open page of the live view: its queue of at most QUEUE_FRAMES events, when its
    stream last took one (`took`), and whether it has left its place (`closed`)."""

    def __init__(self):
        self.queue: asyncio.Queue[str] = asyncio.Queue(QUEUE_FRAMES)
        self.took = time.monotonic()  # as it opens
        self.closed = False

    def put(self, event: str) -> None:
        """One ready event in; a full queue loses its oldest (this page is behind)."""
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(event)

    async def take(self) -> str:
        event = await self.queue.get()
        self.took = time.monotonic()
        return event

    def stalled(self, now: float) -> bool:
        """Its queue is full and its stream took nothing for DROP_S: the page reads nothing."""
        return self.queue.full() and now - self.took >= DROP_S


class Pages:
    """The open pages of the live view (`Page`s, MAX_PAGES at most, counted as they open), and
    each event fanned out to all of them (`fan_out`): an engine frame as it comes (`publish`),
    a beat when no event went out for BEAT_S (`beats`, one task for all the pages). An event is
    written once whatever the number of pages; a page costs the putting of it in its queue and
    the sending. A page whose queue is full loses its oldest event, so a slow page falls behind
    alone; a page that took nothing for DROP_S while its queue is full is dropped: it leaves
    its place, and its stream ends when it next wakes (a page that reads nothing, once its
    connection's buffers are full, or one whose stream never started). The first page to open
    sends the engine Watch(EVERY_S), the last to leave Watch(None). A page that opens gets
    `hello` (what is served) and the last frame at once. show_prompts: frames carry the slots'
    prompts and answers as text (serve --show-prompts); otherwise the stream holds no text of
    a request."""

    def __init__(self, served, show_prompts: bool = False):
        self.served, self.show_prompts = served, show_prompts
        self.open_pages: list[Page] = []
        self.last: str | None = None  # the last frame's event
        self.sent = 0.0  # when the last event went out
        self.beating: asyncio.Task | None = None  # `beats`, while pages are open
        self.counters = Counters(served)
        self.stopping = False

    def __len__(self) -> int:
        return len(self.open_pages)

    def stop(self) -> None:
        """The server stops: every page's stream ends within BEAT_S (a graceful stop waits for
        the streams in flight to end), and its page reconnects to the next server there.
        Callable from any thread."""
        self.stopping = True

    def open(self) -> Page | None:
        """A new page, holding its place from now on, or None past MAX_PAGES. The first page
        tells the engine to build frames, and starts the beats. Called on the event loop."""
        if len(self.open_pages) >= MAX_PAGES:
            return None
        page = Page()
        self.open_pages.append(page)
        if len(self.open_pages) == 1:
            self.counters.seen.clear()
            self.tell_engine(EVERY_S)
            self.sent = time.monotonic()
            self.beating = asyncio.get_running_loop().create_task(self.beats())
        return page

    def close(self, page: Page) -> None:
        """A page leaves its place (its stream ended, or it was dropped); after the last one,
        no frame is built, none is kept, and no beat is sent."""
        if page.closed:
            return
        page.closed = True
        self.open_pages.remove(page)
        if not self.open_pages:
            self.tell_engine(None)
            self.beating.cancel()
            self.last = None

    def tell_engine(self, every_s: float | None) -> None:
        self.served.loop.watch(Watch(every_s, self.show_prompts))  # and each engine after it

    def fan_out(self, event: str) -> None:
        """One ready event to every open page, the pages that read nothing dropped first."""
        self.sent = now = time.monotonic()
        for page in [p for p in self.open_pages if p.stalled(now)]:
            self.close(page)
        for page in self.open_pages:
            page.put(event)

    def publish(self, live: dict) -> None:
        """One engine frame to every open page: the counters added, token ids made text (with
        show_prompts), written as one event for all of them. A frame that cannot be written
        is said on stderr and dropped: the engine and its requests go on."""
        if not self.open_pages:
            return
        try:
            live["counters"] = self.counters.now()
            if "texts" in live:
                decode = self.served.tok.decode
                live["texts"] = {k: [decode(p), decode(a)] for k, (p, a) in live["texts"].items()}
            event = sse("frame", live)
        except Exception as e:
            print(f"the live view dropped a frame: {type(e).__name__}: {e}", file=sys.stderr)
            return
        self.last = event
        self.fan_out(event)

    async def beats(self) -> None:
        """While pages are open: one beat for all of them whenever no event went out for
        BEAT_S. A beat that cannot be built goes out empty (said on stderr): the pages still
        hear the server, and wake."""
        while True:
            await asyncio.sleep(self.sent + BEAT_S - time.monotonic())
            if time.monotonic() - self.sent < BEAT_S:
                continue  # a frame went out meanwhile
            try:
                event = self.beat()
            except Exception as e:
                print(f"the live view's beat failed: {type(e).__name__}: {e}", file=sys.stderr)
                event = sse("beat", {})
            self.fan_out(event)

    def hello(self) -> str:
        """What a page draws before any frame: the model, what is served, the slots."""
        about, texts = self.served.about, self.show_prompts
        hello = {"model": self.served.name, "serving": about, "every_s": EVERY_S, "texts": texts}
        return sse("hello", hello)

    def beat(self) -> str:
        """The engine's state as /health says it (ok, busy, starting, restarting or failed, and
        why: the engine loop's health, read here only) and the counters as they are."""
        verdict = self.served.loop.health()
        beat = {"engine": verdict.status, "why": verdict.why}
        return sse("beat", beat | {"counters": self.counters.now()})

    async def events(self, http, page: Page):
        """The event stream of an open page (`open`): the reconnection delay, hello, the last
        frame, then each event fanned out to it, until its client disconnects (seen at a beat),
        it is dropped, or the server stops; then it leaves its place."""
        try:
            yield f"retry: {RETRY_MS}\n\n" + self.hello()
            if self.last is not None:
                yield self.last
            while not (self.stopping or page.closed):
                event = await page.take()
                if event.startswith("event: beat") and await http.is_disconnected():
                    return
                yield event
        finally:
            self.close(page)


PAGE = Path(__file__).parent / "page"  # the page's files, beside this module
PAGE_TYPES = {"index.html": "text/html", "page.js": "text/javascript", "page.css": "text/css"}


def page_file(name: str) -> tuple[bytes, str]:
    """One of the page's files (PAGE_TYPES' names only): its bytes and its media type."""
    return (PAGE / name).read_bytes(), PAGE_TYPES[name] + "; charset=utf-8"


def sse(event: str, data: dict) -> str:
    """One named server-sent event: its name, its data as one line of JSON."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class Counters:
    """What a serving engineer watches, from the server's metrics (server.Metrics) and its
    engine loop: tokens and requests a second, TTFT and inter-token latency at p50/p90/p99
    (ms), all over the last WINDOW_S seconds, the percentiles from the histograms' buckets as
    Prometheus' histogram_quantile reads them; KV use, the acceptance rate of guesses (11),
    requests served, 429s, requests running and waiting."""

    def __init__(self, served):
        self.served = served
        self.seen: deque[tuple[float, dict]] = deque()  # (time, samples) over the window
        self.windowed: dict = {}  # the figures of the window, as last read

    def now(self) -> dict:
        """The counters: the window's figures, read again at most every COUNTERS_S, and the
        engine loop's as they are."""
        loop, spec = self.served.loop, self.served.loop.speculation
        if not self.seen or time.monotonic() - self.seen[-1][0] >= COUNTERS_S:
            self.windowed = self.window()
        waiting, running = loop.request_counts()
        return self.windowed | {
            "kv_used": loop.kv_used,
            "acceptance": spec.accepted / spec.proposed if spec.proposed else None,
            "running": running,
            "waiting": waiting,
        }

    def window(self) -> dict:
        """Rates and percentiles since the oldest sampling of the last WINDOW_S seconds, and
        the totals served and refused."""
        t, samples = time.monotonic(), self.samples()
        self.seen.append((t, samples))
        while len(self.seen) > 2 and t - self.seen[1][0] >= WINDOW_S:
            self.seen.popleft()
        t0, then = self.seen[0]
        dt = t - t0
        gap = lambda name: samples.get(name, 0.0) - then.get(name, 0.0)
        return {
            "tok_s": gap("tinyllm_generation_tokens_total") / dt if dt > 0 else 0.0,
            "req_s": gap(FINISHED) / dt if dt > 0 else 0.0,
            "ttft_ms": percentiles(samples, then, "tinyllm_time_to_first_token_seconds"),
            "itl_ms": percentiles(samples, then, "tinyllm_inter_token_latency_seconds"),
            "served": samples.get(FINISHED, 0.0),
            "rejected": samples.get("tinyllm_requests_rejected_total", 0.0),
        }

    def samples(self) -> dict:
        """The metrics' samples: {name or (name, le): value}, finished requests summed."""
        out = {FINISHED: 0.0}
        for metric in self.served.metrics.registry.collect():
            for s in metric.samples:
                if s.name == "tinyllm_requests_finished_total":
                    out[FINISHED] += s.value
                elif "le" in s.labels:
                    out[(s.name, float(s.labels["le"]))] = s.value
                else:
                    out[s.name] = s.value
        return out


FINISHED = "finished"  # requests finished, every finish reason


def percentiles(now: dict, then: dict, histogram: str) -> list[float] | None:
    """p50, p90 and p99 (ms) of a histogram's observations between two samplings; None
    when none came."""
    name = histogram + "_bucket"
    bounds = sorted(le for key, le in (k for k in now if isinstance(k, tuple)) if key == name)
    counts = [now[(name, le)] - then.get((name, le), 0.0) for le in bounds]
    if not counts or counts[-1] <= 0:
        return None
    return [round(1e3 * quantile(bounds, counts, q), 1) for q in (0.5, 0.9, 0.99)]


def quantile(bounds: list[float], cumulative: list[float], q: float) -> float:
    """The q-quantile of a histogram, as Prometheus' histogram_quantile: the bucket where the
    cumulative count reaches q of the total, linearly within it; past the last finite bound,
    that bound. bounds: the buckets' upper bounds, increasing (the last inf)."""
    rank = q * cumulative[-1]
    for i, (le, c) in enumerate(zip(bounds, cumulative)):
        if c >= rank:
            if le == float("inf"):
                return bounds[i - 1] if i else 0.0
            lo, below = (bounds[i - 1], cumulative[i - 1]) if i else (0.0, 0.0)
            return lo + (le - lo) * (rank - below) / max(c - below, 1e-12)
    return bounds[-2] if len(bounds) > 1 else 0.0
