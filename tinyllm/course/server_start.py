"""Steps 10 and 13 - a server's start, timed: how long `serve` takes to its first token.

    python -m tinyllm bench --model smollm2 --serve-start --decoder pieces --rounds 3
    python -m tinyllm bench --model smollm2 --serve-start --empty-caches --quant int8

`measure` launches `python -m tinyllm serve` with the bench's model, --quant, --decoder and
--slots, sends one streamed completion as soon as /health answers, and reads the clock at
Ready, at the first token and at the last of TOKENS: wall seconds from the launch, and the
CPU-seconds of the server's processes (its own, the engine's and the compilers they run, as
/proc counts them), the figure that holds still on a shared machine. With empty_caches, each
start gets TorchInductor's cache and tinyllm's (the C kernels) in new temporary folders, as
on a machine that never served: the model file is named by its path, so nothing is fetched.
Each start ends with its process group.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from tinyllm.ext.ranks import free_port, process_cpu_s

TOKENS = 8  # the request's new tokens
START_S = 600  # the longest a start is waited for


def tree_cpu_s(pid: int) -> float:
    """The CPU-seconds of a process and of every process below it, the children it waited for
    included."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu_s(p, waited=True)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue                                    # it ended while we read
    return total


def ask(port: int, path: str, body: dict | None = None, timeout: float = 5):
    """A request to the server on 127.0.0.1:port: GET without a body, POST with one."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def start_once(serve_args: list[str], env: dict, log) -> dict:
    """One start of `serve` with these flags, its output to the file log -> {ready_s, first_s,
    last_s: wall seconds from the launch; ready_cpu_s, first_cpu_s: CPU-seconds by then}."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinyllm", "serve", "--port", str(port),
                             *serve_args], env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                ask(port, "/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.perf_counter() - t0 > START_S:
                    log.seek(0)
                    raise RuntimeError(f"serve did not start: {log.read()[-500:]}") from None
                time.sleep(0.05)
        out = {"ready_s": time.perf_counter() - t0, "ready_cpu_s": tree_cpu_s(proc.pid)}
        model = json.load(ask(port, "/v1/models"))["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": TOKENS,
                "temperature": 0, "stream": True}
        for line in ask(port, "/v1/completions", body, timeout=START_S):
            if line.startswith(b"data: {") and "first_s" not in out:
                if json.loads(line[6:])["choices"][0]["text"]:
                    out["first_s"] = time.perf_counter() - t0
                    out["first_cpu_s"] = tree_cpu_s(proc.pid)
        out["last_s"] = time.perf_counter() - t0
        return out
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(args) -> list[dict]:
    """--serve-start: `rounds` starts of serve for each --quant -> a row each, the median
    start by first_cpu_s (every figure of a row from one start)."""
    from tinyllm.checkpoints.checkpoint import resolve

    rows = []
    for quant in args.quant:
        serve_args = ["--model", str(resolve(args.model).resolve()), "--quant", quant,
                      "--decoder", args.decoder, "--slots", str(args.n_slots)]
        if args.device:
            serve_args += ["--device", args.device]
        starts = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as log:
                env = dict(os.environ)
                if args.empty_caches:
                    env |= {"TINYLLM_CACHE": f"{tmp}/tinyllm",
                            "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}
                starts.append(start_once(serve_args, env, log))
        median = sorted(starts, key=lambda s: s["first_cpu_s"])[(len(starts) - 1) // 2]
        rows.append({"quant": quant, "decoder": args.decoder,
                     "caches": "empty" if args.empty_caches else "as they are", **median})
    return rows


def table(rows: list[dict]) -> str:
    """--serve-start's rows: the weights, the decoder, the caches, then the clock."""
    lines = [f"{'weights':8} {'decoder':8} {'caches':12} {'ready s':>8} {'CPU-s':>6} "
             f"{'1st token s':>12} {'CPU-s':>6} {f'{TOKENS} tokens s':>11}"]
    for r in rows:
        lines.append(f"{r['quant']:8} {r['decoder']:8} {r['caches']:12} {r['ready_s']:8.1f} "
                     f"{r['ready_cpu_s']:6.1f} {r['first_s']:12.1f} {r['first_cpu_s']:6.1f} "
                     f"{r['last_s']:11.1f}")
    return "\n".join(lines)
