"""Step 12 - structured output: a grammar as a per-request token mask.

A request may carry a `Constraint` (`Sampling.constraint`): a JSON schema, any JSON object, a
regular expression or a Lark grammar. A grammar backend compiles it for the model's tokenizer
(once per constraint: compiled grammars are cached) and gives each request a `Matcher` of its
own, which says which tokens may come next (`bitmask`: one bit per token, 32 to an int32 word,
the layout of llguidance, XGrammar and vLLM), moves on with each token the request keeps
(`consume`) and moves back over the guesses speculation drops (`rollback`). The mask is one
more logits processor (logits_processors.GrammarMask): the step's constrained rows' bitmasks
are stacked (B, ceil(V / 32)) and applied at once (`apply_bitmask`), a disallowed token's logit
becoming -inf; the tokenizer's EOS is allowed only where the grammar accepts, and once the
grammar is complete EOS is all it allows, so a constrained request ends with its grammar.

The matcher follows its sequence: it has consumed exactly the tokens the sequence has made. A
preemption keeps those tokens (only their keys and values are computed again), so it keeps the
matcher as it is; speculation's verification moves it over the guesses to read each position's
mask, then back; a finished or aborted request drops it.

A grammar is written over characters, a mask over tokens: one token is several bytes, and it is
allowed only if all of them can come next, one after another. `DFA` is a grammar small enough
to write by hand, an automaton over bytes; `walk` moves it over one token's bytes and
`token_mask` tries every token of the vocabulary from a state, which is the whole idea and
also why the libraries precompile a grammar against the vocabulary (a token trie) instead.

`LLGuidance` is the backend the engine and the server use, over llguidance (one of vLLM's and
SGLang's, and light to install); `DFAGrammars` is a second one, the hand-written automata of a
few constraints, behind the same calls: `check`, `matcher`, and the matcher's `bitmask`,
`consume`, `rollback` (XGrammar would plug in the same way).

Seams: `walk`, `token_mask` (exercise 12).
"""

import json
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_COMPILED = 256      # compiled grammars kept per backend, the least recently used dropped


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: kind (one of KINDS) and spec, the schema (as JSON
    text), the regular expression or the Lark grammar ("" for json_object: any JSON object).
    Frozen and hashable, so equal constraints share one compiled grammar."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got "
                             f"{self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a constraint's spec is text (a schema as JSON), got "
                             f"{type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON schema, given as a dict or as JSON text, kept as compact JSON text in its own
        key order (the order in which the answer writes an object's properties)."""
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


class LLGuidanceMatcher:
    """One request's matcher over llguidance's LLMatcher. Its mask comes as bits, 32 tokens
    to a word (llguidance's numpy helpers: its torch ones import torch.compile, seconds)."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as lgn

        self.m, self.vocab_size = matcher, vocab_size
        self.bits = lgn.allocate_token_bitmask(1, vocab_size)            # (1, ceil(V / 32))
        self._fill = lgn.fill_next_token_bitmask

    def bitmask(self) -> Tensor:
        """The tokens that may come next, a bit each: (ceil(V / 32),) int32."""
        self._fill(self.m, self.bits, 0)
        return torch.from_numpy(self.bits[0].copy())

    def consume(self, token: int) -> bool:
        """Move on with a token the request keeps; False if the grammar does not allow it."""
        return self.m.consume_token(token)

    def rollback(self, n: int) -> None:
        """Move back over the last n tokens."""
        if n:
            self.m.rollback(n)

    def is_error(self) -> bool:
        return self.m.is_error()


class LLGuidance:
    """The grammar backend over llguidance for one tokenizer (tinyllm's Tokenizer) and a model
    of vocab_size logits: compiled grammars cached per constraint (the MAX_COMPILED most
    recently used), a matcher per request."""

    def __init__(self, tok, vocab_size: int):
        self._setup(tok.tok.to_str(), vocab_size, list(tok.eos_ids) or [0])

    def _setup(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        from llguidance import LLTokenizer

        self.llt = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, eos
        self.compiled: dict[Constraint, object] = {}       # constraint -> a template matcher

    def __getstate__(self) -> dict:
        """What crosses a process boundary (the server's engine process): the tokenizer's
        JSON, not llguidance's objects, which do not pickle; the other side builds them."""
        return {"tokenizer_json": self.tokenizer_json, "vocab_size": self.vocab_size,
                "eos": self.eos}

    def __setstate__(self, state: dict) -> None:
        self._setup(state["tokenizer_json"], state["vocab_size"], state["eos"])

    def grammar(self, c: Constraint) -> str:
        from llguidance import LLMatcher

        compact = {"whitespace_flexible": False}        # else a model may write blanks for ever
        if c.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(json.loads(c.spec), defaults=compact)
        if c.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if c.kind == "regex":
            return LLMatcher.grammar_from_regex(c.spec)
        return LLMatcher.grammar_from_lark(c.spec)

    def check(self, c: Constraint) -> str | None:
        """None if the backend takes the constraint, else why not (one sentence)."""
        from llguidance import LLMatcher

        try:
            why = LLMatcher.validate_grammar(self.grammar(c), self.llt)
        except (ValueError, TypeError) as e:
            why = str(e)
        return why or None

    def matcher(self, c: Constraint) -> LLGuidanceMatcher:
        """A fresh matcher of the constraint, from its compiled grammar (compiled on first use,
        then copied). Raises ValueError naming what the backend refuses."""
        from llguidance import LLMatcher

        template = self.compiled.pop(c, None)
        if template is None:
            if (why := self.check(c)) is not None:
                raise ValueError(f"constraint: the {c.kind} is refused: {why}")
            template = LLMatcher(self.llt, self.grammar(c), log_level=0)
        self.compiled[c] = template                     # the most recently used last
        while len(self.compiled) > MAX_COMPILED:
            del self.compiled[next(iter(self.compiled))]
        return LLGuidanceMatcher(template.deep_copy(), self.vocab_size)


def new_matchers(grammars: LLGuidance | None, samplings: list) -> list:
    """A fresh matcher for each constrained sampling (None for the others). Raises ValueError
    when one has a constraint and there is no backend, or the backend refuses it."""
    if any(s.constraint is not None for s in samplings) and grammars is None:
        raise ValueError("constraint: this engine has no grammar backend; give it one: "
                         "ContinuousEngine(..., grammars=LLGuidance(tokenizer, vocab_size))")
    return [None if s.constraint is None else grammars.matcher(s.constraint) for s in samplings]


# ---- a grammar by hand ------------------------------------------------------------------------
def pack_bitmask(allowed: Tensor) -> Tensor:
    """(V,) bool -> (ceil(V / 32),) int32: token 32 w + j is bit j of word w (the low bit
    first), the words' sign bit being bit 31."""
    pad = (-allowed.numel()) % 32
    bits = torch.cat([allowed.long(), allowed.new_zeros(pad, dtype=torch.long)]).view(-1, 32)
    words = (bits << torch.arange(32)).sum(-1)                       # (W,) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).int()


def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character each byte is written as in a token's name.
    The printable bytes are themselves; the others (blank, control) are chr(256 + n), in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def token_bytes(tok, vocab_size: int) -> list[bytes]:
    """The bytes each token id writes, for a byte-level BPE tokenizer (tinyllm's Tokenizer);
    b"" for a special token and for the ids the model has beyond the tokenizer."""
    alphabet, special = byte_alphabet(), set(tok.tok.get_added_tokens_decoder())
    pieces = []
    for i in range(vocab_size):
        name = tok.tok.id_to_token(i)
        if name is None or i in special:
            pieces.append(b"")
        elif any(ch not in alphabet for ch in name):
            raise ValueError(f"token {i} ({name!r}) is not written in byte-level BPE's "
                             f"alphabet: token_bytes reads byte-level BPE tokenizers only")
        else:
            pieces.append(bytes(alphabet[ch] for ch in name))
    return pieces


@dataclass
class DFA:
    """A grammar small enough to write by hand: a deterministic automaton over bytes. start:
    its first state; moves: {(state, byte): the next state} (a byte with no move is not
    allowed there); accepting: the states where the text may end."""
    start: int
    moves: dict[tuple[int, int], int]
    accepting: frozenset[int]

    @classmethod
    def sequence(cls, *parts: str | tuple[str, int, int]) -> "DFA":
        """Parts one after another: a str is itself; (chars, least, most) is one of the
        characters (ASCII), least to most times (least >= 1). A part's characters must not
        be the next one's (the automaton would not know which part a byte is in).
        Example: DFA.sequence("x=", ("0123456789", 1, 3)) is the regex x=[0-9]{1,3}."""
        spans: list[tuple[str, int, int]] = []          # (chars, least, most), literals split
        for p in parts:
            spans += [(c, 1, 1) for c in p] if isinstance(p, str) else [p]
        for chars, least, most in spans:
            if not chars.isascii() or not 1 <= least <= most:
                raise ValueError(f"a part is ASCII characters, least to most times with "
                                 f"1 <= least <= most: got ({chars!r}, {least}, {most})")
        state = {}                                  # (part, count) -> state id; start is 0
        for i, (_, _, most) in enumerate(spans):
            for c in range(1, most + 1):
                state[i, c] = len(state) + 1
        moves = {(0, b): state[0, 1] for b in spans[0][0].encode()}
        for (i, c), s in state.items():
            chars, least, most = spans[i]
            if c < most:
                moves |= {(s, b): state[i, c + 1] for b in chars.encode()}
            if c >= least and i + 1 < len(spans):
                nxt = {(s, b): state[i + 1, 1] for b in spans[i + 1][0].encode()}
                if nxt.keys() & moves.keys():
                    raise ValueError(f"parts {spans[i][0]!r} and {spans[i + 1][0]!r} share "
                                     f"characters: the automaton would not be deterministic")
                moves |= nxt
        last, (_, least, most) = len(spans) - 1, spans[-1]
        return cls(0, moves, frozenset(state[last, c] for c in range(least, most + 1)))


def walk(dfa: DFA, state: int, piece: bytes) -> int | None:
    """The state after the bytes of one token, one byte at a time from `state`; None as soon as
    a byte has no move (the token is not allowed there).
    Example: for x=[0-9]{1,3}, walk(dfa, dfa.start, b"x=4") is the state after one digit, and
    walk(dfa, dfa.start, b"x4") is None."""
    for b in piece:
        state = dfa.moves.get((state, b))
        if state is None:
            return None
    return state


def token_mask(dfa: DFA, state: int, pieces: list[bytes], eos_ids: tuple[int, ...]) -> Tensor:
    """Which tokens may come next from `state`: (V,) bool, V = len(pieces), the bytes of each
    token id. A token is allowed when the automaton can walk all its bytes; a token of no bytes
    (a special token) never is, except an EOS id, which is allowed exactly where the state
    accepts (so a text ends only where the grammar does).
    Example: for x=[0-9]{1,3} after "x=1", the tokens "3", "4" and "45" are allowed
    ("456" is not: 4 digits), and EOS is."""
    allowed = torch.tensor([bool(p) and walk(dfa, state, p) is not None for p in pieces])
    allowed[list(eos_ids)] = state in dfa.accepting
    return allowed


class DFAMatcher:
    """One request's matcher over a hand-written DFA: the states it passed, one per token."""

    def __init__(self, dfa: DFA, pieces: list[bytes], eos_ids: tuple[int, ...]):
        self.dfa, self.pieces, self.eos_ids = dfa, pieces, eos_ids
        self.states = [dfa.start]                   # the state after each consumed token
        self.error = False

    def bitmask(self) -> Tensor:
        return pack_bitmask(token_mask(self.dfa, self.states[-1], self.pieces, self.eos_ids))

    def consume(self, token: int) -> bool:
        state = self.states[-1]
        if token in self.eos_ids:
            new = state if state in self.dfa.accepting else None
        else:
            new = walk(self.dfa, state, self.pieces[token]) if self.pieces[token] else None
        if new is None:
            self.error = True
            return False
        self.states.append(new)
        return True

    def rollback(self, n: int) -> None:
        if n:
            del self.states[-n:]

    def is_error(self) -> bool:
        return self.error


class DFAGrammars:
    """A grammar backend of hand-written automata: {constraint: its DFA} for one byte-level
    BPE tokenizer and a model of vocab_size logits. It takes only the constraints it has."""

    def __init__(self, tok, vocab_size: int, dfas: dict[Constraint, DFA]):
        self.pieces, self.dfas = token_bytes(tok, vocab_size), dict(dfas)
        self.eos = tuple(tok.eos_ids)

    def check(self, c: Constraint) -> str | None:
        return None if c in self.dfas else f"this backend has no automaton for {c.spec!r}"

    def matcher(self, c: Constraint) -> DFAMatcher:
        if (why := self.check(c)) is not None:
            raise ValueError(f"constraint: the {c.kind} is refused: {why}")
        return DFAMatcher(self.dfas[c], self.pieces, self.eos)
