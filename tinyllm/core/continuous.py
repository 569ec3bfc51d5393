"""Step 04 - continuous batching: requests join and leave a fixed set of slots every step.

Static batching (03) waits for a batch's longest request. Here a finished request frees its
slot at once and a waiting one takes it in the next step. Requests may arrive while others
decode (`run_engine` feeds them at their arrival times). A step is three calls, as nano-vllm's:
the scheduler plans it (room for every running request's next token, the newcomers admitted, a
token for each decoding request and the newcomers' contexts: scheduler.py), the runner computes
it (one packed forward pass, and the sampled tokens: model_runner.py), and the engine retires
it (each request's new tokens; a finished one leaves its slot). Between two steps a request is
waiting (in arrival order; one preempted to make room for others waits again, to compute its
context anew), or in a slot with its context computed up to `num_computed_tokens`, or finished.
The engine holds parts (parts.py) and never asks which kind: `tinyllm.build.make_engine`
makes step 04's, or a later step's.
"""

import functools
import time

import torch
from torch import Tensor

from tinyllm.core import parts, token_stage
from tinyllm.core.config import EngineConfig
from tinyllm.core.model import Transformer
from tinyllm.core.model_runner import wants_prompt_logprobs
from tinyllm.core.requests import Event, Request, Result, Sequence, check_request
from tinyllm.core.sampling import Sampling, check_generator
from tinyllm.core.scheduler import Scheduler
from tinyllm.core.stats import Trace
from tinyllm.core.token_stage import new_matchers


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


def written(seq: Sequence, ahead: list[int]) -> list[int]:
    """What seq's slot holds once a step wrote it: its context, then the tokens ahead of it."""
    return seq.context() + ahead


def mark_computed(seqs: list[Sequence], n: list[int], cache: parts.EngineCache,
                  scheduler: Scheduler, ahead: list[list[int]] | None = None) -> None:
    """The step wrote n[i] tokens of seqs[i]: it holds more of its context, which the cache may
    keep for later requests (cache_blocks; a slot keeps nothing).
    ahead[i]: tokens written that join the context only as they are retired (a row that made
    several tokens in one step). A first choice whose prompt is computed lets its other
    choices queue (a cache that shares prefixes serves them its blocks)."""
    for i, (seq, k) in enumerate(zip(seqs, n)):
        prompt_done = seq.num_computed_tokens < len(seq.request.prompt) <= \
            seq.num_computed_tokens + k
        seq.num_computed_tokens += k
        cache.cache_blocks(seq.slot, functools.partial(written, seq, ahead[i] if ahead else []))
        if prompt_done:
            scheduler.release(seq)


def fitting(req: Request, model: Transformer, cache: parts.CacheBooks, default: Sampling
            ) -> Request:
    """The request checked (check_request, against the model; its sampling the request's or
    default), if its prompt and new tokens can fit the cache alone (whose max_len may be less
    than the model's); else a ValueError saying why not."""
    req = check_request(req, model.cfg.vocab_size, model.cfg.max_seq_len, default)
    n = len(req.prompt) + req.max_new_tokens
    if (why := cache.never_fits(n)) is not None:
        raise ValueError(f"prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new "
                         f"tokens {why}")
    return req


def record_trace(trace: Trace, cache: parts.EngineCache, holders: list[int | None],
                 plan: parts.StepPlan) -> None:
    """A step in the trace: who holds each slot, the cache's use, the tokens each slot computes."""
    computed = [0] * cache.n_slots
    for seq in plan.decodes:
        computed[seq.slot] = 1
    for seq, tokens, _ in plan.chunks:
        computed[seq.slot] = len(tokens)
    n_reserved = cache.reserved_tokens()
    trace.record(holders, cache.used_tokens() / n_reserved, cache.allocated_tokens() / n_reserved,
                 computed)


class ContinuousEngine:
    """Continuous batching over a cache, one step() at a time, of parts (parts.py): the cache,
    the runner (which holds the decode step), the planner (step 04's: every context whole) and
    a grammar backend (none). tinyllm.build.make_engine makes them from an EngineConfig. A
    request added at any time (add_request) gets its tokens as step()'s Events and its Result
    in `results` (pop it), on the engine clock from its arrival; `generator` serves those
    without a seed."""

    def __init__(self, model: Transformer, config: EngineConfig, cache: parts.EngineCache,
                 runner: parts.Runner, *, planner: parts.Planner | None = None,
                 grammars: parts.Grammars | None = None,
                 generator: torch.Generator | None = None, trace: Trace | None = None):
        check_generator(generator)
        model.eval()
        self.model, self.config, self.cache, self.runner = model, config, cache, runner
        self.device, self.max_len = next(model.parameters()).device, cache.max_len
        self.decoder, self.stats = runner.decode_step, runner.stats
        self.scheduler = Scheduler(cache, planner)
        self.generator, self.trace, self.grammars = generator, trace, grammars
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
        matchers = new_matchers(self.grammars, choices)    # a constraint's, or None
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
        self.runner.sync(self.scheduler.running)
        return True

    def warm_up(self, progress=None) -> None:
        """A decode step that compiles compiles now: progress(bucket, seconds) hears each."""
        if self.decoder.compiles:
            self.decoder.warm_up(progress=progress)

    @torch.no_grad()
    def step(self) -> list[Event]:
        """1) plan (the scheduler), 2) run (the runner: the forward pass and its tokens),
        3) retire (the new tokens; the finished leave their slots): the step's Events."""
        if not self.scheduler.has_work():
            return []
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if self.trace is not None:
            record_trace(self.trace, self.cache, self.holders(), plan)
        events = self.retire(plan, self.runner.run(plan, self.generator))
        self.runner.sync(self.scheduler.running)
        self.stats.wall_s = self.now() - (self._start or 0.0)
        self.stats.kv_allocated_at_end = self.cache.allocated_tokens()
        return events

    def retire(self, plan: parts.StepPlan, out: parts.StepOutput) -> list[Event]:
        """The step's tokens in their requests: the decode rows' (each row's context grows by
        its new tokens, one or a run of them, each joining the context as it is
        retired), then the chunks' (their prompt logprobs, the tokens they computed, and a
        token for each chunk that ends its context)."""
        decodes, chunks = plan.decodes, plan.chunks
        mark_computed(decodes, [len(t) for t in out.tokens], self.cache, self.scheduler,
                      [t[:-1] for t in out.tokens])
        events = self._append(decodes, out.tokens, out.logprobs)
        if chunks:
            sizes = [(seq, len(tokens)) for seq, tokens, _ in chunks]
            collect_prompt_logprobs(sizes, out.every)
            mark_computed([s for s, _ in sizes], [n for _, n in sizes], self.cache,
                          self.scheduler)
            ended = [chunks[i][0] for i in out.ended]
            events += self._append(ended, out.ended_tokens, out.ended_logprobs)
        return events

    def _append(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list]
                ) -> list[Event]:
        """Record each sequence's new tokens (one, or a run a step made) and their
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
