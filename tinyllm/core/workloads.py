"""Named workloads: the requests a benchmark, a load generator or a peer comparison serves.

Each workload is a list of `Request`s and their arrival times, fixed by a seed, so that every
engine (and every server) measured on it serves exactly the same requests. Shared vocabulary,
like requests.py: the course's benchmark and peers and the serving wing's load generator
import it, and it imports only the requests, the sampling settings and the constraints.
"""

import random
from dataclasses import replace

from tinyllm.core.requests import Request
from tinyllm.core.sampling import Constraint, Sampling

WORKLOADS = ("uniform", "longtail", "eos", "poisson", "shared-prefix", "long-prompt", "chat",
             "quote", "json")
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}},
          "required": ["answer"], "additionalProperties": False}     # the json workload's schema

SPEAKERS = ["Ham.", "Hor.", "Oph.", "King.", "Queen.", "Rom.", "Jul.", "Nurse.", "Mer.", "Macb.",
            "Lady M.", "Lear.", "Fool.", "Oth.", "Iago.", "Pro."]
OPENINGS = ["", "My lord,", "O", "What", "I", "Good", "Come,", "Nay,"]
QUESTIONS = [       # the chat workload: short questions a chat model answers in a few lines
    "What is the capital of France?", "How many days are in a week?",
    "What color is the sky on a clear day?", "Name three fruits.", "What is two plus two?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Why do leaves change color in autumn?", "Give me a short tip for sleeping better.",
    "What is the largest planet in the solar system?", "How do I make a cup of tea?",
    "What is photosynthesis?", "Translate 'good morning' into French.",
    "Write a haiku about the sea.", "What is the opposite of hot?",
    "How many legs does a spider have?", "What does a thermometer measure?",
    "Suggest a name for a pet cat.", "What is the tallest mountain on Earth?",
    "Explain what a computer is in one sentence.", "What language is spoken in Brazil?",
    "How many continents are there?", "Why is exercise good for you?",
    "What is the main ingredient of bread?", "Tell me a fun fact about octopuses.",
    "What is the chemical symbol for gold?", "How many hours are in a day?",
    "What do bees make?", "Recommend a book for a long train ride.",
    "What is the square root of 81?", "Which ocean is the largest?",
    "What is the capital of Japan?", "Describe a rainbow in one sentence.",
    "What instrument has 88 keys?", "How can I save water at home?",
    "Who painted the Mona Lisa?", "Write a short greeting for a birthday card.",
    "What is the difference between weather and climate?",
    "What are the three primary colors?", "How does a bicycle stay upright?",
]


def chat_request(tok, message: str) -> Request:
    """One user message in the model's chat template, greedy, ended by any of its EOS ids
    (cap 128 tokens)."""
    if tok.chat_template is None:
        raise ValueError("the chat workloads need a model with a chat template")
    return Request(tok.apply_chat_template([{"role": "user", "content": message}], tokenize=True),
                   128, eos_id=tok.eos_ids or None)


def text_requests(name: str, tok, n: int, rng: random.Random) -> list[Request]:
    """The quote and json workloads' requests (workload() says what they are)."""
    if name == "quote":
        passages = [" ".join(rng.sample(QUESTIONS, 5)) for _ in range(n)]
        return [Request(tok.encode(f"{p}\n{p}\n{p.split('?')[0]}"), len(tok.encode(p)),
                        eos_id=tok.eos_ids or None) for p in passages]
    constraint = Constraint.json_schema(ANSWER)
    reqs = [chat_request(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
    for r in reqs[::2]:
        r.sampling = Sampling(constraint=constraint)
    return reqs


def sample_greedy(reqs: list[Request], sampling: Sampling | None, seed: int) -> None:
    """The requests that have no sampling of their own sample with `sampling` (None: they
    stay greedy), request i seeded seed * 1000 + i."""
    if sampling is not None:
        for i, r in enumerate(reqs):
            r.sampling = r.sampling or replace(sampling, seed=seed * 1000 + i)


def workload(name: str, tok, n: int = 64, seed: int = 0,
             sampling: Sampling | None = None) -> tuple[list[Request], list[float]]:
    """Requests and their arrival times (all 0 but for 'poisson'). sampling: the requests that
    have none of their own (the greedy ones, constraints aside) sample with it instead, each
    with a seed of its own (seed * 1000 + its index), so that every engine draws their tokens
    alike.

    uniform:  every prompt 16 tokens, 64 new tokens, no EOS;
    longtail: prompts of 8-32 tokens, output lengths long-tailed (most short, a few 256), no EOS;
    eos:      speaker prompts, sampled (temperature 0.8, a seed per request); the bundled
              model's own <|endoftext|> decides each length (cap 256): most speeches are a
              line, a few run to hundreds of tokens;
    poisson:  the eos workload arriving over time, 8 requests per second on average;
    shared-prefix: one 360-token system prompt, then a distinct 40-token question each (90% of
              every prompt shared), 16 new tokens, arriving over time (16 a second);
    long-prompt: short requests (prompts of 8-32 tokens, 32-96 new tokens), and every 16th a
              448-token prompt (8 new tokens): each long one is admitted while others decode;
    chat:     English questions (QUESTIONS, in turn) as one user message each, in the model's
              chat template, greedy, ended by any of the model's EOS ids (cap 128 tokens);
    quote:    a passage (five of QUESTIONS, drawn at random) written twice, one line each, and
              a third time up to its first question mark; the model goes on (greedy, as many
              new tokens as the passage has, its EOS ids): a model continues such a pattern
              by copying, so most of its answer is in the prompt, where prompt lookup (11)
              finds it;
    json:     as chat, every other request constrained (12) to a JSON object of one short
              answer (ANSWER's schema), the others free."""
    rng = random.Random(seed)
    vocab = tok.vocab_size
    rand_prompt = lambda L: [0] + [rng.randrange(1, vocab) for _ in range(L - 1)]
    rand_tokens = lambda L: [rng.randrange(1, vocab) for _ in range(L)]
    if name == "uniform":
        reqs = [Request(rand_prompt(16), 64) for _ in range(n)]
    elif name == "longtail":
        reqs = [Request(rand_prompt(rng.randint(8, 32)),
                        min(256, max(4, int(rng.paretovariate(1.2) * 12)))) for _ in range(n)]
    elif name in ("eos", "poisson"):
        texts = [f"{rng.choice(SPEAKERS)}\n{rng.choice(OPENINGS)}" for _ in range(n)]
        reqs = [Request(tok.encode(t), 256, eos_id=tok.eos_id,
                        sampling=Sampling(temperature=0.8, seed=seed * 1000 + i))
                for i, t in enumerate(texts)]
    elif name == "shared-prefix":
        system = rand_prompt(360)
        reqs = [Request(system + rand_tokens(40), 16) for _ in range(n)]
    elif name == "long-prompt":
        reqs = [Request(rand_prompt(448), 8) if i % 16 == 15 else
                Request(rand_prompt(rng.randint(8, 32)), rng.randint(32, 96)) for i in range(n)]
    elif name == "chat":
        reqs = [chat_request(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
    elif name in ("quote", "json"):
        reqs = text_requests(name, tok, n, rng)
    else:
        raise ValueError(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
    sample_greedy(reqs, sampling, seed)
    arrivals = [0.0] * n
    if name in ("poisson", "shared-prefix"):
        rate, t = {"poisson": 8.0, "shared-prefix": 16.0}[name], 0.0
        for i in range(n):
            t += rng.expovariate(rate)
            arrivals[i] = t
    return reqs, arrivals
