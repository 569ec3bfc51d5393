"""Step 04 - continuous batching: requests join and leave a fixed set of slots every step.

Static batching (03) waits for a batch's longest request. Here a finished request frees its
slot at once and a waiting one takes it in the next step, so no row computes for nobody and
nobody waits for a stranger's long answer. Requests may arrive while others decode; the offline
run is the same loop with every request arriving at 0.

One step of `ContinuousEngine` reads as its four calls: 1) reserve (room for every running
request's next token; scheduler.py), 2) admit the newcomers and plan the step (a token for
every decoding request, the newcomers' contexts), 3) one forward pass for both (the contexts go
straight into their slots), 4) retire what finished. The pass is one ragged step of the cache
(slot_cache.py), packed: its products run on the step's new tokens alone, so a decode row
costs one token beside a long prompt (Orca's iteration-level batching, vLLM's one batch a
step). A decode step of its own is the bucketed decoder's (06) or speculation's (11).
With kv="paged" (05) the memory is a pool of blocks, and requests may be
preempted; with decoder="graphs" (06) the decode step is a replayed CUDA graph, with
decoder="compiled" a step compiled by torch.compile (any device), with decoder="pieces" (13)
each of its layers compiled in pieces around attention (any cache), with decoder="fused" (13)
each layer one C call (float weights on a CPU); with max_step_tokens (07) contexts are
prefilled a chunk at a time; with prefix_cache (08) requests share the blocks of a common
prefix.
"""

import dataclasses
import itertools
import time

import torch
from torch import Tensor

from tinyllm import chunked_prefill, token_stage
from tinyllm.compiled import CompiledDecoder
from tinyllm.config import EngineConfig
from tinyllm.cuda_graph import SlotGraphDecoder
from tinyllm.fused_layer import FusedDecoder
from tinyllm.generate import autocast_for
from tinyllm.model import Transformer, gpu_dtype, unpacked
from tinyllm.paged_kv import PagedKVCache
from tinyllm.piecewise import PiecewiseDecoder
from tinyllm.requests import Event, Request, Result, Sequence, check_request
from tinyllm.sampling import Sampling, check_generator
from tinyllm.scheduler import Scheduler
from tinyllm.slot_cache import SlotCache, SlotKVCache
from tinyllm.speculative import make_speculator
from tinyllm.stats import Stats, Trace, kv_bytes_per_token, sync_device
from tinyllm.token_stage import new_matchers


def make_cache(model: Transformer, config: EngineConfig, max_len: int, n_blocks: int | None,
               device) -> SlotCache:
    """The engine's cache: config.n_slots slots of max_len positions, or (kv="paged") a pool
    of n_blocks blocks shared by them, in the model's dtype (a GPU's compute dtype on CUDA).
    With a prefix cache and no token budget every admitted context is computed whole in its
    admission step, so its blocks are named at admission (a newcomer of the same step shares
    them); under a budget a block is named after the step that writes it (mark_computed)."""
    cfg = model.cfg
    dtype = gpu_dtype(device) if device.type == "cuda" else next(model.parameters()).dtype
    if config.kv == "slots":
        return SlotKVCache(cfg.n_layers, config.n_slots, cfg.n_kv_heads, cfg.head_dim,
                           max_len, dtype, device)
    return PagedKVCache(cfg.n_layers, config.n_slots, cfg.n_kv_heads, cfg.head_dim, n_blocks,
                        config.block_size, max_len, dtype, device, config.prefix_cache,
                        name_at_admission=config.max_step_tokens is None)


def _settings(config: EngineConfig | int, settings: dict):
    """The EngineConfig of ContinuousEngine's arguments (n_slots and keywords, or a config and
    keywords to change), and the decoder passed to reuse, if one was: `decoder` names a kind
    ("eager", "graphs", "compiled") or passes a built decoder (SlotGraphDecoder,
    CompiledDecoder), whose kind, compile mode and cache (max_len; a paged pool's blocks and
    prefix cache) the config then takes."""
    decoder = settings.pop("decoder", None)
    if isinstance(decoder, SlotGraphDecoder):
        settings["decoder"] = "compiled" if isinstance(decoder, CompiledDecoder) else "graphs"
        if isinstance(decoder, CompiledDecoder):
            if settings.setdefault("compile_mode", decoder.mode) != decoder.mode:
                raise ValueError(f"compile_mode {settings['compile_mode']!r}: the decoder "
                                 f"given was compiled in mode {decoder.mode!r}")
        cache = decoder.slots                           # by default, its cache's settings
        settings.setdefault("max_len", cache.max_len)
        if isinstance(cache, PagedKVCache):
            for name, value in (("kv", "paged"), ("kv_blocks", cache.n_blocks),
                                ("block_size", cache.block_size),
                                ("prefix_cache", cache.prefix is not None)):
                settings.setdefault(name, value)
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
        cache = make_cache(model, config, max_len, n_blocks, device)
        if config.decoder == "pieces":                  # the decode step in pieces (13)
            return cache, PiecewiseDecoder(model)
        if config.decoder == "fused":                   # each layer in one C call (13)
            return cache, FusedDecoder(model)
        if config.decoder == "compiled":
            return cache, CompiledDecoder(model, cache, config.buckets, config.compile_mode)
        if config.decoder == "graphs":
            return cache, SlotGraphDecoder(model, cache, config.buckets)
        return cache, None
    cache, wanted = decoder.slots, ["slots", max_len, None, config.n_slots]
    if config.kv == "paged":
        wanted = ["paged", max_len, n_blocks, config.n_slots, config.block_size,
                  config.prefix_cache]
    naming = getattr(cache, "name_at_admission", False)     # safe only without a budget (08)
    if decoder.model is not model or cache_sizes(cache) != wanted or any(cache.active) or \
            (naming and config.max_step_tokens is not None):
        raise ValueError(f"the decoder serves another model, or its cache is not the "
                         f"{config.kv} cache of these settings ({config.n_slots} idle slots of "
                         f"{max_len} positions)")
    return cache, decoder


def cache_sizes(cache: SlotCache) -> list:
    """What a cache was made with: its kind, max_len, blocks (None for slots), slots, and a
    paged pool's block size and whether it has a prefix cache."""
    if isinstance(cache, PagedKVCache):
        return ["paged", cache.max_len, cache.n_blocks, cache.n_slots, cache.block_size,
                cache.prefix is not None]
    return ["slots", cache.max_len, None, cache.n_slots]


class ModelRunner:
    """A step's forward passes on the engine's cache: the decode rows alone (one token each,
    through the model or a decoder: 06, 13), or the prefill chunks (a ragged batch) with the
    decode rows in the same pass. Each returns the logits to sample from; the time inside the
    model of a pass with decode rows is added to stats.forward_s."""

    def __init__(self, model: Transformer, cache: SlotCache, decoder, stats: Stats, device):
        self.model, self.cache, self.decoder, self.stats, self.device = \
            model, cache, decoder, stats, device

    def decode(self, seqs: list[Sequence]) -> Tensor:
        """Each sequence's last token (or, after its prefill, its prompt's) -> logits (B, V)."""
        rows = [s.slot for s in seqs]
        last = [last_token(s) for s in seqs]
        t0 = time.perf_counter()
        self.cache.plan_step(rows, [1] * len(rows))
        if not isinstance(self.decoder, SlotGraphDecoder):   # the model, in pieces or fused (13)
            idx = torch.tensor(last, device=self.device)[:, None]       # (B, 1)
            with autocast_for(self.device):
                forward = self.model if self.decoder is None else self.decoder
                logits, _ = forward(idx, cache=self.cache)              # (B, 1, V)
        else:                                           # every slot, one graph replay (06)
            idx = torch.zeros(self.cache.n_slots, 1, dtype=torch.long, device=self.device)
            idx[rows, 0] = torch.tensor(last, device=self.device)
            logits = self.decoder.step(idx)[rows]                       # (S, 1, V) -> (B, 1, V)
        sync_device(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits[:, -1]                                            # (B, V)

    def verify(self, seqs: list[Sequence], inputs: list[list[int]]) -> Tensor:
        """Speculation's target pass (11): each sequence's last token and its guesses (inputs,
        1 or more a row) in one ragged batch -> every position's logits (B, T, V)."""
        q_lens = [len(t) for t in inputs]
        T = max(q_lens)
        idx = torch.tensor([t + [0] * (T - len(t)) for t in inputs], device=self.device)
        t0 = time.perf_counter()
        self.cache.plan_step([s.slot for s in seqs], q_lens)
        with autocast_for(self.device):
            logits, _ = self.model(idx, cache=self.cache)               # (B, T, V)
        sync_device(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits

    def prefill(self, chunks: list[tuple[Sequence, int]], decodes: list[Sequence] = ()
                ) -> tuple[Tensor | None, list[int], Tensor | None, Tensor | None]:
        """Each sequence's next chunk of its context (next_chunk) in one ragged batch, and
        after them, in the same pass, one token of each decoding sequence in `decodes` (a
        mixed step). The cache packs the ragged batch: the products run on its new tokens
        alone (model.layers_pass). Returns the decode rows' logits (D, V) (None without
        them); the indices of the chunks that end their contexts, their last logits (E, V):
        only those give a token to sample (None when no chunk ends its context); and every
        chunk position's logits (C, T, V) when a sequence still collects its prompt's
        logprobs, else None: the head then runs at the sampled positions alone (vLLM's logits
        indices)."""
        planned = [chunked_prefill.next_chunk(s, n) for s, n in chunks]
        for (seq, n), (toks, _) in zip(chunks, planned):
            if len(toks) != n:
                raise ValueError(f"next_chunk gave {len(toks)} token{'s' * (len(toks) != 1)} "
                                 f"for request {seq.rid}'s chunk of {n}")
        inputs = [t for t, _ in planned] + [[last_token(s)] for s in decodes]
        q_lens = [len(t) for t in inputs]
        T, C = max(q_lens), len(chunks)
        idx = torch.tensor([t + [0] * (T - len(t)) for t in inputs], device=self.device)  # (B, T)
        t0 = time.perf_counter()
        self.cache.plan_step([s.slot for s, _ in chunks] + [s.slot for s in decodes], q_lens)
        ends = [i for i, (_, done) in enumerate(planned) if done]
        with autocast_for(self.device):
            x, where = self.model.layers_pass(idx, cache=self.cache)    # (1, N, d) or (B, T, d)
            # each row's last new token: rows follow each other, packed or all of T tokens
            last = x.reshape(-1, x.size(-1))[[n - 1 for n in itertools.accumulate(q_lens)]]
            every = None
            if any(wants_prompt_logprobs(seq) for seq, _ in chunks):
                every = self.model.compute_logits(unpacked(x, where, len(inputs), T)[:C])
            # the sampled positions: each ending chunk's last token, then each decode row's
            picks = ends + list(range(C, len(inputs)))
            if every is None:
                sampled = self.model.compute_logits(last[picks]) if picks else None  # (P, V)
            else:                                                       # every (C, T, V)
                sampled = torch.cat([every[ends, [q_lens[i] - 1 for i in ends]]] + (
                    [self.model.compute_logits(last[C:])] if decodes else []))  # (E + D, V)
        if decodes:
            sync_device(self.device)
            self.stats.forward_s += time.perf_counter() - t0
        E = len(ends)
        return (sampled[E:] if decodes else None), ends, (sampled[:E] if ends else None), every


def last_token(seq: Sequence) -> int:
    """The token a decoding sequence brings to its next step: its last, or its prompt's last
    (the first step after a prefill whose last token's logits were not kept)."""
    return seq.tokens[-1] if seq.tokens else seq.request.prompt[-1]


def mixes(speculator, decoder) -> bool:
    """Whether a step's decode rows join its prefill chunks' pass (Orca's iteration-level
    batching: one pass a step), as they do unless they have a pass of their own: a speculating
    step's guesses (11), or a graph decoder's replay of every slot (06)."""
    return speculator is None and not isinstance(decoder, SlotGraphDecoder)


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether the sequence asked for its prompt's logprobs and has not all of them yet."""
    got = seq.prompt_logprobs
    return got is not None and len(got) < len(seq.request.prompt)


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


def sample(seqs: list[Sequence], logits: Tensor, shared: torch.Generator | None):
    """Each sequence's next token from logits (B, V) through the token stage, as one-token
    lists (a speculating step keeps several), with its logprobs (None where not asked)."""
    tokens, logprobs = token_stage.select(logits, [s.history() for s in seqs],
                                          [s.generator for s in seqs], shared)
    return [[t] for t in tokens], [[lp] for lp in logprobs]


def mark_computed(seqs: list[Sequence], n: list[int], cache: SlotCache, config: EngineConfig,
                  scheduler: Scheduler, ahead: list[list[int]] | None = None) -> None:
    """The step wrote n[i] tokens of seqs[i]: it holds more of its context, and a prefix cache
    (08) names the blocks that are full now and not named yet (only when a block filled up:
    building the context every step would cost more than the step's own bookkeeping; with no
    budget a newcomer's context was named at its admission already). ahead[i]: tokens written
    that join the context only when retired (a speculating step's kept guesses, 11). A first
    choice whose prompt is computed lets its other choices queue (they share its blocks)."""
    bs = config.block_size
    for i, (seq, k) in enumerate(zip(seqs, n)):
        filled = (seq.num_computed_tokens + k) // bs > seq.num_computed_tokens // bs
        prompt_done = seq.num_computed_tokens < len(seq.request.prompt) <= \
            seq.num_computed_tokens + k
        seq.num_computed_tokens += k
        if config.prefix_cache and filled:
            cache.cache_blocks(seq.slot, seq.context() + (ahead[i] if ahead else []))
        if prompt_done:
            scheduler.release(seq)


def computed_chunks(chunks: list[tuple[Sequence, int]], every: Tensor | None, cache: SlotCache,
                    config: EngineConfig, scheduler: Scheduler) -> None:
    """A step's prefill chunks are computed: their prompt logprobs collected from every (C, T,
    V) (None when none asks), their tokens counted (mark_computed)."""
    collect_prompt_logprobs(chunks, every)
    mark_computed([s for s, _ in chunks], [n for _, n in chunks], cache, config, scheduler)


def leftover(budget: int | None, decodes: list[Sequence], chunks: list[tuple[Sequence, int]]
             ) -> int | None:
    """The tokens a step's plan leaves of its budget (None: no budget)."""
    return None if budget is None else budget - len(decodes) - sum(n for _, n in chunks)


def record_decode_step(stats: Stats, cache: SlotCache, n_rows: int, ragged: bool) -> None:
    """A decode step of n_rows requests in Stats: the rows computed (the requests', or every
    slot's for a bucketed decoder), and the cache's use of what it reserves and allocates."""
    used = cache.used_tokens()
    stats.record_step(n_rows if ragged else cache.n_slots, n_rows, cache.n_slots,
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


class ContinuousEngine:
    """Continuous batching over a SlotCache, one step() at a time.

    `ContinuousEngine(model, EngineConfig(...))` or `ContinuousEngine(model, n_slots, kv="paged",
    ...)`. add_request() queues a request at any time; step() runs one step and returns the new
    tokens as Events; a finished request's Result waits in `results` (pop it). Times are on the
    engine clock, TTFT and latency from the request's arrival. `generator` serves every request
    without a seed; a built `decoder` lends its cache and steps (06); `draft` proposes (11),
    `grammars` constrain (12); a Trace records every step."""

    def __init__(self, model: Transformer, config: EngineConfig | int, *, generator=None,
                 trace: Trace | None = None, draft=None, grammars=None, **settings):
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
        self.sampling, self.generator, self.trace, self.grammars = \
            config.sampling, generator, trace, grammars
        self.stats = Stats(kv_bytes_per_token=per_token,
                           kv_reserved_tokens=self.cache.reserved_tokens())
        self.runner = ModelRunner(model, self.cache, self.decoder, self.stats, device)
        self.speculator = make_speculator(model, config, max_len, device, draft, self.cache,
                                          self.runner, self.stats)
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
        req = fitting(req, self.model, self.cache, self.sampling)
        choices, now, first = req.sampling.choices(), self.now(), None
        matchers = new_matchers(self.grammars, choices)    # a constraint's, or None (12)
        for s, matcher in zip(choices, matchers):       # n > 1: rids rid, rid + 1, ...
            seq = Sequence(self._next_id, req, now, s, s.generator(self.device), matcher)
            self._next_id += 1
            self._seqs[seq.rid] = seq
            self.scheduler.add(seq, first if self.config.prefix_cache else None)
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
        if self.speculator is not None:                 # its draft slot too (11)
            self.speculator.proposer.sync(self.scheduler.running)
        return True

    @torch.no_grad()
    def step(self) -> list[Event]:
        """1) reserve, 2) admit and plan, 3) the forward pass (decodes and prefill chunks in one,
        unless the decodes have their own), 4) retire: the new tokens."""
        if not self.scheduler.has_work():
            return []
        self.stats.preemptions += len(self.scheduler.reserve())
        decodes, chunks = self.scheduler.plan(self.config.max_step_tokens)
        if self.trace is not None:
            record_trace(self.trace, self.cache, self.holders(), decodes, chunks)
        room, t_step = leftover(self.config.max_step_tokens, decodes, chunks), time.perf_counter()
        if decodes:
            record_decode_step(self.stats, self.cache, len(decodes),
                               not isinstance(self.decoder, SlotGraphDecoder))
        if decodes and chunks and mixes(self.speculator, self.decoder):   # one pass for both
            logits, *prefilled = self.runner.prefill(chunks, decodes)
            events = self._decode(decodes, room, t_step, logits)
        else:
            events = self._decode(decodes, room, t_step) if decodes else []
            prefilled = self.runner.prefill(chunks)[1:] if chunks else None
        if chunks:
            ends, logits, every = prefilled
            computed_chunks(chunks, every, self.cache, self.config, self.scheduler)
            if ends:
                seqs = [chunks[i][0] for i in ends]
                events += self._retire(seqs, *sample(seqs, logits, self.generator))
        if self.speculator is not None:
            self.speculator.proposer.sync(self.scheduler.running)
        self.stats.wall_s = self.now() - self._start
        self.stats.kv_allocated_at_end = self.cache.allocated_tokens()
        return events

    # ---- 3) decode: one token for every sequence that has one left ---------------------------
    def _decode(self, seqs: list[Sequence], room: int | None, t_step: float,
                logits: Tensor | None = None) -> list[Event]:
        """A token for each, the step begun at t_step: from logits (B, V) of a mixed pass, else
        from a decode pass of their own (or a speculating step's verified guesses, 11)."""
        if logits is not None:
            tokens, logprobs = sample(seqs, logits, self.generator)
        elif self.speculator is None:
            tokens, logprobs = sample(seqs, self.runner.decode(seqs), self.generator)
        else:                                           # guesses, verified in one pass (11)
            verdicts = self.speculator.decode(seqs, room, self.generator)
            tokens, logprobs = [v.tokens for v in verdicts], [v.logprobs for v in verdicts]
        mark_computed(seqs, [len(t) for t in tokens], self.cache, self.config, self.scheduler,
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


def compiled_decoder(model: Transformer, config: EngineConfig) -> CompiledDecoder:
    """A compiled decoder (06) over the slots ContinuousEngine(model, config) would have,
    every bucket compiled now, before any clock starts: pass it as `decoder=` to the engines
    that time it. Its compile_s says what the compilation took."""
    config = dataclasses.replace(config, decoder="compiled")
    decoder = ContinuousEngine(model, config).decoder
    decoder.warm_up()
    return decoder


@torch.no_grad()
def run_continuous(model: Transformer, requests: list[Request], config: EngineConfig | int,
                   arrivals: list[float] | None = None, *, generator=None,
                   trace: Trace | None = None, progress=None,
                   **settings) -> tuple[list[Result], dict]:
    """Continuous batching of `requests`: each joins the engine when the clock since the start
    reaches its arrival time (in seconds; None: all at 0, the offline run), and the engine steps
    until every request is done. Returns the Results in request order and the summary. config
    and settings as ContinuousEngine's; progress (a tqdm bar, or anything with .update(n)) is
    told of finished requests."""
    eng = ContinuousEngine(model, config, generator=generator, trace=trace, **settings)
    arrivals = [0.0] * len(requests) if arrivals is None else list(arrivals)
    if len(arrivals) != len(requests) or arrivals != sorted(arrivals):
        raise ValueError(f"arrivals must be {len(requests)} times in increasing order, "
                         "one per request")
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
