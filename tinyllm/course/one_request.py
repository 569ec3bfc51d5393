"""One request alone, measured: a prompt of n tokens to its first token (prefill), and a
request's tokens one by one (decode at batch 1), tinyllm's engines beside llama.cpp's on the
same values.

`python -m tinyllm bench --prefill 128,512,2047` times one request of each length on a slot of
its own: its time to first token (TTFT) and its prompt's tokens a second, for each engine of
--engines and each --quant. `--solo N` times a request's N new tokens after a 16-token prompt
instead, in tokens a second and a CPU-second, and the share of the memory's read speed that the
weights' bytes a token make. With --peers, llama.cpp (llama-cpp-python, an optional peer) does
the same on the GGUF file's values: F32 beside float weights, Q8_0 beside int8, the file itself
beside gguf and int4, its threads as many as torch's. Each figure is the median of --rounds
runs, taken in turn.

    python -m tinyllm bench --model smollm2 --solo 128 --quant none,int8,int4,gguf \\
        --engines continuous+fused --peers --rounds 3
"""

import statistics
import time

import torch

from tinyllm.build import make_engine
from tinyllm.checkpoints.checkpoint import resolve
from tinyllm.core.requests import Request

# llama.cpp's weights beside each --quant (FILE: the GGUF file as it is)
PEER_KIND = {"none": "F32", "float": "F32", "int8": "Q8_0", "int4": "FILE", "gguf": "FILE"}


def prompt_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids drawn from the vocabulary (ids 3 and up: no special token), the same for
    every engine and the peer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def tinyllm_ttft(model, config, prompt: list[int]) -> tuple[float, float]:
    """(seconds, CPU seconds) from a request's arrival to its first token, on a fresh engine
    of one slot whose cache holds the prompt and its token."""
    engine = make_engine(model, config.changed(n_slots=1, max_len=len(prompt) + 1))
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(Request(prompt, 1))
    while not any(engine.step()):
        pass
    return time.perf_counter() - t0, time.process_time() - c0


def llamacpp_ttft(gguf, prompt: list[int], threads: int) -> float:
    """Seconds llama.cpp takes to evaluate the prompt (its logits for the last token), on a
    context that holds it, with its server's batch sizes (2048, micro-batches of 512)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(prompt) + 16, n_batch=2048,
                          n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    t0 = time.perf_counter()
    llm.eval(prompt)
    seconds = time.perf_counter() - t0
    llm.close()
    return seconds


def peer_file(model_path, kind: str):
    """The GGUF file llama.cpp runs: the checkpoint's values in F32, or Q8_0 made from them
    (peers.same_values), or the file itself (FILE); None where the checkpoint is not a GGUF
    file."""
    from tinyllm.course.peers import same_values

    path = resolve(model_path)
    if path.suffix != ".gguf":
        return None
    return path if kind == "FILE" else same_values(path, kind)


def peer_files(args, models: dict) -> dict:
    """--peers: each --quant that has a llama.cpp file beside it -> (its name, the file)."""
    peers = {}
    for quant in models if args.peers else ():
        kind = PEER_KIND.get(quant)
        if kind is not None and (f := peer_file(args.model, kind)) is not None:
            peers[quant] = (f.stem.rpartition(".")[2] if kind == "FILE" else kind, f)
    return peers


def measure(args, models: dict, configs: dict) -> list[dict]:
    """Every length of --prefill, each --quant's model, each engine (configs: name -> config),
    and with --peers llama.cpp: a row each of length, who, median TTFT and prompt tokens a
    second (and a tinyllm row's CPU seconds), over --rounds runs taken in turn."""
    cfg = next(iter(models.values())).cfg
    if max(args.prefill) >= cfg.max_seq_len:
        raise ValueError(f"--prefill {max(args.prefill)}: a prompt and its first token need "
                         f"{max(args.prefill) + 1} positions, and the model holds "
                         f"{cfg.max_seq_len}: at most {cfg.max_seq_len - 1} tokens")
    vocab = cfg.vocab_size
    short = prompt_of(16, vocab)
    for model in models.values():                       # kernels built, first calls made
        for config in configs.values():
            tinyllm_ttft(model, config, short)
    peers = {q: p for q, p in peer_files(args, models).items() if PEER_KIND[q] != "FILE"}
    rows = []
    for n in args.prefill:
        prompt, runs = prompt_of(n, vocab), {}
        for _ in range(args.rounds):
            for quant, model in models.items():
                for name, config in configs.items():
                    who = name if len(models) == 1 else f"{name} {quant}"
                    runs.setdefault(who, []).append(tinyllm_ttft(model, config, prompt))
                if quant in peers:
                    who = f"llama.cpp {peers[quant][0]}"
                    seconds = llamacpp_ttft(peers[quant][1], prompt, torch.get_num_threads())
                    runs.setdefault(who, []).append((seconds, None))
        for who, got in runs.items():
            ttft = statistics.median(s for s, _ in got)
            cpu = None if got[0][1] is None else statistics.median(c for _, c in got)
            rows.append({"tokens": n, "engine": who, "ttft_s": ttft, "tok_per_s": n / ttft,
                         "cpu_s": cpu})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a table, each length's engines together, each against the first one's."""
    lines = [f"{'prompt':>7}  {'engine':28}{'TTFT ms':>10}{'tok/s':>10}{'CPU s':>8}{'x first':>9}"]
    first: dict = {}
    for r in rows:
        base = first.setdefault(r["tokens"], r["tok_per_s"])
        cpu = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f}"
        lines.append(f"{r['tokens']:>7}  {r['engine']:28}{r['ttft_s'] * 1e3:10.1f}"
                     f"{r['tok_per_s']:10.0f}{cpu:>8}{r['tok_per_s'] / base:9.2f}")
    return "\n".join(lines)


SOLO_PROMPT = 16                                        # --solo's prompt, in tokens


def tinyllm_decode(model, config, prompt: list[int], n: int) -> tuple[float, float]:
    """(seconds, CPU seconds) of a request's n - 1 decode steps, from its first token to its
    n-th, on a fresh engine of one slot (its prefill and first token before the clocks)."""
    engine = make_engine(model, config.changed(n_slots=1, max_len=len(prompt) + n))
    engine.add_request(Request(prompt, n))               # no EOS: all n tokens
    while not engine.step():                             # the prompt's chunks, to a token
        pass
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0, time.process_time() - c0


def llamacpp_decode(gguf, prompt: list[int], n: int, threads: int,
                    huge: bool = False) -> tuple[float, float]:
    """(seconds, CPU seconds) of llama.cpp's n - 1 decode steps after the prompt's, greedy,
    one token a call, in a process of its own: its weights on 4 KB pages (the file mapped, as
    llama.cpp does by default) or, huge, on 2 MB pages (read into memory that glibc asks
    Linux to back with 2 MB pages: GLIBC_TUNABLES=glibc.malloc.hugetlb=1, set before the
    process starts)."""
    import multiprocessing
    import os

    ctx = multiprocessing.get_context("spawn")
    saved = os.environ.get("GLIBC_TUNABLES")
    if huge:
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    try:
        with ctx.Pool(1) as pool:
            return pool.apply(_llamacpp_decode, (str(gguf), prompt, n, threads, not huge))
    finally:
        if huge:
            os.environ.pop("GLIBC_TUNABLES")
            if saved is not None:
                os.environ["GLIBC_TUNABLES"] = saved


def _llamacpp_decode(gguf: str, prompt: list[int], n: int, threads: int,
                     mapped: bool) -> tuple[float, float]:
    """llamacpp_decode's run, in its process (its own threads count in its CPU time)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt) + n + 16, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, use_mmap=mapped,
                          verbose=False)
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    llm.close()
    return seconds, cpu


def read_speed() -> float:
    """The memory's read speed in bytes a CPU-second: 256 MiB of float32 over the fastest of
    7 sums (notebook 13's bound), on 2 MB pages where the system gives them."""
    from tinyllm.ext import huge_pages
    big = huge_pages.empty(2**26).fill_(1.0)
    times = []
    for _ in range(7):
        c0 = time.process_time()
        big.sum()
        times.append(time.process_time() - c0)
    return big.nbytes / min(times)


PAGES = {"2m": (True,), "4k": (False,), "both": (True, False)}   # --pages: huge or not


def measure_solo(args, models: dict, configs: dict) -> list[dict]:
    """--solo N: each --quant's model on each engine (and with --peers llama.cpp beside it),
    one request of SOLO_PROMPT tokens making N: a row each of who, the median decode tokens a
    second and a CPU-second over --rounds runs taken in turn, and the weights' bytes a token
    over the memory's read speed (of_bound: what share of the bound the CPU time reaches).
    --pages says where every contender's weights lie, 2 MB pages or 4 KB ones, or both (each
    model then twice, its copy on 4 KB pages made here): the rows say which."""
    from tinyllm.ext import huge_pages
    from tinyllm.ext.quant import weight_bytes
    n, sizes = args.solo, PAGES[args.pages]
    cfg = next(iter(models.values())).cfg
    if SOLO_PROMPT + n > cfg.max_seq_len:
        raise ValueError(f"--solo {n}: {SOLO_PROMPT} prompt tokens and {n} new ones exceed the "
                         f"model's {cfg.max_seq_len} positions")
    prompt = prompt_of(SOLO_PROMPT, cfg.vocab_size)
    placed = {(q, True): m for q, m in models.items()} if True in sizes else {}
    for quant, model in models.items() if False in sizes else ():    # a copy on 4 KB pages
        placed[quant, False] = huge_pages.unplaced(model)
    for model in placed.values():                       # kernels built, first calls made
        for config in configs.values():
            tinyllm_decode(model, config, prompt, 4)
    peers = peer_files(args, models)
    bandwidth = read_speed()
    runs: dict[str, list[tuple[float, float]]] = {}
    nbytes: dict[str, int] = {}

    def named(who: str, huge: bool) -> str:
        return who if len(sizes) == 1 else f"{who} ({'2 MB' if huge else '4 KB'} pages)"

    for _ in range(args.rounds):
        for (quant, huge), model in placed.items():
            for name, config in configs.items():
                who = named(name if len(models) == 1 else f"{name} {quant}", huge)
                nbytes[who] = weight_bytes(model)
                runs.setdefault(who, []).append(tinyllm_decode(model, config, prompt, n))
            if quant in peers:
                who = named(f"llama.cpp {peers[quant][0]}", huge)
                nbytes[who] = peers[quant][1].stat().st_size
                runs.setdefault(who, []).append(llamacpp_decode(
                    peers[quant][1], prompt, n, torch.get_num_threads(), huge))
    rows = []
    for who, got in runs.items():
        seconds, cpu = (statistics.median(x[i] for x in got) for i in (0, 1))
        rows.append({"engine": who, "tokens": n - 1, "tok_per_s": (n - 1) / seconds,
                     "tok_per_cpu_s": (n - 1) / cpu, "bytes_per_token": nbytes[who],
                     "of_bound": nbytes[who] * (n - 1) / cpu / bandwidth,
                     "read_gb_per_s": bandwidth / 1e9})
    return rows


def solo_table(rows: list[dict]) -> str:
    """--solo's rows as a table: each engine, its speed, and its share of the read bound."""
    w = max(len(r["engine"]) for r in rows) + 2
    lines = [f"{'engine':{w}}{'MB a token':>11}{'tok/s':>9}{'tok/CPU-s':>11}{'of bound':>10}"]
    for r in rows:
        lines.append(f"{r['engine']:{w}}{r['bytes_per_token'] / 1e6:11.1f}{r['tok_per_s']:9.1f}"
                     f"{r['tok_per_cpu_s']:11.1f}{r['of_bound']:10.2f}")
    return "\n".join(lines)
