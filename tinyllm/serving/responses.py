"""Step 10 - an answer's JSON: its choices streamed as chunks, or collected into one body.

An answer comes as `Piece`s (server.Answer makes them): a settled piece of one choice's text,
with the tokens it came from and, when the request asks, their logprobs. A request of n
choices has n interleaved streams of pieces, each ending with a piece that carries its
finish_reason. `choice_events` writes them as server-sent events, as OpenAI and vLLM do: a
chunk per piece, naming its choice's `index` (chat first sends each choice's role), the
choice's logprobs in each chunk, then the usage (prompt tokens once, completion tokens summed
over the choices) when asked, then `data: [DONE]`; with vLLM's continuous usage, each chunk
also carries the usage of its choice so far. `answer_body` writes the collected answer:
one choice per index, its whole text and logprobs. An echoed prompt (completions' echo) is one
more piece before each choice's first (`echo_first`): its text, its tokens, their logprobs.
`Spelling` spells the logprobs in the endpoint's shape (logprobs.py).
"""

import json
from dataclasses import dataclass, field

from tinyllm.core.requests import TokenLogprobs
from tinyllm.serving.logprobs import TokenTexts, chat_logprobs, completion_logprobs

COMPLETIONS = "completions"


@dataclass
class Piece:
    """A settled piece of choice `index`'s text; finish_reason on the choice's last piece;
    n_out: the choice's tokens so far; tokens: those this piece's text came from; logprobs:
    theirs (None when the request asks for none; None for an echoed prompt's first token)."""

    index: int
    text: str
    finish_reason: str | None = None
    n_out: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None


def usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def sse_event(data) -> str:
    """One server-sent event: `data: ` and its JSON (or [DONE]), then a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Spelling:
    """How one answer spells its pieces' logprobs: in the endpoint's shape (kind), k
    alternatives a token (None: no logprobs); a completion's text offsets run on over each
    choice's pieces."""

    def __init__(self, texts: TokenTexts, kind: str, k: int | None, n: int = 1):
        self.texts, self.kind, self.k = texts, kind, k
        self.offsets = [0] * n

    def __call__(self, piece: Piece) -> dict | None:
        if self.k is None or piece.logprobs is None:
            return None
        if self.kind == COMPLETIONS:
            out, self.offsets[piece.index] = completion_logprobs(
                piece.tokens, piece.logprobs, self.texts, self.k, self.offsets[piece.index]
            )
            return out
        return chat_logprobs([lp for lp in piece.logprobs if lp is not None], self.texts, self.k)


def streamed_choice(kind: str, piece: Piece, logprobs: dict | None) -> dict:
    """A chunk's choice: {"text": piece} (completions) or {"delta": {"content": piece}} (chat;
    {} for an empty piece), its index, finish_reason and logprobs."""
    content = (
        {"text": piece.text}
        if kind == COMPLETIONS
        else {"delta": {"content": piece.text} if piece.text else {}}
    )
    return {
        "index": piece.index,
        **content,
        "finish_reason": piece.finish_reason,
        "logprobs": logprobs,
    }


async def choice_events(
    pieces,
    kind: str,
    head: dict,
    n_prompt: int,
    include_usage: bool,
    n: int = 1,
    spell=None,
    continuous: bool = False,
):
    """The server-sent events of a streamed answer of n choices: pieces (an async iterator of
    Piece) each as a chunk of head and its choice (its logprobs as spell spells them, else
    None); chat first sends each choice's role; then the usage when include_usage, then
    [DONE]. With continuous (vLLM's continuous_usage_stats) every chunk carries the usage so
    far too: the prompt's tokens and its choice's (0 in a role chunk). With n 1, no logprobs
    and no continuous usage these are exactly sse_events' (server.py)."""

    def chunk(choice: dict, n_out: int) -> str:
        usage_so_far = {"usage": usage(n_prompt, n_out)} if continuous else {}
        return sse_event({**head, "choices": [choice], **usage_so_far})

    if kind != COMPLETIONS:
        for i in range(n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""}}
            yield chunk({**role, "finish_reason": None, "logprobs": None}, 0)
    n_out = [0] * n
    async for piece in pieces:
        n_out[piece.index] = piece.n_out
        logprobs = spell(piece) if spell is not None else None
        yield chunk(streamed_choice(kind, piece, logprobs), piece.n_out)
    if include_usage:
        yield sse_event({**head, "choices": [], "usage": usage(n_prompt, sum(n_out))})
    yield sse_event("[DONE]")


async def echo_first(pieces, echo):
    """pieces, each choice's first one preceded by echo(index): its echoed prompt's Piece."""
    echoed = set()
    async for piece in pieces:
        if piece.index not in echoed:
            echoed.add(piece.index)
            yield echo(piece.index)
        yield piece


def joined(pieces: list[Piece], n: int) -> list[Piece]:
    """Each choice's pieces as one: its whole text, tokens and logprobs, its last
    finish_reason, its tokens made."""
    out = [Piece(i, "", logprobs=None) for i in range(n)]
    for p in pieces:
        c = out[p.index]
        c.text += p.text
        c.tokens += p.tokens
        c.finish_reason = p.finish_reason or c.finish_reason
        c.n_out = max(c.n_out, p.n_out)
        if p.logprobs is not None:
            c.logprobs = (c.logprobs or []) + p.logprobs
    return out


def answer_body(
    kind: str, head: dict, choices: list[Piece], n_prompt: int, spell, prompt_logprobs=None
) -> dict:
    """A collected answer: head, one choice per index (its text, finish_reason and logprobs),
    the usage; vLLM's prompt_logprobs (when asked) in each choice of a completion, in the
    body of a chat completion."""
    out = []
    for c in choices:
        content = (
            {"text": c.text}
            if kind == COMPLETIONS
            else {"message": {"role": "assistant", "content": c.text}}
        )
        choice = {"index": c.index, **content, "finish_reason": c.finish_reason}
        choice["logprobs"] = spell(c)
        if prompt_logprobs is not None and kind == COMPLETIONS:
            choice["prompt_logprobs"] = prompt_logprobs
        out.append(choice)
    body = {**head, "choices": out, "usage": usage(n_prompt, sum(c.n_out for c in choices))}
    if prompt_logprobs is not None and kind != COMPLETIONS:
        body["prompt_logprobs"] = prompt_logprobs
    return body
