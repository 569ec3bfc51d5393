"""Prefill, measured: a prompt of n tokens to its first token, tinyllm's engines beside
llama.cpp's prompt evaluation on the same values.

A decode step reads every weight for a token a row; a prefill computes a whole prompt in one
pass, so its products are matrices and its cost is arithmetic, with attention's share growing
with the prompt. `python -m tinyllm bench --prefill 128,512,2048` times one request of each
length on a slot of its own: its time to first token (TTFT) and its prompt's tokens a second,
for each engine of --engines (`continuous`: the whole prompt in one pass; `continuous+chunked`:
--max-step-tokens a step, 07) and each --quant; with --peers, llama.cpp's own evaluation of the
same prompt (llama-cpp-python, where installed) on the GGUF file's values in F32 (for float
weights) and in Q8_0 made from them (for int8), its threads as many as torch's. Each figure is
the median of --rounds runs, taken in turn.

    python -m tinyllm bench --model smollm2 --prefill 128,512,2048 --quant none,int8 \\
        --engines continuous,continuous+chunked --max-step-tokens 512 --peers --rounds 3
"""

import statistics
import time

import torch

from tinyllm.build import make_engine
from tinyllm.checkpoints.checkpoint import resolve
from tinyllm.core.requests import Request

PEER_KIND = {"none": "F32", "int8": "Q8_0"}     # llama.cpp's weights beside each --quant


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
    """The GGUF file llama.cpp evaluates: the checkpoint's values in F32, or Q8_0 made from
    them (peers.same_values); None where the checkpoint is not a GGUF file."""
    from tinyllm.course.peers import same_values

    path = resolve(model_path)
    return same_values(path, kind) if path.suffix == ".gguf" else None


def measure(args, models: dict, configs: dict) -> list[dict]:
    """Every length of --prefill, each --quant's model, each engine (configs: name -> config),
    and with --peers llama.cpp: a row each of length, who, median TTFT and prompt tokens a
    second (and a tinyllm row's CPU seconds), over --rounds runs taken in turn."""
    vocab = next(iter(models.values())).cfg.vocab_size
    short = prompt_of(16, vocab)
    for model in models.values():                       # kernels built, first calls made
        for config in configs.values():
            tinyllm_ttft(model, config, short)
    peers = {}
    if args.peers:
        for quant in models:
            if quant in PEER_KIND and (f := peer_file(args.model, PEER_KIND[quant])) is not None:
                peers[quant] = f
    rows = []
    for n in args.prefill:
        prompt, runs = prompt_of(n, vocab), {}
        for _ in range(args.rounds):
            for quant, model in models.items():
                for name, config in configs.items():
                    who = name if len(models) == 1 else f"{name} {quant}"
                    runs.setdefault(who, []).append(tinyllm_ttft(model, config, prompt))
                if quant in peers:
                    who = f"llama.cpp {PEER_KIND[quant]}"
                    seconds = llamacpp_ttft(peers[quant], prompt, torch.get_num_threads())
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
