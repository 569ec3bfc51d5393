"""Step 09 - the peers: one workload through tinyllm's engines and through transformers.

    python -m tinyllm bench --peers                     # the bundled model, longtail workload
    python -m tinyllm bench --peers --model model.gguf --workload chat --slots 8

tinyllm runs its solo generate(), static batching, continuous batching on slots (eager, and
compiled as in step 06, its compile seconds in the compile_s column) and paged; and, given a
bf16 copy of the model, continuous batching compiled in bf16. transformers runs the same weights
two ways: `generate()` on left-padded static batches, and its continuous-batching manager
(`init_continuous_batching`) with an explicit, small paged KV cache. On a GGUF file, where
llama-cpp-python is installed (an optional peer), llama.cpp runs the file as it is (batched)
and a copy de-quantised to F32, the very values tinyllm computes with (solo and batched). Every
request's tokens are compared with tinyllm's solo generate(): the table says how many agreed.
Greedy workloads only (sampling draws differ).
"""

import contextlib
import functools
import importlib.util
import time
from dataclasses import replace
from pathlib import Path

import torch

from tinyllm.build import compiled_decoder, run_continuous
from tinyllm.checkpoints.gguf_file import reader_class
from tinyllm.core.config import EngineConfig
from tinyllm.core.generate import generate
from tinyllm.core.requests import Request, eos_ids, is_done, is_eos, longest
from tinyllm.core.static import run_static


def peer_model(path, device, dtype=torch.float32):
    """transformers' model of the checkpoint directory or GGUF file, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()       # it warns that eos -1 (no EOS) never stops a row: intended
    path = Path(path)
    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with quick_gguf_reads():
        peer = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return peer.to(device).eval()


@contextlib.contextmanager
def quick_gguf_reads():
    """transformers reads a GGUF file with the gguf package: it opens the file twice, and it
    builds gguf's map of tensor names once per module of the model (397 times for SmolLM2),
    half a minute in all. Within this block the reader it opens is gguf_file's (the same
    reader, parsing from a plain view of the file), and the name map is built once per
    architecture and depth. What it reads, and the model it builds, are unchanged."""
    import gguf
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = reader_class()
    gguf.get_tensor_name_map = functools.lru_cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def upto(tokens: list[int], req: Request) -> list[int]:
    """A request's answer from a longer row: at most max_new_tokens, ending at its EOS."""
    tokens = tokens[:req.max_new_tokens]
    end = next((i + 1 for i, t in enumerate(tokens) if is_eos(t, req.eos_id)), len(tokens))
    return tokens[:end]


@torch.no_grad()
def hf_static(peer, reqs: list[Request], batch: int, pad_id: int) -> list[list[int]]:
    """transformers' generate(), greedy, batch requests at a time, left-padded; each batch
    runs to its longest request, whose tokens a shorter request then drops."""
    device = next(peer.parameters()).device
    out = []
    for b0 in range(0, len(reqs), batch):
        group = reqs[b0:b0 + batch]
        L = max(len(r.prompt) for r in group)
        ids = torch.tensor([[pad_id] * (L - len(r.prompt)) + r.prompt for r in group],
                           device=device)
        mask = torch.tensor([[0] * (L - len(r.prompt)) + [1] * len(r.prompt) for r in group],
                            device=device)
        eos = {eos_ids(r.eos_id) for r in group}
        if len(eos) > 1:                # generate() stops every row at the same EOS ids
            raise ValueError(f"requests {b0}..{b0 + len(group) - 1} of one batch end at "
                             f"different EOS ids {sorted(map(sorted, eos))}: generate() takes "
                             f"one set per batch")
        eos = sorted(eos.pop())
        gen = peer.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id,
                            max_new_tokens=max(r.max_new_tokens for r in group),
                            eos_token_id=eos or -1)
        out += [upto(row, r) for row, r in zip(gen[:, L:].tolist(), group)]
    return out


def hf_continuous(peer, reqs: list[Request], max_requests: int, block_size: int = 32,
                  n_blocks: int = 256) -> list[list[int]]:
    """transformers' continuous batching: every request queued at once, each with its own
    max_new_tokens and EOS, at most max_requests in a batch, in a KV cache of n_blocks pages
    of block_size tokens (explicit, so it does not size itself from the machine's memory)."""
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in reqs),
                          eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=n_blocks,
                                  max_requests_per_batch=max_requests,
                                  max_batch_tokens=max_requests * 64)
    manager = peer.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    try:
        ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_new_tokens,
                                   eos_token_id=sorted(eos_ids(r.eos_id)) or -1)
               for i, r in enumerate(reqs)]
        results = {}
        while len(results) < len(ids):              # results come back in finishing order
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' continuous batching returned no result")
            if out.error:
                raise RuntimeError(f"transformers' continuous batching: {out.error}")
            results[out.request_id] = out
    finally:
        manager.stop(block=True)
    return [upto(list(results[rid].generated_tokens), r) for rid, r in zip(ids, reqs)]


_quiet = None       # llama.cpp's log callback, kept alive while llama.cpp may call it


def _llamacpp_open(gguf: str | Path, reqs: list[Request], batch: int):
    """llama.cpp's bindings, its model of the file, a context for `batch` sequences that holds
    the longest request, and a llama_batch as large as the largest group's prompts."""
    global _quiet
    import ctypes

    import llama_cpp as L
    if _quiet is None:
        _quiet = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(_quiet, ctypes.c_void_p(0))
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
    if not model:
        raise ValueError(f"{gguf}: llama.cpp could not load it")
    n_prompt = max(sum(len(r.prompt) for r in reqs[b:b + batch])
                   for b in range(0, len(reqs), batch))
    params = L.llama_context_default_params()
    params.n_ctx = batch * (-(-longest(reqs) // 256) * 256)   # each sequence gets n_ctx / n_seq_max
    params.n_batch = params.n_ubatch = max(n_prompt, batch)
    params.n_seq_max = batch
    params.n_threads = params.n_threads_batch = torch.get_num_threads()
    ctx = L.llama_init_from_model(model, params)
    return L, model, ctx, L.llama_batch_init(params.n_batch, 0, batch)


def greedy_group(group: list[Request], decode, argmax) -> list[list[int]]:
    """One group's tokens, greedy, batched as llama.cpp's server batches: every prompt in one
    decode call (a sequence id each, logits only at each prompt's end), then one call per
    step with the next token of every sequence still running; a finished sequence stops.
    decode(entries) runs (token, position, sequence, wants logits) entries; argmax(row) is the
    best token of the last call's row-th logits."""
    entries = [(t, i, s, i == len(r.prompt) - 1) for s, r in enumerate(group)
               for i, t in enumerate(r.prompt)]
    decode(entries)
    rows = [n for n, e in enumerate(entries) if e[3]]         # where each prompt ends
    toks: list[list[int]] = [[] for _ in group]
    live = list(range(len(group)))
    while live:
        for s, row in zip(live, rows):
            toks[s].append(argmax(row))
        live = [s for s in live if not is_done(group[s], toks[s])]
        if live:
            decode([(toks[s][-1], len(group[s].prompt) + len(toks[s]) - 1, s, True)
                    for s in live])
            rows = list(range(len(live)))
    return toks


def llamacpp_batched(gguf: str | Path, reqs: list[Request], batch: int) -> list[list[int]]:
    """llama.cpp (llama-cpp-python's bindings to its C API) on a GGUF file, greedy, `batch`
    requests at a time, each group batched as llama.cpp's server batches (greedy_group); the
    group's KV cache is cleared for the next. llama.cpp computes with the file's quantized
    weights as they are, so its tokens can differ from tinyllm's de-quantized float32 ones."""
    import numpy as np
    L, model, ctx, lbatch = _llamacpp_open(gguf, reqs, batch)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        for n, (token, pos, seq, logits) in enumerate(entries):
            lbatch.token[n], lbatch.pos[n], lbatch.logits[n] = token, pos, logits
            lbatch.seq_id[n][0], lbatch.n_seq_id[n] = seq, 1
        lbatch.n_tokens = len(entries)
        if L.llama_decode(ctx, lbatch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        logits = L.llama_get_logits_ith(ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    out = []
    try:
        for b0 in range(0, len(reqs), batch):
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            out += greedy_group(reqs[b0:b0 + batch], decode, argmax)
    finally:
        L.llama_batch_free(lbatch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return out


def same_values(gguf: str | Path, kind: str = "F32") -> Path:
    """The GGUF file de-quantised to kind (F32, BF16) in the cache directory, written once:
    llama.cpp on the values tinyllm loads."""
    from tinyllm.checkpoints.gguf_file import write_dequantized
    from tinyllm.core.config import cache_dir
    gguf = Path(gguf)
    dst = cache_dir() / f"{gguf.stem}.{kind}.gguf"
    if not dst.exists() or dst.stat().st_mtime < gguf.stat().st_mtime:
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_dequantized(gguf, dst, kind)
    return dst


def _row(reqs: list[Request], toks: list[list[int]], wall: float,
         solo: list[list[int]]) -> dict:
    """A row of the table: tokens made, wall time, tokens/s, and the requests agreeing with solo."""
    n = sum(map(len, toks))
    return {"requests": len(reqs), "tokens": n, "wall_s": wall, "tok_s": n / wall,
            "agree": sum(a == b for a, b in zip(toks, solo))}


def _timed(fn, reqs: list[Request]) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    toks = fn(reqs)
    return toks, time.perf_counter() - t0


def _tinyllm_engines(model, config: EngineConfig, kv_mib: dict) -> dict:
    """tinyllm's batched engines on config's slots: static (batches of n_slots), continuous
    on slots and paged; each continuous run's reserved KV MiB goes into kv_mib[kv]."""
    def continuous(rs, kv="slots"):
        results, summary = run_continuous(model, rs, replace(config, kv=kv))
        kv_mib[kv] = summary["kv_reserved_mib"]
        return [r.tokens for r in results]

    return {"tinyllm static": lambda rs: [r.tokens for r in
                                          run_static(model, rs, config.n_slots)[0]],
            "tinyllm continuous": continuous,
            "tinyllm paged": lambda rs: continuous(rs, kv="paged")}


def _compiled_engine(model, config: EngineConfig, compile_mode: str):
    """The continuous engine with a compiled decoder of config's slots, in compile_mode, its
    one bucket (the longest request) compiled now, before any clock: (the engine, the
    compilation's seconds)."""
    config = replace(config, decoder="compiled", buckets=(config.max_len,),
                     compile_mode=compile_mode)
    decoder = compiled_decoder(model, config)

    def engine(rs):
        return [r.tokens for r in run_continuous(model, rs, config, decoder=decoder)[0]]
    return engine, sum(decoder.compile_s.values())


def _hf_engines(peer, batch: int, pad_id: int, max_len: int) -> dict:
    """transformers' generate() on static batches and its continuous batching, with a KV cache
    of `batch` requests of max_len."""
    return {"hf generate": lambda rs: hf_static(peer, rs, batch, pad_id),
            "hf continuous": lambda rs: hf_continuous(peer, rs, batch,
                                                      n_blocks=batch * -(-max_len // 32))}


def _llamacpp_engines(gguf: str | Path, batch: int) -> dict:
    """llama.cpp on the GGUF file's F32 copy (solo and batched) and on the file as it is."""
    f32 = same_values(gguf)
    kind = Path(gguf).stem.rsplit(".", 1)[-1]           # SmolLM2-135M-Instruct.Q4_1 -> Q4_1
    return {"llama.cpp F32 solo": lambda rs: llamacpp_batched(f32, rs, 1),
            "llama.cpp F32 batched": lambda rs: llamacpp_batched(f32, rs, batch),
            f"llama.cpp {kind} batched": lambda rs: llamacpp_batched(gguf, rs, batch)}


def compare(model, peer, reqs: list[Request], batch: int, pad_id: int = 0,
            gguf: str | Path | None = None, compiled: bool = True,
            bf16_model=None, compile_mode: str = "default") -> dict[str, dict]:
    """Each engine on the same requests: wall time, tokens, tokens/s, and how many requests'
    tokens equal tinyllm's solo generate() (float32). compiled: add the compiled decoder's
    row; bf16_model: the same model in bf16, for a compiled bf16 row. A compiled row compiles
    one bucket, the workload's longest request, before its clock starts (compile_s), in
    compile_mode (default, max-autotune). llama.cpp runs a gguf file where it is installed."""
    if any(r.sampling is not None for r in reqs):
        raise ValueError("the peer comparison is greedy: tokens of sampled requests would differ")
    generate(model, reqs[0].prompt, 4)                  # first call: allocator, kernel choice
    solo, wall = _timed(lambda rs: [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id)
                                    for r in rs], reqs)
    rows = {"tinyllm solo": _row(reqs, solo, wall, solo)}
    config = EngineConfig(batch, max_len=longest(reqs))  # the KV cache fits the work
    kv_mib, compile_s = {}, {}
    engines = {**_tinyllm_engines(model, config, kv_mib),
               **_hf_engines(peer, batch, pad_id, config.max_len)}
    for name, m in (("tinyllm compiled", model if compiled else None),
                    ("tinyllm compiled bf16", bf16_model)):
        if m is not None:
            engines[name], compile_s[name] = _compiled_engine(m, config, compile_mode)
    if gguf is not None and importlib.util.find_spec("llama_cpp") is not None:
        engines.update(_llamacpp_engines(gguf, batch))
    warm = [Request(r.prompt, 4, r.eos_id) for r in reqs[:2]]
    for name, fn in engines.items():
        fn(warm)                                        # first calls: allocator, kernel choice
        rows[name] = _row(reqs, *_timed(fn, reqs), solo)
    for name, kind in (("tinyllm continuous", "slots"), ("tinyllm paged", "paged")):
        rows[name]["kv_mib"] = kv_mib[kind]
    for name, seconds in compile_s.items():
        rows[name]["compile_s"] = seconds
    return rows


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'':24}{'requests':>9}{'tokens':>8}{'wall_s':>9}{'tok_s':>9}{'== solo':>9}"
             f"{'KV MiB':>9}{'compile_s':>10}"]
    for name, r in rows.items():
        kv = f"{r['kv_mib']:>9.1f}" if "kv_mib" in r else f"{'-':>9}"
        kv += f"{r['compile_s']:>10.1f}" if "compile_s" in r else f"{'-':>10}"
        lines.append(f"{name:24}{r['requests']:>9}{r['tokens']:>8}{r['wall_s']:>9.2f}"
                     f"{r['tok_s']:>9.0f}{r['agree']:>6}/{r['requests']}" + kv)
    return "\n".join(lines)
