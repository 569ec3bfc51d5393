"""Step 04 - continuous batching: requests join and leave a fixed set of slots every step.

Static batching (03) waits for a batch's longest request. Here a finished request frees its
slot at once and a waiting one takes it in the next step, so no row computes for nobody and
nobody waits for a stranger's long answer. Requests may arrive while others decode; the offline
run is the same loop with every request arriving at 0.

One step of `ContinuousEngine` reads as its four calls: 1) reserve (room for every running
request's next token; scheduler.py), 2) admit the newcomers and plan the step (a token for
every decoding request, the newcomers' contexts), 3) decode, then prefill (the contexts go
straight into their slots), 4) retire what finished. Each forward pass is one ragged step of the
cache (slot_cache.py). With kv="paged" (05) the memory is a pool of blocks, and requests may be
preempted; with decoder="graphs" (06) the decode step is a replayed CUDA graph, with
decoder="compiled" a step compiled by torch.compile (any device); with max_step_tokens
(07) contexts are prefilled a chunk at a time; with prefix_cache (08) requests share the blocks
of a common prefix.
"""

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from tinyllm import chunked_prefill
from tinyllm.compiled import MODES, CompiledDecoder
from tinyllm.cuda_graph import SlotGraphDecoder
from tinyllm.generate import autocast_for
from tinyllm.model import Transformer, gpu_dtype
from tinyllm.paged_kv import PagedKVCache
from tinyllm.requests import (Event, Request, Result, Sequence, check_positive_int,
                              check_request)
from tinyllm.sampling import Sampling, check_generator, sample_rows
from tinyllm.scheduler import Scheduler
from tinyllm.slot_cache import SlotCache, SlotKVCache
from tinyllm.stats import Stats, Trace, kv_bytes_per_token, sync_device


DEFAULT_KV_MIB = 512     # the KV cache's memory when none is given (vLLM's CPU default: 4 GiB)
DECODERS = {"eager": None, "graphs": SlotGraphDecoder, "compiled": CompiledDecoder}


@dataclass(frozen=True)
class EngineConfig:
    """A continuous engine's settings, checked when made.

    n_slots: requests decoded together. max_len: positions per request, prompt included
    (None: the model's max_seq_len). temperature, top_k, top_p: the default sampling, which a
    request's own `sampling` overrides. kv: "slots" (04) or "paged" (05), a pool of kv_blocks
    blocks of block_size positions (None: the memory of the slot cache). decoder (06,
    kv="slots" for all but "eager"): "eager" runs the model's forward pass; "graphs" replays a
    CUDA graph per window in `buckets` (their eager bucketed twin on a CPU); "compiled" runs a
    step compiled by torch.compile per bucket, on any device (compiled.py), in compile_mode
    "default" or "max-autotune" (a faster step for a longer compilation).
    max_step_tokens (07): at most this many tokens computed per step, decodes first, the rest
    in prompt chunks (None: every context whole); at least n_slots, so that every running
    request can decode. prefix_cache (08, kv="paged"): requests share the blocks of a
    common prefix. kv_mib: the memory the KV cache may reserve, in MiB (None: DEFAULT_KV_MIB;
    the cache is zero-filled when made, so all of it is taken at once). The budget bounds the
    defaults: a slot cache's max_len (n_slots slots of max_len positions each), and the paged
    pool (the memory of n_slots such slots); settings given explicitly that need more than the
    budget are refused. Size it to the work: max_len as long as the longest request.
    """
    n_slots: int
    max_len: int | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    kv: str = "slots"
    block_size: int = 16
    kv_blocks: int | None = None
    decoder: str = "eager"
    compile_mode: str = "default"
    buckets: tuple[int, ...] | None = None
    max_step_tokens: int | None = None
    prefix_cache: bool = False
    kv_mib: float | None = None

    def __post_init__(self):
        check_positive_int("n_slots", self.n_slots)
        for name in ("max_len", "kv_blocks"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("block_size", self.block_size)
        if self.kv not in ("slots", "paged"):
            raise ValueError(f"kv must be 'slots' or 'paged', got {self.kv!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(map(repr, DECODERS))}, "
                             f"got {self.decoder!r}")
        if self.decoder != "eager" and self.kv != "slots":
            raise ValueError(f"the {self.decoder} decoder decodes a slot cache: use kv='slots'")
        if self.compile_mode not in MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(map(repr, MODES))}, "
                             f"got {self.compile_mode!r}")
        if self.compile_mode != "default" and self.decoder != "compiled":
            raise ValueError(f"compile_mode is the compiled decoder's: use decoder='compiled' "
                             f"(got decoder={self.decoder!r})")
        if self.max_step_tokens is not None:
            check_positive_int("max_step_tokens", self.max_step_tokens)
            if self.max_step_tokens < self.n_slots:
                raise ValueError(f"max_step_tokens {self.max_step_tokens} is less than n_slots "
                                 f"{self.n_slots}: every running request decodes one token a step")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        if self.prefix_cache and self.kv != "paged":
            raise ValueError("prefix_cache shares blocks of a paged cache: use kv='paged'")
        if self.kv_mib is not None and (isinstance(self.kv_mib, bool) or
                                        not isinstance(self.kv_mib, (int, float)) or
                                        not self.kv_mib > 0):
            raise ValueError(f"kv_mib must be a number of MiB > 0, got {self.kv_mib!r}")
        self.sampling                                   # checks temperature, top_k, top_p

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)

    def kv_sizes(self, model_max_len: int, bytes_per_token: int) -> tuple[int, int | None]:
        """(max_len, the paged pool's blocks or None) within the KV budget: the settings given,
        or the defaults cut to the budget. Raises naming what does not fit."""
        mib = DEFAULT_KV_MIB if self.kv_mib is None else self.kv_mib
        budget = int(mib * 2**20) // bytes_per_token            # positions the budget holds
        max_len = model_max_len if self.max_len is None else self.max_len
        if max_len > model_max_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {model_max_len}")
        if self.kv == "slots":
            if self.max_len is None:
                max_len = min(max_len, budget // self.n_slots)
            need, what = self.n_slots * max_len, f"{self.n_slots} slots of {max(max_len, 1)} positions"
            n_blocks = None
        else:
            n_blocks = self.kv_blocks or min(self.n_slots * math.ceil(max_len / self.block_size),
                                             budget // self.block_size)
            need, what = n_blocks * self.block_size, f"{n_blocks} blocks of {self.block_size}"
        if max_len < 1 or (n_blocks is not None and n_blocks < 1) or need > budget:
            raise ValueError(f"the KV cache of {what} needs {need * bytes_per_token / 2**20:.1f} "
                             f"MiB, over kv_mib={mib:g} ({budget} positions of "
                             f"{bytes_per_token} bytes): raise kv_mib, or ask for fewer slots "
                             f"or a shorter max_len")
        return max_len, n_blocks

    def make_cache(self, model: Transformer, max_len: int, n_blocks: int | None,
                   device) -> SlotCache:
        cfg = model.cfg
        dtype = gpu_dtype(device) if device.type == "cuda" else next(model.parameters()).dtype
        if self.kv == "slots":
            return SlotKVCache(cfg.n_layers, self.n_slots, cfg.n_kv_heads, cfg.head_dim,
                               max_len, dtype, device)
        return PagedKVCache(cfg.n_layers, self.n_slots, cfg.n_kv_heads, cfg.head_dim,
                            n_blocks, self.block_size, max_len, dtype, device, self.prefix_cache)


def _settings(config: EngineConfig | int, settings: dict):
    """The EngineConfig of ContinuousEngine's arguments (n_slots and keywords, or a config and
    keywords to change), and the decoder passed to reuse, if one was. `decoder` names a kind
    or passes a decoder (SlotGraphDecoder, CompiledDecoder); step 06's `cuda_graph=True` is
    decoder="graphs", and `cuda_graph=` a decoder passes it."""
    decoder = settings.pop("decoder", None)
    if "cuda_graph" in settings:
        graph = settings.pop("cuda_graph")
        if decoder is not None:
            raise ValueError("give decoder= or cuda_graph=, not both")
        if not isinstance(graph, (bool, SlotGraphDecoder)):
            raise ValueError(f"cuda_graph must be False, True or a SlotGraphDecoder, "
                             f"got {graph!r}")
        decoder = "graphs" if graph is True else graph or None
    if isinstance(decoder, SlotGraphDecoder):
        settings["decoder"] = "compiled" if isinstance(decoder, CompiledDecoder) else "graphs"
        if isinstance(decoder, CompiledDecoder):
            if settings.setdefault("compile_mode", decoder.mode) != decoder.mode:
                raise ValueError(f"compile_mode {settings['compile_mode']!r}: the decoder "
                                 f"given was compiled in mode {decoder.mode!r}")
        settings.setdefault("max_len", decoder.slots.max_len)     # by default, its cache's
    elif decoder is not None:
        settings["decoder"], decoder = decoder, None
    if isinstance(config, EngineConfig):
        return dataclasses.replace(config, **settings), decoder
    return EngineConfig(config, **settings), decoder


def _cache_and_decoder(model: Transformer, config: EngineConfig, max_len: int,
                       n_blocks: int | None, device, decoder: SlotGraphDecoder | None):
    """The engine's cache, and its bucketed decoder (06) when it has one: a new pair, or the
    given decoder with its own cache (and its graphs or compiled steps), reused if it fits
    these settings and is idle."""
    if decoder is None:
        cache = config.make_cache(model, max_len, n_blocks, device)
        if config.decoder == "compiled":
            return cache, CompiledDecoder(model, cache, config.buckets, config.compile_mode)
        kind = DECODERS[config.decoder]
        return cache, kind(model, cache, config.buckets) if kind is not None else None
    cache = decoder.slots
    if decoder.model is not model or cache.n_slots != config.n_slots or \
            cache.max_len != max_len or any(cache.active):
        raise ValueError(f"the decoder serves another model, or its cache is not "
                         f"{config.n_slots} idle slots of {max_len} positions")
    return cache, decoder


class ContinuousEngine:
    """Continuous batching over a SlotCache, one step() at a time.

    `ContinuousEngine(model, EngineConfig(...))`, or the settings as keywords:
    `ContinuousEngine(model, n_slots, kv="paged", ...)`. add_request() queues a request at any
    time; step() runs one step and returns the new tokens as Events; a finished request's
    Result waits in `results` (pop it). Times are on the engine clock; TTFT and latency count
    from the request's arrival. One generator (`generator`) is shared by every request without
    a seed of its own. Pass a decoder (SlotGraphDecoder, CompiledDecoder) as `decoder` to reuse
    its cache and its graphs or compiled steps, and a Trace to record every decode step. Not
    thread-safe: call it from one thread.
    """

    def __init__(self, model: Transformer, config: EngineConfig | int, *, generator=None,
                 trace: Trace | None = None, **settings):
        config, decoder = _settings(config, settings)
        check_generator(generator)
        device = next(model.parameters()).device
        per_token = kv_bytes_per_token(model, device)
        max_len, n_blocks = config.kv_sizes(model.cfg.max_seq_len, per_token)
        model.eval()
        self.model, self.config, self.max_len, self.device = model, config, max_len, device
        self.cache, self.decoder = _cache_and_decoder(model, config, max_len, n_blocks, device,
                                                      decoder)
        self.scheduler = Scheduler(self.cache)
        self.sampling, self.generator, self.trace = config.sampling, generator, trace
        self.stats = Stats(kv_bytes_per_token=per_token,
                           kv_reserved_tokens=self.cache.reserved_tokens())
        self.results: dict[int, Result] = {}
        self._seqs: dict[int, Sequence] = {}            # unfinished requests, by id
        self._next_id = 0
        self._t0 = time.perf_counter()
        self._start: float | None = None                # the first arrival

    # ---- the public surface ----------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add_request(self, req: Request) -> int:
        """Queue a request; returns its id. Raises at once (and changes nothing) if it is
        malformed or can never fit the cache."""
        req = check_request(req, self.model.cfg.vocab_size, self.max_len)
        n = len(req.prompt) + req.max_new_tokens
        if (why := self.cache.never_fits(n)) is not None:
            raise ValueError(f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} "
                             f"new tokens {why}")
        sampling = req.sampling or self.sampling
        seq = Sequence(self._next_id, req, self.now(), sampling, sampling.generator(self.device))
        self._next_id += 1
        self._seqs[seq.rid] = seq
        self.scheduler.add(seq)
        if self._start is None:
            self._start = seq.arrival
        return seq.rid

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> tuple[int, int]:
        """(requests waiting for a slot, slots decoding a request)."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def holders(self) -> list[int | None]:
        """The request id each slot is serving now (None: a free slot)."""
        running = self.scheduler.running
        return [running[s].rid if s in running else None for s in range(self.config.n_slots)]

    def kv_used_frac(self) -> float:
        return self.cache.used_tokens() / max(1, self.cache.reserved_tokens())

    def abort(self, rid: int) -> bool:
        """Drop an unfinished request (e.g. its client went away), freeing its slot at once.
        Returns False if it is unknown or already finished. No Result is kept."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    @torch.no_grad()
    def step(self) -> list[Event]:
        """1) reserve, 2) admit and plan, 3) decode, then prefill, 4) retire. Returns the new
        tokens."""
        if not self.scheduler.has_work():
            return []
        self.stats.preemptions += len(self.scheduler.reserve())
        decodes, chunks = self.scheduler.plan(self.config.max_step_tokens)
        if not decodes and not chunks:                  # unreachable with the reference seams
            sched = self.scheduler
            raise RuntimeError(
                f"a step with nothing to compute: {len(sched.waiting)} requests wait, the running "
                f"ones have {[s.left() for s in sched.in_slot_order()]} tokens left, and the "
                f"cache's free slots are {self.cache.free_slots()} of {self.cache.n_slots} (a "
                f"finished request that never released its slot, or a plan that gave no tokens?)")
        if self.trace is not None:
            computed = [0] * self.config.n_slots
            for seq, n in [(s, 1) for s in decodes] + chunks:
                computed[seq.slot] = n
            self._record_trace(computed)
        events = self._decode(decodes) if decodes else []
        if chunks:
            events += self._prefill(chunks)
        self.stats.wall_s = self.now() - self._start
        self.stats.kv_allocated_at_end = self.cache.allocated_tokens()
        return events

    def _record_trace(self, computed: list[int]) -> None:
        cache = self.cache
        n_reserved = cache.reserved_tokens()
        self.trace.record(self.holders(), cache.used_tokens() / n_reserved,
                          cache.allocated_tokens() / n_reserved, computed)

    # ---- 3) decode: one token for every sequence that has one left ---------------------------
    def _decode(self, seqs: list[Sequence]) -> list[Event]:
        t_step = time.perf_counter()
        st, cache = self.stats, self.cache
        rows = [s.slot for s in seqs]
        n_used, n_alloc, n_reserved = (cache.used_tokens(), cache.allocated_tokens(),
                                       cache.reserved_tokens())
        st.record_step(len(rows) if self.decoder is None else self.config.n_slots, len(rows),
                       self.config.n_slots, n_used / n_reserved, n_used / max(1, n_alloc))
        last = [s.tokens[-1] if s.tokens else s.request.prompt[-1] for s in seqs]
        t0 = time.perf_counter()
        cache.plan_step(rows, [1] * len(rows))
        if self.decoder is None:
            idx = torch.tensor(last, device=self.device)[:, None]       # (B, 1)
            with autocast_for(self.device):
                logits, _ = self.model(idx, cache=cache)                # (B, 1, V)
        else:                                           # every slot, one graph replay (06)
            idx = torch.zeros(self.config.n_slots, 1, dtype=torch.long, device=self.device)
            idx[rows, 0] = torch.tensor(last, device=self.device)
            logits = self.decoder.step(idx)[rows]                       # (S, 1, V) -> (B, 1, V)
        sync_device(self.device)
        st.forward_s += time.perf_counter() - t0
        self._computed(seqs, [1] * len(seqs))
        events = self._retire(seqs, logits[:, -1])
        st.decode_s += time.perf_counter() - t_step
        return events

    # ---- 3) prefill: each chunk of a context straight into its slot --------------------------
    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Event]:
        """Compute each sequence's next chunk (the whole rest of its context without a
        budget); only a chunk that ends its context gives logits to sample from."""
        seqs = [s for s, _ in chunks]
        planned = [chunked_prefill.next_chunk(s, n) for s, n in chunks]
        for (seq, n), (toks, _) in zip(chunks, planned):
            if len(toks) != n:
                raise ValueError(f"next_chunk gave {len(toks)} token{'s' * (len(toks) != 1)} "
                                 f"for request {seq.rid}'s chunk of {n}")
        q_lens = [n for _, n in chunks]
        T = max(q_lens)
        idx = torch.tensor([t + [0] * (T - len(t)) for t, _ in planned], device=self.device)  # (B, T)
        self.cache.plan_step([s.slot for s in seqs], q_lens)
        with autocast_for(self.device):
            logits, _ = self.model(idx, cache=self.cache)               # (B, T, V)
        self._computed(seqs, q_lens)
        ends = [i for i, (_, done) in enumerate(planned) if done]
        if not ends:
            return []
        last = logits[torch.tensor(ends, device=self.device),
                      torch.tensor([q_lens[i] - 1 for i in ends], device=self.device)]   # (E, V)
        return self._retire([seqs[i] for i in ends], last)

    def _computed(self, seqs: list[Sequence], n: list[int]) -> None:
        """The step wrote these tokens: each sequence holds more of its context, and a prefix
        cache (08) names the blocks that are full now (only when a block filled up: building
        the context every step would cost more than the step's own bookkeeping)."""
        bs = self.config.block_size
        for seq, k in zip(seqs, n):
            filled = (seq.computed + k) // bs > seq.computed // bs
            seq.computed += k
            if self.config.prefix_cache and filled:
                self.cache.cache_blocks(seq.slot, seq.context())

    # ---- 4) retire: sample, record, free the slots of the finished -------------------------
    def _retire(self, seqs: list[Sequence], logits: Tensor) -> list[Event]:
        """Sample each row's next token from logits (B, V) and record it; a finished request
        leaves its slot at once."""
        nxt = sample_rows(logits, [s.sampling for s in seqs], [s.generator for s in seqs],
                          self.generator)                               # (B, 1)
        now = self.now()
        events, st = [], self.stats
        for seq, tok in zip(seqs, nxt.squeeze(-1).tolist()):
            done = seq.append(tok, now)
            reason = None
            if done:
                self.results[seq.rid] = result = seq.result(now)
                reason = result.finish_reason
                st.useful_tokens += len(seq.tokens)
                st.prompt_tokens += len(seq.request.prompt)
                st.prefill_tokens += seq.prefilled
                st.cached_prompt_tokens += seq.cached
                st.recomputed_tokens += seq.prefilled + seq.cached - len(seq.request.prompt)
                self.scheduler.finish(seq)
                del self._seqs[seq.rid]
            events.append(Event(seq.rid, tok, done, reason))
        return events


def compiled_decoder(model: Transformer, n_slots: int, **settings) -> CompiledDecoder:
    """A compiled decoder (06) over the slots ContinuousEngine(model, n_slots, **settings)
    would have, every bucket compiled now, before any clock starts: pass it as `decoder=` to
    the engines that time it. Its compile_s says what the compilation took."""
    decoder = ContinuousEngine(model, n_slots, **{**settings, "decoder": "compiled"}).decoder
    decoder.warm_up()
    return decoder


@torch.no_grad()
def run_continuous(model: Transformer, requests: list[Request], n_slots: int | EngineConfig,
                   arrivals: list[float] | None = None, *, generator=None,
                   trace: Trace | None = None, progress=None,
                   **settings) -> tuple[list[Result], dict]:
    """Continuous batching of `requests`: each joins the engine when the clock since the start
    reaches its arrival time (in seconds; None: all at 0, the offline run), and the engine steps
    until every request is done. Returns the Results in request order and the summary. settings
    as ContinuousEngine's; progress (a tqdm bar, or anything with .update(n)) is told of
    finished requests."""
    eng = ContinuousEngine(model, n_slots, generator=generator, trace=trace, **settings)
    arrivals = [0.0] * len(requests) if arrivals is None else list(arrivals)
    if len(arrivals) != len(requests) or arrivals != sorted(arrivals):
        raise ValueError(f"arrivals must be {len(requests)} times in increasing order, one per request")
    t0 = time.perf_counter()
    rids: list[int] = []
    while len(rids) < len(requests) or eng.has_work():
        now = time.perf_counter() - t0
        while len(rids) < len(requests) and arrivals[len(rids)] <= now:
            try:
                rids.append(eng.add_request(requests[len(rids)]))
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {len(rids)}: {e}") from None
        if eng.has_work():
            finished = sum(ev.done for ev in eng.step())
            if progress is not None and finished:
                progress.update(finished)
        elif len(rids) < len(requests):
            time.sleep(min(0.01, arrivals[len(rids)] - now))
    results = [eng.results.pop(r) for r in rids]
    return results, eng.stats.summary(results)
