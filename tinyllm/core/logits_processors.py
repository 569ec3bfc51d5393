"""The token stage's processors: a request's logits changed from its history, before sampling.

A `LogitsProcessor` takes a batch of logits (B, V) and each row's `History` (its settings,
prompt, tokens made, the ids that end it) and returns logits (B, V). `process` applies each to
the rows that ask for it (`applies`), so a row that asks for nothing keeps its logits bit for
bit, and no row depends on its neighbours. The built-in ones are vLLM's, in vLLM's order: a
grammar's mask (`GrammarMask`, 12; bits, 32 tokens a word: `apply_bitmask`), `MinTokens`,
`LogitBias`, then `Penalties` (`apply_penalties`, the batched rule; `penalize_row`, the same
rule for one row, token by token: they agree exactly).
Seams: `apply_penalties` (exercise 10), `apply_bitmask` (exercise 12).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tinyllm.core.sampling import Sampling


@dataclass
class History:
    """What a processor may read of one row: its request's settings, prompt and generated
    tokens (the engine's own lists: read, never change them), the ids that end it (the
    checked request's eos_id: None, one id or a tuple), and its grammar's matcher, if any."""
    sampling: Sampling
    prompt: list[int]
    output: list[int]
    eos_id: int | tuple[int, ...] | None = None
    matcher: Any = None             # its grammar's matcher (12), at the state after output

    def stop_ids(self) -> list[int]:
        eos = self.eos_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class LogitsProcessor:
    """Changes the logits of the rows whose settings ask for it: applies(sampling) says which;
    __call__(logits (B, V), rows: one History per row) -> new logits (B, V), each row from its
    own history alone. Never changes its input in place."""

    def applies(self, sampling: Sampling) -> bool:
        raise NotImplementedError

    def __call__(self, logits: Tensor, rows: list[History]) -> Tensor:
        raise NotImplementedError


class MinTokens(LogitsProcessor):
    """No stop id (EOS, stop_token_ids) while fewer than min_tokens tokens are made."""

    def applies(self, sampling: Sampling) -> bool:
        return sampling.min_tokens > 0

    def __call__(self, logits: Tensor, rows: list[History]) -> Tensor:
        logits = logits.clone()
        for i, h in enumerate(rows):
            if len(h.output) < h.sampling.min_tokens and h.stop_ids():
                logits[i, h.stop_ids()] = float("-inf")
        return logits


class LogitBias(LogitsProcessor):
    """logit_bias's numbers added to its tokens' logits."""

    def applies(self, sampling: Sampling) -> bool:
        return bool(sampling.logit_bias)

    def __call__(self, logits: Tensor, rows: list[History]) -> Tensor:
        logits = logits.clone()
        for i, h in enumerate(rows):
            ids = [t for t, _ in h.sampling.logit_bias]
            bias = torch.tensor([b for _, b in h.sampling.logit_bias], dtype=logits.dtype,
                                device=logits.device)
            logits[i, ids] += bias
        return logits


def token_counts(rows: list[History], vocab_size: int, device) -> tuple[Tensor, Tensor]:
    """Each row's counts of its generated tokens (B, V) and which tokens its prompt or output
    holds (B, V), from its history."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.long, device=device)
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for i, h in enumerate(rows):
        if h.output:
            out = torch.tensor(h.output, device=device)
            counts[i].index_add_(0, out, torch.ones_like(out))
        seen[i, torch.tensor(h.prompt + h.output, device=device)] = True
    return counts, seen


def apply_penalties(logits: Tensor, counts: Tensor, seen: Tensor, presence: Tensor,
                    frequency: Tensor, repetition: Tensor) -> Tensor:
    """The penalties of every row at once, as vLLM applies them: logits (B, V); counts (B, V),
    how often each token is among the row's generated tokens; seen (B, V) bool, whether it is
    in the row's prompt or generated tokens; presence, frequency, repetition (B, 1), the rows'
    penalties. Returns new logits (B, V), the input unchanged:
    1) repetition: a seen token's logit is divided by the row's repetition penalty where it is
       positive, multiplied by it where it is not (1.0 changes nothing);
    2) then frequency and presence: logit - frequency * count - presence * (count > 0).
    Example: logits [[2., -1., 0.5]], counts [[0, 2, 0]], seen [[True, True, False]],
    presence [[0.5]], frequency [[0.25]], repetition [[2.]]
    -> [[1., -2. - 0.5 - 0.5, 0.5]] = [[1., -3., 0.5]]."""
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    return logits - frequency * counts - presence * (counts > 0)


def penalize_row(logits: Tensor, prompt: list[int], output: list[int], presence: float,
                 frequency: float, repetition: float) -> Tensor:
    """apply_penalties' rule for one row, token by token: logits (V,) -> new logits (V,)."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    for t in set(output):
        logits[t] = logits[t] - frequency * output.count(t) - presence
    return logits


class Penalties(LogitsProcessor):
    """Presence, frequency and repetition penalties, batched (apply_penalties)."""

    def applies(self, sampling: Sampling) -> bool:
        return sampling.presence_penalty != 0 or sampling.frequency_penalty != 0 \
            or sampling.repetition_penalty != 1

    def __call__(self, logits: Tensor, rows: list[History]) -> Tensor:
        counts, seen = token_counts(rows, logits.size(-1), logits.device)
        column = lambda name: torch.tensor([[getattr(h.sampling, name)] for h in rows],
                                           dtype=logits.dtype, device=logits.device)  # (B, 1)
        return apply_penalties(logits, counts, seen, column("presence_penalty"),
                               column("frequency_penalty"), column("repetition_penalty"))


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(B, W) int32 words -> (B, vocab_size) bool: token 32 w + j is bit j of word w."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, device=bitmask.device)) & 1  # (B, W, 32)
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """A batch of grammar masks at once, the way XGrammar, llguidance and vLLM apply them:
    logits (B, V); bitmask (B, W) int32, W = ceil(V / 32), one bit per token: token t is
    allowed when bit t % 32 of word t // 32 is 1 (the low bit first; bit 31 is the word's
    sign). Returns new logits (B, V): an allowed token's logit as it was, the others -inf (the
    bits past V, padding, are ignored); the input unchanged.
    Example: logits [[1., 2., 3.]], bitmask [[5]] (0b101: tokens 0 and 2) -> [[1., -inf, 3.]]."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.size(-1))     # (B, V)
    return logits.masked_fill(~allowed, float("-inf"))


class GrammarMask(LogitsProcessor):
    """A constrained request's grammar (12): the tokens its matcher does not allow next get
    -inf. Each matcher gives its bitmask in the state after its row's output; the rows' masks
    are applied together (apply_bitmask)."""

    def applies(self, sampling: Sampling) -> bool:
        return sampling.constraint is not None

    def __call__(self, logits: Tensor, rows: list[History]) -> Tensor:
        bitmask = torch.stack([h.matcher.bitmask() for h in rows])          # (B, ceil(V / 32))
        return apply_bitmask(logits, bitmask)


PROCESSORS: tuple[LogitsProcessor, ...] = (GrammarMask(), MinTokens(), LogitBias(), Penalties())


def process(logits: Tensor, rows: list[History],
            processors: tuple[LogitsProcessor, ...] = PROCESSORS) -> Tensor:
    """Every processor in turn on the rows it applies to: logits (B, V) -> (B, V). Returns the
    input itself when no row asks for any (it is never changed in place)."""
    for proc in processors:
        idx = [i for i, h in enumerate(rows) if proc.applies(h.sampling)]
        if not idx:
            continue
        ix = torch.tensor(idx, device=logits.device)
        new = proc(logits[ix], [rows[i] for i in idx])
        logits = logits.clone()
        logits[ix] = new
    return logits
