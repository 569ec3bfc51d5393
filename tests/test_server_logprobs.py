"""Step 10 - the token stage through the API, with the official `openai` client: the logprobs a
client sees (completions' legacy shape with echo, chat's content, vLLM's prompt_logprobs, and
lm-eval's exact loglikelihood body) equal the solo oracle's; n choices, seeded, streamed or
not, each equal to solo with seed + i; penalties, logit_bias, stop_token_ids and min_tokens
answer as solo does; a bad setting gets a 400 naming its field; a client that goes away aborts
every choice, and a full server counts each choice. The server runs in float32, as served."""

import asyncio
import itertools

import httpx
import openai
import pytest

from tests.test_server import NAME, PROMPTS, Running
from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.serving.logprobs import TokenTexts

pytestmark = pytest.mark.slow  # servers, each with its engine process

# a logprob's tolerance: in float32 the engine's decode attention (cpu_kernels'
# decode_attention) and solo's (scaled_dot_product_attention) add in other orders
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def running(bundled):
    model, tok = bundled
    srv = Running(make_engine(model, 4), tok)
    yield srv
    srv.stop()


def oracle(running, ids: list[int], n: int, **sampling):
    """Solo generation of the request the server makes of these settings: its Result."""
    tok = running.tok
    return solo(running.engine.model, Request(ids, n, tok.eos_ids or None, Sampling(**sampling)))


def spelled(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def check_legacy_logprobs(tok, got: dict, tokens: list[int], entries: list, k: int) -> None:
    """A completion's logprobs (as JSON) are the oracle's: a token string, logprob, top-k dict
    (and the token itself) and text offset for each token; None where nothing predicts it."""
    strs = [spelled(tok, t) for t in tokens]
    assert got["tokens"] == strs
    assert got["text_offset"] == list(itertools.accumulate([0] + [len(s) for s in strs[:-1]]))
    assert len(got["token_logprobs"]) == len(got["top_logprobs"]) == len(entries)
    for lp, top, e in zip(got["token_logprobs"], got["top_logprobs"], entries):
        if e is None:
            assert lp is None and top is None
            continue
        expected = {spelled(tok, t): v for t, v in e.top[:k]}
        expected.setdefault(spelled(tok, e.token), e.logprob)
        assert lp == pytest.approx(e.logprob, abs=LOGPROB_TOL)
        assert top.keys() == expected.keys()
        assert all(top[s] == pytest.approx(v, abs=LOGPROB_TOL) for s, v in expected.items())


def stream_logprobs(chunks) -> dict:
    """A streamed choice's logprobs, its chunks' lists joined."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            for key in out:
                out[key] += getattr(c.choices[0].logprobs, key)
    return out


def test_completion_logprobs_with_echo_equal_solo_streamed_or_not(running):
    tok, cl = running.tok, running.client()
    ids = tok.encode(PROMPTS[0])
    res = oracle(running, ids, 6, logprobs=2, prompt_logprobs=2)
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, echo=True)
    choice = cl.completions.create(**kw).choices[0]
    assert choice.text == PROMPTS[0] + tok.decode(res.tokens)
    entries = res.prompt_logprobs + res.logprobs
    assert entries[0] is None and len(entries) == len(ids) + len(res.tokens)
    check_legacy_logprobs(tok, choice.logprobs.model_dump(), ids + res.tokens, entries, 2)
    chunks = list(cl.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    check_legacy_logprobs(tok, stream_logprobs(chunks), ids + res.tokens, entries, 2)
    # without echo: the answer's tokens only, offsets from its start
    choice = cl.completions.create(**{**kw, "echo": False}).choices[0]
    check_legacy_logprobs(tok, choice.logprobs.model_dump(), res.tokens, res.logprobs, 2)


def test_lm_evals_loglikelihood_body(running):
    """lm-eval's local-completions sends exactly this body (token ids, a batch of one) and
    reads token_logprobs[ctxlen:-1] and top_logprobs to score a continuation."""
    tok = running.tok
    context, continuation = tok.encode("Ham.\nTo be, or"), tok.encode(" not", False)
    prompt = context + continuation
    for sent in (prompt, [prompt]):
        body = {"model": NAME, "prompt": sent, "temperature": 0, "max_tokens": 1}
        r = httpx.post(
            running.url + "/completions",
            json={**body, "logprobs": 1, "seed": 1234, "echo": True},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        res = oracle(running, prompt, 1, logprobs=1, prompt_logprobs=1)
        scored = lp["token_logprobs"][len(context) : -1]
        expected = [e.logprob for e in res.prompt_logprobs[len(context) :]]
        assert scored == pytest.approx(expected, abs=LOGPROB_TOL)
        is_greedy = all(
            t == max(top.values()) for t, top in zip(scored, lp["top_logprobs"][len(context) : -1])
        )
        greedy = all(e.token == e.top[0][0] for e in res.prompt_logprobs[len(context) :])
        assert is_greedy == greedy


def test_vllms_prompt_logprobs(running):
    """vLLM's prompt_logprobs: per prompt token (the first null) {id: {logprob, rank,
    decoded_token}} for the token and its top k."""
    tok = running.tok
    ids = tok.encode(PROMPTS[1])
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 2, "prompt_logprobs": 2}
    got = httpx.post(running.url + "/completions", json=body, timeout=30).json()
    got = got["choices"][0]["prompt_logprobs"]
    res = oracle(running, ids, 2, prompt_logprobs=2)
    assert len(got) == len(ids) and got[0] is None
    for entry, e in zip(got[1:], res.prompt_logprobs[1:]):
        expected = {e.token: e.logprob, **dict(e.top)}
        assert {int(t) for t in entry} == set(expected)
        for t, v in entry.items():
            assert v["logprob"] == pytest.approx(expected[int(t)], abs=LOGPROB_TOL)
            assert v["decoded_token"] == spelled(tok, int(t))
        assert [entry[str(t)]["rank"] for t, _ in e.top] == [1, 2]
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    got = httpx.post(running.url + "/chat/completions", json=body, timeout=30).json()
    res = oracle(running, chat_prompt(running, messages), 2, prompt_logprobs=0)
    assert got["prompt_logprobs"][0] is None, "chat: in the body, as vLLM has it"
    assert [[int(t) for t in e] for e in got["prompt_logprobs"][1:]] == [
        [e.token] for e in res.prompt_logprobs[1:]
    ]


def chat_prompt(running, messages) -> list[int]:
    return running.tok.apply_chat_template(messages, tokenize=True)


def test_chat_logprobs_with_top_logprobs_equal_solo_streamed_or_not(running):
    tok, cl = running.tok, running.client()
    messages = [{"role": "user", "content": "Who art thou?"}]
    res = oracle(running, chat_prompt(running, messages), 8, logprobs=3)
    kw = dict(
        model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    plain = cl.chat.completions.create(**kw).choices[0]
    chunks = list(cl.chat.completions.create(**kw, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    for content in (plain.logprobs.content, streamed):
        assert len(content) == len(res.logprobs)
        for got, e in zip(content, res.logprobs):
            assert got.token == spelled(tok, e.token)
            assert got.logprob == pytest.approx(e.logprob, abs=LOGPROB_TOL)
            assert [a.token for a in got.top_logprobs] == [spelled(tok, t) for t, _ in e.top]
            want = [v for _, v in e.top]
            assert [a.logprob for a in got.top_logprobs] == pytest.approx(want, abs=LOGPROB_TOL)
        answer = [e for e, t in zip(content, res.tokens) if t not in tok.eos_ids]
        assert b"".join(bytes(e.bytes) for e in answer).decode() == plain.message.content


def test_a_split_character_is_spelled_by_its_bytes(running, bundled):
    """logit_bias forces the token of half an 'é' (its first UTF-8 byte): each such token's
    string is U+FFFD, its bytes the byte; every token's bytes decode as the tokenizer does."""
    tok = bundled[1]
    half = tok.encode(" é", False)[1]
    texts = TokenTexts(tok)
    assert texts.bytes_of(half) == "é".encode()[:1]
    assert all(texts.text(t) == spelled(tok, t) for t in range(tok.vocab_size))
    r = running.client().chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias={str(half): 100},
    )
    content = r.choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in content] == [("\ufffd", [0xC3])] * 3


def texts_of(choices) -> list[str]:
    return [c.text for c in sorted(choices, key=lambda c: c.index)]


def test_n_seeded_choices_equal_solo_with_seed_plus_i(running):
    """n=3 with a seed: the same choices twice; choice i is a request of n=1 with seed + i and
    solo's with that seed; streamed, each chunk names its choice, each choice ends with its
    finish_reason, and the usage sums the choices' tokens."""
    tok, cl = running.tok, running.client()
    ids = tok.encode(PROMPTS[1])
    solos = [oracle(running, ids, 12, temperature=0.9, seed=7 + i) for i in range(3)]
    expected = [tok.decode(r.tokens) for r in solos]
    assert len(set(expected)) > 1, "three seeds should not all give one answer"
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0.9)
    r = cl.completions.create(**kw, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert (
        texts_of(r.choices)
        == expected
        == texts_of(cl.completions.create(**kw, n=3, seed=7, best_of=3).choices)
    )
    assert r.usage.completion_tokens == sum(len(s.tokens) for s in solos)
    one = [cl.completions.create(**kw, seed=7 + i).choices[0].text for i in range(3)]
    assert one == expected
    chunks = list(
        cl.completions.create(
            **kw, n=3, seed=7, stream=True, stream_options={"include_usage": True}
        )
    )
    got, reasons = ["", "", ""], [[], [], []]
    for c in chunks[:-1]:
        (choice,) = c.choices
        got[choice.index] += choice.text
        reasons[choice.index].append(choice.finish_reason)
    assert got == expected
    assert all(
        rs[-1] == s.finish_reason and set(rs[:-1]) <= {None} for rs, s in zip(reasons, solos)
    )
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert running.wait_idle() == (0, 0)


def test_n_seeded_chat_choices_streamed_or_not(running):
    tok, cl = running.tok, running.client()
    messages = [{"role": "user", "content": "Speak, what art thou?"}]
    solos = [
        oracle(running, chat_prompt(running, messages), 10, temperature=1.0, seed=3 + i)
        for i in range(3)
    ]
    expected = [tok.decode(r.tokens) for r in solos]
    kw = dict(model=NAME, messages=messages, max_tokens=10, n=3, seed=3)
    r = cl.chat.completions.create(**kw)
    assert [c.message.content for c in r.choices] == expected
    got, roles = ["", "", ""], set()
    for c in cl.chat.completions.create(**kw, stream=True):
        (choice,) = c.choices
        roles |= {choice.index} if choice.delta.role == "assistant" else set()
        got[choice.index] += choice.delta.content or ""
    assert got == expected and roles == {0, 1, 2}


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.3}]
)
def test_a_penalty_changes_the_answer_as_solo(running, penalty):
    tok, cl = running.tok, running.client()
    ids = tok.encode(PROMPTS[2])
    plain = tok.decode(oracle(running, ids, 30).tokens)
    expected = tok.decode(oracle(running, ids, 30, **penalty).tokens)
    assert expected != plain
    r = cl.completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=30, temperature=0, extra_body=penalty
    )
    assert r.choices[0].text == expected


def test_logit_bias_forces_a_token(running):
    tok = running.tok
    forced = tok.encode(" Romeo", False)[0]
    r = running.client().completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == tok.decode([forced] * 5)


def test_stop_token_ids_end_with_stop_and_min_tokens_hold_off_eos(running):
    tok, cl = running.tok, running.client()
    ids = tok.encode(PROMPTS[0])
    toks = oracle(running, ids, 20).tokens
    stop = next(t for i, t in enumerate(toks) if i >= 3 and t not in toks[:i])
    cut = toks[: toks.index(stop) + 1]  # the stop token is kept, as EOS is
    r = cl.completions.create(
        model=NAME,
        prompt=PROMPTS[0],
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [stop]},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(cut)
    assert r.choices[0].text == tok.decode(cut)
    short = tok.encode(PROMPTS[3])  # its answer: "!" and EOS
    assert len(oracle(running, short, 12).tokens) < 10
    expected = oracle(running, short, 12, min_tokens=10).tokens
    r = cl.completions.create(
        model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=0, extra_body={"min_tokens": 10}
    )
    assert r.usage.completion_tokens == len(expected) >= 10
    assert r.choices[0].text == tok.decode(expected)


@pytest.mark.parametrize(
    "endpoint, kw, param, says",
    [
        ("completions", dict(n=0), "n", "[1, 128]"),
        ("completions", dict(logprobs=21), "logprobs", "[0, 20]"),
        ("completions", dict(presence_penalty=3), "presence_penalty", "[-2, 2]"),
        ("completions", dict(logit_bias={"99999": 5}), "logit_bias", "outside the vocabulary"),
        ("completions", dict(logit_bias={"5": 200}), "logit_bias", "[-100, 100]"),
        ("completions", dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids", "outside"),
        ("completions", dict(extra_body={"min_tokens": 9}), "min_tokens", "max_tokens"),
        (
            "completions",
            dict(extra_body={"prompt_logprobs": 2}, stream=True),
            "prompt_logprobs",
            "stream",
        ),
        ("chat", dict(top_logprobs=2), "top_logprobs", "logprobs: true"),
        ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
        ("chat", dict(n=0), "n", "[1, 128]"),
        ("chat", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "tool"),
    ],
)
def test_a_bad_setting_gets_a_400_naming_it(running, endpoint, kw, param, says):
    """A setting out of its range gets a 400 naming the field and saying the range (tools stay
    refused: "not supported")."""
    cl = running.client()
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            cl.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, **kw)
        else:
            messages = [{"role": "user", "content": "Hi"}]
            cl.chat.completions.create(model=NAME, messages=messages, max_tokens=5, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert says in e.value.body["message"], e.value.body
    assert ("not supported" in e.value.body["message"]) == (param == "tools"), e.value.body
    assert running.request_counts() == (0, 0)


def test_a_client_that_goes_away_aborts_every_choice(running):
    """The choices run while the client reads its first event (480 tokens each: long enough
    for a busy machine), and stop at once when it closes the stream."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 480, "n": 3, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", running.url + "/completions", json=body, timeout=30) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data:"))
        assert running.request_counts() == (0, 3), "its three choices run while it reads"
    assert running.wait_idle(timeout=2) == (0, 0), "a choice of the closed stream still runs"


def test_a_full_server_counts_each_choice(bundled):
    """With 1 slot and 2 sequences waiting at most, n=3 can never wait: a 400 naming n at once;
    n=2 is served, each choice equal to solo."""
    model, tok = bundled
    srv = Running(make_engine(model, 1), tok, max_waiting=2)
    try:
        cl = srv.client()
        with pytest.raises(openai.BadRequestError) as e:
            cl.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, n=3, temperature=0)
        assert e.value.body["param"] == "n", e.value.body
        r = cl.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, n=2, temperature=0)
        expected = tok.decode(oracle(srv, tok.encode(PROMPTS[0]), 4).tokens)
        assert texts_of(r.choices) == [expected] * 2
        assert srv.wait_idle() == (0, 0)
    finally:
        srv.stop()


def test_many_concurrent_requests_of_several_choices(running):
    """Eight concurrent requests of 2 or 3 choices each, streamed and not, with logprobs: each
    choice equals solo with its seed, whatever shares its batch."""
    tok = running.tok

    async def one(cl, i):
        kw = dict(model=NAME, prompt=PROMPTS[i], max_tokens=8, temperature=0.8, seed=10 * i)
        kw.update(n=2 + i % 2, logprobs=1)
        if i % 2:
            return texts_of((await cl.completions.create(**kw)).choices)
        got = [""] * kw["n"]
        async for c in await cl.completions.create(**kw, stream=True):
            got[c.choices[0].index] += c.choices[0].text
        return got

    async def all_of_them():
        cl = openai.AsyncOpenAI(base_url=running.url, api_key="none", max_retries=0)
        return await asyncio.gather(*(one(cl, i) for i in range(8)))

    for i, got in enumerate(asyncio.run(all_of_them())):
        ids = tok.encode(PROMPTS[i])
        expected = [
            tok.decode(oracle(running, ids, 8, temperature=0.8, seed=10 * i + j).tokens)
            for j in range(2 + i % 2)
        ]
        assert got == expected, f"request {i}"
    assert running.wait_idle() == (0, 0)


def test_stop_strings_apply_to_each_choice(running):
    tok = running.tok
    ids = tok.encode(PROMPTS[1])
    full = [
        tok.decode(oracle(running, ids, 20, temperature=1.0, seed=5 + i).tokens) for i in range(2)
    ]
    stop = next(full[0][i : i + 2] for i in range(3, len(full[0])) if full[0][i] != " ")
    r = running.client().completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=20, n=2, seed=5, stop=[stop]
    )
    for text, c in zip(full, sorted(r.choices, key=lambda c: c.index)):
        cut = text.find(stop)
        assert c.text == (text[:cut] if cut >= 0 else text)
        assert cut < 0 or c.finish_reason == "stop"
    assert full[0].find(stop) >= 0
    assert running.wait_idle() == (0, 0)
