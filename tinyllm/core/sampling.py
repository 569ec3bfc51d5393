"""Sampling: how the next token is picked from the logits, for one row or a batch of rows.

`sample_next` is what solo `generate()` uses; `sample_rows` gives each row of a batch its own
settings and, for a seeded request, its own generator, so that a request draws exactly the
tokens it would draw alone whatever shares its batch. Draws are by inverse CDF with one
uniform number per row: the same generator state gives the same token alone or in any batch.
"""

import json
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

KINDS = ("json_schema", "json_object", "regex", "lark")     # what a Constraint may be (12)
GREEDY_BELOW = 1e-5     # a temperature this small is greedy: dividing by it would overflow


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the bad setting."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}")


def is_greedy(temperature: float) -> bool:
    """Temperature 0, or below GREEDY_BELOW (as vLLM does): the argmax, no draw."""
    return temperature < GREEDY_BELOW


def _is_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _is_count(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, int) and x >= 0


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (step 12's structured output, applied by a grammar
    backend): kind (one of KINDS) and spec, the schema (as JSON
    text), the regular expression or the Lark grammar ("" for json_object: any JSON object).
    Frozen and hashable, so equal constraints share one compiled grammar."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got "
                             f"{self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a constraint's spec is text (a schema as JSON), got "
                             f"{type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON schema, given as a dict or as JSON text, kept as compact JSON text in its own
        key order (the order in which the answer writes an object's properties)."""
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


@dataclass(frozen=True)
class Sampling:
    """A request's settings for its token stage (vLLM's SamplingParams, for text). Frozen and
    hashable, so equal settings group together.

    temperature, top_k, top_p: sample_next's. seed: this request draws from its own generator,
    seeded so; None shares the engine's. The processors (logits_processors.py) change the
    logits first, from the request's history: presence_penalty and frequency_penalty subtract
    from the logit of each token already generated (once, and once per time), repetition_penalty
    divides a positive logit (multiplies a negative one) of each token in the prompt or the
    output, logit_bias adds to chosen tokens' logits ({id: bias}, kept as sorted pairs), and
    min_tokens forbids every stop id until that many tokens are made. min_p keeps the tokens at
    least min_p times as likely as the likeliest. stop_token_ids end the request as its EOS
    does (kept as its last token); ignore_eos: its EOS does not end it (its stop_token_ids still
    do). logprobs: each generated token comes with its log-probability and the top `logprobs`
    alternatives; prompt_logprobs: each prompt token too (from the first one on). n: n choices
    of one prompt, choice i seeded seed + i (choices()). constraint: a grammar the output must
    match (structured.py, 12), applied as a mask by the engine's grammar backend."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    constraint: Constraint | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got "
                                 f"{getattr(self, name)!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got "
                             f"{self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self._freeze_lists()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_count(self.min_tokens):
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not _is_count(getattr(self, name)):
                raise ValueError(f"{name} must be an int >= 0 or None, got "
                                 f"{getattr(self, name)!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint or None, got {self.constraint!r}")
        if self.constraint is not None and self.min_tokens:
            raise ValueError("min_tokens with a constraint: the grammar decides where the "
                             "answer ends (its EOS may be all it allows)")
        if self.seed is not None and self.seed + self.n > 2**64:
            raise ValueError(f"seed {self.seed} with n={self.n}: choice i is seeded seed + i, "
                             f"which must stay below 2**64")

    def _freeze_lists(self) -> None:
        """logit_bias as sorted (id, bias) pairs (from a dict or pairs), stop_token_ids as a
        tuple of ids; the ids are checked against the vocabulary by check_request."""
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
        if any(not math.isfinite(b) for _, b in pairs) or len({t for t, _ in pairs}) < len(pairs):
            raise ValueError(f"logit_bias must map token ids to finite numbers, got {bias!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__") or \
                any(isinstance(t, bool) or not isinstance(t, int) for t in stops):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stops!r}")
        object.__setattr__(self, "logit_bias", pairs)
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(stops)))

    def generator(self, device) -> torch.Generator | None:
        """A seeded request's own generator, or None (it shares the engine's)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)

    def choices(self) -> list["Sampling"]:
        """The settings of each of the n choices: n 1, choice i seeded seed + i (as vLLM seeds
        them; unseeded choices share the engine's generator), prompt logprobs asked of the
        first only (the prompt is one)."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i,
                        prompt_logprobs=self.prompt_logprobs if i == 0 else None)
                for i in range(self.n)]

    def sampler(self) -> tuple:
        """The settings the sampler reads (after the processors): rows equal in these share a
        distribution's work."""
        return self.temperature, self.top_k, self.top_p, self.min_p


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None,
                min_p: float = 0.0) -> Tensor:
    """Pick the next token of each row: logits (B, V) -> token ids (B, 1).

    temperature 0 is greedy (argmax; top_k, top_p and min_p change nothing), and so is any
    temperature below GREEDY_BELOW. Otherwise the logits are divided by the temperature, cut to
    the tokens at least min_p times as likely as the likeliest, to the top_k largest and to the
    smallest set whose probability reaches top_p (nucleus), and one token is drawn with
    `generator`.
    """
    check_sampling(temperature, top_k, top_p)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if is_greedy(temperature):
        return logits.argmax(dim=-1, keepdim=True)                          # (B, 1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)        # (B, V)
    u = torch.rand(probs.size(0), 1, generator=generator, dtype=torch.float64,
                   device=probs.device)                                     # (B, 1)
    return draw(probs, u)


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: the token whose slice of the cumulative distribution holds u.
    probs (B, V), u (B, 1) uniform in [0, 1) -> token ids (B, 1). One uniform number per row,
    so a row draws the same token from the same generator state alone or in any batch (and it
    is much faster on a CPU than torch.multinomial). A token of probability 0 is never drawn.
    A row with no probability at all (every logit -inf) draws the last token: the id is always
    one of the vocabulary's, which the next step's embedding indexes."""
    cdf = probs.double().cumsum(dim=-1)                                     # (B, V)
    total = cdf[:, -1:]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))   # < total
    return torch.searchsorted(cdf, x, right=True).clamp_(max=probs.size(-1) - 1)   # (B, 1)


def sampling_probs(logits: Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None, min_p: float = 0.0) -> Tensor:
    """The distribution sample_next draws from when temperature > 0: (B, V) -> (B, V). A logit
    that overflowed to +inf (a tiny repetition penalty divides a positive one) counts as the
    largest float, so those tokens share the draw; NaN counts as -inf."""
    logits = (logits.float() / temperature).nan_to_num(
        nan=-math.inf, posinf=torch.finfo(torch.float32).max, neginf=-math.inf)
    if min_p > 0:                   # p < min_p * p_max, in logits: below log(min_p) + max
        floor = logits.max(dim=-1, keepdim=True).values + math.log(min_p)   # (B, 1)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]              # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = nucleus(logits, top_p)
    return logits.softmax(dim=-1)                                           # (B, V)


def nucleus(logits: Tensor, top_p: float) -> Tensor:
    """top_p's cut: the logits (B, V) of each row's smallest set of likeliest tokens whose
    probability reaches top_p (each token whose likelier tokens hold less than top_p), -inf
    elsewhere. The likeliest token always stays (as vLLM and llama.cpp keep it): a top_p
    below float32's smallest number compares as 0. That set lies among a row's k likeliest
    tokens once those hold top_p, so it sorts the k likeliest alone (topk), k from 64 up by
    fours: a vocabulary of 49,152 tokens costs a sort of it only where the probability is
    that spread."""
    probs, V = logits.softmax(dim=-1), logits.size(-1)                       # (B, V)
    k = min(64, V)
    while True:
        top, order = logits.topk(k, dim=-1)       # (B, k), ranked by logit as a sort ranks them
        p = probs.gather(-1, order)                                         # (B, k)
        held = p.cumsum(dim=-1)
        if k == V or bool((held[:, -1] >= top_p).all()):
            break
        k = min(4 * k, V)
    before = held - p                              # probability of the tokens ranked above
    cut = before >= top_p                                                   # (B, k)
    cut[:, 0] = False                              # the likeliest stays, however small top_p
    kept = top.masked_fill(cut, float("-inf"))                              # (B, k)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)


def sample_rows(logits: Tensor, samplings: list[Sampling],
                generators: list[torch.Generator | None], shared: torch.Generator | None) -> Tensor:
    """Next token per row (B, V) -> (B, 1), each row with its own settings (the sampler's:
    Sampling.sampler()). Rows without a generator of their own take one sample_next call per
    distinct setting, in order of first appearance, with the shared generator; so when every
    row shares one setting, RNG use is that of one sample_next call. Rows with their own
    generator (seeded requests) share the work of each setting's distribution, then each draws
    its token alone, with its generator."""
    shared_rows: dict[tuple, list[int]] = {}
    own_rows: dict[tuple, list[int]] = {}
    for i, (s, g) in enumerate(zip(samplings, generators)):
        (shared_rows if g is None else own_rows).setdefault(s.sampler(), []).append(i)
    if len(shared_rows) == 1 and not own_rows:
        ((temperature, top_k, top_p, min_p),) = shared_rows
        return sample_next(logits, temperature, top_k, top_p, shared, min_p)
    out = torch.empty(logits.size(0), 1, dtype=torch.long, device=logits.device)
    for (temperature, top_k, top_p, min_p), idx in shared_rows.items():
        ix = torch.tensor(idx, device=logits.device)
        out[ix] = sample_next(logits[ix], temperature, top_k, top_p, shared, min_p)
    for (temperature, top_k, top_p, min_p), idx in own_rows.items():
        ix = torch.tensor(idx, device=logits.device)
        if is_greedy(temperature):
            out[ix] = logits[ix].argmax(dim=-1, keepdim=True)
            continue
        probs = sampling_probs(logits[ix], temperature, top_k, top_p, min_p)  # (n, V)
        u = torch.cat([torch.rand(1, 1, generator=generators[i], dtype=torch.float64,
                                  device=logits.device) for i in idx])  # (n, 1)
        out[ix] = draw(probs, u)
    return out
