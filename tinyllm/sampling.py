"""Sampling: how the next token is picked from the logits, for one row or a batch of rows.

`sample_next` is what solo `generate()` uses; `sample_rows` gives each row of a batch its own
settings and, for a seeded request, its own generator, so that a request draws exactly the
tokens it would draw alone whatever shares its batch. Draws are by inverse CDF with one
uniform number per row: the same generator state gives the same token alone or in any batch.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

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
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")

    def generator(self, device) -> torch.Generator | None:
        """A seeded request's own generator, or None (it shares the engine's)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Pick the next token of each row: logits (B, V) -> token ids (B, 1).

    temperature 0 is greedy (argmax; top_k and top_p change nothing), and so is any temperature
    below GREEDY_BELOW. Otherwise the logits are divided by the temperature, cut to the top_k
    largest and to the smallest set whose probability reaches top_p (nucleus), and one token is
    drawn with `generator`.
    """
    check_sampling(temperature, top_k, top_p)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if is_greedy(temperature):
        return logits.argmax(dim=-1, keepdim=True)                          # (B, 1)
    probs = sampling_probs(logits, temperature, top_k, top_p)               # (B, V)
    u = torch.rand(probs.size(0), 1, generator=generator, dtype=torch.float64,
                   device=probs.device)                                     # (B, 1)
    return draw(probs, u)


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling: the token whose slice of the cumulative distribution holds u.
    probs (B, V), u (B, 1) uniform in [0, 1) -> token ids (B, 1). One uniform number per row,
    so a row draws the same token from the same generator state alone or in any batch (and it
    is much faster on a CPU than torch.multinomial). A token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(dim=-1)                                     # (B, V)
    total = cdf[:, -1:]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))   # < total
    return torch.searchsorted(cdf, x, right=True)                           # (B, 1)


def sampling_probs(logits: Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> Tensor:
    """The distribution sample_next draws from when temperature > 0: (B, V) -> (B, V)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]              # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)         # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs          # probability of the tokens ranked above
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)                                           # (B, V)


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
        if is_greedy(temperature):
            out[ix] = logits[ix].argmax(dim=-1, keepdim=True)
            continue
        probs = sampling_probs(logits[ix], temperature, top_k, top_p)  # (n, V)
        u = torch.cat([torch.rand(1, 1, generator=generators[i], dtype=torch.float64,
                                  device=logits.device) for i in idx])  # (n, 1)
        out[ix] = draw(probs, u)
    return out
