"""Exercise 11 - speculative decoding: the tokens a request keeps of a target pass that
checked its guesses, greedy and sampled, and the cache's books after that pass.

Three seams of the reference package, all in `tinyllm.ext.speculative`:
- `accept_greedy` keeps a greedy request's guesses while each one is the token the target
  picks at its position, then the target's own pick: so the request gets its solo tokens
  exactly, 1 to k + 1 of them a pass;
- `accept_sampled` decides whether a sampled request keeps one guess: with probability
  min(1, p / q), decided by a uniform u the engine draws; where a guess falls, the engine
  draws a token from the residual max(0, p - q) instead, which leaves the output distributed
  as the target's;
- `roll_back` gives back the cache positions of the guesses that fell, and nothing when
  every guess stood.

The engine's speculating decode step (`Speculator.decode`) calls them. The proposer guesses up
to k tokens for each decoding request (`NgramProposer`: a lookup in the request's own context;
`DraftProposer`: a smaller model); the cache reserves room for them; the target computes each
row's last token and its guesses in one ragged pass (k + 1 positions); `verify` reads each
row's verdict position by position, your accept_greedy for a greedy row, your accept_sampled at
each of a draft's guesses of a sampled row (a lookup's certain guesses it checks against the
target's own draw, kept with the same chance); then your roll_back, row by row, with what the
row fed and kept.

Check your work with `make check EX=11` (or `check_exercise("11")` in notebook 11). The tests
plug your functions into the engine of `tinyllm.build.make_engine(speculate="ngram" |
"draft")`, on slots and on a paged pool, and compare every greedy request's tokens with solo(),
and every seeded sampled request's tokens with the package's own run of the same seed.
"""

from torch import Tensor


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
