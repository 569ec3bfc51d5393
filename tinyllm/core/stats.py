"""Stats and timing: what every engine measures, and how.

`Stats` is filled by the engine that runs the requests, and read through `Stats.summary()`
(the notebooks and the benchmark read nothing else). Per-step figures are kept as running
sums, so a long-lived engine's Stats stay the same size. A `Trace` records what every decode
step looked like, one short list per step, when a caller asks for one (viz.py draws it).
"""

import math
import time
from dataclasses import dataclass

import torch

from tinyllm.core.requests import Result


@dataclass
class Stats:
    wall_s: float = 0.0
    useful_tokens: int = 0
    decode_steps: int = 0
    computed_rows: int = 0
    useful_rows: int = 0
    kv_reserved_tokens: int = 0
    kv_bytes_per_token: int = 0
    preemptions: int = 0
    peak_active: int = 0
    kv_allocated_at_end: int = 0
    decode_s: float = 0.0             # time in decode steps, all of it,
    forward_s: float = 0.0            # and the part of it inside the model's forward;
    slot_rows: int = 0                # rows the engine had (batch size or slots) per step
    recomputed_tokens: int = 0        # context brought back after a preemption
    prompt_tokens: int = 0            # prompts of the finished requests,
    prefill_tokens: int = 0           # the context tokens computed for them (recompute too),
    cached_prompt_tokens: int = 0     # and those a prefix cache served instead
    spec_rows: int = 0                # speculation (11): rows verified by a target pass,
    spec_proposed: int = 0            # the guesses they brought, those kept,
    spec_accepted: int = 0
    spec_tokens: int = 0              # and the tokens they made
    kv_used_sum: float = 0.0          # per decode step: KV positions in use / reserved,
    kv_used_peak: float = 0.0
    kv_alloc_sum: float = 0.0         # and in use / allocated (the paged cache's blocks)
    kv_alloc_steps: int = 0

    def record_step(self, computed_rows: int, useful_rows: int, slot_rows: int,
                    kv_used: float, kv_alloc: float | None = None) -> None:
        """One decode step: rows computed, rows that served a request, rows the engine has,
        and the KV cache's use (of what is reserved; of what is allocated, if it says)."""
        self.decode_steps += 1
        self.computed_rows += computed_rows
        self.useful_rows += useful_rows
        self.slot_rows += slot_rows
        self.peak_active = max(self.peak_active, useful_rows)
        self.kv_used_sum += kv_used
        self.kv_used_peak = max(self.kv_used_peak, kv_used)
        if kv_alloc is not None:
            self.kv_alloc_sum += kv_alloc
            self.kv_alloc_steps += 1

    def record_speculation(self, verdicts) -> None:
        """A speculative decode step (11): each row's guesses, those kept, its new tokens."""
        self.spec_rows += len(verdicts)
        self.spec_proposed += sum(v.proposed for v in verdicts)
        self.spec_accepted += sum(v.accepted for v in verdicts)
        self.spec_tokens += sum(len(v.tokens) for v in verdicts)

    def record_finished(self, seq) -> None:
        """A request finished (a Sequence, 04): its tokens, and the prompt work it took."""
        self.useful_tokens += len(seq.tokens)
        self.prompt_tokens += len(seq.request.prompt)
        self.prefill_tokens += seq.num_prefilled_tokens
        self.cached_prompt_tokens += seq.num_cached_tokens
        self.recomputed_tokens += (seq.num_prefilled_tokens + seq.num_cached_tokens
                                   - len(seq.request.prompt))

    def summary(self, results: list[Result]) -> dict:
        """The figures of a run, from its Results and the engine's counts. Counts of steps and
        tokens do not depend on the machine; the seconds do (its speed, and what else runs).

        requests, wall_s, useful_tokens (generated), tok_s (useful_tokens / wall_s);
        decode_steps; row_util: the share of computed rows that served a request; occupancy:
        the share of the engine's rows or slots that held one; latency_mean_s, latency_p95_s,
        ttft_mean_s, ttft_p95_s: from each request's arrival; tpot_mean_s: the mean time per
        token after the first; itl_p99_s, itl_max_s: the gaps between two tokens of a request;
        prompt_tokens, prefill_tokens (context tokens computed, recomputes included),
        cached_prompt_tokens (served by a prefix cache, 08); kv_reserved_mib: the KV cache's
        memory; kv_used_mean, kv_used_peak: per decode step, the positions the requests hold
        over the positions reserved; kv_alloc_used_mean: the same over the positions allocated
        (the paged cache's blocks in use; None for a cache that allocates nothing); with a
        prefix cache both count a shared block once per table that holds it, so they exceed
        1 when requests share prefixes (the sharing factor); preemptions, recomputed_tokens
        (context computed again after a preemption); peak_active: the most requests decoded
        together; kv_allocated_at_end: the positions still allocated when the run ended (0 on
        a paged pool unless something leaked; a slot cache allocates all it reserves, up
        front); decode_overhead: the share of a decode step spent outside the forward pass."""
        lat = sorted(r.latency_s for r in results)
        ttft = sorted(r.ttft_s for r in results)
        itl = sorted(gap for r in results for gap in r.itl_s)          # every request's gaps
        tpot = [(r.latency_s - r.ttft_s) / (len(r.tokens) - 1)
                for r in results if len(r.tokens) > 1]
        pct = lambda xs, p: xs[min(len(xs) - 1, math.ceil(p * len(xs)) - 1)] if xs else 0.0
        p95 = lambda xs: pct(xs, 0.95)
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
            "tpot_mean_s": mean(tpot),
            "itl_p99_s": pct(itl, 0.99),
            "itl_max_s": itl[-1] if itl else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "kv_reserved_mib": self.kv_reserved_tokens * self.kv_bytes_per_token / 2**20,
            "kv_used_mean": self.kv_used_sum / max(1, self.decode_steps),
            "kv_used_peak": self.kv_used_peak,
            "kv_alloc_used_mean": (self.kv_alloc_sum / self.kv_alloc_steps
                                   if self.kv_alloc_steps else None),
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "peak_active": self.peak_active,
            "kv_allocated_at_end": self.kv_allocated_at_end,
            "decode_overhead": 1 - self.forward_s / self.decode_s if self.decode_s else 0.0,
            **self._speculation(),
        }

    def _speculation(self) -> dict:
        """With speculation (11): spec_proposed, spec_accepted, acceptance_rate (kept over
        proposed) and tokens_per_pass (a request's new tokens per target pass, 1 without)."""
        if not self.spec_rows:
            return {}
        return {"spec_proposed": self.spec_proposed, "spec_accepted": self.spec_accepted,
                "acceptance_rate": self.spec_accepted / max(1, self.spec_proposed),
                "tokens_per_pass": self.spec_tokens / self.spec_rows}


class Trace:
    """What each step looked like: rows[step][row] = the request id a row or slot served
    (None: nobody), kv_used[step] = KV positions in use / reserved (at the step's start),
    kv_alloc[step] = positions allocated / reserved (the paged cache's blocks; else 1 or None),
    computed[step][row] = the tokens the row computed (1 for a decode, more for a prompt or a
    chunk of one, 0 for a row that waited; None where the engine does not say). Static
    batching records its decode steps, the continuous engine every step. Pass one to an engine
    to fill it; one short list per step. viz.py draws it."""

    def __init__(self):
        self.rows: list[list[int | None]] = []
        self.kv_used: list[float] = []
        self.kv_alloc: list[float | None] = []
        self.computed: list[list[int] | None] = []

    def record(self, holders: list[int | None], kv_used: float,
               kv_alloc: float | None = None, computed: list[int] | None = None) -> None:
        self.rows.append(list(holders))
        self.kv_used.append(kv_used)
        self.kv_alloc.append(kv_alloc)
        self.computed.append(None if computed is None else list(computed))


def sync_device(device: torch.device) -> None:
    """Wait for the GPU, so the forward pass's time is measured, not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(model, device: torch.device) -> int:
    """Bytes of keys and values one token holds in the caches of `model`, all layers."""
    elem = 2 if device.type == "cuda" else next(model.parameters()).element_size()
    return sum(layer.self_attn.cache_bytes_per_token(elem) for layer in model.layers)


class ForwardTimer:
    """Times the model's decode forward passes (a KVCache that already holds tokens) from
    outside the loop, with forward hooks, so any loop (yours too) is measured the same way."""

    def __init__(self, model, stats: Stats):
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
