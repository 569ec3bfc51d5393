"""Step 04 - the model runner: a planned step's forward passes and the tokens they sample.

The scheduler plans a step (parts.StepPlan); the runner computes it (`run`): the decode rows
and the prompts' chunks in one packed pass (a mixed step, `prefill` with decodes), or the
decode rows' pass (`decode`, through the engine's decode step: the model, or a later step's
decoder) and then the chunks' (a decoder that replays every slot, 06, has its own pass). It
samples each decode row's token and each ending chunk's (`sample`, through the token stage)
and returns them (parts.StepOutput). The head runs only where a token is sampled (vLLM's
logits indices), unless a prompt asks for its logprobs. Speculation's target pass (11) is one
more ragged pass (`verify`). As vLLM's and nano-vllm's model runners do, it plans the cache's
step, runs the model, samples, and times what it ran.
"""

import itertools
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from tinyllm.core import token_stage
from tinyllm.core.generate import autocast_for
from tinyllm.core.model import Transformer, unpacked
from tinyllm.core.parts import DecodeStep, EngineCache, StepOutput, StepPlan
from tinyllm.core.requests import Sequence
from tinyllm.core.stats import Stats, kv_bytes_per_token, sync_device


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


class ModelStep(DecodeStep):
    """Step 04's decode step: the model itself, model(idx, cache=cache)."""

    def __init__(self, model: Transformer):
        self.model = model

    def __call__(self, idx: Tensor, cache) -> tuple[Tensor, None]:
        return self.model(idx, cache=cache)


def sample(seqs: list[Sequence], logits: Tensor, shared: torch.Generator | None):
    """Each sequence's next token from logits (B, V) through the token stage, as one-token
    lists (a speculating step keeps several), with its logprobs (None where not asked)."""
    tokens, logprobs = token_stage.select(logits, [s.history() for s in seqs],
                                          [s.generator for s in seqs], shared)
    return [[t] for t in tokens], [[lp] for lp in logprobs]


class ModelRunner:
    """A planned step's passes on the engine's cache and the tokens they sample (`run`): the
    decode rows alone (one token each, through decode_step: the model, or a decoder of 06 or
    13, called as the model is), or the prefill chunks (a ragged batch) with the decode rows in
    the same pass. A step with decode rows adds its time to stats.decode_s, until its decode
    tokens are sampled, and the part inside the model to stats.forward_s (the engine's Stats,
    made here)."""

    def __init__(self, model: Transformer, cache: EngineCache, decode_step: DecodeStep, device):
        self.model, self.cache, self.decode_step, self.device = model, cache, decode_step, device
        self.stats = Stats(kv_bytes_per_token=kv_bytes_per_token(model, device),
                           kv_reserved_tokens=cache.reserved_tokens())

    def run(self, plan: StepPlan, generator: torch.Generator | None) -> StepOutput:
        """The plan's tokens: its decode rows and chunks in one pass, or (a decode step that
        computes every slot) the decode rows' pass, then the chunks'."""
        decodes, chunks = plan.decodes, plan.chunks
        mixed = bool(decodes and chunks) and not self.decode_step.computes_every_slot
        t0 = self.begin_decode(decodes) if decodes else 0.0
        prefilled = self.prefill(chunks, decodes) if mixed else None
        tokens: list[list[int]] = []
        logprobs: list[list] = []
        if decodes:
            logits = prefilled.decodes if prefilled is not None else self.decode(decodes)
            tokens, logprobs = sample(decodes, logits, generator)
            self.stats.decode_s += time.perf_counter() - t0
        if chunks and not mixed:
            prefilled = self.prefill(chunks)
        return self.output(tokens, logprobs, chunks, prefilled, generator)

    def begin_decode(self, decodes: list[Sequence]) -> float:
        """A step of these decode rows in the stats (the rows computed: every slot's for a
        decode step that computes every slot; the cache's use); returns its start."""
        cache, every = self.cache, self.decode_step.computes_every_slot
        used = cache.used_tokens()
        self.stats.record_step(cache.n_slots if every else len(decodes), len(decodes),
                               cache.n_slots, used / cache.reserved_tokens(),
                               used / max(1, cache.allocated_tokens()))
        return time.perf_counter()

    def output(self, tokens: list[list[int]], logprobs: list[list],
               chunks: list[tuple[Sequence, list[int], bool]], prefilled: "PrefillPass | None",
               generator: torch.Generator | None) -> StepOutput:
        """The step's output: the decode rows' tokens, and a token sampled for each chunk that
        ends its context."""
        if prefilled is None or not prefilled.ends:
            return StepOutput(tokens, logprobs, [], [], [],
                              None if prefilled is None else prefilled.every)
        ended, every = prefilled.ends, prefilled.every
        ended_tokens, ended_logprobs = sample([chunks[i][0] for i in ended], prefilled.ended,
                                              generator)
        return StepOutput(tokens, logprobs, ended, ended_tokens, ended_logprobs, every)

    def sync(self, running: dict[int, Sequence]) -> None:
        """Nothing to follow: the runner keeps nothing of a request between steps."""

    def check_integrity(self, idle: bool = False) -> str | None:
        return None

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
        1 or more a row) in one ragged batch -> every position's logits (B, T, V): the decode
        step's `verify` where it computes it (13: the fused layers), else the model's."""
        q_lens = [len(t) for t in inputs]
        T = max(q_lens)
        idx = torch.tensor([t + [0] * (T - len(t)) for t in inputs], device=self.device)
        t0 = time.perf_counter()
        self.cache.plan_step([s.slot for s in seqs], q_lens)
        with autocast_for(self.device):
            logits = self.decode_step.verify(idx, q_lens, self.cache)
            if logits is None:
                logits, _ = self.model(idx, cache=self.cache)           # (B, T, V)
        sync_device(self.device)
        self.stats.forward_s += time.perf_counter() - t0
        return logits

    def prefill(self, chunks: list[tuple[Sequence, list[int], bool]],
                decodes: list[Sequence] | tuple[()] = ()) -> PrefillPass:
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
