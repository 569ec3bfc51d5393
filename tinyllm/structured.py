"""Step 12 - structured output: a grammar as a per-request token mask.

A request may carry a `Constraint` (`Sampling.constraint`): a JSON schema, any JSON object, a
regular expression or a Lark grammar. A grammar backend compiles it for the model's tokenizer
(once per constraint: compiled grammars are cached) and gives each request a `Matcher` of its
own, which says which tokens may come next (`allowed`), moves on with each token the request
keeps (`consume`) and moves back over the guesses speculation drops (`rollback`). The mask is
one more logits processor (logits_processors.GrammarMask): a disallowed token's logit becomes
-inf, row by row in the step's batch, each row by its own matcher; the tokenizer's EOS is
allowed only where the grammar accepts, and once the grammar is complete EOS is all it allows,
so a constrained request ends with its grammar.

The matcher follows its sequence: it has consumed exactly the tokens the sequence has made. A
preemption keeps those tokens (only their keys and values are computed again), so it keeps the
matcher as it is; speculation's verification moves it over the guesses to read each position's
mask, then back; a finished or aborted request drops it.

`LLGuidance` is the backend, over llguidance (one of vLLM's and SGLang's, and light to
install); another (XGrammar) would plug in behind the same calls: `check`, `matcher`, and the
matcher's `allowed`, `consume`, `rollback`.
"""

import json
from dataclasses import dataclass

import numpy as np
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

    def allowed(self) -> Tensor:
        """The tokens that may come next: (V,) bool."""
        self._fill(self.m, self.bits, 0)
        bits = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits).bool()

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
