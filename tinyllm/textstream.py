"""Step 10 - text as it streams: an answer's tokens become text a settled piece at a time.

A token is not a character. A byte-level tokenizer splits a multi-byte character (an accent,
an emoji) across tokens, and decoding only the first of them gives the replacement character
U+FFFD. A stop string ("\\n\\n", "User:") may span tokens too, and its text must never reach
the client. So after each token the server decodes the whole answer so far and sends only the
new text that is *settled* (`next_piece`): not an unfinished character at the end, and not the
possible beginning of a stop string, which waits until the next tokens decide. When a stop
string appears, the text ends just before it and so does the request.

Seam: `next_piece` (exercise 10).
"""

REPLACEMENT = "\ufffd"                                  # what a split character decodes to


def next_piece(text: str, sent: int, stops: list[str], final: bool = False) -> tuple[str, bool]:
    """The new text to send, and whether a stop string ended the answer. text is the whole
    answer decoded so far; its first `sent` characters are already sent. A stop string found
    anywhere in text (the earliest, if several) ends the answer: send up to where it starts,
    and True. Otherwise hold back, unless final (the answer is over): a trailing run of
    REPLACEMENT characters (a character whose bytes have not all come) and the longest end of
    text that is the beginning of a stop string. Never returns text before `sent`."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if found:
        return text[sent:max(sent, min(found))], True
    end = len(text)
    if not final:
        while end > sent and text[end - 1] == REPLACEMENT:
            end -= 1
        for s in stops:
            for k in range(min(len(s) - 1, end), 0, -1):    # the longest first
                if text[:end].endswith(s[:k]):
                    end -= k
                    break
    return text[sent:max(sent, end)], False


class TextStream:
    """One answer's text as its tokens come: push(token) -> the settled new text (maybe "");
    finish() -> what was held back, once the answer is over. stopped: a stop string ended it
    (push then returns "" for ever). decode: token ids -> text (the tokenizer's)."""

    def __init__(self, decode, stops: list[str] | None = None):
        self.decode, self.stops = decode, list(stops or [])
        self.tokens: list[int] = []
        self.text = ""                                  # sent so far
        self.stopped = False

    def _piece(self, final: bool) -> str:
        if self.stopped:
            return ""
        piece, self.stopped = next_piece(self.decode(self.tokens), len(self.text), self.stops, final)
        self.text += piece
        return piece

    def push(self, token: int) -> str:
        self.tokens.append(token)
        return self._piece(final=False)

    def finish(self) -> str:
        return self._piece(final=True)
