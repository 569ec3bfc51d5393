"""Exercise 10 - serving: the settled pieces of a streamed answer, and the load generator's
percentiles.

Two seams of the reference package:
- `tinyllm.textstream.next_piece`: after each token the server decodes the whole answer so
  far and sends only what is settled: never an unfinished character (a trailing U+FFFD,
  `textstream.REPLACEMENT`), never the text of a stop string, nor the start of one until the
  next tokens decide;
- `tinyllm.loadgen.percentile`: the p-th percentile of the latencies a run measured.

Check your work with `make check EX=10` (or `check_exercise("10")` in notebook 10). The tests
plug your functions into the server (and the load generator) and compare every streamed
answer with solo generate().
"""

import math

from tinyllm.textstream import REPLACEMENT


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


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0-100) of xs by linear interpolation between closest ranks, as
    numpy's default; 0.0 for no values."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
