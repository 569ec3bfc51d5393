"""Steps 02-03 - serving many requests: padded prefill and static batching (and the seed API).

Workload model: offline, every request is queued at t=0 (no arrival process yet), except in
ContinuousEngine, where requests may arrive while others decode.

- prefill_padded (02): left-pad prompts of different lengths to one length and prefill them
  together; pad masks and per-row RoPE positions make each row compute what it would alone.
- run_static (03): take requests in order, B at a time. Prefill once, decode until the batch's
  *longest* request is done. Rows that finish early keep computing (wasted work), and the next
  batch waits for the slowest row.
- run_continuous / ContinuousEngine (04, in continuous.py, re-exported here with
  choose_admissions): S slots (SlotKVCache). Every step, queued requests are
  admitted into free slots (one batched, padded prefill for the newcomers), then every active
  slot decodes one token together. A finished request frees its slot at once. With
  kv="paged" (05) the slots' memory is a shared pool of blocks (paged_kv.py), and a request
  may be preempted and recomputed when the pool runs dry.

All return per-request Results (generated tokens, TTFT, latency) and Stats (throughput, wasted
decode rows, KV memory reserved vs used). Correctness: each request's tokens must equal its
solo generate() output (tests/test_engine.py).

Beyond the seed design: token ids are range-checked when a request is added (the model does
not check them); `Sampling(seed=...)` gives a request its own generator, so its tokens equal
solo generate() with that seed whatever shares its batch; a `Trace` passed to an engine
records which request holds which row at every decode step (viz.py draws it); the continuous
engine's decode step computes the active slots only, where the seed computed every slot, so
its `row_util` is 1 and `occupancy` (beyond the seed: rows serving a request / rows the
engine has) says how full its slots were.
"""

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tinyllm.generate import (autocast_for, check_prompt, check_sampling, draw,
                              sample_next, sampling_probs)
from tinyllm.kv_cache import KVCache
from tinyllm.model import Transformer


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens (sample_next's settings). Frozen, so equal settings group together.
    seed: this request draws from its own generator, seeded so; None shares the engine's."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    eos_id: int | None = None
    sampling: Sampling | None = None


@dataclass
class Result:
    tokens: list[int]
    ttft_s: float
    latency_s: float


@dataclass
class Stats:
    wall_s: float = 0.0
    useful_tokens: int = 0
    decode_steps: int = 0
    computed_rows: int = 0
    useful_rows: int = 0
    kv_reserved_tokens: int = 0
    kv_used_frac: list[float] = field(default_factory=list)
    kv_alloc_frac: list[float] = field(default_factory=list)
    kv_bytes_per_token: int = 0
    preemptions: int = 0
    peak_active: int = 0
    kv_allocated_at_end: int = 0
    decode_s: float = 0.0             # beyond the seed: time in decode steps, all of it,
    forward_s: float = 0.0            # and the part of it inside the model's forward;
    slot_rows: int = 0                # rows the engine had (batch size or slots) per step
    recomputed_tokens: int = 0        # context prefilled again after a preemption

    def summary(self, results: list[Result]) -> dict:
        lat = sorted(r.latency_s for r in results)
        ttft = sorted(r.ttft_s for r in results)
        p95 = lambda xs: xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)] if xs else 0.0
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        return {
            "requests": len(results),
            "wall_s": self.wall_s,
            "useful_tokens": self.useful_tokens,
            "tok_s": self.useful_tokens / self.wall_s if self.wall_s else 0.0,
            "decode_steps": self.decode_steps,
            "row_util": self.useful_rows / max(1, self.computed_rows),
            "occupancy": self.useful_rows / max(1, self.slot_rows),
            "latency_mean_s": mean(lat),
            "latency_p95_s": p95(lat),
            "ttft_mean_s": mean(ttft),
            "ttft_p95_s": p95(ttft),
            "kv_reserved_mib": self.kv_reserved_tokens * self.kv_bytes_per_token / 2**20,
            "kv_used_mean": mean(self.kv_used_frac),
            "kv_used_peak": max(self.kv_used_frac, default=0.0),
            "kv_alloc_used_mean": mean(self.kv_alloc_frac) if self.kv_alloc_frac else None,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "peak_active": self.peak_active,
            "kv_allocated_at_end": self.kv_allocated_at_end,
            "decode_overhead": 1 - self.forward_s / self.decode_s if self.decode_s else 0.0,
        }


def sync_device(device: torch.device) -> None:
    """Wait for the GPU, so the forward pass's time is measured, not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(model: Transformer, device: torch.device) -> int:
    elem = 2 if device.type == "cuda" else next(model.parameters()).element_size()
    return sum(layer.self_attn.cache_bytes_per_token(elem) for layer in model.layers)


def check_request(req: Request, vocab_size: int, max_len: int) -> None:
    """Raise ValueError naming what is wrong with a request before it touches any state."""
    if not isinstance(req, Request):
        raise TypeError(f"expected a Request, got {type(req).__name__}")
    if req.sampling is not None and not isinstance(req.sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, got {type(req.sampling).__name__}")
    check_prompt(list(req.prompt), req.max_new_tokens, vocab_size, max_len)


# ---- step 02: padded prefill ------------------------------------------------------------------

def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad to the longest prompt. Returns idx (B, L) and pad_lens (B,)."""
    L = max(len(p) for p in prompts)
    pad_lens = torch.tensor([L - len(p) for p in prompts])              # (B,)
    idx = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts])   # (B, L)
    return idx, pad_lens


@torch.no_grad()
def prefill_padded(model: Transformer, prompts: list[list[int]], max_len: int,
                   pad_id: int = 0) -> tuple[Tensor, KVCache, list[int]]:
    """Left-pad prompts to one length, run one prefill. Returns last-position logits (B, V),
    the filled cache (pos = padded length) and each row's pad count."""
    device = next(model.parameters()).device
    idx, pad_lens = left_pad(prompts, pad_id)
    idx, pad_lens = idx.to(device), pad_lens.to(device)
    cache = KVCache(model.cfg.n_layers, max_len, pad_lens=pad_lens)
    with autocast_for(device):
        logits, _ = model(idx, cache=cache)                             # (B, L, V)
    return logits[:, -1], cache, pad_lens.tolist()


def is_done(req: Request, toks: list[int]) -> bool:
    return len(toks) >= req.max_new_tokens or (req.eos_id is not None and toks[-1] == req.eos_id)


class Trace:
    """What each decode step looked like: rows[step][row] = the request id a row or slot
    served (None: nobody), kv_used[step] = KV positions in use / reserved, kv_alloc[step] =
    positions allocated / reserved (the paged cache's blocks; else 1 or None).
    Pass one to an engine to fill it; one short list per step. viz.py draws it."""

    def __init__(self):
        self.rows: list[list[int | None]] = []
        self.kv_used: list[float] = []
        self.kv_alloc: list[float | None] = []

    def record(self, holders: list[int | None], kv_used: float,
               kv_alloc: float | None = None) -> None:
        self.rows.append(list(holders))
        self.kv_used.append(kv_used)
        self.kv_alloc.append(kv_alloc)


# ---- step 03: static batching -----------------------------------------------------------------

def sample_rows(logits: Tensor, samplings: list[Sampling],
                generators: list[torch.Generator | None], shared: torch.Generator | None) -> Tensor:
    """Next token per row (B, V) -> (B, 1), each row with its own settings. Rows without a
    generator of their own take one sample_next call per distinct setting, in order of first
    appearance, with the shared generator; so when every row shares one setting, RNG use is
    that of one sample_next call. Rows with their own generator (seeded requests) share the
    work of each setting's distribution, then each draws its token alone, with its generator."""
    shared_rows: dict[Sampling, list[int]] = {}
    own_rows: dict[tuple, list[int]] = {}
    for i, (s, g) in enumerate(zip(samplings, generators)):
        if g is None:
            shared_rows.setdefault(s, []).append(i)
        else:
            own_rows.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
    if len(shared_rows) == 1 and not own_rows:
        (s,) = shared_rows
        return sample_next(logits, s.temperature, s.top_k, s.top_p, shared)
    out = torch.empty(logits.size(0), 1, dtype=torch.long, device=logits.device)
    for s, idx in shared_rows.items():
        ix = torch.tensor(idx, device=logits.device)
        out[ix] = sample_next(logits[ix], s.temperature, s.top_k, s.top_p, shared)
    for (temperature, top_k, top_p), idx in own_rows.items():
        ix = torch.tensor(idx, device=logits.device)
        if temperature == 0:
            out[ix] = logits[ix].argmax(dim=-1, keepdim=True)
            continue
        probs = sampling_probs(logits[ix], temperature, top_k, top_p)  # (n, V)
        u = torch.cat([torch.rand(1, 1, generator=generators[i], dtype=torch.float64,
                                  device=logits.device) for i in idx])  # (n, 1)
        out[ix] = draw(probs, u)
    return out


def own_generator(req: Request, device) -> torch.Generator | None:
    """A seeded request's private generator, or None (it shares the engine's)."""
    if req.sampling is None or req.sampling.seed is None:
        return None
    return torch.Generator(device).manual_seed(req.sampling.seed)


def run_batch(model: Transformer, batch: list[Request], pick, clock) -> list[Result]:
    """One static batch: prefill the prompts together (prefill_padded, with room for the
    longest request's new tokens), then decode all rows together until every request is done.
    A row whose request has finished keeps computing; its tokens are thrown away.
    pick: logits (B, V) -> tokens (B, 1). clock() -> seconds since the run began: a Result's
    ttft_s is the clock when its first token was picked, latency_s when its last was."""
    device = next(model.parameters()).device
    L = max(len(r.prompt) for r in batch)
    new_max = max(r.max_new_tokens for r in batch)
    logits, cache, _ = prefill_padded(model, [r.prompt for r in batch], L + new_max)
    outs: list[list[int]] = [[] for _ in batch]
    results: list[Result | None] = [None] * len(batch)
    ttft = [0.0] * len(batch)
    while True:
        nxt = pick(logits)                                              # (B, 1)
        now = clock()
        for j, t in enumerate(nxt.squeeze(-1).tolist()):
            if results[j] is not None:
                continue                                                # a wasted row
            outs[j].append(t)
            if len(outs[j]) == 1:
                ttft[j] = now
            if is_done(batch[j], outs[j]):
                results[j] = Result(outs[j], ttft[j], now)
        if all(r is not None for r in results):
            return results
        with autocast_for(device):
            logits, _ = model(nxt, cache=cache)                         # (B, 1, V)
        logits = logits[:, -1]                                          # (B, V)


def account_batch(stats: Stats, batch: list[Request], results: list[Result],
                  trace: Trace | None, ids: list[int]) -> None:
    """Stats (and the trace) of a finished static batch, from its results alone: request j
    made len(tokens_j) tokens, the first from the prefill, so it held its row for
    len(tokens_j) - 1 of the batch's decode steps; the batch ran as long as its longest."""
    B = len(batch)
    capacity = B * (max(len(r.prompt) for r in batch) + max(r.max_new_tokens for r in batch))
    stats.kv_reserved_tokens = max(stats.kv_reserved_tokens, capacity)
    held = [len(r.tokens) - 1 for r in results]                         # decode steps per row
    for step in range(max(held)):
        live = [j for j in range(B) if held[j] > step]
        stats.decode_steps += 1
        stats.computed_rows += B
        stats.slot_rows += B
        stats.useful_rows += len(live)
        stats.peak_active = max(stats.peak_active, len(live))
        used = sum(len(batch[j].prompt) + step + 1 for j in live) / capacity
        stats.kv_used_frac.append(used)
        if trace is not None:
            trace.record([ids[j] if held[j] > step else None for j in range(B)], used)


class ForwardTimer:
    """Times the model's decode forward passes (one new token per row) from outside the
    loop, with forward hooks, so any loop (yours too) is measured the same way."""

    def __init__(self, model: Transformer, stats: Stats):
        self.stats, self.device = stats, next(model.parameters()).device
        self.hooks = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                      model.register_forward_hook(self._stop)]

    def _start(self, module, args, kwargs):
        cache = kwargs.get("cache")
        decode = cache is not None and cache.pos > 0                    # not a prefill
        self.t0 = time.perf_counter() if decode else None

    def _stop(self, module, args, out):
        if self.t0 is not None:
            sync_device(self.device)
            self.stats.forward_s += time.perf_counter() - self.t0

    def close(self):
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def run_static(model: Transformer, requests: list[Request], batch_size: int,
               temperature: float = 0.0, top_k=None, top_p=None, generator=None,
               trace: Trace | None = None, progress=None) -> tuple[list[Result], dict]:
    """Static batching (03): requests in order, batch_size at a time, each batch run to its
    longest member. The settings given here are the default; a request's `sampling` overrides
    them, and a seeded request draws from its own generator, as in ContinuousEngine (the
    seed design refused per-request sampling here; with per-row generators both engines can
    serve one workload and each request still gets its solo tokens).
    Pass a Trace to have every decode step recorded in it; progress (a tqdm bar, or anything
    with .update(n)) is told of finished requests."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    default = Sampling(temperature, top_k, top_p)                        # validates them
    model.eval()
    cfg = model.cfg
    device = next(model.parameters()).device
    for i, r in enumerate(requests):
        try:
            check_request(r, cfg.vocab_size, cfg.max_seq_len)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    for b0 in range(0, len(requests), batch_size):
        batch = requests[b0:b0 + batch_size]
        L, new_max = max(len(r.prompt) for r in batch), max(r.max_new_tokens for r in batch)
        if L + new_max > cfg.max_seq_len:
            raise ValueError(f"batch {b0 // batch_size}: padded prompt {L} + new {new_max} "
                             f"exceeds max_seq_len {cfg.max_seq_len}")
    stats = Stats(kv_bytes_per_token=kv_bytes_per_token(model, device))
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0
    results: list[Result] = []
    timer = ForwardTimer(model, stats)
    try:
        for b0 in range(0, len(requests), batch_size):
            batch = requests[b0:b0 + batch_size]
            rows = [r.sampling or default for r in batch]
            gens = [own_generator(r, device) for r in batch]
            pick = lambda logits: sample_rows(logits, rows, gens, generator)
            done = run_batch(model, batch, pick, clock)
            # decode time: from the first token (the end of the prefill) to the last
            stats.decode_s += max(r.latency_s for r in done) - min(r.ttft_s for r in done)
            account_batch(stats, batch, done, trace, list(range(b0, b0 + len(batch))))
            results += done
            if progress is not None:
                progress.update(len(done))
    finally:
        timer.close()
    stats.wall_s = clock()
    stats.useful_tokens = sum(len(r.tokens) for r in results)
    return results, stats.summary(results)


@dataclass
class Event:
    """One generated token, as step() reports it (a server streams these)."""
    rid: int
    token: int
    done: bool


STEP_04 = ("ContinuousEngine", "choose_admissions", "run_continuous")


def __getattr__(name: str):
    """Step 04 lives in continuous.py (which imports this module); the seed's API has its
    names here too, so `from tinyllm.engine import ContinuousEngine` works."""
    if name in STEP_04:
        from tinyllm import continuous
        return getattr(continuous, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
