"""Step 03 - static batching: B requests at a time, each batch run to its longest member.

Take requests in order, batch_size at a time. Prefill the batch once (padded, 02), then decode
every row together until the batch's *longest* request is done. Rows whose request finished
early keep computing (wasted work), and the next batch waits for the slowest row: continuous
batching (04) removes both. Each request's tokens equal its solo generate() output.
"""

import time

import torch

from tinyllm.core import padded, token_stage
from tinyllm.core.generate import autocast_for
from tinyllm.core.logits_processors import History
from tinyllm.core.model import Transformer
from tinyllm.core.requests import (
    Request,
    Result,
    check_positive_int,
    check_request,
    finish_reason,
    is_done,
)
from tinyllm.core.sampling import Sampling, check_generator
from tinyllm.core.stats import ForwardTimer, Stats, Trace, kv_bytes_per_token


def run_batch(model: Transformer, batch: list[Request], pick, clock) -> list[Result]:
    """One static batch: prefill the prompts together (prefill_padded, with room for the
    longest request's new tokens), then decode all rows together until every request is done.
    A row whose request has finished keeps computing; its tokens are thrown away.
    pick: logits (B, V) -> tokens (B, 1). clock() -> seconds since the run began: a Result's
    ttft_s is the clock when its first token was picked, latency_s when its last was."""
    device = next(model.parameters()).device
    L = max(len(r.prompt) for r in batch)
    new_max = max(r.max_new_tokens for r in batch)
    logits, cache, _ = padded.prefill_padded(model, [r.prompt for r in batch], L + new_max)
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


def finished(result: Result, req: Request, picked: list[float], logprobs: list) -> Result:
    """result with its inter-token gaps (its k-th token came with the batch's k-th pick), its
    finish reason, and its tokens' logprobs when its sampling asks for them."""
    times, n = picked[:len(result.tokens)], len(result.tokens)
    return Result(result.tokens, result.ttft_s, result.latency_s,
                  [b - a for a, b in zip(times, times[1:])], finish_reason(req, result.tokens),
                  logprobs[:n] if req.sampling.logprobs is not None else None)


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
        used = sum(len(batch[j].prompt) + step + 1 for j in live) / capacity
        stats.record_step(B, len(live), B, used)
        if trace is not None:
            trace.record([ids[j] if held[j] > step else None for j in range(B)], used)


def sampled_batch(model: Transformer, batch: list[Request], generator, clock) -> list[Result]:
    """One batch through run_batch, each row through the token stage with its checked
    request's settings, history and generator: its Results, with their gaps, finish reasons
    and logprobs (when asked)."""
    device = next(model.parameters()).device
    rows = [History(r.sampling, r.prompt, [], r.eos_id) for r in batch]
    gens = [r.sampling.generator(device) for r in batch]
    picked: list[float] = []                            # the clock at each step's tokens
    logprobs: list[list] = [[] for _ in batch]

    def pick(logits):
        picked.append(clock())
        tokens, lps = token_stage.select(logits, rows, gens, generator)
        for row, lp, t, out in zip(rows, lps, tokens, logprobs):
            row.output.append(t)                        # a finished row's too: it is thrown away
            out.append(lp)
        return torch.tensor(tokens, device=logits.device)[:, None]     # (B, 1)

    done = run_batch(model, batch, pick, clock)
    if not isinstance(done, list) or len(done) != len(batch) or \
            not all(isinstance(r, Result) for r in done):
        raise TypeError(f"run_batch returned {done!r} for a batch of {len(batch)} "
                        f"requests: expected a list of {len(batch)} Results, in order")
    return [finished(r, req, picked, lps) for r, req, lps in zip(done, batch, logprobs)]


def checked_batches(requests: list[Request], batch_size: int, cfg,
                    default: Sampling) -> list[Request]:
    """The requests, checked (check_request, with default sampling where a request has none;
    a bad one is named by its index), once every batch of batch_size fits the model: its
    padded prompt and its longest answer within max_seq_len. Static batching runs one choice
    a request, no prompt logprobs and no constraint (the continuous engine does all three)."""
    checked = []
    for i, r in enumerate(requests):
        try:
            checked.append(check_request(r, cfg.vocab_size, cfg.max_seq_len, default))
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        s = checked[-1].sampling
        if s.n != 1 or s.prompt_logprobs is not None or s.constraint is not None:
            raise ValueError(f"request {i}: static batching runs one choice (n=1) without "
                             f"prompt logprobs or a constraint; the continuous engine runs them")
    for b0 in range(0, len(checked), batch_size):
        batch = checked[b0:b0 + batch_size]
        L, new_max = max(len(r.prompt) for r in batch), max(r.max_new_tokens for r in batch)
        if L + new_max > cfg.max_seq_len:
            raise ValueError(f"batch {b0 // batch_size}: padded prompt {L} + new {new_max} "
                             f"exceeds max_seq_len {cfg.max_seq_len}")
    return checked


@torch.no_grad()
def run_static(model: Transformer, requests: list[Request], batch_size: int,
               temperature: float = 0.0, top_k=None, top_p=None, generator=None,
               trace: Trace | None = None, progress=None) -> tuple[list[Result], dict]:
    """Static batching (03): requests in order, batch_size at a time, each batch run to its
    longest member. The settings given here are the default; a request's `sampling` overrides
    them, and a seeded request draws from its own generator, as in ContinuousEngine, so each
    request gets its solo tokens whatever shares its batch.
    Pass a Trace to have every decode step recorded in it; progress (a tqdm bar, or anything
    with .update(n)) is told of finished requests."""
    check_positive_int("batch_size", batch_size)
    default = Sampling(temperature, top_k, top_p)                        # validates them
    check_generator(generator)
    model.eval()
    device = next(model.parameters()).device
    requests = checked_batches(requests, batch_size, model.cfg, default)
    stats = Stats(kv_bytes_per_token=kv_bytes_per_token(model, device))
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0
    results: list[Result] = []
    timer = ForwardTimer(model, stats)
    try:
        for b0 in range(0, len(requests), batch_size):
            batch = requests[b0:b0 + batch_size]
            done = sampled_batch(model, batch, generator, clock)
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
