"""Step 11 - speculative decoding: guess k tokens cheaply, check every guess in one target pass,
keep the agreed run and one token more, roll the rest back.

`NgramProposer` proposes what followed the request's last n tokens earlier in its own context
(prompt lookup; vLLM's `prompt_lookup_max/min`). `DraftProposer` runs a smaller model
(`early_exit`: the target cut to its first layers; or a checkpoint with the same tokenizer) with
its own KV cache, a slot per engine slot. The target computes every guess of every decoding
request in one ragged pass, k + 1 positions a row, and `verify` reads the verdict through the
token stage, each row with its history so far: a greedy request keeps a guess while it is the
token the target picks, so its output is the solo output exactly; a sampled one keeps guess x
with probability min(1, p(x) / q(x)) and otherwise draws from max(0, p - q), normalised, so its
output is distributed as the target's. A pass gives 1 to k + 1 tokens a request; the caches
then roll back the guesses that fell (`rollback`), never into a block a prefix cache shares.

Seams: `accept_greedy`, `accept_sampled` and `roll_back` (exercise 11).
"""

import copy
import dataclasses
import math
import time

import torch
from torch import Tensor, nn

from tinyllm.core.generate import autocast_for
from tinyllm.core.logits_processors import process
from tinyllm.core.model import Transformer
from tinyllm.core.model_runner import ModelRunner, last_token, sample
from tinyllm.core.parts import StepOutput, StepPlan
from tinyllm.core.requests import Sequence, TokenLogprobs, is_done
from tinyllm.core.sampling import draw, is_greedy, sampling_probs
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.core.token_stage import token_logprobs


# ---- the verdict, one row ------------------------------------------------------------------
def accept_greedy(guesses: list[int], picks: list[int]) -> list[int]:
    """The tokens a greedy request keeps: its guesses (k of them) while each equals the
    target's pick at its position (picks: k + 1 tokens, the target's choice after the row's
    last token and after each guess), then the target's pick where the first guess fell, or
    after the last guess when none did. Returns 1 to k + 1 tokens.
    Example: guesses [5, 8, 2], picks [5, 8, 9, 4] -> [5, 8, 9]; guesses [5, 8], picks
    [5, 8, 1] -> [5, 8, 1]; guesses [], picks [7] -> [7]."""
    kept = []
    for guess, pick in zip(guesses, picks):
        if guess != pick:
            break
        kept.append(guess)
    return kept + [picks[len(kept)]]


def accept_sampled(guess: int, p: Tensor, q: Tensor | None, u: float) -> bool:
    """Whether a sampled request keeps `guess`: with probability min(1, p[guess] / q[guess]),
    decided by u, uniform in [0, 1) (keep when u < that). p (V,): the target's distribution
    for the guess's token (from the logits of the position before it, which judge it); q (V,):
    the proposer's, from which the guess was drawn (so q[guess] > 0); None when the
    proposer is certain (a lookup: q is one-hot at guess, and the rule is u < p[guess]).
    Example: p[guess] 0.3, q[guess] 0.6 -> kept when u < 0.5."""
    qx = 1.0 if q is None else float(q[guess])
    return u < min(1.0, float(p[guess]) / qx)


def residual(p: Tensor, q: Tensor | None, guess: int) -> Tensor:
    """Where a sampled guess fell, the distribution of the token drawn instead: max(0, p - q),
    normalised (q one-hot at guess when None: p without the guess). p, q (V,) -> (V,)."""
    if q is None:
        q = torch.zeros_like(p)
        q[guess] = 1.0
    r = (p - q.to(p.dtype)).clamp(min=0)
    total = r.sum()
    return r / total if total > 0 else p


def roll_back(cache, slot: int, fed: int, kept: int) -> None:
    """The cache's books after a target pass that fed a row `fed` positions (its last token
    and fed - 1 guesses) and kept `kept` new tokens (1 to fed: the guesses that stood and the
    target's own): the slot keeps `kept` of the `fed` positions, those whose tokens are now the
    row's context (its last token and the guesses that stood); the rest are rolled back
    (cache.rollback(slot, n), which frees a paged slot's emptied blocks), and nothing is rolled
    back when every position stands. The newest kept token is not in the cache: the next step
    feeds it.
    Example: fed 5 (last token + 4 guesses), kept 3 (2 guesses stood, then the target's own):
    cache.rollback(slot, 2); fed 5, kept 5: nothing."""
    if fed - kept:
        cache.rollback(slot, fed - kept)


# ---- the verdict, a batch ------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    """What a row keeps of a target pass: its tokens (accepted guesses and the target's own),
    their logprobs (None where not asked), and how many guesses it had and kept."""
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    proposed: int
    accepted: int


def distribution(logits: Tensor, seq: Sequence) -> Tensor:
    """The target's (or a draft's) sampling distribution for one processed row (V,) -> (V,)."""
    s = seq.sampling
    return sampling_probs(logits[None], s.temperature, s.top_k, s.top_p, s.min_p)[0]


def verify(logits: Tensor, seqs: list[Sequence], guesses: list[list[int]],
           drafts: list[list[Tensor] | None], shared: torch.Generator | None) -> list[Verdict]:
    """Each row's verdict from the target's logits (B, T, V) over its last token and its
    guesses (row i's first len(guesses[i]) + 1 positions). At each position the token stage's
    processors see the row's history as if its guesses so far stand (they do, up to the first
    that falls); then accept_greedy's rule (greedy rows) or _sampled's (accept_sampled's for a
    draft's guesses), in order, with the row's generator (drafts[i]: the proposer's
    distributions; None for a lookup). A row stops at its EOS or its max_new_tokens: nothing
    after it is kept."""
    proposed = guesses
    processed, guesses = processed_logits(logits, seqs, guesses)
    verdicts = []
    for i, (seq, g) in enumerate(zip(seqs, guesses)):
        if is_greedy(seq.sampling.temperature):
            kept = accept_greedy(g, [int(x.argmax()) for x in processed[i]])
        else:
            kept = _sampled(processed[i], seq, g, drafts[i], shared)
        n = next((m for m in range(1, len(kept)) if is_done(seq.request, seq.tokens + kept[:m])),
                 len(kept))
        accepted = min(n, len(kept) - 1)                # all but the last were guesses
        kept, k = kept[:n], seq.sampling.logprobs
        lps = [None] * n if k is None else token_logprobs(logits[i, :n], kept, k)
        verdicts.append(Verdict(kept, lps, len(proposed[i]), accepted))
    return verdicts


def plain_verdicts(logits: Tensor, seqs: list[Sequence], shared: torch.Generator | None
                   ) -> list[Verdict]:
    """The verdicts of rows that guessed nothing, from their last token's logits (B, V): the
    engine's plain decode step's picks (continuous.sample)."""
    return unguessed(*sample(seqs, logits, shared))


def unguessed(tokens: list[list[int]], logprobs: list[list]) -> list[Verdict]:
    """The verdicts of rows that guessed nothing and made these tokens (one each)."""
    return [Verdict(t, lp, 0, 0) for t, lp in zip(tokens, logprobs)]


def processed_logits(logits: Tensor, seqs: list[Sequence], guesses: list[list[int]]):
    """Each row's processed logits at each position it needs (position j with the history
    of its guesses before j), and the guesses its verdict reads. A constrained row's matcher
    (12) moves over each guess to give the next position's mask, and back at the end; a guess
    its grammar does not allow ends the row's positions there: greedy, the guess is dropped
    (the target's masked pick cannot equal it); sampled, it stays, and falls (p is 0 there).
    A guess that would end the request is dropped there too (a matcher never moves past its
    end): the target's pick at its position decides."""
    B, dev = len(seqs), logits.device
    guesses = [list(g) for g in guesses]
    n_pos, moved = [len(g) + 1 for g in guesses], [0] * B
    processed: list[list[Tensor]] = [[] for _ in range(B)]            # per row, per position
    for j in range(max(n_pos)):
        for i in range(B):
            m = seqs[i].matcher
            if m is None or not 0 < j < n_pos[i]:
                continue
            guess = guesses[i][j - 1]
            if is_done(seqs[i].request, seqs[i].tokens + guesses[i][:j]):
                n_pos[i], guesses[i] = j, guesses[i][:j - 1]    # its end: the pick decides
            elif processed[i][j - 1][guess] == float("-inf") or not m.consume(guess):
                n_pos[i] = j
                greedy = is_greedy(seqs[i].sampling.temperature)
                guesses[i] = guesses[i][:j - 1] if greedy else guesses[i][:j]
            else:
                moved[i] += 1
        rows = [i for i in range(B) if j < n_pos[i]]
        if not rows:
            break
        hist = [seqs[i].history(guesses[i][:j]) for i in rows]
        out = process(logits[torch.tensor(rows, device=dev), j], hist)          # (R, V)
        for r, i in enumerate(rows):
            processed[i].append(out[r])
    for i, seq in enumerate(seqs):
        if seq.matcher is not None:
            seq.matcher.rollback(moved[i])
    return processed, guesses


def _sampled(processed: list[Tensor], seq: Sequence, guesses: list[int], drafts,
             shared: torch.Generator | None) -> list[int]:
    """A sampled row's tokens: its guesses while accept_sampled keeps them, then one drawn
    from the residual where one falls, or from the last position's distribution. A lookup's
    guesses (drafts None, q one-hot): the target's own draw at each position, as a plain step
    draws it (sample_rows: one uniform of the row's generator, draw), while it is the guess,
    and the first that is not."""
    gen = seq.generator or shared
    rand = lambda: torch.rand(1, 1, generator=gen, dtype=torch.float64, device=processed[0].device)
    kept = []
    for j, guess in enumerate(guesses):
        p = distribution(processed[j], seq)
        if drafts is None:                              # q one-hot: kept with chance p(guess)
            token = int(draw(p[None], rand()))
            if token != guess:
                return kept + [token]
        elif not accept_sampled(guess, p, drafts[j], float(rand())):
            return kept + [int(draw(residual(p, drafts[j], guess)[None], rand()))]
        kept.append(guess)
    p = distribution(processed[len(guesses)], seq)
    return kept + [int(draw(p[None], rand()))]


# ---- proposers -----------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
    last n tokens (n from n_max down to n_min), up to k of them. Certain: q is one-hot, so a
    sampled row's tokens do not depend on its guesses (_sampled)."""

    certain = True

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], ks: list[int], shared=None):
        """Up to ks[i] guesses per row, and None (no distributions: a lookup is certain)."""
        return [lookup(s.context(), k, self.n_max, self.n_min) if k > 0 else []
                for s, k in zip(seqs, ks)], [None] * len(seqs)

    def kept(self, seq: Sequence, verdict: "Verdict") -> None:
        """A lookup keeps no state: nothing to roll back."""

    def sync(self, running: dict) -> None:
        """A lookup keeps no state."""

    def check_integrity(self, idle: bool = False) -> str | None:
        return None


def lookup(context: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """What followed the latest earlier occurrence of context's last n tokens (the longest n
    that occurs), at most k tokens; [] when none occurs or k is 0.
    Example: [1, 2, 3, 9, 1, 2], k 2 -> [3, 9]."""
    if k <= 0:
        return []
    for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def early_exit(model: Transformer, n_layers: int) -> Transformer:
    """A draft that costs n_layers of the target's: its first n_layers blocks, then its own
    final norm and head (self-speculation; the weights are shared, not copied)."""
    if not 1 <= n_layers < model.cfg.n_layers:
        raise ValueError(f"a draft of {n_layers} layers: the target has {model.cfg.n_layers}, "
                         f"so give 1 to {model.cfg.n_layers - 1}")
    draft = copy.copy(model)                            # shares every module and buffer
    draft._modules = dict(model._modules)
    draft.layers = nn.ModuleList(list(model.layers)[:n_layers])
    draft.cfg = dataclasses.replace(model.cfg, n_layers=n_layers)
    return draft


class DraftProposer:
    """A draft model proposes, greedily for greedy requests, sampled (with the request's own
    settings and generator) for the others. Its KV cache has a slot per engine slot; a slot is
    taken when its sequence first decodes, filled lazily with whatever of the context it lacks
    (its whole context after an admission or a preemption), rolled back with the target's, and
    freed when the sequence leaves its engine slot (sync). A sampled row's guesses are draws
    of its generator (not certain), so its tokens depend on how many it makes."""

    certain = False

    def __init__(self, draft: Transformer, n_slots: int, max_len: int, device):
        cfg = draft.cfg
        self.model = draft.eval()
        dtype = next(draft.parameters()).dtype
        self.cache = SlotKVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, max_len,
                                 dtype, device)
        self.owner: list[Sequence | None] = [None] * n_slots
        self.device = device

    def sync(self, running: dict) -> None:
        """Free the draft slots whose sequence no longer holds its engine slot."""
        for slot, seq in enumerate(self.owner):
            if seq is not None and running.get(slot) is not seq:
                self.cache.release(slot)
                self.owner[slot] = None

    def check_integrity(self, idle: bool = False) -> str | None:
        return self.cache.check_integrity(idle)

    def propose(self, seqs: list[Sequence], ks: list[int], shared: torch.Generator | None):
        """Up to ks[i] guesses per row, and the draft's distribution at each (None for a
        greedy row: it proposes its argmax, and greedy verification needs no q). A
        constrained row's guesses keep to its grammar: its matcher moves over them, then back."""
        rows = [i for i, k in enumerate(ks) if k > 0]
        guesses: list[list[int]] = [[] for _ in seqs]
        dists: list[list[Tensor] | None] = [None] * len(seqs)
        for i in rows:
            self._take(seqs[i])
        feed = {i: seqs[i].context()[self.cache.lens[seqs[i].slot]:] for i in rows}
        moved = [0] * len(seqs)                         # guesses each matcher moved over
        ks = list(ks)
        for j in range(max((ks[i] for i in rows), default=0)):
            rows_j = [i for i in rows if j < ks[i]]
            if not rows_j:
                break
            inputs = [feed[i] if j == 0 else [guesses[i][-1]] for i in rows_j]
            logits = self._forward([seqs[i].slot for i in rows_j], inputs)          # (R, V)
            hist = [seqs[i].history(guesses[i]) for i in rows_j]
            processed = process(logits, hist)
            for r, i in enumerate(rows_j):
                guesses[i].append(self._guess(processed[r], seqs[i], shared, dists, i))
                if is_done(seqs[i].request, seqs[i].tokens + guesses[i]):
                    ks[i] = j + 1                       # nothing is guessed past its end
                elif seqs[i].matcher is not None:
                    if seqs[i].matcher.consume(guesses[i][-1]):
                        moved[i] += 1
                    else:                               # its grammar allows nothing more
                        guesses[i].pop()
                        ks[i] = j
        for i in rows:
            if seqs[i].matcher is not None:
                seqs[i].matcher.rollback(moved[i])
        return guesses, dists

    def _take(self, seq: Sequence) -> None:
        """The draft slot of seq's engine slot, taken anew when another held it."""
        if self.owner[seq.slot] is not seq:
            if self.cache.active[seq.slot]:
                self.cache.release(seq.slot)
            self.cache.admit(seq.slot, seq.context_len())
            self.owner[seq.slot] = seq

    def _guess(self, processed: Tensor, seq: Sequence, shared, dists: list, i: int) -> int:
        """The draft's guess from its processed logits (V,): the argmax for a greedy request,
        else a draw from its distribution, recorded in dists[i]."""
        if is_greedy(seq.sampling.temperature):
            return int(processed.argmax())
        q = distribution(processed, seq)
        u = torch.rand(1, 1, generator=seq.generator or shared, dtype=torch.float64,
                       device=self.device)
        dists[i] = (dists[i] or []) + [q]
        return int(draw(q[None], u))

    def _forward(self, slots: list[int], inputs: list[list[int]]) -> Tensor:
        """One ragged draft step: each slot's inputs -> the last position's logits (R, V)."""
        q_lens = [len(t) for t in inputs]
        T = max(q_lens)
        idx = torch.tensor([t + [0] * (T - len(t)) for t in inputs], device=self.device)
        self.cache.plan_step(slots, q_lens)
        with autocast_for(self.device):
            logits, _ = self.model(idx, cache=self.cache)                           # (R, T, V)
        return logits[torch.arange(len(slots), device=self.device),
                      torch.tensor(q_lens, device=self.device) - 1]

    def kept(self, seq: Sequence, verdict: Verdict) -> None:
        """After the verdict, before its tokens join seq: the draft keeps the context the
        target keeps, less the newest token (the next step feeds it): roll back the guesses
        it computed that fell."""
        if self.owner[seq.slot] is not seq:
            return
        want = seq.context_len() + len(verdict.tokens) - 1
        extra = self.cache.lens[seq.slot] - want
        if extra > 0:
            self.cache.rollback(seq.slot, extra)


def make_speculator(model: Transformer, config, cache, draft: Transformer | None,
                    decoder=None) -> "Speculator | None":
    """The engine's speculator over its cache (None without config.speculate); a draft model
    is given only to speculate with (speculate='draft'). `decoder`, the engine's decode step,
    says how many query rows its verify pass takes (`verify_rows`), if it has one."""
    if draft is not None and config.speculate != "draft":
        raise ValueError(f"a draft model proposes only with speculate='draft' (got "
                         f"speculate={config.speculate!r})")
    if config.speculate is None:
        return None
    device = cache.k[0].device
    return Speculator(make_proposer(model, config, cache.max_len, device, draft),
                      config.spec_tokens, cache, None if decoder is None else decoder.verify_rows)


def make_proposer(model: Transformer, config, max_len: int, device, draft: Transformer | None):
    """The config's proposer: a lookup, or a draft (the one given, or the target's first
    draft_layers layers, half of them by default)."""
    if config.speculate == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    if draft is None:
        draft = early_exit(model, config.draft_layers or max(1, model.cfg.n_layers // 2))
    elif draft.cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the draft's vocabulary has {draft.cfg.vocab_size} tokens, the "
                         f"target's {model.cfg.vocab_size}: a draft shares the tokenizer")
    elif draft.cfg.max_seq_len < max_len:
        raise ValueError(f"the draft holds {draft.cfg.max_seq_len} positions, the engine's "
                         f"requests up to {max_len}: give a shorter max_len")
    return DraftProposer(draft, config.n_slots, max_len, device)


FREE_ROWS = 3       # a step's fixed cost (the weights read, the calls), in rows' worth
DECAY = 0.5         # the weight of a request's earlier guesses, each time it guesses again
PROBE_STEPS = 2     # a request that stopped guessing tries one guess after this many steps,
BACKOFF = 5         # doubled for each guessing step in a row that fell, up to this many times
FIRST_SHARE = 0.5   # the share of its guesses a request is taken to keep before it guesses,
PRIOR = 1.0         # worth this many guesses of its record


def pays(rows: int) -> float:
    """The chance of standing a guess needs to pay in a step of `rows` rows (Speculator)."""
    return rows / (FREE_ROWS + rows)


class Speculator:
    """The decode step of a speculating engine: guesses (the proposer's), room for them in the
    cache, one ragged target pass (the engine's runner.verify), the verdicts, and the rollback
    of what fell in both caches. The engine counts what it proposed and kept (Stats).

    Guesses are paid for: every guess is a token the target computes, kept or not. A kept guess
    saves a row its token of a later step, a row's share of that step's cost; a guess costs
    about one more row. A step of B rows costs its fixed part (the weights read, the calls made:
    FREE_ROWS rows' worth) and the B rows', so a guess pays while its chance of standing is at
    least `pays(B)` = B / (FREE_ROWS + B): 1/4 alone, 0.4 beside one other row, 0.73 among 8. So
    a request guesses as far as its guesses stand (`guesses_for`): each keeps its own record of
    guesses made and kept, the older ones weighing DECAY less each time it guesses again, and
    with a share a of them kept, its j-th guess of a step stands with chance about a^j (a =
    FIRST_SHARE before it has guessed); it makes the guesses whose chance pays (alone: k of them
    while nearly all stand, 2 at a = 0.5, 1 at a = 0.3). Under that it stops guessing, and tries
    one guess after PROBE_STEPS * 2^m steps without one, m the guessing steps in a row whose
    guesses all fell (BACKOFF at most: text the request copies from its prompt comes and goes,
    and a request that never copies tries ever more rarely), in a step of rows few enough that a
    newcomer's guesses pay: among more, a try costs more than it is likely to bring. On a CPU,
    where a step's rows cost nearly as much as its fixed part, a batch of 4 rows or more then
    guesses only for requests whose guesses have stood. A step with no guess at all runs the
    engine's plain decode step, not a verify pass: where guessing does not pay, speculation
    costs the lookups and nothing more. A decode step whose verify pass is as fast as its plain
    step up to some rows (`verify_rows`: the fused layers', 13) gets no more guesses than those
    rows leave beside the step's own: past them the verify pass would be the model's, slower
    than the plain step the guesses replace."""

    def __init__(self, proposer, k: int, cache, verify_rows: int | None = None):
        self.proposer, self.k, self.cache = proposer, k, cache
        self.verify_rows = verify_rows                  # the decode step's fast verify: rows
        self.record: dict[int, list[float]] = {}       # rid -> [guesses made, kept], decayed
        self.quiet: dict[int, int] = {}                 # rid -> steps since it last guessed
        self.misses: dict[int, int] = {}                # rid -> guessing steps in a row that fell

    def sync(self, running: dict) -> None:
        """The proposer follows the engine's slots (a draft frees the slots of who left); the
        records of who left go."""
        self.proposer.sync(running)
        here = {seq.rid for seq in running.values()}
        for book in (self.record, self.quiet, self.misses):
            for rid in [r for r in book if r not in here]:
                del book[rid]

    def guesses_for(self, rid: int, rows: int = 1) -> int:
        """The guesses that pay for a request in a step of `rows` rows: with a share a of its
        guesses kept (its record, and PRIOR guesses of which FIRST_SHARE stood: a newcomer's
        share is FIRST_SHARE, and one guess that stands is not yet a record), those whose
        chance a^j is at least pays(rows), k at most; none under it, but one after
        PROBE_STEPS * 2^m steps without a guess (m: its guessing steps in a row that fell,
        BACKOFF at most) where a newcomer's guesses would pay (few rows)."""
        made, kept = self.record.get(rid, (0.0, 0.0))
        share, bar = (kept + PRIOR * FIRST_SHARE) / (made + PRIOR), pays(rows)
        if share < bar:                # a try, where a newcomer's guesses would pay
            wait = PROBE_STEPS << min(self.misses.get(rid, 0), BACKOFF)
            return 1 if bar <= FIRST_SHARE and self.quiet.get(rid, 0) >= wait else 0
        return max(1, min(self.k, int(math.log(bar) / math.log(share))))

    def learn(self, seq: Sequence, verdict: "Verdict") -> None:
        """A row's verdict in its record: what it guessed and kept (and whether all of it
        fell), or one more quiet step."""
        if verdict.proposed == 0:
            self.quiet[seq.rid] = self.quiet.get(seq.rid, 0) + 1
            return
        made, kept = self.record.get(seq.rid, (0.0, 0.0))
        self.record[seq.rid] = [made * DECAY + verdict.proposed,
                                kept * DECAY + verdict.accepted]
        self.quiet[seq.rid] = 0
        self.misses[seq.rid] = 0 if verdict.accepted else self.misses.get(seq.rid, 0) + 1

    def check_integrity(self, idle: bool = False) -> str | None:
        return self.proposer.check_integrity(idle)

    def decoded(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list]
                ) -> list["Verdict"]:
        """A step where these rows guessed nothing (none was allowed a guess, or they decoded
        beside the prefill chunks, in their pass): their verdicts, one token each, as decode
        gives them, learnt and returned."""
        verdicts = unguessed(tokens, logprobs)
        for seq, verdict in zip(seqs, verdicts):
            self.proposer.kept(seq, verdict)
            self.learn(seq, verdict)
        return verdicts

    def allowed(self, seqs: list[Sequence], tokens_left: int | None) -> list[int]:
        """Guesses each row may have: as many as pay (guesses_for) in a step of these rows, or
        for a sampled row of a proposer that is not certain (a draft's) as many as pay alone
        (its guesses draw from its generator, so they depend on its own record only, and its
        seeded tokens are the same alone or batched);
        less than its tokens still to make (its last comes from the target), within what the
        step leaves of its budget (tokens_left; None: no limit), the rows the decode step's
        verify pass takes beside the step's own (verify_rows), and the slot's positions."""
        if self.verify_rows is not None:
            room = max(self.verify_rows - len(seqs), 0)
            tokens_left = room if tokens_left is None else min(tokens_left, room)
        ks = []
        for seq in seqs:
            alone = not (self.proposer.certain or is_greedy(seq.sampling.temperature))
            rows = 1 if alone else len(seqs)
            k = self.guesses_for(seq.rid, rows)
            if k > 0:                                   # most rows of a wide step: none
                k = min(k, seq.request.max_new_tokens - len(seq.tokens) - 1,
                        self.cache.max_len - seq.context_len() - 1)
                if tokens_left is not None:
                    k = min(k, tokens_left)
                    tokens_left -= max(k, 0)
            ks.append(max(k, 0))
        return ks

    def decode(self, seqs: list[Sequence], tokens_left: int | None, shared, runner
               ) -> list[Verdict]:
        guesses, drafts = self.proposer.propose(seqs, self.allowed(seqs, tokens_left), shared)
        for i, seq in enumerate(seqs):                  # memory for the guesses, or none
            if guesses[i] and not self.cache.reserve(seq.slot, 1 + len(guesses[i])):
                guesses[i], drafts[i] = [], None
        if any(guesses):
            last = [last_token(s) for s in seqs]
            logits = runner.verify(seqs, [[t] + g for t, g in zip(last, guesses)])
            plain = [i for i, g in enumerate(guesses) if not g]
            some = [i for i, g in enumerate(guesses) if g]
            verdicts = [None] * len(seqs)
            for i, v in zip(plain, plain_verdicts(logits[plain, 0], [seqs[i] for i in plain],
                                                  shared)):
                verdicts[i] = v
            for i, v in zip(some, verify(logits[some], [seqs[i] for i in some],
                                         [guesses[i] for i in some], [drafts[i] for i in some],
                                         shared)):
                verdicts[i] = v
        else:                                           # no guess: the plain decode step
            verdicts = plain_verdicts(runner.decode(seqs), seqs, shared)
        for seq, g, v in zip(seqs, guesses, verdicts):
            roll_back(self.cache, seq.slot, 1 + len(g), len(v.tokens))
            self.proposer.kept(seq, v)
            self.learn(seq, v)
        return verdicts


class SpeculatingRunner:
    """Step 04's runner (model_runner.ModelRunner) with speculation around it, as step 13's C
    attention wraps the model's: a step where some decode row may guess (Speculator.allowed)
    runs the speculator's decode (the guesses, one target pass, the verdicts: a run of tokens
    a row), then the chunks' own pass; any other step is the plain runner's, whose tokens the
    speculator learns from. The engine sees a runner like any other."""

    def __init__(self, base: ModelRunner, speculator: Speculator):
        self.base, self.speculator = base, speculator
        self.decode_step, self.stats = base.decode_step, base.stats

    def run(self, plan: StepPlan, generator: torch.Generator | None) -> StepOutput:
        decodes, chunks = plan.decodes, plan.chunks
        if not decodes or not any(self.speculator.allowed(decodes, plan.budget_left)):
            out = self.base.run(plan, generator)
            verdicts = self.speculator.decoded(decodes, out.tokens, out.logprobs)
            if decodes and not chunks:                  # a decode pass of their own
                self.stats.record_speculation(verdicts)
            return out
        t0 = self.base.begin_decode(decodes)
        verdicts = self.speculator.decode(decodes, plan.budget_left, generator, self.base)
        self.stats.record_speculation(verdicts)
        self.stats.decode_s += time.perf_counter() - t0
        prefilled = self.base.prefill(chunks) if chunks else None
        return self.base.output([v.tokens for v in verdicts], [v.logprobs for v in verdicts],
                                chunks, prefilled, generator)

    def sync(self, running: dict) -> None:
        self.speculator.sync(running)

    def check_integrity(self, idle: bool = False) -> str | None:
        return self.speculator.check_integrity(idle)
