"""Requests and results: the vocabulary every engine speaks.

A `Request` is what a client asks for (a prompt, how many tokens at most, where to stop, how to
sample); a `Result` is what it gets back, with its time to first token and its latency; an
`Event` is one generated token as it is made (a server streams these), with its
`TokenLogprobs` when the request asks for them. Inside the continuous
engine a request lives as one `Sequence`, which holds everything the engine knows of it.
The checks here run before a request touches any engine state.
"""

import numbers
from dataclasses import dataclass, field

import torch

from tinyllm.core.logits_processors import History
from tinyllm.core.sampling import Sampling


@dataclass
class Request:
    """prompt: token ids; max_new_tokens: at most this many new tokens; eos_id: the token that
    ends it (kept as its last token), several (a chat model may end its turn with any of them:
    Llama 3 Instruct with 128001, 128008 or 128009), or None; sampling: None is the engine's."""
    prompt: list[int]
    max_new_tokens: int
    eos_id: int | tuple[int, ...] | None = None
    sampling: Sampling | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability under the model (the log-softmax of its raw logits, before
    any processor or temperature: vLLM's default) and the top alternatives at its position,
    likeliest first: (id, logprob) pairs, as many as the request's logprobs (or
    prompt_logprobs) asks."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Result:
    """A finished request: its tokens, the time to its first token and to its last (from its
    arrival), itl_s, the gaps between its consecutive tokens (len(tokens) - 1 of them), and
    why it ended: "stop" (its EOS) or "length" (max_new_tokens), as the OpenAI API says.
    logprobs: one TokenLogprobs per token when its sampling asks for them; prompt_logprobs: one
    per prompt token (None for the first, which nothing predicts) when asked."""
    tokens: list[int]
    ttft_s: float
    latency_s: float
    itl_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Event:
    """One generated token, as step() reports it (a server streams these); the last of a
    request is done, with its finish_reason ("stop" or "length"). logprobs: the token's, when
    asked; prompt_logprobs: the prompt's, on a request's first event, when asked."""
    rid: int
    token: int
    done: bool
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def eos_ids(eos_id) -> frozenset[int]:
    """The ids that end a request, from its eos_id: None, one id or several."""
    if eos_id is None:
        return frozenset()
    if isinstance(eos_id, numbers.Integral):
        return frozenset((int(eos_id),))
    return frozenset(int(t) for t in eos_id)


def is_eos(token: int, eos_id) -> bool:
    """Whether token ends a request whose eos_id is eos_id (None, one id or several); asked
    for every token, so it builds nothing."""
    if eos_id is None:
        return False
    return token == eos_id if isinstance(eos_id, numbers.Integral) else token in eos_id


def is_done(req: Request, toks: list[int]) -> bool:
    return len(toks) >= req.max_new_tokens or is_eos(toks[-1], req.eos_id)


def finish_reason(req: Request, toks: list[int]) -> str | None:
    """Why a request with these tokens is done: "stop" (an EOS), "length" (max_new_tokens),
    None while it is not."""
    if toks and is_eos(toks[-1], req.eos_id):
        return "stop"
    return "length" if len(toks) >= req.max_new_tokens else None


def longest(reqs: list[Request]) -> int:
    """The positions the longest of these requests takes, prompt and new tokens: what a cache
    must hold for it."""
    return max(len(r.prompt) + r.max_new_tokens for r in reqs)


def check_positive_int(name: str, value) -> None:
    """Raise ValueError unless value is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_prompt(prompt, max_new_tokens: int, vocab_size: int, max_len: int) -> list[int]:
    """The prompt as a new list of ints (it may be any iterable of integers, numpy's too).
    Raises ValueError if it is empty, holds an id outside [0, vocab_size), or prompt plus new
    tokens would not fit max_len positions."""
    check_positive_int("max_new_tokens", max_new_tokens)
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"the prompt must be a list of token ids, got {type(prompt).__name__}")
    prompt = list(prompt)
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token id")
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or \
                not 0 <= int(t) < vocab_size:
            raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens "
                         f"exceeds max_seq_len {max_len}")
    return [int(t) for t in prompt]


def check_eos(eos_id, vocab_size: int) -> None:
    """eos_id is None (never stop early), a token id of the vocabulary, or a non-empty list,
    tuple or set of them."""
    if eos_id is None:
        return
    ids = list(eos_id) if isinstance(eos_id, (list, tuple, set, frozenset)) else [eos_id]
    if not ids or any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                      or not 0 <= int(t) < vocab_size for t in ids):
        raise ValueError(f"eos_id must be a token id in [0, {vocab_size}), several of them "
                         f"(a list), or None, got {eos_id!r}")


def check_token_stage(sampling: Sampling, vocab_size: int) -> None:
    """The ids a sampling names (logit_bias, stop_token_ids) are in the vocabulary, and it asks
    for no more alternatives than the vocabulary has."""
    for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                      ("stop_token_ids", sampling.stop_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(sampling, name) or 0) > vocab_size:
            raise ValueError(f"{name} asks for {getattr(sampling, name)} alternatives; the "
                             f"vocabulary has {vocab_size}")


def stop_ids(eos_id, sampling: Sampling):
    """The ids that end a request: its eos_id unless its sampling ignores EOS, and its
    stop_token_ids; one id stays an int, several are a tuple in order, none is None."""
    ids = [] if eos_id is None or sampling.ignore_eos else \
        [int(eos_id)] if isinstance(eos_id, numbers.Integral) else [int(t) for t in eos_id]
    ids = list(dict.fromkeys(ids + list(sampling.stop_token_ids)))
    return None if not ids else ids[0] if len(ids) == 1 else tuple(ids)


def check_request(req: Request, vocab_size: int, max_len: int,
                  default: Sampling | None = None) -> Request:
    """A checked copy of req, its prompt a new list of ints, its sampling the given one or
    default (an engine's) or Sampling(), its eos_id the ids that end it (stop_ids: EOS unless
    ignored, and the stop_token_ids). Raises naming what is wrong."""
    if not isinstance(req, Request):
        raise TypeError(f"expected a Request, got {type(req).__name__}")
    if req.sampling is not None and not isinstance(req.sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, got {type(req.sampling).__name__}")
    prompt = check_prompt(req.prompt, req.max_new_tokens, vocab_size, max_len)
    check_eos(req.eos_id, vocab_size)
    sampling = req.sampling or default or Sampling()
    check_token_stage(sampling, vocab_size)
    return Request(prompt, req.max_new_tokens, stop_ids(req.eos_id, sampling), sampling)


class Sequence:
    """One request inside the continuous engine, from add_request to its Result.

    Its context (the prompt, and after a preemption the tokens it had made) is computed into
    its slot from num_computed_tokens on: the whole context after admission, a chunk at a time
    under a token budget (07), then one token per step, the one it last sampled (decode).
    """

    def __init__(self, rid: int, request: Request, arrival: float, sampling: Sampling,
                 generator: torch.Generator | None, matcher=None):
        self.rid = rid                                  # its id, in arrival order (lower: earlier)
        self.request = request                          # the checked Request
        self.arrival = arrival                          # the engine clock when it came
        self.sampling = sampling                        # the request's sampling, or the engine's
        self.generator = generator                      # its own when seeded, else None
        self.matcher = matcher                          # its grammar's, when constrained (12)
        self.tokens: list[int] = []                     # made so far (kept if preempted)
        self.ttft: float | None = None                  # the clock at its first token
        self.itl: list[float] = []                      # the gaps between its tokens
        self._last: float | None = None                 # the clock at its last token
        self.slot: int | None = None                    # the slot holding it; None while it waits
        self.num_computed_tokens = 0                    # context tokens its slot holds
        self.num_prefilled_tokens = 0                   # context tokens it had to compute
        self.num_cached_tokens = 0                      # context tokens a prefix cache served (08)
        self.logprobs: list[TokenLogprobs] = []         # its tokens' when asked (kept if preempted)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = \
            None if sampling.prompt_logprobs is None else [None]    # its prompt's, in order

    def context(self) -> list[int]:
        """The tokens to prefill: the prompt, and after a preemption the tokens made so far."""
        return self.request.prompt + self.tokens

    def prefix_key(self) -> list[int] | None:
        """What a prefix cache (08) may serve this sequence by: its context, or None while it
        still needs its prompt's logprobs (a cached block has no logits to give them; vLLM
        skips the prefix cache for such a request too). Its own blocks are cached all the same."""
        got = self.prompt_logprobs
        if got is not None and len(got) < len(self.request.prompt):
            return None
        return self.context()

    def context_len(self) -> int:
        return len(self.request.prompt) + len(self.tokens)

    def history(self, ahead: list[int] | None = None) -> History:
        """What the token stage's processors read of it (its own lists, not copies); with
        ahead, as if those tokens followed its own (speculation's guesses, 11)."""
        output = self.tokens if not ahead else self.tokens + ahead
        return History(self.sampling, self.request.prompt, output, self.request.eos_id,
                       self.matcher)

    def left(self) -> int:
        """Tokens of the context still to compute before the next token can be sampled: 1
        while it decodes, more while its context is prefilled."""
        return self.context_len() - self.num_computed_tokens

    def append(self, token: int, now: float, logprobs: TokenLogprobs | None = None) -> bool:
        """Record a new token made at engine time now (and its logprobs, when asked); True
        when the request is done."""
        self.tokens.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.matcher is not None:
            self.matcher.consume(token)
        if self.ttft is None:
            self.ttft = now
        else:
            self.itl.append(now - self._last)
        self._last = now
        return is_done(self.request, self.tokens)

    def result(self, now: float) -> Result:
        asked = self.sampling.logprobs is not None
        return Result(self.tokens, self.ttft - self.arrival, now - self.arrival, self.itl,
                      finish_reason(self.request, self.tokens), self.logprobs if asked else None,
                      self.prompt_logprobs)

    def __repr__(self) -> str:
        return (f"Sequence(rid={self.rid}, slot={self.slot}, tokens={len(self.tokens)}, "
                f"num_computed_tokens={self.num_computed_tokens})")
