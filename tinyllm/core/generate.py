"""Step 01 - generation: solo generate(), the oracle.

`generate()` runs one prompt with a `KVCache`: prefill the prompt once, then decode one token
at a time. It is deliberately simple, and it is the oracle of the whole course: every batched,
paged or graphed path must give each request exactly the tokens `generate()` gives it.
`solo()` is the same loop for a whole `Request`, with any sampling settings (penalties, logit
bias, min-p, logprobs, prompt logprobs: the token stage, token_stage.py), and returns its
`Result`; `generate()` is solo() for the plain settings. `generate_uncached()` recomputes the
whole sequence for every token; step 01 measures the difference, and the tests check both give
the same tokens.
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from tinyllm.core import kv_cache, token_stage
from tinyllm.core.logits_processors import History
from tinyllm.core.model import Transformer, gpu_dtype
from tinyllm.core.requests import (
    Request,
    Result,
    TokenLogprobs,
    check_eos,
    check_prompt,
    check_request,
    eos_ids,
    finish_reason,
)
from tinyllm.core.sampling import Sampling, check_generator, check_sampling, sample_next
from tinyllm.core.token_stage import new_matchers


def autocast_for(device: torch.device):
    """Autocast to the GPU's low-precision dtype on CUDA (bf16, or fp16 where the GPU has no
    bf16: model.gpu_dtype), nothing on the CPU (where float32/float64 keep results exact)."""
    if device.type != "cuda":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cuda", dtype=gpu_dtype(device))


def _prepare(model: Transformer, prompt, max_new_tokens, eos_id, temperature, top_k, top_p,
             generator):
    """Validate everything, then return the prompt as (1, T) ids, the set of ids that end
    the answer, and the token picker."""
    prompt = check_prompt(prompt, max_new_tokens, model.cfg.vocab_size, model.cfg.max_seq_len)
    check_sampling(temperature, top_k, top_p)
    check_generator(generator)
    check_eos(eos_id, model.cfg.vocab_size)
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)            # (1, T)
    pick = partial(sample_next, temperature=temperature, top_k=top_k, top_p=top_p,
                   generator=generator)
    return idx, eos_ids(eos_id), pick


def decode_loop(model: Transformer, idx: Tensor, max_new_tokens: int, eos_ids: frozenset[int],
                pick: Callable[[Tensor], Tensor]) -> list[int]:
    """The cached generate loop: prefill idx (1, T) into a fresh KVCache, then feed back one
    token at a time. pick maps last-position logits (1, V) to a token (1, 1). Stops after
    max_new_tokens tokens or at a token of eos_ids (returned as the last token; the set may be
    empty: a chat model may end its turn with any of several ids).

    The cache: KVCache(model.cfg.n_layers, max_len) with room for prompt and new tokens.
    The model: logits, _ = model(ids, cache=cache) returns logits (1, T, V) for T new ids."""
    cache = kv_cache.KVCache(model.cfg.n_layers, idx.size(1) + max_new_tokens)
    logits, _ = model(idx, cache=cache)                                      # (1, T, V)
    out: list[int] = []
    while True:
        nxt = pick(logits[:, -1])                                            # (1, 1)
        out.append(int(nxt.item()))
        if len(out) >= max_new_tokens or out[-1] in eos_ids:
            return out
        logits, _ = model(nxt, cache=cache)                                  # (1, 1, V)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int,
             eos_id: int | list[int] | tuple[int, ...] | None = None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """Solo generation, the oracle: the new tokens for one prompt, ending at max_new_tokens or
    at its EOS (eos_id: one id, several, or None), which is kept as the last token."""
    prompt = check_prompt(prompt, max_new_tokens, model.cfg.vocab_size, model.cfg.max_seq_len)
    check_eos(eos_id, model.cfg.vocab_size)
    check_generator(generator)
    sampling = Sampling(temperature, top_k, top_p)
    eos = tuple(eos_id) if isinstance(eos_id, list) else eos_id
    return solo(model, Request(prompt, max_new_tokens, eos, sampling), generator).tokens


def prompt_logprobs(model: Transformer, idx: Tensor, k: int) -> list[TokenLogprobs | None]:
    """Each prompt token's logprobs (None for the first) from one uncached pass over idx (1, T)."""
    logits, _ = model(idx)                                                   # (1, T, V)
    return [None] + token_stage.token_logprobs(logits[0, :-1], idx[0, 1:].tolist(), k)


@torch.no_grad()
def solo(model: Transformer, request: Request, generator: torch.Generator | None = None,
         grammars=None) -> Result:
    """Solo generation of a Request with any settings, the oracle of the token stage: its
    tokens, their logprobs and its prompt's when its sampling asks for them (a Result whose
    times are 0). A seeded sampling draws from its own generator, an unseeded one from
    `generator`; a constrained one is masked by a matcher of the grammar backend `grammars`
    (12). One choice: for n > 1, run each of sampling.choices()."""
    model.eval()
    req = check_request(request, model.cfg.vocab_size, model.cfg.max_seq_len)
    check_generator(generator)
    s = req.sampling
    if s.n != 1:
        raise ValueError(f"solo runs one choice, got n={s.n}: run each of sampling.choices()")
    device = next(model.parameters()).device
    idx = torch.tensor([req.prompt], dtype=torch.long, device=device)         # (1, T)
    (matcher,) = new_matchers(grammars, [s])
    history, own = History(s, req.prompt, [], req.eos_id, matcher), s.generator(device)
    logprobs: list[TokenLogprobs] = []

    def pick(logits: Tensor) -> Tensor:                                      # (1, V) -> (1, 1)
        (token,), (lp,) = token_stage.select(logits, [history], [own], generator)
        history.output.append(token)
        logprobs.append(lp)
        if matcher is not None:
            matcher.consume(token)
        return torch.tensor([[token]], device=device)

    with autocast_for(device):
        tokens = decode_loop(model, idx, req.max_new_tokens, eos_ids(req.eos_id), pick)
        prompt = None if s.prompt_logprobs is None else \
            prompt_logprobs(model, idx, s.prompt_logprobs)
    return Result(tokens, 0.0, 0.0, [], finish_reason(req, tokens),
                  logprobs if s.logprobs is not None else None, prompt)


@torch.no_grad()
def generate_uncached(model: Transformer, prompt: list[int], max_new_tokens: int,
                      eos_id: int | list[int] | tuple[int, ...] | None = None,
                      temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None,
                      generator: torch.Generator | None = None) -> list[int]:
    """generate() without a cache: the whole sequence is run again for every new token."""
    model.eval()
    idx, eos, pick = _prepare(model, prompt, max_new_tokens, eos_id, temperature, top_k, top_p,
                              generator)
    out: list[int] = []
    with autocast_for(idx.device):
        while True:
            logits, _ = model(idx)                                           # (1, T + t, V)
            nxt = pick(logits[:, -1])                                        # (1, 1)
            out.append(nxt.item())
            if len(out) >= max_new_tokens or out[-1] in eos:
                return out
            idx = torch.cat([idx, nxt], dim=1)                               # (1, T + t + 1)
