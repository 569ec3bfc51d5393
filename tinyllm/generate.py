"""Step 01 - generation: sampling, and solo generate(), the oracle.

`generate()` runs one prompt with a `KVCache`: prefill the prompt once, then decode one token
at a time. It is deliberately simple, and it is the oracle of the whole course: every batched,
paged or graphed path must give each request exactly the tokens `generate()` gives it.
`generate_uncached()` recomputes the whole sequence for every token; step 01 measures the
difference, and the tests check both give the same tokens.
"""

from functools import partial
from typing import Callable

import torch
from torch import Tensor

from tinyllm import kv_cache
from tinyllm.model import Transformer


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA, nothing on the CPU (where float32/float64 keep results exact)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


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


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Pick the next token of each row: logits (B, V) -> token ids (B, 1).

    temperature 0 is greedy (argmax; top_k and top_p change nothing). Otherwise the logits
    are divided by the temperature, cut to the top_k largest and to the smallest set whose
    probability reaches top_p (nucleus), and one token is drawn with `generator`.
    """
    check_sampling(temperature, top_k, top_p)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if temperature == 0:
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


def check_prompt(prompt: list[int], max_new_tokens: int, vocab_size: int, max_len: int) -> None:
    """Raise ValueError if the prompt is empty, holds an id outside [0, vocab_size), or prompt
    plus new tokens would not fit max_len positions."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token id")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens "
                         f"exceeds max_seq_len {max_len}")


def _prepare(model: Transformer, prompt, max_new_tokens, temperature, top_k, top_p, generator):
    """Validate everything, then return the prompt as (1, T) ids and the token picker."""
    prompt = list(prompt)
    check_prompt(prompt, max_new_tokens, model.cfg.vocab_size, model.cfg.max_seq_len)
    check_sampling(temperature, top_k, top_p)
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)            # (1, T)
    pick = partial(sample_next, temperature=temperature, top_k=top_k, top_p=top_p,
                   generator=generator)
    return idx, pick


def decode_loop(model: Transformer, idx: Tensor, max_new_tokens: int, eos_id: int | None,
                pick: Callable[[Tensor], Tensor]) -> list[int]:
    """The cached generate loop: prefill idx (1, T) into a fresh KVCache, then feed back one
    token at a time. pick maps last-position logits (1, V) to a token (1, 1). Stops after
    max_new_tokens tokens or at eos_id (which is returned as the last token).

    The cache: KVCache(model.cfg.n_layers, max_len) with room for prompt and new tokens.
    The model: logits, _ = model(ids, cache=cache) returns logits (1, T, V) for T new ids."""
    cache = kv_cache.KVCache(model.cfg.n_layers, idx.size(1) + max_new_tokens)
    logits, _ = model(idx, cache=cache)                                      # (1, T, V)
    out: list[int] = []
    while True:
        nxt = pick(logits[:, -1])                                            # (1, 1)
        out.append(nxt.item())
        if len(out) >= max_new_tokens or out[-1] == eos_id:
            return out
        logits, _ = model(nxt, cache=cache)                                  # (1, 1, V)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, eos_id: int | None = None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """Solo generation, the oracle: the new tokens for one prompt (eos_id included if hit)."""
    model.eval()
    idx, pick = _prepare(model, prompt, max_new_tokens, temperature, top_k, top_p, generator)
    with autocast_for(idx.device):
        return decode_loop(model, idx, max_new_tokens, eos_id, pick)


@torch.no_grad()
def generate_uncached(model: Transformer, prompt: list[int], max_new_tokens: int,
                      eos_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> list[int]:
    """generate() without a cache: the whole sequence is run again for every new token."""
    model.eval()
    idx, pick = _prepare(model, prompt, max_new_tokens, temperature, top_k, top_p, generator)
    out: list[int] = []
    with autocast_for(idx.device):
        while True:
            logits, _ = model(idx)                                           # (1, T + t, V)
            nxt = pick(logits[:, -1])                                        # (1, 1)
            out.append(nxt.item())
            if len(out) >= max_new_tokens or out[-1] == eos_id:
                return out
            idx = torch.cat([idx, nxt], dim=1)                               # (1, T + t + 1)
