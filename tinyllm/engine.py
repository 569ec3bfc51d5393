"""Steps 02-04 - serving many requests: padded prefill, static and continuous batching.

Workload model: offline, every request is queued at t=0 (no arrival process yet), except in
ContinuousEngine, where requests may arrive while others decode.

- prefill_padded (02): left-pad prompts of different lengths to one length and prefill them
  together; pad masks and per-row RoPE positions make each row compute what it would alone.
- run_static (03): take requests in order, B at a time. Prefill once, decode until the batch's
  *longest* request is done. Rows that finish early keep computing (wasted work), and the next
  batch waits for the slowest row.
- run_continuous / ContinuousEngine (04): S slots (SlotKVCache). Every step, queued requests are
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
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tinyllm.generate import (autocast_for, check_prompt, check_sampling, draw,
                              sample_next, sampling_probs)
from tinyllm.kv_cache import KVCache, SlotKVCache
from tinyllm.cuda_graph import SlotGraphDecoder
from tinyllm.paged_kv import PagedKVCache
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


def _sync(device: torch.device) -> None:
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
            _sync(self.device)
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


# ---- step 04: continuous batching -------------------------------------------------------------

def choose_admissions(queue: list[int], n_free: int, fits) -> list[int]:
    """Which queued requests enter now: the longest prefix of the queue (first come, first
    served) with at most n_free requests for which fits(prefix) holds. fits(rids) says whether
    these requests can share one padded prefill and the cache has room for them."""
    chosen: list[int] = []
    for rid in queue:
        if len(chosen) == n_free or not fits(chosen + [rid]):
            break
        chosen.append(rid)
    return chosen


class ContinuousEngine:
    """Step 04: run_continuous's loop as an object, so requests can arrive while others
    decode. add_request() queues a request at any time; each step() admits queued requests
    into free slots (one padded prefill), decodes one token for every active slot and
    returns the new tokens as Events. A finished request's Result is in `results` (pop it).

    Times are seconds on the engine clock (since construction). TTFT and latency count from
    the request's arrival, so with every request added at once they match run_continuous's.
    Sampling: the engine's settings are the default; a request's `sampling` overrides them.
    Rows with equal settings are sampled in one call, so when every row uses the same
    settings the result (and RNG use) is exactly as with per-engine settings. One generator
    is shared by all rows, except a request whose Sampling has a seed: it draws from its own
    generator, so its tokens equal solo generate() with that seed. Not thread-safe: call
    add_request / step / abort from one thread.

    kv="slots": SlotKVCache, every slot reserves max_len positions (04).
    kv="paged": PagedKVCache (05), kv_blocks blocks of block_size positions shared by all slots
    (default: the memory of the slot cache). A request that could not fit the pool even alone
    is refused by add_request. When the pool runs dry, the youngest running request is
    preempted: it goes back to the queue, in arrival order, and is recomputed later from its
    prompt and the tokens it has made (they are part of its context then).
    cuda_graph (06, kv="slots"): True decodes through a cuda_graph.SlotGraphDecoder, one
    captured graph per attention-window bucket (`buckets`) replayed for every slot, free or
    not; on a CPU the same bucketed step runs eagerly. Pass a SlotGraphDecoder instead to
    reuse its cache and graphs (its slots must be idle). Prefill stays eager.
    trace: a Trace to record every decode step in.

    One step: 1) reserve (the paged cache gives every running request the block its next token
    needs, preempting if it must), 2) admit, 3) decode, 4) retire. (The seed admitted before
    reserving, so a newcomer could be preempted in the step that prefilled it.)
    """

    def __init__(self, model: Transformer, n_slots: int, max_len: int | None = None,
                 temperature: float = 0.0, top_k=None, top_p=None, generator=None,
                 kv: str = "slots", block_size: int = 16, kv_blocks: int | None = None,
                 cuda_graph=False, buckets: tuple[int, ...] | None = None,
                 trace: Trace | None = None):
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be an int >= 1, got {n_slots!r}")
        if kv not in ("slots", "paged"):
            raise ValueError(f"kv must be 'slots' or 'paged', got {kv!r}")
        for name, val in (("block_size", block_size), ("kv_blocks", kv_blocks)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if cuda_graph is not False and kv != "slots":
            raise ValueError("cuda_graph decodes a slot cache: use kv='slots'")
        if not (isinstance(cuda_graph, (bool, SlotGraphDecoder))):
            raise ValueError(f"cuda_graph must be False, True or a SlotGraphDecoder, got {cuda_graph!r}")
        model.eval()
        cfg = model.cfg
        self.model = model
        self.device = device = next(model.parameters()).device
        self.n_slots = n_slots
        self.max_len = max_len = max_len or cfg.max_seq_len
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        self.sampling = Sampling(temperature, top_k, top_p)
        self.generator = generator
        dtype = torch.bfloat16 if device.type == "cuda" else next(model.parameters()).dtype
        self.decoder: SlotGraphDecoder | None = None
        if isinstance(cuda_graph, SlotGraphDecoder):            # reuse its cache and graphs
            slots = cuda_graph.slots
            if cuda_graph.model is not model or slots.n_slots != n_slots or \
                    slots.max_len != max_len or any(slots.active):
                raise ValueError(f"the decoder serves another model, or its cache is not "
                                 f"{n_slots} idle slots of {max_len} positions")
            self.decoder, self.slots = cuda_graph, slots
        elif kv == "slots":
            self.slots = SlotKVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim,
                                     max_len, dtype, device)
            if cuda_graph:
                self.decoder = SlotGraphDecoder(model, self.slots, buckets)
        else:
            n_blocks = kv_blocks or n_slots * math.ceil(max_len / block_size)
            self.slots = PagedKVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim,
                                      n_blocks, block_size, max_len, dtype, device)
        self.stats = Stats(kv_bytes_per_token=kv_bytes_per_token(model, device),
                           kv_reserved_tokens=self.slots.reserved_tokens())
        self.trace = trace
        self.results: dict[int, Result] = {}
        self._req: dict[int, Request] = {}
        self._arrival: dict[int, float] = {}
        self._outs: dict[int, list[int]] = {}
        self._ttft: dict[int, float] = {}
        self._gen: dict[int, torch.Generator] = {}
        self._slot_req: list[int | None] = [None] * n_slots
        self._last_tok = torch.zeros(n_slots, 1, dtype=torch.long, device=device)
        self._queue: deque[int] = deque()
        self._next_id = 0
        self._t0 = time.perf_counter()

    # ---- the public surface ----------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add_request(self, req: Request) -> int:
        """Queue a request; returns its id. Raises at once (and changes nothing) if it is
        malformed or can never fit a slot."""
        check_request(req, self.model.cfg.vocab_size, self.max_len)
        if isinstance(self.slots, PagedKVCache):
            need = self.slots.blocks_for(len(req.prompt) + req.max_new_tokens)
            if need > self.slots.n_blocks:
                raise ValueError(
                    f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new tokens needs "
                    f"{need} blocks of {self.slots.block_size}, but the whole KV pool has "
                    f"{self.slots.n_blocks}")
        rid, self._next_id = self._next_id, self._next_id + 1
        self._req[rid] = Request(list(req.prompt), req.max_new_tokens, req.eos_id, req.sampling)
        self._arrival[rid] = self.now()
        if (gen := own_generator(req, self.device)) is not None:
            self._gen[rid] = gen
        self._queue.append(rid)
        return rid

    def has_work(self) -> bool:
        return bool(self._queue) or any(self.slots.active)

    def load(self) -> tuple[int, int]:
        """(requests waiting for a slot, slots decoding a request)."""
        return len(self._queue), sum(self.slots.active)

    def holders(self) -> list[int | None]:
        """The request id each slot is serving now (None: a free slot)."""
        return list(self._slot_req)

    def kv_used_frac(self) -> float:
        return self.slots.used_tokens() / max(1, self.slots.reserved_tokens())

    def abort(self, rid: int) -> bool:
        """Drop an unfinished request (e.g. its client went away), freeing its slot.
        Returns False if it is unknown or already finished. No Result is kept."""
        if rid not in self._req:
            return False
        if rid in self._queue:
            self._queue.remove(rid)
        if rid in self._slot_req:
            s = self._slot_req.index(rid)
            self._slot_req[s] = None
            self.slots.release(s)
        self._forget(rid)
        return True

    @torch.no_grad()
    def step(self) -> list[Event]:
        """Reserve, admit what fits, decode one token per active slot. Returns the new tokens."""
        self._reserve()
        events = self._admit()
        if any(self.slots.active):
            events += self._decode()
        elif self._queue and not events:        # add_request's checks make this unreachable
            raise RuntimeError(f"request {self._queue[0]} cannot be admitted into an empty cache")
        return events

    # ---- 1) reserve --------------------------------------------------------------------------
    def _reserve(self) -> None:
        """Room for every running request's next token; a preempted request is queued again,
        the queue kept in arrival order (request ids grow with arrival)."""
        preempted = []
        for s in self.slots.reserve_step():
            preempted.append(self._slot_req[s])
            self._slot_req[s] = None
        if preempted:
            self.stats.preemptions += len(preempted)
            self._queue = deque(sorted([*preempted, *self._queue]))

    # ---- 2) admit ----------------------------------------------------------------------------
    def _admit(self) -> list[Event]:
        free = self.slots.free_slots()
        if not (free and self._queue):
            return []
        fits = lambda rids: (self._fits_padded(rids) and
                             self.slots.can_admit([len(self._context(r)) for r in rids]))
        rids = choose_admissions(list(self._queue), len(free), fits)
        if not rids:
            return []
        for _ in rids:                                  # they are the queue's first
            self._queue.popleft()
        prompts = [self._context(r) for r in rids]
        self.stats.recomputed_tokens += sum(len(p) for r, p in zip(rids, prompts) if self._outs.get(r))
        logits, pre, pad = prefill_padded(self.model, prompts, max_len=max(len(p) for p in prompts))
        nxt = self._sample(logits, rids)
        taken = free[:len(rids)]
        self.slots.admit(taken, pre, pad, arrivals=rids)
        self._last_tok[torch.tensor(taken, device=self.device)] = nxt
        now = self.now()
        events = []
        for s, rid, t in zip(taken, rids, nxt.squeeze(-1).tolist()):
            self._slot_req[s] = rid
            self._outs.setdefault(rid, [])
            events.append(self._record(s, rid, t, now))
        return events

    # ---- 3) decode ---------------------------------------------------------------------------
    def _decode(self) -> list[Event]:
        t_step = time.perf_counter()
        st, slots = self.stats, self.slots
        live = slots.live_slots()                       # the step's rows: active slots only
        st.peak_active = max(st.peak_active, len(live))
        st.decode_steps += 1
        st.computed_rows += len(live) if self.decoder is None else self.n_slots
        st.slot_rows += self.n_slots
        st.useful_rows += len(live)
        used = slots.used_tokens()
        st.kv_used_frac.append(used / slots.reserved_tokens())
        st.kv_alloc_frac.append(used / max(1, slots.allocated_tokens()))
        if self.trace is not None:
            self.trace.record(self._slot_req, st.kv_used_frac[-1],
                              slots.allocated_tokens() / slots.reserved_tokens())
        rows = torch.tensor(live, device=self.device)
        t0 = time.perf_counter()
        if self.decoder is None:
            with autocast_for(self.device):
                logits, _ = self.model(self._last_tok[rows], cache=slots)   # (B, 1, V)
        else:                                           # every slot, one graph replay (06)
            logits = self.decoder.step(self._last_tok)[rows]            # (S, 1, V) -> (B, 1, V)
        _sync(self.device)
        st.forward_s += time.perf_counter() - t0
        nxt = self._sample(logits[:, -1], [self._slot_req[s] for s in live])   # (B, 1)
        self._last_tok[rows] = nxt
        now = self.now()
        # 4) retire: _record frees the slot of a request that just finished
        events = [self._record(s, self._slot_req[s], t, now)
                  for s, t in zip(live, nxt.squeeze(-1).tolist())]
        st.decode_s += time.perf_counter() - t_step
        return events

    # ---- helpers -----------------------------------------------------------------------------
    def _context(self, rid: int) -> list[int]:
        """Prompt plus tokens generated so far (non-empty only after a preemption)."""
        return self._req[rid].prompt + self._outs.get(rid, [])

    def _sampling(self, rid: int | None) -> Sampling:
        return (self._req[rid].sampling if rid is not None else None) or self.sampling

    def _sample(self, logits: Tensor, rids: list[int | None]) -> Tensor:
        """Next token per row (B, V) -> (B, 1), row i with request rids[i]'s settings."""
        return sample_rows(logits, [self._sampling(r) for r in rids],
                           [self._gen.get(r) for r in rids], self.generator)

    def _left(self, rid: int) -> int:
        return self._req[rid].max_new_tokens - len(self._outs.get(rid, []))

    def _fits_padded(self, rids: list[int]) -> bool:
        """Every row of a padded prefill sits at positions up to L + its remaining tokens, so
        that must fit max_len (the RoPE table, and slot storage). A preempted request comes back
        with a longer context, so this can fail for a batch even when each request fits alone."""
        return max(len(self._context(r)) for r in rids) + max(self._left(r) for r in rids) <= self.max_len

    def _record(self, s: int, rid: int, tok: int, now: float) -> Event:
        outs = self._outs[rid]
        outs.append(tok)
        if len(outs) == 1:
            self._ttft[rid] = now
        done = is_done(self._req[rid], outs)
        if done:
            t_in = self._arrival[rid]
            self.results[rid] = Result(outs, self._ttft[rid] - t_in, now - t_in)
            self.stats.useful_tokens += len(outs)
            self._slot_req[s] = None
            self.slots.release(s)
            self._forget(rid)
        return Event(rid, tok, done)

    def _forget(self, rid: int) -> None:
        for d in (self._req, self._arrival, self._outs, self._ttft, self._gen):
            d.pop(rid, None)


@torch.no_grad()
def run_continuous(model: Transformer, requests: list[Request], n_slots: int,
                   max_len: int | None = None, temperature: float = 0.0, top_k=None,
                   top_p=None, generator=None, kv: str = "slots", block_size: int = 16,
                   kv_blocks: int | None = None, cuda_graph=False,
                   buckets: tuple[int, ...] | None = None, trace: Trace | None = None,
                   progress=None) -> tuple[list[Result], dict]:
    """Offline continuous batching (04): every request queued at t=0, run to completion.
    A thin wrapper over ContinuousEngine; see it for kv / cuda_graph. trace and progress
    as in run_static."""
    eng = ContinuousEngine(model, n_slots, max_len, temperature, top_k, top_p, generator,
                           kv, block_size, kv_blocks, cuda_graph, buckets, trace)
    t0 = time.perf_counter()
    rids = [eng.add_request(r) for r in requests]
    while eng.has_work():
        finished = sum(ev.done for ev in eng.step())
        if progress is not None and finished:
            progress.update(finished)
    st = eng.stats
    st.kv_allocated_at_end = eng.slots.allocated_tokens()
    st.wall_s = time.perf_counter() - t0
    results = [eng.results.pop(r) for r in rids]
    return results, st.summary(results)
