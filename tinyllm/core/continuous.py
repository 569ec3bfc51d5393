"""Step 04 - continuous batching: requests join and leave a fixed set of slots every step.

Static batching (03) waits for a batch's longest request. Here a finished request frees its
slot at once and a waiting one takes it in the next step, so no row computes for nobody and
nobody waits for a stranger's long answer. Requests may arrive while others decode
(`run_engine` feeds them at their arrival times); the offline run is the same loop with every
request arriving at 0.

One step of `ContinuousEngine` reads as its four calls: 1) reserve (room for every running
request's next token; scheduler.py), 2) admit the newcomers and plan the step (a token for
every decoding request, the newcomers' contexts), 3) one forward pass for both (the contexts go
straight into their slots; model_runner.py), 4) retire what finished. The pass is one ragged
step of the cache (slot_cache.py), packed: its products run on the step's new tokens alone, so
a decode row costs one token beside a long prompt (Orca's iteration-level batching, vLLM's one
batch a step).

The engine is made of parts, each behind a small interface, and never asks which kind it
holds: the cache (this step's SlotKVCache), the decode step (the model), the planner (every
context whole: scheduler.WholeContexts); later steps bring other parts through the same
interfaces, and `tinyllm.build.make_engine` makes them from an EngineConfig. Given no parts,
the engine makes this step's own.
"""

import time

import torch
from torch import Tensor

from tinyllm.core import token_stage
from tinyllm.core.config import EngineConfig
from tinyllm.core.model import Transformer, gpu_dtype
from tinyllm.core.model_runner import ModelRunner, wants_prompt_logprobs
from tinyllm.core.requests import Event, Request, Result, Sequence, check_request
from tinyllm.core.sampling import Sampling, check_generator
from tinyllm.core.scheduler import Scheduler
from tinyllm.core.slot_cache import SlotCache, SlotKVCache
from tinyllm.core.stats import Stats, Trace, kv_bytes_per_token
from tinyllm.core.token_stage import new_matchers

# what this step's engine makes itself; other values, the builder
LATER = {"kv": "slots", "decoder": "eager", "max_step_tokens": None, "prefix_cache": False,
         "speculate": None, "tensor_parallel_size": 1}


def compiles(decoder) -> bool:
    """Whether a decode step compiles (06's compiled step, before it serves; 13's pieces,
    while it serves)."""
    return hasattr(decoder, "warm_up")


def slot_cache(model: Transformer, config: EngineConfig, device=None) -> SlotKVCache:
    """This step's cache for the model: config.n_slots slots of the config's max_len (within
    its KV budget), in the model's dtype (a GPU's compute dtype on CUDA)."""
    device = device or next(model.parameters()).device
    max_len, _ = config.kv_sizes(model.cfg.max_seq_len, kv_bytes_per_token(model, device))
    dtype = gpu_dtype(device) if device.type == "cuda" else next(model.parameters()).dtype
    cfg = model.cfg
    return SlotKVCache(cfg.n_layers, config.n_slots, cfg.n_kv_heads, cfg.head_dim, max_len,
                       dtype, device)


def config_and_cache(model: Transformer, config: EngineConfig | int, settings: dict,
                     cache: SlotCache | None, device) -> tuple[EngineConfig, SlotCache]:
    """The engine's config (n_slots, or a config; `settings` change fields) and its cache: the
    one given, or this step's own (slot_cache) for a config that asks for no later step's."""
    config = config if isinstance(config, EngineConfig) else EngineConfig(config)
    config = config.changed(**settings)
    if cache is None:
        check_own_settings(config)
        cache = slot_cache(model, config, device)
    return config, cache


def check_own_settings(config: EngineConfig) -> None:
    """Raise ValueError naming a setting of a later step, which this step's engine cannot make
    itself: tinyllm.build.make_engine makes the parts of any EngineConfig."""
    for name, own in LATER.items():
        if getattr(config, name) != own:
            raise ValueError(f"{name}={getattr(config, name)!r} is a later step's: make the "
                             f"engine with tinyllm.build.make_engine(model, config), which "
                             f"builds its parts, or pass them")


def sample(seqs: list[Sequence], logits: Tensor, shared: torch.Generator | None):
    """Each sequence's next token from logits (B, V) through the token stage, as one-token
    lists (a speculating step keeps several), with its logprobs (None where not asked)."""
    tokens, logprobs = token_stage.select(logits, [s.history() for s in seqs],
                                          [s.generator for s in seqs], shared)
    return [[t] for t in tokens], [[lp] for lp in logprobs]


def collect_prompt_logprobs(chunks: list[tuple[Sequence, int]], logits: Tensor | None) -> None:
    """The prompt logprobs a step's chunks give, appended to each sequence that asks for them:
    logits (B, T, V) of the chunks (None when none asks), each computed from
    seq.num_computed_tokens on. Position p predicts prompt token p + 1; the positions already
    collected (a prompt computed again after a preemption) are skipped."""
    for b, (seq, n) in enumerate(chunks):
        got, prompt = seq.prompt_logprobs, seq.request.prompt
        if not wants_prompt_logprobs(seq):
            continue
        start = seq.num_computed_tokens
        lo, hi = max(start, len(got) - 1), min(start + n, len(prompt) - 1)
        if lo < hi:
            got += token_stage.token_logprobs(logits[b, lo - start:hi - start],
                                              prompt[lo + 1:hi + 1], seq.sampling.prompt_logprobs)


def mark_computed(seqs: list[Sequence], n: list[int], cache: SlotCache, scheduler: Scheduler,
                  ahead: list[list[int]] | None = None) -> None:
    """The step wrote n[i] tokens of seqs[i]: it holds more of its context, which the cache may
    keep for later requests (cache_blocks: a prefix cache names the blocks that filled up, 08).
    ahead[i]: tokens written that join the context only when retired (a speculating step's kept
    guesses, 11). A first choice whose prompt is computed lets its other choices queue (a
    cache that shares prefixes serves them its blocks)."""
    for i, (seq, k) in enumerate(zip(seqs, n)):
        prompt_done = seq.num_computed_tokens < len(seq.request.prompt) <= \
            seq.num_computed_tokens + k
        seq.num_computed_tokens += k
        cache.cache_blocks(seq.slot, lambda seq=seq, i=i: seq.context() + (ahead[i] if ahead
                                                                            else []))
        if prompt_done:
            scheduler.release(seq)


def computed_chunks(chunks: list[tuple[Sequence, int]], every: Tensor | None, cache: SlotCache,
                    scheduler: Scheduler) -> None:
    """A step's prefill chunks are computed: their prompt logprobs collected from every (C, T,
    V) (None when none asks), their tokens counted (mark_computed)."""
    collect_prompt_logprobs(chunks, every)
    mark_computed([s for s, _ in chunks], [n for _, n in chunks], cache, scheduler)


def tokens_left(max_step_tokens: int | None, decodes: list[Sequence],
                chunks: list[tuple[Sequence, int]]) -> int | None:
    """The tokens a step's plan leaves of its budget, max_step_tokens (None: no budget)."""
    if max_step_tokens is None:
        return None
    return max_step_tokens - len(decodes) - sum(n for _, n in chunks)


def record_decode_step(stats: Stats, cache: SlotCache, n_rows: int, decoder) -> None:
    """A decode step of n_rows requests in Stats: the rows computed (the requests', or every
    slot's for a decoder that computes every slot), and the cache's use of what it reserves and
    allocates."""
    used = cache.used_tokens()
    every = getattr(decoder, "computes_every_slot", False)
    stats.record_step(cache.n_slots if every else n_rows, n_rows, cache.n_slots,
                      used / cache.reserved_tokens(), used / max(1, cache.allocated_tokens()))


def fitting(req: Request, model: Transformer, cache: SlotCache, default: Sampling) -> Request:
    """The request checked (check_request, against the model; its sampling the request's or
    default), if its prompt and new tokens can fit the cache alone (whose max_len may be less
    than the model's); else a ValueError saying why not."""
    req = check_request(req, model.cfg.vocab_size, model.cfg.max_seq_len, default)
    n = len(req.prompt) + req.max_new_tokens
    if (why := cache.never_fits(n)) is not None:
        raise ValueError(f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new "
                         f"tokens {why}")
    return req


def record_trace(trace: Trace, cache: SlotCache, holders: list[int | None],
                 decodes: list[Sequence], chunks: list[tuple[Sequence, int]]) -> None:
    """A step in the trace: who holds each slot, the cache's use, the tokens each slot computes."""
    computed = [0] * cache.n_slots
    for seq, n in [(s, 1) for s in decodes] + chunks:
        computed[seq.slot] = n
    n_reserved = cache.reserved_tokens()
    trace.record(holders, cache.used_tokens() / n_reserved, cache.allocated_tokens() / n_reserved,
                 computed)


def decodes_apart(speculator, decodes: list[Sequence], left: int | None, decoder) -> bool:
    """Whether a step's decode rows have a pass of their own rather than joining its prefill
    chunks' (Orca's iteration-level batching: one pass a step): a speculating step's guesses
    (11: a row the speculator allows a guess, within the step's `left` tokens), or a decoder
    that replays every slot (06's graphs)."""
    guessing = speculator is not None and any(speculator.allowed(decodes, left))
    return guessing or getattr(decoder, "computes_every_slot", False)


def chunk_tokens(planner, chunks: list[tuple[Sequence, int]]) -> list[tuple]:
    """Each chunk as (sequence, the tokens it computes, whether they end its context), as the
    planner says (next_chunk); a chunk of the wrong length is named."""
    out = []
    for seq, n in chunks:
        tokens, ends = planner.next_chunk(seq, n)
        if len(tokens) != n:
            raise ValueError(f"next_chunk gave {len(tokens)} token{'s' * (len(tokens) != 1)} "
                             f"for request {seq.rid}'s chunk of {n}")
        out.append((seq, tokens, ends))
    return out


class ContinuousEngine:
    """Continuous batching over a SlotCache, one step() at a time, of parts: this step's own for
    `ContinuousEngine(model, n_slots or EngineConfig)`, or a later step's as keywords (`cache`,
    `decoder`, `planner`, `speculator`, `grammars`: tinyllm.build.make_engine). A request added at
    any time (add_request) gets its tokens as step()'s Events and its Result in `results` (pop
    it), on the engine clock from its arrival; `generator` serves those without a seed."""

    def __init__(self, model: Transformer, config: EngineConfig | int, *, cache=None,
                 decoder=None, planner=None, speculator=None, grammars=None, generator=None,
                 trace: Trace | None = None, **settings):
        check_generator(generator)
        device = next(model.parameters()).device
        config, cache = config_and_cache(model, config, settings, cache, device)
        model.eval()
        self.model, self.config, self.cache, self.device = model, config, cache, device
        self.max_len, self.decoder, self.speculator = cache.max_len, decoder, speculator
        self.scheduler = Scheduler(cache, planner)
        self.generator, self.trace, self.grammars = generator, trace, grammars
        self.stats = Stats(kv_bytes_per_token=kv_bytes_per_token(model, device),
                           kv_reserved_tokens=cache.reserved_tokens())
        self.runner = ModelRunner(model, cache, decoder or model, self.stats, device)
        self.results: dict[int, Result] = {}
        self._seqs: dict[int, Sequence] = {}            # unfinished requests, by id
        self._next_id, self._t0 = 0, time.perf_counter()
        self._start: float | None = None                # the first arrival

    # ---- the public surface ----------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add_request(self, req: Request) -> int:
        """Queue a request; returns its id. Raises at once (and changes nothing) if it is
        malformed or can never fit the cache."""
        req = fitting(req, self.model, self.cache, self.config.sampling)
        choices, now, first = req.sampling.choices(), self.now(), None
        matchers = new_matchers(self.grammars, choices)    # a constraint's, or None (12)
        for s, matcher in zip(choices, matchers):       # n > 1: rids rid, rid + 1, ...
            seq = Sequence(self._next_id, req, now, s, s.generator(self.device), matcher)
            self._next_id += 1
            self._seqs[seq.rid] = seq
            self.scheduler.add(seq, first if self.cache.shares_prefixes else None)
            first = first or seq
        self._start = now if self._start is None else self._start
        return first.rid

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def request_counts(self) -> tuple[int, int]:
        """(requests waiting for a slot, slots decoding a request)."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def holders(self) -> list[int | None]:
        """The request id each slot is serving now (None: a free slot)."""
        running = self.scheduler.running
        return [running[s].rid if s in running else None for s in range(self.cache.n_slots)]

    def kv_used_frac(self) -> float:
        return self.cache.used_tokens() / max(1, self.cache.reserved_tokens())

    def abort(self, rid: int) -> bool:
        """Drop an unfinished request (e.g. its client went away), freeing its slot at once.
        Returns False if it is unknown or already finished. No Result is kept."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        if self.speculator is not None:                 # its draft slot too (11)
            self.speculator.sync(self.scheduler.running)
        return True

    def warm_up(self, progress=None) -> None:
        """A decoder that compiles (06, 13) compiles now: progress(bucket, seconds) hears each."""
        if compiles(self.decoder):
            self.decoder.warm_up(progress=progress)

    @torch.no_grad()
    def step(self) -> list[Event]:
        """1) reserve, 2) admit and plan, 3) the forward pass (decodes and prefill chunks in one,
        unless the decodes have their own), 4) retire: the new tokens."""
        if not self.scheduler.has_work():
            return []
        self.stats.preemptions += len(self.scheduler.reserve())
        decodes, chunks = self.scheduler.plan()
        if self.trace is not None:
            record_trace(self.trace, self.cache, self.holders(), decodes, chunks)
        t_step, planner = time.perf_counter(), self.scheduler.planner
        if decodes:
            record_decode_step(self.stats, self.cache, len(decodes), self.decoder)
        left = tokens_left(planner.max_step_tokens, decodes, chunks)
        if decodes and chunks and not decodes_apart(self.speculator, decodes, left, self.decoder):
            prefilled = self.runner.prefill(chunk_tokens(planner, chunks), decodes)
            events = self._decode(decodes, left, t_step, prefilled.decodes)
        else:
            events = self._decode(decodes, left, t_step) if decodes else []
            prefilled = self.runner.prefill(chunk_tokens(planner, chunks)) if chunks else None
        if chunks:
            computed_chunks(chunks, prefilled.every, self.cache, self.scheduler)
            if prefilled.ends:
                seqs = [chunks[i][0] for i in prefilled.ends]
                events += self._retire(seqs, *sample(seqs, prefilled.ended, self.generator))
        if self.speculator is not None:
            self.speculator.sync(self.scheduler.running)
        self.stats.wall_s = self.now() - self._start
        self.stats.kv_allocated_at_end = self.cache.allocated_tokens()
        return events

    # ---- 3) decode: one token for every sequence that has one left ---------------------------
    def _decode(self, seqs: list[Sequence], tokens_left: int | None, t_step: float,
                logits: Tensor | None = None) -> list[Event]:
        """A token for each, the step begun at t_step: from logits (B, V) of a mixed pass, else
        from a decode pass of their own (or a speculating step's verified guesses, 11)."""
        if logits is not None:
            tokens, logprobs = sample(seqs, logits, self.generator)
            if self.speculator is not None:             # a step without guesses (11)
                self.speculator.decoded(seqs, tokens, logprobs)
        elif self.speculator is None or not any(self.speculator.allowed(seqs, tokens_left)):
            tokens, logprobs = sample(seqs, self.runner.decode(seqs), self.generator)
            if self.speculator is not None:             # no row may guess (11)
                self.stats.record_speculation(self.speculator.decoded(seqs, tokens, logprobs))
        else:                                           # guesses, verified in one pass (11)
            verdicts = self.speculator.decode(seqs, tokens_left, self.generator, self.runner)
            self.stats.record_speculation(verdicts)
            tokens, logprobs = [v.tokens for v in verdicts], [v.logprobs for v in verdicts]
        mark_computed(seqs, [len(t) for t in tokens], self.cache, self.scheduler,
                      [t[:-1] for t in tokens])
        events = self._retire(seqs, tokens, logprobs)
        self.stats.decode_s += time.perf_counter() - t_step
        return events

    # ---- 4) retire: sample, record, free the slots of the finished -------------------------
    def _retire(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list]
                ) -> list[Event]:
        """Record each sequence's new tokens (one, or a speculating step's run) and their
        logprobs; a finished request leaves its slot at once, nothing after its end kept."""
        now, events = self.now(), []
        for seq, toks, lps in zip(seqs, tokens, logprobs):
            for tok, lp in zip(toks, lps):
                prompt = seq.prompt_logprobs if not seq.tokens else None
                done = seq.append(tok, now, lp)
                if done:
                    self.results[seq.rid] = seq.result(now)
                    self.stats.record_finished(seq)
                    self.scheduler.finish(seq)
                    del self._seqs[seq.rid]
                reason = self.results[seq.rid].finish_reason if done else None
                events.append(Event(seq.rid, tok, done, reason, lp, prompt))
                if done:
                    break
        return events


@torch.no_grad()
def run_engine(engine: ContinuousEngine, requests: list[Request],
               arrivals: list[float] | None = None, progress=None) -> tuple[list[Result], dict]:
    """Serve `requests` with an engine: each joins it when the clock since the start reaches its
    arrival time (in seconds; None: all at 0, the offline run), and the engine steps until every
    request is done. Returns the Results in request order and the summary. progress (a tqdm bar,
    or anything with .update(n)) is told of finished requests."""
    arrivals = [0.0] * len(requests) if arrivals is None else list(arrivals)
    if len(arrivals) != len(requests) or arrivals != sorted(arrivals):
        raise ValueError(f"arrivals must be {len(requests)} times in increasing order, "
                         "one per request")
    t0 = time.perf_counter()
    rids: list[int] = []
    while len(rids) < len(requests) or engine.has_work():
        now = time.perf_counter() - t0
        while len(rids) < len(requests) and arrivals[len(rids)] <= now:
            try:
                rids.append(engine.add_request(requests[len(rids)]))
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {len(rids)}: {e}") from None
        if engine.has_work():
            finished = sum(ev.done for ev in engine.step())
            if progress is not None and finished:
                progress.update(finished)
        elif len(rids) < len(requests):
            time.sleep(min(0.01, arrivals[len(rids)] - now))
    results = [engine.results.pop(r) for r in rids]
    return results, engine.stats.summary(results)


def run_continuous(model: Transformer, requests: list[Request], config: EngineConfig | int,
                   arrivals: list[float] | None = None, *, generator=None,
                   trace: Trace | None = None, progress=None,
                   **settings) -> tuple[list[Result], dict]:
    """Continuous batching of `requests` on this step's engine (ContinuousEngine(model, config,
    generator=..., trace=..., **settings)), as run_engine serves them: the Results in request
    order and the summary. tinyllm.build.run_continuous takes any EngineConfig."""
    engine = ContinuousEngine(model, config, generator=generator, trace=trace, **settings)
    return run_engine(engine, requests, arrivals, progress)
