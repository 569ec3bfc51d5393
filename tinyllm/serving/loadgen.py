"""Step 10 - the load generator: a server measured the way serving systems are measured.

    python -m tinyllm loadgen --url http://127.0.0.1:8000/v1 --rate 4 --requests 64
    python -m tinyllm loadgen --url ... --rate 1,2,4,8 --json      # a sweep: latency against load

It speaks only the OpenAI API (streamed `/v1/completions`, read with httpx), so the same command
measures tinyllm's server, vLLM's, SGLang's, llama.cpp's or `transformers serve`. Requests
arrive open-loop at Poisson times of the given rate, or at a fixed concurrency (--concurrency
N). It reports what vLLM's benchmark reports: request throughput, output tokens per second, and
at p50 / p90 / p99 TTFT, TPOT, ITL and end-to-end latency; goodput is the rate of requests that
met the SLO (--slo-ttft-ms, --slo-tpot-ms). --watchers N holds N pages of tinyllm's live view
open meanwhile (live.py).

Seam: `percentile` (exercise 10).
"""

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class Record:
    """One request as the client saw it: when it was sent, when each chunk came, how many
    tokens it got (the usage the server reported, else one per chunk), and any error."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def latency(self) -> float:
        return self.chunks[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0-100) of xs, as numpy's default (np.percentile(xs, p)): p=0 is
    the smallest value, p=100 the largest, p=50 the median; between two values it interpolates
    linearly. 0.0 for no values. The caller's list keeps its order.
    Examples: percentile([3.0, 1.0, 2.0], 50) -> 2.0; percentile([10, 20, 30, 40], 50) ->
    25.0; percentile([10, 20, 30, 40], 90) -> 37.0; percentile([], 99) -> 0.0."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(
    records: list[Record],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict:
    """The serving figures of a run: counts, throughputs, and TTFT / TPOT / ITL / latency at
    p50, p90, p99 (milliseconds), and goodput (requests a second meeting the SLO)."""
    ok = [r for r in records if r.error is None and r.chunks]
    out = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_tok_s": sum(r.tokens for r in ok) / duration if duration else 0.0,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])],
        "e2e": [r.latency for r in ok],
    }
    for name, xs in series.items():
        out[f"{name}_mean_ms"] = 1e3 * sum(xs) / len(xs) if xs else 0.0
        for p in (50, 90, 99):
            out[f"{name}_p{p}_ms"] = 1e3 * percentile(xs, p)
    good = [
        r
        for r in ok
        if (slo_ttft is None or r.ttft * 1e3 <= slo_ttft)
        and (slo_tpot is None or (r.tpot or 0.0) * 1e3 <= slo_tpot)
    ]
    out["goodput"] = len(good) / duration if duration else 0.0
    return out


async def one_request(
    client, url: str, model: str, prompt: str, max_tokens: int, rec: Record, ignore_eos=False
) -> None:
    """Stream one completion (POST url/completions, server-sent events) into rec: a time per
    chunk with text, and the tokens made; with ignore_eos (vLLM's field) every request runs to
    its max_tokens. The events are read as plain JSON: a client that builds objects for every
    chunk would spend more than the server does."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if ignore_eos else {}),
    }
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    rec.chunks.append(time.perf_counter())
                    chunks += 1
                if event.get("usage"):
                    rec.tokens = event["usage"]["completion_tokens"]
            rec.tokens = rec.tokens or chunks
    except Exception as e:  # a failed request is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"


def run(coro):
    """Run a coroutine to its end, on uvloop's event loop where it is installed (the `serve`
    extra brings it): the client then spends less per chunk, and on a small machine leaves more
    of it to the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def run_load(
    url: str,
    prompts: list[tuple[str, int]],
    rate: float | None = None,
    concurrency: int | None = None,
    model: str | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    watchers: int = 0,
) -> tuple[list[Record], float]:
    """Send every (prompt, max_tokens): at Poisson arrivals of `rate` a second (None: all at
    once), or from `concurrency` clients each waiting for its last answer; with ignore_eos,
    each runs to its max_tokens; with watchers, that many pages of tinyllm's live view stay
    open meanwhile (`watch`). Returns the records and the run's duration in seconds."""
    import httpx

    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        if model is None:
            model = (await client.get(f"{url}/models")).json()["data"][0]["id"]
        pages = [asyncio.ensure_future(watch(client, url)) for _ in range(watchers)]
        try:
            return await send_all(client, url, model, prompts, rate, concurrency, seed, ignore_eos)
        finally:
            for page in pages:
                page.cancel()
            await asyncio.gather(*pages, return_exceptions=True)


async def watch(client, url: str) -> None:
    """One page of tinyllm's live view (GET /engine/events beside url's /v1), its events read
    and dropped, until cancelled: what an open page costs the server."""
    async with client.stream("GET", url.removesuffix("/v1") + "/engine/events") as resp:
        async for _ in resp.aiter_raw():
            pass


async def send_all(client, url, model, prompts, rate, concurrency, seed, ignore_eos):
    """run_load's requests, sent as it says: the records and the duration."""
    rng = random.Random(seed)
    records = [Record(0.0) for _ in prompts]
    t0 = time.perf_counter()

    async def send(i: int) -> None:
        records[i].sent = time.perf_counter()
        await one_request(client, url, model, *prompts[i], records[i], ignore_eos)

    if concurrency:
        nxt = iter(range(len(prompts)))

        async def worker():
            for i in nxt:
                await send(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        tasks, t = [], 0.0
        for i in range(len(prompts)):
            if rate:
                t += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tasks.append(asyncio.ensure_future(send(i)))
        await asyncio.gather(*tasks)
    return records, time.perf_counter() - t0


def prompts_of(workload: str, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) of a named workload (workloads.py), as text (any server's
    tokenizer reads it): its requests decoded with the bundled tokenizer."""
    from tinyllm.checkpoints.checkpoint import resolve
    from tinyllm.checkpoints.tokenizer import Tokenizer
    from tinyllm.core import workloads

    tok = Tokenizer.from_file(resolve("default") / "tokenizer.json")
    reqs, _ = workloads.workload(workload, tok, n, seed)
    return [(tok.decode(r.prompt), r.max_new_tokens) for r in reqs]


def table(rows: dict[str, dict]) -> str:
    """Runs side by side, one row per figure."""
    names = list(rows)
    w = [max(12, len(n) + 2) for n in names]
    lines = [f"{'':22}" + "".join(f"{n:>{k}}" for n, k in zip(names, w))]
    for key in rows[names[0]]:
        lines.append(
            f"{key:22}"
            + "".join(
                f"{rows[n][key]:>{k}.2f}"
                if isinstance(rows[n][key], float)
                else f"{rows[n][key]:>{k}}"
                for n, k in zip(names, w)
            )
        )
    return "\n".join(lines)


WATCHERS = (
    "hold N pages of tinyllm's live view open during each run (GET /engine/events): what "
    "watching the engine costs its server (default: 0)"
)


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m tinyllm loadgen`."""
    ap = argparse.ArgumentParser(
        prog="python -m tinyllm loadgen",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure an OpenAI-compatible server (tinyllm's, vLLM's, SGLang's, "
        "llama.cpp's, transformers serve) with streamed completions: open-loop "
        "Poisson arrivals or a fixed concurrency; throughput, TTFT, TPOT, ITL and "
        "latency at p50/p90/p99, and goodput under an SLO.",
        epilog="examples:\n"
        "  python -m tinyllm loadgen --url http://127.0.0.1:8000/v1 --rate 4 --requests 64\n"
        "  python -m tinyllm loadgen --url http://127.0.0.1:8000/v1 --rate 1,2,4,8\n"
        "  python -m tinyllm loadgen --url http://127.0.0.1:8000/v1 --concurrency 16",
    )
    ap.add_argument(
        "--url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1"
    )
    ap.add_argument(
        "--rate",
        default="4",
        metavar="R[,R...]",
        help="requests per second, Poisson arrivals; several for a sweep; "
        "inf: all at once (default: 4)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="instead of a rate: N clients, each sending its next request when its last ends",
    )
    ap.add_argument(
        "--requests", type=int, default=64, metavar="N", help="requests per run (default: 64)"
    )
    ap.add_argument(
        "--workload",
        default="longtail",
        metavar="NAME",
        help="a workload of `python -m tinyllm bench --help`, as text (default: longtail)",
    )
    ap.add_argument(
        "--model", default=None, help="the model name to ask for (default: the server's first)"
    )
    ap.add_argument(
        "--slo-ttft-ms", type=float, default=None, metavar="MS", help="goodput: TTFT at most MS"
    )
    ap.add_argument(
        "--slo-tpot-ms", type=float, default=None, metavar="MS", help="goodput: TPOT at most MS"
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request runs to its max_tokens (vLLM's ignore_eos, as `vllm bench serve "
        "--ignore-eos` and guidellm send it)",
    )
    ap.add_argument("--watchers", type=int, default=0, metavar="N", help=WATCHERS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        rates = [None if r.strip() in ("inf", "") else float(r) for r in args.rate.split(",")]
    except ValueError:
        ap.error(f"--rate takes numbers separated by commas, got {args.rate!r}")
    prompts = prompts_of(args.workload, args.requests, args.seed)
    runs = {}
    for rate in [None] if args.concurrency else rates:
        name = (
            f"concurrency {args.concurrency}"
            if args.concurrency
            else ("all at once" if rate is None else f"{rate:g} req/s")
        )
        records, duration = run(
            run_load(
                args.url,
                prompts,
                rate,
                args.concurrency,
                args.model,
                args.seed,
                args.ignore_eos,
                args.watchers,
            )
        )
        runs[name] = summarize(records, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        failed = [r.error for r in records if r.error]
        if failed and not args.json:
            print(f"{name}: {len(failed)} requests failed, the first with {failed[0]}")
    if args.json:
        summary = {"url": args.url, "workload": args.workload, "requests": args.requests}
        print(json.dumps({**summary, "runs": runs}, indent=2))
        return
    print(f"{args.url}: {args.requests} requests of {args.workload} per run\n")
    print(table(runs))
