"""Step 10 - log-probabilities as the API spells them.

The engine gives a token's logprobs as a `TokenLogprobs`: its id, its log-probability (the raw
log-softmax, before penalties and temperature, as vLLM gives it) and the top alternatives,
likeliest first. An answer spells them in one of three shapes:
- completions (OpenAI's legacy format): `{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`, one entry a token, top_logprobs holding the k likeliest and the token itself;
  an echoed prompt's first token has null for both;
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`;
- vLLM's prompt_logprobs: one entry a prompt token, the first null, each
  `{"<id>": {"logprob", "rank", "decoded_token"}}`, rank null outside the top k.
A token is spelled by its bytes (`TokenTexts`); its string is those bytes as UTF-8, a split
character shown as U+FFFD (as vLLM shows it); chat's "bytes" has the exact bytes. A logprob is
shown as -9999.0 at least (JSON has no -infinity), as vLLM shows it.
"""

import re

from tinyllm.core.requests import TokenLogprobs

FLOOR = -9999.0  # the least logprob shown
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read back: each character of a byte-level BPE's vocabulary
    -> the byte it stands for (printable bytes stand for themselves, the rest for 256 + i)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_LEVEL = byte_level_alphabet()


class TokenTexts:
    """Each token id's bytes and string, as logprobs spell them; read once, then remembered."""

    def __init__(self, tok):
        self.tok, self.known = tok, {}
        inner = getattr(tok, "tok", None)  # the tokenizers library's Tokenizer
        self.byte_level = type(getattr(inner, "decoder", None)).__name__ == "ByteLevel"
        added = inner.get_added_tokens_decoder() if inner is not None else {}
        self.added = set(added)

    def bytes_of(self, t: int) -> bytes:
        if t not in self.known:
            self.known[t] = self._bytes(t)
        return self.known[t]

    def _bytes(self, t: int) -> bytes:
        piece = self.tok.id_to_token(t)
        if piece is None:
            return b""
        if t in self.added:
            return piece.encode()
        if self.byte_level and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if m := BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m[1], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's space

    def text(self, t: int) -> str:
        return self.bytes_of(t).decode("utf-8", errors="replace")


def shown(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(
    tokens: list[int], logprobs: list[TokenLogprobs | None], texts: TokenTexts, k: int, offset=0
) -> tuple[dict, int]:
    """The legacy completions shape of tokens and their logprobs (None: an echoed prompt's first
    token), text offsets counted from offset; and the offset after the last token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(tokens, logprobs):
        text = texts.text(t)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {}
        for alt, alt_lp in lp.top[:k]:
            top.setdefault(texts.text(alt), shown(alt_lp))
        top.setdefault(text, shown(lp.logprob))
        out["token_logprobs"].append(shown(lp.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_entry(t: int, logprob: float, texts: TokenTexts) -> dict:
    return {"token": texts.text(t), "logprob": shown(logprob), "bytes": list(texts.bytes_of(t))}


def chat_logprobs(logprobs: list[TokenLogprobs], texts: TokenTexts, k: int) -> dict:
    """The chat shape of a choice's tokens' logprobs: {"content": [...]}."""
    content = []
    for lp in logprobs:
        entry = chat_entry(lp.token, lp.logprob, texts)
        entry["top_logprobs"] = [chat_entry(t, alt, texts) for t, alt in lp.top[:k]]
        content.append(entry)
    return {"content": content}


def vllm_prompt_logprobs(
    logprobs: list[TokenLogprobs | None], texts: TokenTexts, k: int
) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (the first None) {"<id>": {"logprob", "rank",
    "decoded_token"}} for the token itself, then its k likeliest alternatives."""
    out = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        ranks = {t: r for r, (t, _) in enumerate(lp.top[:k], 1)}
        entry = {
            str(lp.token): {
                "logprob": shown(lp.logprob),
                "rank": ranks.get(lp.token),
                "decoded_token": texts.text(lp.token),
            }
        }
        for t, alt in lp.top[:k]:
            entry.setdefault(
                str(t), {"logprob": shown(alt), "rank": ranks[t], "decoded_token": texts.text(t)}
            )
        out.append(entry)
    return out
