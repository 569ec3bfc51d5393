"""Step 12 - structured output: a grammar as a per-request token mask.

A request may carry a `Constraint` (`Sampling.constraint`): a JSON schema, any JSON object, a
regular expression or a Lark grammar. A grammar backend compiles it for the model's tokenizer
(cached) and gives each request a `Matcher`, which says which tokens may come next (`bitmask`:
one bit per token, 32 to an int32 word, the layout of llguidance, XGrammar and vLLM), moves on
with each token the request keeps (`consume`: False for one its mask refuses) and back over the
guesses speculation drops (`rollback`). logits_processors.GrammarMask applies the step's masks
at once (`apply_bitmask`); EOS is allowed only where the grammar accepts, and is all it allows
once the grammar is complete. A backend's `check` says why it refuses a constraint (the
server's 400); a matcher whose library fails mid-answer is in error (`is_error`) and allows EOS
alone. `DFA` is a hand-written automaton over bytes: `walk` moves it over a token's bytes and
`token_mask` tries every token from a state. `LLGuidance` is the engine's and server's backend;
`DFAGrammars` serves a few constraints by hand-written automata behind the same calls.
Seams: `walk`, `token_mask` (exercise 12).
"""

import json
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from tinyllm.core.logits_processors import unpack_bitmask
from tinyllm.core.sampling import KINDS, Constraint  # noqa: F401 (a constraint's names, here too)
from tinyllm.ext.constraint_checks import flaw, patterns

MAX_COMPILED = 256      # compiled grammars kept per backend, the least recently used dropped
PROBE_TOKENS = 8        # tokens a new grammar is walked along before it is taken (LLGuidance)


class LLGuidanceMatcher:
    """One request's matcher over llguidance's LLMatcher (m, a copy of its constraint's
    compiled grammar, the template), keeping the books llguidance does not: every token it
    consumes counts for a rollback (llguidance records no EOS, so rolling back over one would
    undo a text token instead), and a token the mask refuses changes nothing (llguidance would
    go into an error state for good).

    llguidance may fail on a token its mask allowed, or on a mask, when a limit of its lexer or
    parser is met. The copies of one compiled grammar share its lexer, and so its limits: where
    a copy fails, the matcher moves to a grammar compiled for it alone, over its tokens again
    (another request's answers must not make this one fail), and only a failure there leaves it
    in error (`is_error`): it then allows EOS alone, and a rollback over the token it failed on
    builds it again. Its mask comes as bits, 32 tokens to a word (llguidance's numpy helpers:
    its torch ones import torch.compile, seconds)."""

    def __init__(self, backend: "LLGuidance", c: Constraint, template):
        import llguidance.numpy as lgn

        self.backend, self.constraint, self.template = backend, c, template
        self.m = template.deep_copy()
        self.tokens: list[int] = []                 # the text tokens llguidance consumed
        self.ended = 0                              # EOS tokens consumed after them
        self.bits = lgn.allocate_token_bitmask(1, backend.vocab_size)   # (1, ceil(V / 32))
        self._fill = lgn.fill_next_token_bitmask

    def bitmask(self) -> Tensor:
        """The tokens that may come next, a bit each: (ceil(V / 32),) int32; EOS alone after
        an EOS, and in error."""
        if not self.ended and not self.is_error():
            self._run(lambda m: self._fill(m, self.bits, 0))
            if not self.is_error():
                return torch.from_numpy(self.bits[0].copy())
        return self.backend.eos_mask.clone()

    def consume(self, token: int) -> bool:
        """Move on with a token the request keeps; False, and nothing changes, if the mask
        does not allow it."""
        if token in self.backend.eos:
            if not (self.ended or self.is_error() or self.m.is_accepting()):
                return False
            self.ended += 1
            return True
        if self.ended or self.is_error():
            return False
        if self._run(lambda m: m.try_consume_tokens([token])) == 1 or self.is_error():
            self.tokens.append(token)               # in error: llguidance failed on it
            return True
        return False

    def rollback(self, n: int) -> None:
        """Move back over the last n tokens consumed."""
        eos = min(n, self.ended)
        self.ended, n = self.ended - eos, n - eos
        if n:
            del self.tokens[len(self.tokens) - n:]
            if self.is_error():                     # llguidance never leaves an error state
                self._alone()
            else:
                self.m.rollback(n)

    def is_error(self) -> bool:
        """Whether llguidance failed on this answer (on a grammar compiled for it alone)."""
        return self.m.is_error()

    def error(self) -> str:
        """llguidance's reason for its error state, its first line ("" when none)."""
        return self.m.get_error().split("\n")[0]

    def _run(self, op):
        """op(m); where llguidance fails on a copy of the shared grammar, op again after
        moving to one of its own (`_alone`)."""
        out = op(self.m)
        if self.m.is_error() and self.template is not None:
            self.backend.forget(self.constraint, self.template)   # its copies may fail too
            self._alone()
            out = op(self.m)
        return out

    def _alone(self) -> None:
        """m anew on a grammar compiled for this matcher alone, moved over its tokens."""
        self.m, self.template = self.backend.compile_alone(self.constraint), None
        self.m.try_consume_tokens(self.tokens)


class LLGuidance:
    """The grammar backend over llguidance for one tokenizer (tinyllm's Tokenizer) and a model
    of vocab_size logits: compiled grammars cached per constraint (the MAX_COMPILED most
    recently used), a matcher per request.

    `check` refuses up front what llguidance would take and then fail to enforce: a regular
    expression that ends in a lone backslash (llguidance drops it), a JSON schema that no
    finite value matches (a $ref that always leads back to itself: llguidance writes it for
    ever, or runs out of room and ends it), a grammar llguidance fails on along its first
    tokens (a limit of its lexer or parser: `probe`), and a schema with a pattern it refuses
    as a regular expression (`pattern_flaw`)."""

    def __init__(self, tok, vocab_size: int):
        self._setup(tok.tok.to_str(), vocab_size, list(tok.eos_ids) or [0])

    def _setup(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        from llguidance import LLTokenizer

        self.llt = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.tokenizer_json, self.vocab_size, self.eos = tokenizer_json, vocab_size, eos
        self.eos_mask = pack_bitmask(torch.isin(torch.arange(vocab_size), torch.tensor(eos)))
        self.compiled: dict[Constraint, object] = {}       # constraint -> its compiled grammar
        self.lock = threading.Lock()                       # the server checks from threads

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
        """None if the backend takes the constraint, else why not (one sentence). A taken one
        is compiled, and kept."""
        return self.compile(c)[1]

    def template(self, c: Constraint):
        """The compiled grammar of c (compiled on first use, then kept). Raises ValueError
        naming what the backend refuses."""
        template, why = self.compile(c)
        if why is not None:
            raise ValueError(f"constraint: the {c.kind} is refused: {why}")
        return template

    def compile(self, c: Constraint) -> tuple[object | None, str | None]:
        """c's compiled grammar, kept as the most recently used, and None; or None and why the
        backend refuses c."""
        with self.lock:
            template = self.compiled.get(c)
        if template is None:
            template, why = self.build(c)
            if why is not None:
                return None, why
        self.keep(c, template)
        return template, None

    def build(self, c: Constraint) -> tuple[object | None, str | None]:
        """c compiled anew and probed, kept nowhere, and None; or None and why the backend
        refuses c."""
        from llguidance import LLMatcher

        try:
            why = flaw(c) or LLMatcher.validate_grammar(self.grammar(c), self.llt) or \
                self.pattern_flaw(c)
        except (ValueError, TypeError) as e:
            why = str(e)
        if why:
            return None, why
        template = self.compile_alone(c)
        why = self.probe(c, template)
        return (None, why) if why is not None else (template, None)

    def pattern_flaw(self, c: Constraint) -> str | None:
        """Why a JSON schema's pattern is refused, or None: one the backend refuses as a regex
        constraint. llguidance reads a pattern as a search (a match anywhere in the string), so
        a string's text before the match is free and nothing forces the match: the probe of the
        schema never meets the pattern, and a{1000000}, refused as a regex, is taken in a
        schema, its answer free text cut by its length."""
        if c.kind != "json_schema":
            return None
        for p in patterns(json.loads(c.spec)):
            if (why := self.build(Constraint("regex", p))[1]) is not None:
                return f"its pattern {p!r} is refused as a regular expression: {why}"
        return None

    def probe(self, c: Constraint, template) -> str | None:
        """Why llguidance fails on a compiled grammar along its first PROBE_TOKENS tokens (the
        lowest allowed id each time), or None: some grammars it compiles, and fails on only
        while matching them (a{1000000}: too many expressions for its lexer)."""
        m = LLGuidanceMatcher(self, c, template)
        for _ in range(PROBE_TOKENS):
            allowed = unpack_bitmask(m.bitmask()[None], self.vocab_size)[0]       # (V,)
            allowed[self.eos] = False
            if m.is_error() or not allowed.any():
                break
            m.consume(int(allowed.nonzero()[0]))
        return f"llguidance fails on it while matching: {m.error()}" if m.is_error() else None

    def compile_alone(self, c: Constraint):
        """c's grammar compiled anew, for one matcher (kept nowhere)."""
        from llguidance import LLMatcher

        return LLMatcher(self.llt, self.grammar(c), log_level=0)

    def keep(self, c: Constraint, template) -> None:
        """Keep c's compiled grammar as the most recently used, dropping the least."""
        with self.lock:
            self.compiled.pop(c, None)
            self.compiled[c] = template
            while len(self.compiled) > MAX_COMPILED:
                del self.compiled[next(iter(self.compiled))]

    def forget(self, c: Constraint, template) -> None:
        """Drop c's compiled grammar if it is this one (llguidance failed on a copy of it)."""
        with self.lock:
            if self.compiled.get(c) is template:
                del self.compiled[c]

    def matcher(self, c: Constraint) -> LLGuidanceMatcher:
        """A fresh matcher of the constraint, from its compiled grammar (compiled on first use,
        then copied). Raises ValueError naming what the backend refuses."""
        return LLGuidanceMatcher(self, c, self.template(c))


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
    """One request's matcher over a hand-written DFA: the states it passed, one per token (None
    after an EOS, where EOS is all it allows). A token its mask refuses changes nothing."""

    def __init__(self, dfa: DFA, pieces: list[bytes], eos_ids: tuple[int, ...]):
        self.dfa, self.pieces, self.eos_ids = dfa, pieces, eos_ids
        self.states: list[int | None] = [dfa.start]     # the state after each consumed token

    def bitmask(self) -> Tensor:
        state = self.states[-1]
        if state is None:
            return pack_bitmask(torch.isin(torch.arange(len(self.pieces)),
                                           torch.tensor(self.eos_ids)))
        return pack_bitmask(token_mask(self.dfa, state, self.pieces, self.eos_ids))

    def consume(self, token: int) -> bool:
        state = self.states[-1]
        if token in self.eos_ids:
            ok = state is None or state in self.dfa.accepting
            new = None
        else:
            new = None if state is None or not self.pieces[token] else \
                walk(self.dfa, state, self.pieces[token])
            ok = new is not None
        if ok:
            self.states.append(new)
        return ok

    def rollback(self, n: int) -> None:
        if n:
            del self.states[-n:]

    def is_error(self) -> bool:
        """A hand-written automaton never fails."""
        return False


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
