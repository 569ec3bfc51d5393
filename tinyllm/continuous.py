"""Step 04 - continuous batching: requests join and leave a fixed set of slots every step.

`ContinuousEngine` keeps S slots (SlotKVCache, 04; or the paged cache of 05 behind the same
interface, optionally decoded through CUDA graphs, 06). Every step it reserves room for the
running requests, admits queued requests into free slots (`choose_admissions`, one padded
prefill for the newcomers), decodes one token for every busy slot and retires the requests that
finished, freeing their slots at once. `run_continuous` is the offline run: every request
queued at t=0. Builds on 02 (padded prefill) and 03 (requests, results, stats, sampling);
`tinyllm.engine` re-exports both names, the seed's API.
"""

import math
import time
from collections import deque

import torch
from torch import Tensor

from tinyllm.cuda_graph import SlotGraphDecoder
from tinyllm.engine import (Event, Request, Result, Sampling, Stats, Trace, check_request, is_done,
                            kv_bytes_per_token, own_generator, prefill_padded, sample_rows,
                            sync_device)
from tinyllm.generate import autocast_for
from tinyllm.kv_cache import SlotKVCache
from tinyllm.model import Transformer
from tinyllm.paged_kv import PagedKVCache


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
        sync_device(self.device)
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
