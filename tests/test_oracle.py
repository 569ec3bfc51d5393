"""Every setting at once: any engine configuration gives each request its solo run.

The course's one promise, held over the continuous engine's whole configuration space at once,
since bugs live where two settings meet. Hypothesis draws an EngineConfig from every field and
value the engine accepts (slots or a paged pool, block sizes, pools down to the tightest that
fits, KV budgets, the prefix cache, no budget or a small one, each decoder that runs on a CPU,
the C attention or the library's (or the library's for a server's first steps, while the C
kernels build), no speculation or n-gram or draft guesses, from the target's
first layers or a model of its own, float, int8 or int4 weights, one process or the model split
over 2 ranks), and a workload built to meet
the interactions: newcomers of one step sharing stems of every length around the block size
and the packed step's split (QUERY_ROWS), arrivals between steps, aborts, seeded sampling,
penalties, logit bias, stop ids, constraints, n > 1, logprobs, and a step that raises at a drawn
point (its requests fail, as the server's step_alone fails them, and the engine goes on). Every
finished choice equals its solo run (tokens and logprobs, float64), the books are checked after
every step, and nothing is left at the end. A combination or a request the engine refuses is
refused by name, and counted.

`make oracle MINUTES=30` runs it for as long as asked and prints what it covered
(tools/oracle.py); COVERED counts it as it goes.
"""

import contextlib
import copy
import dataclasses
import itertools
import re
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tests.conftest import make_tiny
from tinyllm.build import make_engine
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.core.config import EngineConfig
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request, Result
from tinyllm.core.sampling import Sampling
from tinyllm.core.stats import kv_bytes_per_token
from tinyllm.ext import cpu_kernels
from tinyllm.ext.cpu_attention import QUERY_ROWS, install
from tinyllm.ext.quant import quantize
from tinyllm.ext.structured import Constraint, LLGuidance, byte_alphabet
from tinyllm.serving.engine_core import Keys, step_alone

V, EOS = 97, 0
TP_SIZES = (1,) * 15 + (2,)  # ranks the model is split over (14): 2 in one example of 16


def tiny_tokenizer() -> Tokenizer:
    """A byte-level tokenizer of the tiny models' 97 ids, so that a grammar can mask them: id 0
    ends a text, ids 1 and 2 are a blank and a newline, ids 3..96 the printable characters."""
    alphabet = {b: ch for ch, b in byte_alphabet().items()}
    chars = [alphabet[32], alphabet[10]] + [chr(c) for c in range(ord("!"), ord("~") + 1)]
    vocab = {"<|endoftext|>": EOS} | {ch: i + 1 for i, ch in enumerate(chars)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return Tokenizer(hf, eos_id=EOS)


def tiny(seed: int = 41):
    return make_tiny(seed=seed, n_layers=3)  # 3 layers: drafts of 1 or 2


MODELS = {"float": tiny(), "int8": quantize(tiny(), "int8"), "int4": quantize(tiny(), "int4")}
C_MODELS = {weights: install(copy.deepcopy(m)) for weights, m in MODELS.items()}  # C attention
DRAFT = make_tiny(seed=43, n_layers=1)  # a draft of its own, with the targets' vocabulary
GRAMMARS = LLGuidance(tiny_tokenizer(), V)
CONSTRAINTS = [
    Constraint("regex", "(yes|no)"),
    Constraint("regex", "[a-z]{1,4}( [a-z]{1,4})?"),
    Constraint("lark", 'start: "yes" | "no" | /[0-9]{1,3}/'),
    Constraint("json_object"),
    Constraint.json_schema(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        }
    ),
]
COMPILING = ("compiled", "pieces")  # their first step compiles (seconds, once a weight kind)
COVERED: Counter = Counter()  # what the examples met, summed over the process
SOAK = False  # tools/oracle.py: compile for every weight kind too, not for float weights only


# ---- the configuration ---------------------------------------------------------------------------
@st.composite
def configs(draw, tp_sizes=TP_SIZES) -> tuple[str, EngineConfig, bool]:
    """(the weights, an EngineConfig of any field and value, whether the C attention runs). The
    pool's blocks and max_len are left to fit the workload (fitted); max-autotune is left out
    (minutes of compiling a step). A model split over 2 ranks (14) is drawn with float or int4
    weights: int8's products quantize each rank's part of a row by its own largest magnitude,
    so a split int8 model is not the unsplit one to the last bit."""
    tp = draw(st.sampled_from(tp_sizes))
    weights = draw(st.sampled_from(sorted(MODELS) if tp == 1 else ["float", "int4"]))
    kv = draw(st.sampled_from(["slots", "paged"]))
    n_slots = draw(st.sampled_from([3, 2, 4, 1, 5]))
    decoders = ["eager", "graphs", "fused"] + list(COMPILING if SOAK or weights == "float" else ())
    proposers = [None, "ngram", "draft"]
    if tp > 1:  # mostly what a split model takes, now and then what it refuses
        decoders, proposers = (
            ["eager"] * 4 * len(decoders) + decoders,
            [None, "ngram"] * 4 + proposers,
        )
    speculate = draw(st.sampled_from(proposers))
    temperature = draw(st.sampled_from([0.0, 0.0, 0.8]))
    config = dict(
        n_slots=n_slots,
        kv=kv,
        block_size=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        prefix_cache=kv == "paged" and draw(st.sampled_from([True, True, False])),
        kv_headroom=kv == "slots" or draw(st.sampled_from([True, True, False])),
        max_step_tokens=draw(st.sampled_from([None, None, n_slots + draw(st.integers(0, 12))])),
        decoder=draw(st.sampled_from(decoders)),
        buckets=draw(st.sampled_from([None, None, (8, 16, 32, 64), (1, 2, 3, 96)])),
        speculate=speculate,
        spec_tokens=draw(st.integers(1, 5)),
        draft_layers=draw(st.sampled_from([None, 1, 2, 3])),
        prompt_lookup_max=draw(st.integers(1, 4)),
        prompt_lookup_min=draw(st.sampled_from([1, 1, 2])),
        temperature=temperature,
        top_k=draw(st.sampled_from([None, 5])) if temperature else None,
        top_p=draw(st.sampled_from([None, 0.9])) if temperature else None,
        tensor_parallel_size=tp,
    )
    if config["decoder"] == "compiled" and config["buckets"] not in (None, (8, 16, 32, 64)):
        config["buckets"] = None  # one compiled program set per bucket list: two of them
    try:
        made = EngineConfig(**config)
    except ValueError as e:  # a combination the config refuses, by name
        return weights, config, str(e)
    return weights, made, draw(st.booleans())


# ---- the workload --------------------------------------------------------------------------------
def around(bs: int) -> list[int]:
    """Stem lengths that meet the block size and the packed step's split (QUERY_ROWS)."""
    near = {bs * k + d for k in (1, 2, 3) for d in (-1, 0, 1)}
    split = {QUERY_ROWS - 1, QUERY_ROWS, QUERY_ROWS + 1, QUERY_ROWS + bs, 44}
    return sorted(n for n in near | split | {0, 1} if 0 <= n <= 44)


@st.composite
def samplings(draw, greedy_only: bool, default: Sampling) -> Sampling | None:
    """A request's sampling: None (the engine's default, when that is greedy), greedy or
    seeded, with the token stage's processors, stop ids, logprobs, n and a constraint."""
    if default.temperature == 0 and draw(st.integers(0, 4)) == 0:
        return None
    sampled = not greedy_only and draw(st.booleans())
    constraint = draw(st.sampled_from([None] * 4 + CONSTRAINTS))
    return Sampling(
        temperature=draw(st.sampled_from([0.7, 1.0])) if sampled else 0.0,
        top_k=draw(st.sampled_from([None, 3])) if sampled else None,
        top_p=draw(st.sampled_from([None, 0.8, 1e-50])) if sampled else None,  # 1e-50: argmax
        min_p=draw(st.sampled_from([0.0, 0.05])) if sampled else 0.0,
        seed=draw(st.integers(0, 2**16)),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.8, 5e-324])),  # 5e-324: +inf
        logit_bias=draw(st.sampled_from([{}, {}, {EOS: 2.0}, {7: -5.0, 11: 3.0}])),
        stop_token_ids=draw(st.sampled_from([(), (), (5,), (9, 13)])),
        ignore_eos=draw(st.integers(0, 4)) == 0,
        min_tokens=0 if constraint else draw(st.sampled_from([0, 0, 2])),  # the grammar ends it
        logprobs=draw(st.sampled_from([0, 2, None])),  # the logprobs see what tokens may not
        prompt_logprobs=draw(st.sampled_from([None, None, 0, 2])),
        n=draw(st.sampled_from([1, 1, 1, 2, 3])),
        constraint=constraint,
    )


@st.composite
def workloads(draw, config: EngineConfig) -> list[Request]:
    """Requests on a few stems (lengths around the block size and the split), each a stem's
    prefix and a tail of its own; greedy only under a draft's speculation (its sampled
    guesses keep the target's law, with other draws than solo's; a lookup's keep solo's)."""
    stem_len = st.sampled_from(around(config.block_size))
    stems = [
        draw(st.lists(st.integers(1, V - 1), min_size=n, max_size=n))
        for n in draw(st.lists(stem_len, min_size=1, max_size=3))
    ]
    reqs = []
    for _ in range(draw(st.integers(3, 10))):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.sampled_from([len(stem), len(stem), draw(st.integers(0, len(stem)))]))
        tail = draw(st.lists(st.integers(1, V - 1), min_size=0 if cut else 1, max_size=10))
        sampling = draw(samplings(config.speculate == "draft", config.sampling))
        reqs.append(
            Request(
                stem[:cut] + tail,
                draw(st.integers(1, 12)),
                draw(st.sampled_from([EOS, EOS, None])),
                sampling,
            )
        )
    return reqs


def fitted(config: EngineConfig, model, reqs: list[Request], data) -> EngineConfig:
    """The config's memory for this workload: a slot of the longest request's positions or
    more, a pool from the tightest that holds the longest request alone (preemptions) up; and
    a KV budget (kv_mib) of the default, exactly what the cache needs, or too little."""
    need = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    if config.kv == "slots":
        config = dataclasses.replace(config, max_len=data.draw(st.sampled_from([None, need])))
        positions = config.n_slots * (config.max_len or model.cfg.max_seq_len)
    else:
        blocks = -(-need // config.block_size)
        blocks += data.draw(st.sampled_from([0, 1, 2, blocks, 3 * blocks]))
        config = dataclasses.replace(config, kv_blocks=blocks)
        positions = blocks * config.block_size
    mib = positions * kv_bytes_per_token(model, torch.device("cpu")) / 2**20
    return dataclasses.replace(config, kv_mib=data.draw(st.sampled_from([None, mib, mib / 2])))


# ---- running it ----------------------------------------------------------------------------------
def books(eng: ContinuousEngine, idle: bool = False) -> None:
    """The cache's books (and a draft's), sound; idle: nothing held either."""
    why = eng.cache.check_integrity(idle)
    if why is None:
        why = eng.runner.check_integrity(idle)
    assert why is None, why


def added(eng: ContinuousEngine, req: Request) -> int | None:
    """The request's first rid, or None when the engine refuses it by name (it can never fit
    this cache: a KV budget that cuts max_len)."""
    try:
        return eng.add_request(req)
    except ValueError as e:
        assert "positions" in str(e) or "blocks" in str(e), f"refused without saying why: {e}"
        COVERED["refused: a request that never fits"] += 1
        return None


def drive(eng: ContinuousEngine, reqs: list[Request], data) -> tuple[list, set[int]]:
    """Requests join between steps (all at once, or a few a step), some are aborted, and the
    books are checked after every step. Each step runs as the server runs it (step_alone), with
    a request's rid as its key: a step that raises fails the requests it held, which count as
    aborted. Returns each request's first rid (None: refused) and the aborted rids."""
    pending, rids, aborted, keys = list(reqs), [], set(), Keys()
    at_once = data.draw(st.sampled_from([True, True, False]))  # newcomers of one step
    while pending or eng.has_work():
        for _ in range(len(pending) if at_once else data.draw(st.integers(0, 3))):
            if pending:
                rids.append(added(eng, pending.pop(0)))
        if eng._seqs and data.draw(st.integers(0, 199)) == 0:
            rid = data.draw(st.sampled_from(sorted(eng._seqs)))
            assert eng.abort(rid)
            aborted.add(rid)
        for rid in eng._seqs.keys() - keys.key_of.keys():
            keys.add(rid, rid)
        _, dropped = step_alone(eng, keys, False)
        aborted |= {key for key, _ in dropped or []}
        COVERED["steps that raised, the engine going on"] += dropped is not None
        for rid in eng.results.keys() & keys.key_of.keys():  # finished: out of the books
            keys.pop(rid)
        books(eng)
    books(eng, idle=True)
    assert not eng._seqs and not eng.scheduler.has_work()
    return rids, aborted


class Injected(RuntimeError):
    """The fault a drawn step raises (faulty)."""


# where a step may raise: admitting and planning, a prefill pass, a decode pass, retiring tokens
FAULT_POINTS = ("scheduler.plan", "runner.prefill", "runner.decode", "retire")


@contextlib.contextmanager
def faulty(eng: ContinuousEngine, point: str | None, at: int):
    """The engine's `point` (one of FAULT_POINTS, or None: none) raises Injected at its call
    number `at` (from 0), before it runs; its other calls run as they are."""
    if point is None:
        yield
        return
    owner, _, name = point.rpartition(".")
    obj = getattr(eng, owner) if owner else eng
    obj = getattr(obj, "base", obj)  # a speculating runner's passes are its base runner's
    real, count = getattr(obj, name), itertools.count()

    def raising(*args, **kwargs):
        if next(count) == at:
            raise Injected(f"{point} raised at its call {at}")
        return real(*args, **kwargs)

    setattr(obj, name, raising)
    try:
        yield
    finally:
        delattr(obj, name)  # the class's method again


def short(settings) -> str:
    """A dataclass's settings that differ from their defaults, as keywords."""
    changed = {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(settings)
        if getattr(settings, f.name) != f.default
    }
    return ", ".join(f"{k}={v!r}" for k, v in changed.items())


def same_logprobs(want, got, what: str) -> None:
    """Logprobs (a list of TokenLogprobs, or of TokenLogprobs or None) equal to float64's
    order of additions: each token's and its top alternatives'."""
    assert (want is None) == (got is None), f"{what}: logprobs asked, not given (or the reverse)"
    for i, (a, b) in enumerate(zip(want or [], got or [])):
        if a is None or b is None:
            assert a is b, f"{what}: position {i}'s logprobs"
            continue
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-9, (
            f"{what}: token {i}'s logprob {b.logprob} (solo {a.logprob})"
        )
        assert len(a.top) == len(b.top) and all(
            abs(x[1] - y[1]) < 1e-9 and (x[0] == y[0] or abs(x[1] - y[1]) < 1e-12)
            for x, y in zip(a.top, b.top)
        ), f"{what}: token {i}'s top logprobs {b.top} (solo {a.top})"
    assert len(want or []) == len(got or []), f"{what}: {len(got or [])} logprobs"


def check_solo(model, config: EngineConfig, reqs, rids, aborted, results: dict) -> None:
    """Every finished choice is its solo run: tokens, finish reason, logprobs."""
    for i, (req, rid) in enumerate(zip(reqs, rids)):
        if rid is None:
            continue
        sampling = req.sampling or config.sampling
        for c, s in enumerate(sampling.choices()):
            if rid + c in aborted:
                continue
            got: Result = results.pop(rid + c)
            want = solo(
                model, Request(req.prompt, req.max_new_tokens, req.eos_id, s), grammars=GRAMMARS
            )
            what = f"request {i} choice {c} (Sampling({short(s)}), EngineConfig({short(config)}))"
            t = next(
                (t for t, (a, b) in enumerate(zip(want.tokens, got.tokens)) if a != b),
                min(len(want.tokens), len(got.tokens)),
            )
            assert got.tokens == want.tokens, (
                f"{what} diverged from solo generate at token {t}: expected "
                f"{want.tokens[t : t + 1]}, got {got.tokens[t : t + 1]} ({len(got.tokens)} tokens, "
                f"solo {len(want.tokens)})"
            )
            assert got.finish_reason == want.finish_reason, what
            same_logprobs(want.logprobs, got.logprobs, what)
            same_logprobs(want.prompt_logprobs, got.prompt_logprobs, f"{what}, its prompt")
            COVERED["choices"] += 1
            COVERED["constrained"] += s.constraint is not None


def kind_of(why: str) -> str:
    """A refusal's sentence with its numbers left out, to count refusals of one kind together."""
    return re.sub(r"\d+(\.\d+)?", "N", why)[:70]


@contextlib.contextmanager
def kernels_built_after(model, eng, steps: int):
    """As a server's first steps run while the C kernels are still being built: for the
    engine's first `steps` steps (0: none) the C attention, installed not to wait for them,
    finds them unbuilt and attends as the model does; from then on they are built."""
    if not steps:
        yield
        return
    attns, saved = [b.self_attn for b in model.layers], (cpu_kernels._built, cpu_kernels._builder)
    step, count = eng.step, itertools.count(1)

    def counted():
        if next(count) > steps:
            cpu_kernels._built = saved[0]  # the build is done
        return step()

    for a in attns:
        a.wait_for_kernels = False
    cpu_kernels._built, cpu_kernels._builder = None, object()  # a build under way
    eng.step = counted
    try:
        yield
    finally:
        cpu_kernels._built, cpu_kernels._builder = saved
        for a in attns:
            a.wait_for_kernels = True


def run_example(data, tp_sizes=TP_SIZES) -> None:
    """One drawn configuration and workload through the engine, every choice against solo."""
    weights, config, c_attention = data.draw(configs(tp_sizes))
    if isinstance(c_attention, str):  # refused by the config: named, and counted
        assert any(name in c_attention for name in config), c_attention
        COVERED["refused: " + kind_of(c_attention.split(":")[0])] += 1
        event("refused by the config")
        return
    model = (C_MODELS if c_attention else MODELS)[weights]
    reqs = data.draw(workloads(config))
    config = fitted(config, model, reqs, data)
    own = config.speculate == "draft" and data.draw(st.booleans())  # a draft model of its own
    try:
        eng = make_engine(model, config, grammars=GRAMMARS, draft=DRAFT if own else None)
    except ValueError as e:  # a decoder or draft that cannot serve these weights: by name
        named = [f.name for f in dataclasses.fields(EngineConfig)] + ["decoder=", "draft"]
        assert any(n in str(e) for n in named), f"refused without naming the setting: {e}"
        COVERED["refused: " + kind_of(str(e))] += 1
        event("refused by the engine")
        return
    if eng.decoder.compiles_later and data.draw(st.booleans()):
        eng.decoder.eager_until_compiled = True  # as serve runs the pieces: uncompiled rows eager
        COVERED["pieces eager until compiled"] += 1
    building = data.draw(st.integers(0, 6)) if c_attention else 0
    COVERED["C kernels built mid-run"] += building > 0
    fault, at = (
        data.draw(st.sampled_from([None] * 4 + list(FAULT_POINTS))),
        data.draw(st.integers(0, 9)),
    )
    with kernels_built_after(model, eng, building), faulty(eng, fault, at):
        try:
            rids, aborted = drive(eng, reqs, data)
        except Injected:  # raised holding no request: the engine fails as a whole
            COVERED["faults that failed the engine"] += 1
            return
    check_solo(MODELS[weights], config, reqs, rids, aborted, eng.results)  # the plain model
    assert not eng.results, "results of requests nobody added"
    st_ = eng.stats
    COVERED.update(
        examples=1,
        requests=len(reqs),
        aborted=len(aborted),
        preemptions=st_.preemptions,
        prefix_hit_tokens=st_.cached_prompt_tokens,
        proposed=st_.spec_proposed,
        accepted=st_.spec_accepted,
    )
    COVERED[f"decoder {config.decoder}"] += 1
    COVERED[f"ranks {config.tensor_parallel_size}"] += 1
    COVERED[f"weights {weights}"] += 1
    event(f"{config.kv} {config.decoder} {weights} speculate={config.speculate}")


@pytest.mark.slow  # two minutes of drawing: make test and make oracle run it, not make test-quick
@settings(
    max_examples=600,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(data=st.data())
def test_every_configuration_gives_every_request_its_solo_run(data):
    """Any EngineConfig the engine accepts, any workload: each finished choice's tokens and
    logprobs are its solo run's, the books sound after every step, nothing held at the end; a
    combination refused is refused by name."""
    run_example(data)


def test_blocks_named_at_admission_by_a_step_that_raised_are_forgotten():
    """Found by the oracle: without a budget, a newcomer's full blocks are named as it is
    admitted, before the step's pass writes them. A step that raises before its pass fails its
    requests (step_alone), and the names of the blocks it never wrote go with them: a later
    request of the same prefix computes it again, to its solo logprobs (not those of blocks
    that hold no keys)."""
    stem, s = [(5 * j) % (V - 1) + 1 for j in range(20)], Sampling(logprobs=0)
    config = EngineConfig(2, kv="paged", block_size=4, prefix_cache=True)
    eng, keys = make_engine(MODELS["float"], config), Keys()
    first = eng.add_request(Request(stem + [3], 4, sampling=s))
    keys.add(first, first)
    with faulty(eng, "runner.prefill", 0):
        assert step_alone(eng, keys, False) == (
            [],
            [(first, "Injected: runner.prefill raised at its call 0")],
        )
    assert not eng.cache.prefix.cached, "a block that was never written keeps its name"
    books(eng, idle=True)
    req = Request(stem + [5], 4, sampling=s)
    rid = eng.add_request(req)
    while eng.has_work():
        eng.step()
    check_solo(MODELS["float"], config, [req], [rid], set(), eng.results)


@pytest.mark.parametrize("c_attention", [True, False], ids=["C attention", "library attention"])
def test_newcomers_sharing_a_long_ones_blocks_get_their_solo_logprobs(c_attention):
    """Found by the oracle: without a budget, newcomers of one step share the blocks a longer
    newcomer of the same step names at admission; the owner's row attends in the library's
    group, the sharers' in the C kernel (or, without it, a group of one-token rows that attends
    first). Each layer stores every row's keys before any row reads: solo logprobs, not 1e-3
    off."""
    stem = [(7 * j) % (V - 1) + 1 for j in range(40)]
    s = Sampling(logprobs=0)
    tails = ((32, [3]), (36, [5, 6]), (20, [9] * 9))
    reqs = [Request(stem, 6, sampling=s)] + [Request(stem[:n] + t, 6, sampling=s) for n, t in tails]
    config = EngineConfig(4, kv="paged", block_size=4, prefix_cache=True)
    eng = make_engine((C_MODELS if c_attention else MODELS)["float"], config)
    rids = [eng.add_request(r) for r in reqs]
    eng.step()
    cached = sum(seq.num_cached_tokens for seq in eng._seqs.values())
    assert cached == 32 + 36 + 20, "the three share the stem in the step that admits them"
    while eng.has_work():
        eng.step()
    check_solo(MODELS["float"], config, reqs, rids, set(), eng.results)
