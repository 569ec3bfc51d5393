"""Exercise 12 - structured output: a grammar's mask over the vocabulary, for a grammar written
by hand, and a batch of masks applied to a step's logits.

Three seams of the reference package:
- `walk` (tinyllm.ext.structured) moves a hand-written automaton (a `DFA` over bytes) over one
  token's bytes: a token is several characters, and all of them must be allowed, one after
  another;
- `token_mask` (tinyllm.ext.structured) tries every token of the vocabulary from a state: the
  tokens the grammar allows next, and EOS only where the text may end;
- `apply_bitmask` (tinyllm.core.logits_processors) applies the masks of a step's constrained rows
  at once, as 32-token words of bits (the layout of llguidance, XGrammar and vLLM): an
  allowed token keeps its logit, the others get -inf.

The engine's token stage calls them. A constrained request carries a `Constraint`; the
engine's grammar backend gives it a matcher (`DFAGrammars` holds hand-written automata, its
`DFAMatcher` calls your token_mask and walk; `LLGuidance` compiles any JSON schema, regex or
grammar with llguidance); each step `GrammarMask` stacks the constrained rows' bitmasks and
calls your apply_bitmask; the sampler then picks among the allowed tokens, and the matcher
moves on with the token kept.

Check your work with `make check EX=12` (or `check_exercise("12")` in notebook 12). The tests
compare your masks with llguidance's for the same regular expression, then plug your functions
into `ContinuousEngine` on a paged pool among free requests, and compare every request's
tokens with its solo run.
"""

import torch
from torch import Tensor

from tinyllm.ext.structured import DFA


def walk(dfa: DFA, state: int, piece: bytes) -> int | None:
    """The state after the bytes of one token, one byte at a time from `state`; None as soon as
    a byte has no move (the token is not allowed there).
    Example: for x=[0-9]{1,3}, walk(dfa, dfa.start, b"x=4") is the state after one digit, and
    walk(dfa, dfa.start, b"x4") is None."""
    raise NotImplementedError(
        "exercise 12: follow dfa.moves from state, a byte of piece at a "
        "time; None where a byte has no move"
    )


def token_mask(dfa: DFA, state: int, pieces: list[bytes], eos_ids: tuple[int, ...]) -> Tensor:
    """Which tokens may come next from `state`: (V,) bool, V = len(pieces), the bytes of each
    token id. A token is allowed when the automaton can walk all its bytes; a token of no bytes
    (a special token) never is, except an EOS id, which is allowed exactly where the state
    accepts (so a text ends only where the grammar does).
    Example: for x=[0-9]{1,3} after "x=1", the tokens "3", "4" and "45" are allowed
    ("456" is not: 4 digits), and EOS is."""
    raise NotImplementedError(
        "exercise 12: walk each token's bytes from state (a token of "
        "no bytes is not allowed), then EOS where state accepts"
    )


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """A batch of grammar masks at once, the way XGrammar, llguidance and vLLM apply them:
    logits (B, V); bitmask (B, W) int32, W = ceil(V / 32), one bit per token: token t is
    allowed when bit t % 32 of word t // 32 is 1 (the low bit first; bit 31 is the word's
    sign). Returns new logits (B, V): an allowed token's logit as it was, the others -inf (the
    bits past V, padding, are ignored); the input unchanged.
    Example: logits [[1., 2., 3.]], bitmask [[5]] (0b101: tokens 0 and 2) -> [[1., -inf, 3.]]."""
    raise NotImplementedError(
        "exercise 12: unpack bit t % 32 of word t // 32 for each "
        "token t < V, and -inf where it is 0"
    )
