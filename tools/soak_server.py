"""Repository tooling (not part of the package) - the server soaked: the real `serve` under a
mixed load and faults, while CPU hogs load the machine, then checked for what it lost and left.

    python tools/soak_server.py --minutes 10            # or: make soak-server MINUTES=10
    python tools/soak_server.py --minutes 2 --hogs 4 --tp 2 --json soak.json

It starts `python -m tinyllm serve` (a paged pool with a prefix cache; with --tp 2, the model
over two ranks) and --hogs processes that only burn CPU, then for --minutes runs, all at once:
plain streamed requests (their time to first token measured), heavy ones (n choices, logprobs
and prompt logprobs over long prompts), clients that leave mid-answer, constraints of the
largest size the server checks, abandoned after half a second, and one over it, crowds of live
pages (more than the server feeds, a few that never read), and /health every 100 ms. Faults
come in turn: the engine process paused for --pause seconds and resumed (it must stay a live,
busy engine: no 503, no restart), the engine killed, and with --tp 2 a rank paused past the
engine timeout and a rank killed (each must end in a restart). A request ends answered, refused
as it should be (a 400 for the oversized constraint, a 429 when full, a 503 for a page past the
most), failed by a restart that was due, or left by its client; anything else is lost.
Afterwards the engine must be idle with no block held, /health ok, the restarts those due, and
SIGTERM must end a stream in flight with an error event and the server with status 0. It prints
what it saw, and exits 1 when something failed.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyllm.serving.loadgen import percentile  # noqa: E402

NAME = "tinyllm-shakespeare"
PROMPTS = ["Ham.\nTo be, or not", "Rom.\nBut soft", "Lear.\nBlow, winds", "Jul.\nO Romeo",
           "Macb.\nIs this a dagger", "Oth.\nIt is the cause", "Nurse.\n", "Fool.\n"]  # fmt: skip
LONG = " ".join(PROMPTS) * 4  # 450 characters: up to about 350 tokens
RESTARTS = "; the server restarts it"  # how a request the engine held when it failed ends


@dataclass
class Outcome:
    """One request as its client saw it: what it was, when it was sent and ended, its status,
    the time to its first token (plain streams), and how it ended."""

    kind: str
    sent: float
    ended: float = 0.0
    status: int = 0
    ttft: float | None = None
    said: str = ""
    end: str = "lost"  # answered, refused, restarted, left or lost


@dataclass
class Soak:
    """What the run saw: every request's outcome, /health's answers (time, seconds, status,
    state), the faults (kind, start, recovered), the page crowds, the load averages."""

    outcomes: list[Outcome] = field(default_factory=list)
    health: list[tuple[float, float, int, str]] = field(default_factory=list)
    faults: list[tuple[str, float, float]] = field(default_factory=list)
    pages: list[tuple[int, int]] = field(default_factory=list)  # (served, refused) per crowd
    load: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# ---- the processes ------------------------------------------------------------------------------
def start_server(port: int, args, log: Path) -> subprocess.Popen:
    flags = ["--port", str(port), "--kv", "paged", "--prefix-cache", "--slots", str(args.slots),
             "--engine-timeout", str(args.engine_timeout)]  # fmt: skip
    if args.tp > 1:
        flags += ["--tensor-parallel-size", str(args.tp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = log.open("w")
    cmd = [sys.executable, "-m", "tinyllm", "serve", *flags]
    server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    t0 = time.monotonic()
    while "serving " not in log.read_text():
        if server.poll() is not None or time.monotonic() - t0 > 600:
            raise SystemExit(f"the server did not start (a slow machine?):\n{log.read_text()}")
        time.sleep(0.2)
    return server


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


# ---- the clients --------------------------------------------------------------------------------
class Clients:
    """The load: each kind of client a loop until `until`, each request's Outcome kept."""

    def __init__(self, base: str, soak: Soak, until: float, constraint_bytes: int):
        self.base, self.soak, self.until = base, soak, until
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=None)
        )
        self.choices = choices_of(constraint_bytes)
        self.oversized = choices_of(2 * constraint_bytes + 4096)

    def running(self) -> bool:
        return time.monotonic() < self.until

    async def stream(self, kind: str, body: dict, leave_after: int | None = None) -> Outcome:
        """A streamed completion: its first token's time, and how it ended (left after
        leave_after chunks, when given)."""
        out = Outcome(kind, time.monotonic())
        self.soak.outcomes.append(out)
        try:
            async with self.http.stream("POST", self.base + "/v1/completions", json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.said = (await r.aread()).decode(errors="replace")[:300]
                    return out
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out.end = "answered"
                        return out
                    data = json.loads(line[6:])
                    if "error" in data:
                        out.said = data["error"]["message"]
                        return out
                    if out.ttft is None:
                        out.ttft = time.monotonic() - out.sent
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        out.end = "left"
                        return out
        except httpx.HTTPError as e:
            out.said = f"{type(e).__name__}: {e}"
        finally:
            out.ended = time.monotonic()
        return out

    async def post(self, kind: str, body: dict, leave_s: float | None = None) -> Outcome:
        """A completion answered in one body (left after leave_s seconds, when given)."""
        out = Outcome(kind, time.monotonic())
        self.soak.outcomes.append(out)
        try:
            call = self.http.post(self.base + "/v1/completions", json=body)
            r = await (call if leave_s is None else asyncio.wait_for(call, leave_s))
            out.status, out.said = r.status_code, r.text[:300]
            out.end = "answered" if r.status_code == 200 else "lost"
        except asyncio.TimeoutError:
            out.end = "left"
        except httpx.HTTPError as e:
            out.said = f"{type(e).__name__}: {e}"
        finally:
            out.ended = time.monotonic()
        return out

    async def plain(self, seed: int) -> None:
        rng = random.Random(seed)
        while self.running():
            body = {"model": NAME, "prompt": rng.choice(PROMPTS), "stream": True,
                    "max_tokens": rng.randint(8, 32), "temperature": 0}  # fmt: skip
            await self.stream("plain", body)

    async def heavy(self, seed: int) -> None:
        rng = random.Random(seed)
        while self.running():
            body = {"model": NAME, "prompt": LONG[: rng.randint(150, 450)], "n": 8,
                    "logprobs": 5, "prompt_logprobs": 20, "max_tokens": 16,
                    "temperature": 1.0, "seed": rng.randint(0, 9999)}  # fmt: skip
            await self.post("heavy", body)

    async def leaving(self, seed: int) -> None:
        rng = random.Random(seed)
        while self.running():
            body = {"model": NAME, "prompt": rng.choice(PROMPTS), "max_tokens": 200,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            if rng.random() < 0.5:
                await self.stream("leaving", {**body, "stream": True}, leave_after=3)
            else:
                await self.post("leaving", body, leave_s=rng.uniform(0.2, 1.0))

    async def constraints(self, seed: int) -> None:
        """Constraints of the largest size the server checks, each abandoned after half a
        second; now and then one over the size, to be refused."""
        rng = random.Random(seed)
        while self.running():
            over = rng.random() < 0.1
            body = {"model": NAME, "prompt": "Ham.\n", "max_tokens": 8,
                    "guided_choice": self.oversized if over else self.choices}  # fmt: skip
            out = await self.post("constraint", body, leave_s=None if over else 0.5)
            if over and out.status == 400 and "guided_choice" in out.said:
                out.end = "refused"

    async def crowds(self, every_s: float, size: int, stalled: int) -> None:
        """Every every_s seconds, size pages open the live view at once, and read for 2 s;
        stalled more open and never read."""
        while self.running():
            await asyncio.sleep(every_s)
            frozen = [await self.open_stalled() for _ in range(stalled)]
            got = await asyncio.gather(*(self.page() for _ in range(size)))
            self.soak.pages.append((got.count(200), got.count(503)))
            for r in frozen:
                if r is not None:
                    await r.aclose()

    async def page(self) -> int:
        try:
            async with self.http.stream("GET", self.base + "/engine/events") as r:
                if r.status_code == 200:
                    t0 = time.monotonic()
                    async for _ in r.aiter_raw():
                        if time.monotonic() - t0 > 2:
                            break
                return r.status_code
        except httpx.HTTPError:
            return 0

    async def open_stalled(self):
        """A page that opens the stream and never reads it; None if it got no stream."""
        try:
            r = await self.http.send(
                self.http.build_request("GET", self.base + "/engine/events"), stream=True
            )
        except httpx.HTTPError:
            return None
        return r

    async def watch_health(self) -> None:
        async with httpx.AsyncClient(timeout=600.0) as http:
            while self.running():
                t0 = time.monotonic()
                try:
                    r = await http.get(self.base + "/health")
                    state = r.json().get("status", "?")
                    code = r.status_code
                except httpx.HTTPError as e:
                    code, state = 0, type(e).__name__
                self.soak.health.append((t0, time.monotonic() - t0, code, state))
                await asyncio.sleep(0.1)


def choices_of(size: int) -> list[str]:
    """A guided_choice whose grammar is about size bytes."""
    verse = "to be or not to be, that is the question "
    return [f"{i:06d} {verse}" for i in range(max(1, (size - 64) // (len(verse) + 14)))]


# ---- the faults ---------------------------------------------------------------------------------
async def faults(server: subprocess.Popen, base: str, args, soak: Soak, until: float) -> None:
    """The faults, in turn, spread over the run: each recorded with the time it began and the
    time /health said ok again."""
    kinds = ["pause engine", "kill engine"] + (["pause rank", "kill rank"] if args.tp > 1 else [])
    gap = (until - time.monotonic()) / (len(kinds) + 1)
    for kind in kinds:
        await asyncio.sleep(gap * random.uniform(0.6, 1.0))
        serving = httpx.get(base + "/health", timeout=600).json().get("processes", {})
        pid = serving.get("the engine's process" if kind.endswith("engine") else "rank 1")
        if pid is None:
            soak.problems.append(f"{kind}: /health names no such process: {serving}")
            continue
        t0 = time.monotonic()
        if kind.startswith("kill"):
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            pause = args.pause if kind == "pause engine" else 2 * args.engine_timeout + 5
            await asyncio.sleep(pause)
            with contextlib.suppress(ProcessLookupError):  # a hung one was ended meanwhile
                os.kill(pid, signal.SIGCONT)
        gone = pid if kind.startswith("kill") else None
        soak.faults.append((kind, t0, await ok_again(base, t0, gone)))


async def ok_again(base: str, since: float, gone: int | None = None) -> float:
    """When /health says ok again after a fault (it may say busy, or restarting, meanwhile),
    naming no longer the killed process `gone`: a kill's first /health may still say ok, before
    the watchdog looks, and the restart it is due comes after."""
    async with httpx.AsyncClient(timeout=600.0) as http:
        while True:
            try:
                r = await http.get(base + "/health")
                said = r.json() if r.status_code == 200 else {}
                if said.get("status") == "ok" and gone not in said.get("processes", {}).values():
                    return time.monotonic()
            except httpx.HTTPError:
                pass
            if time.monotonic() - since > 900:
                return time.monotonic()
            await asyncio.sleep(0.2)


async def load_average(soak: Soak, until: float) -> None:
    while time.monotonic() < until:
        soak.load.append(float(Path("/proc/loadavg").read_text().split()[0]))
        await asyncio.sleep(5)


# ---- the run, and what it left ------------------------------------------------------------------
async def baseline(base: str, n: int = 12) -> list[float]:
    """Times to first token of n plain streams, one at a time, on the idle server."""
    clients, soak = Clients(base, Soak(), time.monotonic() + 3600, 1), Soak()
    clients.soak = soak
    for i in range(n):
        body = {"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)], "stream": True,
                "max_tokens": 8, "temperature": 0}  # fmt: skip
        await clients.stream("plain", body)
    await clients.http.aclose()
    return [o.ttft for o in soak.outcomes if o.ttft is not None]


async def run(base: str, server: subprocess.Popen, args, soak: Soak, constraint_bytes: int):
    until = time.monotonic() + 60 * args.minutes
    c = Clients(base, soak, until, constraint_bytes)
    tasks = [c.plain(i) for i in range(args.plain)] + [c.heavy(i) for i in range(args.heavy)]
    tasks += [c.leaving(i) for i in range(args.leaving)]
    tasks += [c.constraints(i) for i in range(args.constraints)]
    tasks += [c.crowds(args.crowd_every, args.crowd, stalled=2), c.watch_health()]
    tasks += [faults(server, base, args, soak, until), load_average(soak, until)]
    await asyncio.gather(*tasks)
    await c.http.aclose()


def judge(soak: Soak, max_pages: int, crowd: int) -> None:
    """Each request's end, and what went wrong (soak.problems)."""
    due = [(t0, t1) for kind, t0, t1 in soak.faults if kind != "pause engine"]
    in_due = lambda a, b: any(a <= t1 and b >= t0 - 1.0 for t0, t1 in due)
    for out in soak.outcomes:
        if out.end != "lost":
            continue
        if out.status == 429 and "the server is full" in out.said:
            out.end = "refused"
        elif RESTARTS in out.said and in_due(out.sent, out.ended):
            out.end = "restarted"
        else:
            soak.problems.append(f"a {out.kind} request was lost: {out.status} {out.said!r}")
    for t, seconds, code, state in soak.health:
        if code == 503 and not in_due(t, t + seconds):
            soak.problems.append(f"/health said 503 ({state}) with no restart due")
        elif code not in (200, 503):
            soak.problems.append(f"/health got no answer: {state}")
    for served, refused in soak.pages:
        if served > max_pages or served + refused != crowd:
            soak.problems.append(f"a crowd of {crowd} pages: {served} served, {refused} refused")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def settled(base: str, restarts_due: int, soak: Soak) -> dict:
    """Once the engine is idle: nothing running or waiting, no block held, /health ok, the
    restarts those due -> the figures."""
    t0 = time.monotonic()
    while True:
        text = httpx.get(base + "/metrics", timeout=600).text
        busy = metric(text, "tinyllm_requests_running") + metric(text, "tinyllm_requests_waiting")
        if busy == 0 or time.monotonic() - t0 > 600:
            break
        time.sleep(0.5)
    health = httpx.get(base + "/health", timeout=600).json()
    held = metric(text, 'tinyllm_kv_blocks{state="held"}')
    restarts = int(metric(text, "tinyllm_engine_restarts_total"))
    if busy:
        soak.problems.append(f"the engine did not go idle: {busy:.0f} requests in it")
    if held:
        soak.problems.append(f"{held:.0f} blocks are still held by no request")
    if health["status"] != "ok" or health["kv_cache"] != "ok":
        soak.problems.append(f"/health after the run: {health}")
    if restarts != restarts_due:
        soak.problems.append(f"{restarts} restarts, where {restarts_due} were due")
    return {"restarts": restarts, "blocks_held": held, "health": health["status"]}


def sigterm(server: subprocess.Popen, base: str, soak: Soak) -> dict:
    """SIGTERM while a stream is in flight: the stream ends with an error event, the server
    with status 0."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    said, t0 = None, time.monotonic()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            said = f"{r.status_code} before it streamed: {r.read().decode()[:300]}"
        for line in r.iter_lines():
            if line.startswith("data: {") and said is None:
                said = "begun"
                server.send_signal(signal.SIGTERM)
            elif line.startswith("data: ") and "error" in line:
                said = json.loads(line[6:])["error"]["message"]
    if said is None or said.startswith(f"{r.status_code} before"):
        server.send_signal(signal.SIGTERM)
    try:
        status = server.wait(120)
    except subprocess.TimeoutExpired:
        status = "none in 120 s"
    if said != "the server is stopping":
        soak.problems.append(f"the stream in flight at SIGTERM ended with {said!r}")
    if status != 0:
        soak.problems.append(f"the server exited {status} after SIGTERM")
    return {"stream_said": said, "exit_status": status, "stop_s": time.monotonic() - t0}


def report(soak: Soak, idle: list[float], extra: dict) -> dict:
    ends = {}
    for out in soak.outcomes:
        ends.setdefault(out.kind, {}).setdefault(out.end, 0)
        ends[out.kind][out.end] += 1
    plain = [o.ttft for o in soak.outcomes if o.kind == "plain" and o.ttft is not None]
    health = [s for _, s, _, _ in soak.health]
    begin = soak.faults[0][1] if soak.faults else 0.0
    return {
        "requests": len(soak.outcomes),
        "ends": ends,
        "faults": [(k, round(t0 - begin, 1), round(t1 - t0, 1)) for k, t0, t1 in soak.faults],
        "health_answers": len(health),
        "health_longest_s": max(health, default=0.0),
        "health_p99_s": percentile(health, 99),
        "health_503": sum(code == 503 for _, _, code, _ in soak.health),
        "health_busy": sum(state == "busy" for *_, state in soak.health),
        "ttft_idle_p50_s": percentile(idle, 50),
        "ttft_plain_p50_s": percentile(plain, 50),
        "ttft_plain_p99_s": percentile(plain, 99),
        "pages_served_refused": soak.pages,
        "load_average": [
            min(soak.load, default=0),
            percentile(soak.load, 50),
            max(soak.load, default=0),
        ],  # fmt: skip
        **extra,
        "problems": soak.problems,
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    ap.add_argument("--hogs", type=int, default=4 * os.cpu_count(), help="CPU-burning processes")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the served model (1 or 2)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--engine-timeout", type=float, default=15.0, help="serve --engine-timeout")
    ap.add_argument("--pause", type=float, default=8.0, help="seconds the engine is paused")
    ap.add_argument("--plain", type=int, default=6, help="clients of plain streams")
    ap.add_argument("--heavy", type=int, default=1, help="clients of heavy requests")
    ap.add_argument("--leaving", type=int, default=2, help="clients that leave mid-answer")
    ap.add_argument("--constraints", type=int, default=2, help="clients of big constraints")
    ap.add_argument("--crowd", type=int, default=80, help="pages in each crowd")
    ap.add_argument("--crowd-every", type=float, default=20.0, help="seconds between crowds")
    ap.add_argument("--json", metavar="FILE", help="write the report here too")
    return ap


def main(argv=None) -> int:
    from tests.conftest import free_port
    from tinyllm.serving import api, live

    args = parser().parse_args(argv)
    port, soak = free_port(), Soak()
    base, log = (
        f"http://127.0.0.1:{port}",
        Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{port}.log",
    )
    server = start_server(port, args, log)
    hogging = []
    try:
        idle = asyncio.run(baseline(base))
        hogging = hogs(args.hogs)
        asyncio.run(run(base, server, args, soak, api.MAX_CONSTRAINT))
        for h in hogging:
            h.kill()
        judge(soak, live.MAX_PAGES, args.crowd)
        due = sum(kind != "pause engine" for kind, *_ in soak.faults)
        extra = settled(base, due, soak) | sigterm(server, base, soak)
    finally:
        for h in hogging:
            h.kill()
        if server.poll() is None:
            server.kill()
    result = report(soak, idle, extra)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if soak.problems:
        print(f"soak: {len(soak.problems)} problems; the server's log: {log}", file=sys.stderr)
        return 1
    log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
