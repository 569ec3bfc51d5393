"""Step 04 - the model runner: a step's forward passes on the engine's cache.

The continuous engine (continuous.py) decides what a step computes; the runner runs it: the
decode rows alone, one token each (`decode`, through the engine's decode step: the model, or a
later step's decoder), or the prompts' chunks with the decode rows beside them in one packed
pass (`prefill`), whose result names what each part gave (`PrefillPass`). The head runs only
where a token is sampled (vLLM's logits indices), unless a prompt asks for its logprobs.
Speculation's target pass (11) is one more ragged pass (`verify`). As vLLM's and nano-vllm's
model runners do, it plans the cache's step, runs the model, and times what it ran.
"""

import itertools
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from tinyllm.core.generate import autocast_for
from tinyllm.core.model import Transformer, unpacked
from tinyllm.core.requests import Sequence
from tinyllm.core.slot_cache import SlotCache
from tinyllm.core.stats import Stats, sync_device


@dataclass
class PrefillPass:
    """What one prefill pass gave: the decode rows' logits (D, V) (None without decode rows);
    the indices of the chunks that end their contexts and their last logits (E, V) (None
    when none ends: only those give a token to sample); and every chunk position's logits
    (C, T, V) when a sequence still collects its prompt's logprobs, else None."""
    decodes: Tensor | None
    ends: list[int]
    ended: Tensor | None
    every: Tensor | None


class ModelRunner:
    """A step's forward passes on the engine's cache: the decode rows alone (one token each,
    through decode_step: the model, or a decoder of 06 or 13, called as the model is), or the
    prefill chunks (a ragged batch) with the decode rows in the same pass. The time inside the
    model of a pass with decode rows is added to stats.forward_s."""

    def __init__(self, model: Transformer, cache: SlotCache, decode_step, stats: Stats, device):
        self.model, self.cache, self.decode_step, self.stats, self.device = \
            model, cache, decode_step, stats, device

    def decode(self, seqs: list[Sequence]) -> Tensor:
        """Each sequence's last token (or, after its prefill, its prompt's) -> logits (B, V)."""
        idx = torch.tensor([last_token(s) for s in seqs], device=self.device)[:, None]  # (B, 1)
        t0 = time.perf_counter()
        self.cache.plan_step([s.slot for s in seqs], [1] * len(seqs))
        with autocast_for(self.device):
            logits, _ = self.decode_step(idx, cache=self.cache)         # (B, 1, V)
        sync_device(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits[:, -1]                                            # (B, V)

    def verify(self, seqs: list[Sequence], inputs: list[list[int]]) -> Tensor:
        """Speculation's target pass (11): each sequence's last token and its guesses (inputs,
        1 or more a row) in one ragged batch -> every position's logits (B, T, V). A decode
        step that offers `verify(idx, q_lens, cache)` computes it where it can (13: the fused
        layers), returning None where the model is to."""
        q_lens = [len(t) for t in inputs]
        T = max(q_lens)
        idx = torch.tensor([t + [0] * (T - len(t)) for t in inputs], device=self.device)
        t0 = time.perf_counter()
        self.cache.plan_step([s.slot for s in seqs], q_lens)
        verify = getattr(self.decode_step, "verify", None)
        with autocast_for(self.device):
            logits = None if verify is None else verify(idx, q_lens, self.cache)
            if logits is None:
                logits, _ = self.model(idx, cache=self.cache)           # (B, T, V)
        sync_device(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits

    def prefill(self, chunks: list[tuple[Sequence, list[int], bool]],
                decodes: list[Sequence] = ()) -> PrefillPass:
        """The chunks, (sequence, the tokens of its context it computes now, whether they end
        it), in one ragged batch, and after them, in the same pass, one token of each decoding
        sequence in `decodes` (a mixed step). The cache packs the ragged batch: the products
        run on its new tokens alone (model.layers_pass); the head runs at the sampled
        positions alone, unless a sequence collects its prompt's logprobs."""
        inputs = [tokens for _, tokens, _ in chunks] + [[last_token(s)] for s in decodes]
        q_lens = [len(t) for t in inputs]
        T, C = max(q_lens), len(chunks)
        idx = torch.tensor([t + [0] * (T - len(t)) for t in inputs], device=self.device)  # (B, T)
        t0 = time.perf_counter()
        self.cache.plan_step([s.slot for s, _, _ in chunks] + [s.slot for s in decodes], q_lens)
        ends = [i for i, (_, _, done) in enumerate(chunks) if done]
        with autocast_for(self.device):
            x, where = self.model.layers_pass(idx, cache=self.cache)    # (1, N, d) or (B, T, d)
            # each row's last new token: rows follow each other, packed or all of T tokens
            last = x.reshape(-1, x.size(-1))[[n - 1 for n in itertools.accumulate(q_lens)]]
            every = None
            if any(wants_prompt_logprobs(seq) for seq, _, _ in chunks):
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
        return PrefillPass(sampled[E:] if decodes else None, ends,
                           sampled[:E] if ends else None, every)


def last_token(seq: Sequence) -> int:
    """The token a decoding sequence brings to its next step: its last, or its prompt's last
    (the first step after a prefill whose last token's logits were not kept)."""
    return seq.tokens[-1] if seq.tokens else seq.request.prompt[-1]


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether the sequence asked for its prompt's logprobs and has not all of them yet."""
    got = seq.prompt_logprobs
    return got is not None and len(got) < len(seq.request.prompt)
