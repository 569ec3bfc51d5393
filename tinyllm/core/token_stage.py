"""The token stage: a step's logits to each row's next token and its logprobs, in one place.

Every engine and solo generation (the oracle) end a forward pass here. `select` takes the
logits of the rows that sample this step (B, V) and each row's History and generator: the
processors change the logits (logits_processors.py: min_tokens, logit bias, penalties), the
sampler picks from them (sampling.py: temperature, min-p, top-k, top-p, or the argmax), and
the rows that ask for logprobs get the chosen token's log-probability and the top
alternatives. Logprobs are read from the raw logits, before any processor or temperature (as
vLLM's default does): what the model believes, which an evaluation (lm-eval) compares against
another engine. Every operation is per row, so a row's token and logprobs are those it gets
alone (the oracle covers logprobs too). A prompt's logprobs are `token_logprobs` of its tokens
from the logits at the positions before them.
"""

import torch
from torch import Tensor

from tinyllm.core.logits_processors import History, process
from tinyllm.core.requests import TokenLogprobs
from tinyllm.core.sampling import sample_rows


def log_probs(logits: Tensor) -> Tensor:
    """Log-softmax (N, V) -> (N, V), in float64 for float64 logits, float32 otherwise."""
    return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) \
        .log_softmax(dim=-1)


def token_logprobs(logits: Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's token's log-probability and the top k (id, logprob) pairs, likeliest first:
    raw logits (N, V), one token per row."""
    lp = log_probs(logits)                                                  # (N, V)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k:
        values, ids = lp.topk(k, dim=-1)                                    # (N, k)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprobs(t, c, top) for t, c, top in zip(tokens, chosen, tops)]


def select(logits: Tensor, rows: list[History], generators: list[torch.Generator | None],
           shared: torch.Generator | None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Next token per row from the step's raw logits (B, V): processed, then sampled (each row
    with its own generator where it has one, else `shared`, as sample_rows draws). Returns the
    tokens and, per row, its TokenLogprobs (None where its sampling asks for none)."""
    tokens = sample_rows(process(logits, rows), [h.sampling for h in rows], generators,
                         shared).squeeze(-1).tolist()                       # (B,)
    out: list[TokenLogprobs | None] = [None] * len(rows)
    by_k: dict[int, list[int]] = {}
    for i, h in enumerate(rows):
        if h.sampling.logprobs is not None:
            by_k.setdefault(h.sampling.logprobs, []).append(i)
    for k, idx in by_k.items():
        ix = torch.tensor(idx, device=logits.device)
        for i, lp in zip(idx, token_logprobs(logits[ix], [tokens[i] for i in idx], k)):
            out[i] = lp
    return tokens, out


def new_matchers(grammars, samplings: list) -> list:
    """A fresh matcher for each constrained sampling (None for the others), from a grammar
    backend (step 12's: grammars.matcher(constraint)). Raises ValueError when one has a
    constraint and there is no backend, or the backend refuses it."""
    if any(s.constraint is not None for s in samplings) and grammars is None:
        raise ValueError("constraint: this engine has no grammar backend; give it one: "
                         "make_engine(..., grammars=LLGuidance(tokenizer, vocab_size))")
    return [None if s.constraint is None else grammars.matcher(s.constraint) for s in samplings]
