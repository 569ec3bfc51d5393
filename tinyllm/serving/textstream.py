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

REPLACEMENT = "\ufffd"  # what a split character decodes to


def next_piece(text: str, sent: int, stops: list[str], final: bool = False) -> tuple[str, bool]:
    """The new text to send, and whether a stop string ended the answer.

    text is the whole answer decoded so far; its first `sent` characters are already sent.
    stops are the request's stop strings; final says the answer is over (no token follows).
    - A stop string in text ends the answer just before it: return the unsent text up to the
      earliest place where any stop string starts, and True. No text of a stop string is sent.
    - Otherwise return the unsent text that is settled, and False. The next tokens can still
      change the end of text in two ways: an unfinished character (REPLACEMENT, U+FFFD, at the
      end) may complete, and an end of text that begins a stop string may grow into it. Both
      wait; nothing waits when final.
    - Text before `sent` is never returned again, and the caller's arguments are not changed.
    Examples: ("Good\n", 0, ["\n\n"]) -> ("Good", False); then ("Good\nNay", 4, ["\n\n"])
    -> ("\nNay", False); ("ab END cd STOP", 0, ["STOP", "END"]) -> ("ab ", True);
    ("ab", 0, ["bc", "ac"]) -> ("a", False): "b" may begin "bc", and "a" here begins nothing;
    ("caf\ufffd", 0, []) -> ("caf", False), and with final=True ("caf\ufffd", False)."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if found:
        return text[sent : max(sent, min(found))], True
    end = len(text)
    if not final:
        while end > sent and text[end - 1] == REPLACEMENT:
            end -= 1
        hold = max(
            (k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0
        )  # the longest end of text that begins a stop
        end -= hold
    return text[sent : max(sent, end)], False


class TextStream:
    """One answer's text as its tokens come: push(token) -> the settled new text (maybe "");
    finish() -> what was held back, once the answer is over. stopped: a stop string ended it
    (push then returns "" for ever). decode: token ids -> text (the tokenizer's)."""

    def __init__(self, decode, stops: list[str] | None = None):
        self.decode, self.stops = decode, list(stops or [])
        self.tokens: list[int] = []
        self.text = ""  # sent so far
        self.stopped = False

    def _piece(self, final: bool) -> str:
        if self.stopped:
            return ""
        piece, self.stopped = next_piece(
            self.decode(self.tokens), len(self.text), self.stops, final
        )
        self.text += piece
        return piece

    def push(self, token: int) -> str:
        self.tokens.append(token)
        return self._piece(final=False)

    def finish(self) -> str:
        return self._piece(final=True)
