"""Step 13 - the fused decoder: a layer's decode step in one C call (decode_layer) computes
what the model's layer computes, on slots and on a paged pool (float64: up to the order of
additions), and each row's result is its own in any batch (float32, bit for bit; float and
quantized weights); every engine with decoder="fused" gives each request its solo tokens on
random workloads, nothing leaked, and a quantized model's engine gives each request the tokens
it gets alone; an index outside the cache raises and writes nothing; a model it cannot compute
is refused by name.
"""

import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MIXED_REQUESTS as REQS
from tests.conftest import make_tiny
from tinyllm.build import make_engine
from tinyllm.core.continuous import ContinuousEngine
from tinyllm.core.generate import solo
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.ext import cpu_kernels
from tinyllm.ext.cpu_attention import kernel_rows
from tinyllm.ext.fused_layer import FusedDecoder, layer_weights, quant_weights
from tinyllm.ext.quant import QuantLinear, linears, quantize

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no C compiler: the kernels cannot be built"
)
MAX_LEN = 40


def make_cache(kind: str, model, n_slots: int):
    cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
    shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim)
    if kind == "paged":  # blocks of 4, enough for every slot, handed out in no particular order
        return PagedKVCache(*shape, n_slots * MAX_LEN // 4 + 1, 4, MAX_LEN, dtype)
    return SlotKVCache(*shape, MAX_LEN, dtype)


def decode_step(model, decoder, kind: str, prompts: list[list[int]], rows: list[int]):
    """Prefill the prompts (one slot each) through the model, then one decode step of the
    slots `rows` through decoder(idx, cache) -> (its logits (len(rows), V), the cache)."""
    cache = make_cache(kind, model, len(prompts))
    lens = [len(p) for p in prompts]
    for s, n in enumerate(lens):
        cache.admit(s, n)
    cache.plan_step(list(range(len(prompts))), lens)
    padded = torch.tensor([p + [0] * (max(lens) - len(p)) for p in prompts])
    with torch.no_grad():
        model(padded, cache=cache)
        for s in rows:
            assert cache.reserve(s, 1)
        cache.plan_step(rows, [1] * len(rows))
        logits, _ = decoder(torch.tensor([[7 + 3 * s] for s in rows]), cache)
    assert cache.check_integrity() is None
    return logits[:, 0], cache


shapes_st = st.fixed_dictionaries(
    dict(
        n_kv_heads=st.integers(1, 3),
        group=st.integers(1, 3),  # query heads per KV head
        head_dim=st.sampled_from([2, 6, 8, 16, 18, 40]),  # the 16-float vectors' leftovers too
        d_model=st.integers(4, 48),
        d_ff=st.integers(1, 70),
        n_layers=st.integers(1, 2),
        tie_embeddings=st.booleans(),
    )
)
prompts_st = st.lists(st.lists(st.integers(1, 96), min_size=1, max_size=20), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=shapes_st, prompts=prompts_st, kind=st.sampled_from(["slots", "paged"]), data=st.data()
)
def test_a_fused_step_is_the_models_step(shape, prompts, kind, data):
    """From the same cache state, a decode step of some of the slots gives the model's logits
    and writes the model's keys and values, float64 (only the order of additions differs)."""
    group = shape.pop("group")
    model = make_tiny(seed=len(prompts), n_heads=group * shape["n_kv_heads"], **shape)
    rows = data.draw(st.lists(st.sampled_from(range(len(prompts))), min_size=1, unique=True))
    want, cache = decode_step(model, lambda idx, c: model(idx, cache=c), kind, prompts, rows)
    got, fused = decode_step(model, FusedDecoder(model), kind, prompts, rows)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert fused.lens == cache.lens
    for a, b in zip(fused.k + fused.v, cache.k + cache.v):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def q8_0(model):
    """Every linear layer of the model as GGUF's Q8_0 blocks hold it: int8 in groups of 32
    along the input (halved until they divide it), a float16 scale a group (QuantLinear's
    int8a8). Returns the model."""
    for parent, name, linear in linears(model):
        w = linear.weight.detach()
        N, K = w.shape
        g = next(g for g in (32, 16, 8, 4, 2, 1) if K % g == 0)
        wg = w.reshape(N, K // g, g)
        scale = (wg.abs().amax(-1) / 127).clamp(min=1e-4).half()  # (N, G)
        q = torch.round(wg / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        setattr(parent, name, QuantLinear(8, q.reshape(N, K), scale, None, K))
    return model


# float32 models of each weight kind decode_layer and decode_layer_q compute; int4 and Q8_0
# with d_model 72 have groups of 8 there (the plain loops), 16 in the output product and 32 in
# the MLP's down product (the vector ones)
FLOAT32_MODELS = {
    "float": lambda m: quantize(m, "float"),
    "int8": lambda m: quantize(m, "int8"),
    "int4": lambda m: quantize(m, "int4"),
    "q8_0": q8_0,
}


@pytest.mark.parametrize("weights", FLOAT32_MODELS)
@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_in_float32_each_row_is_its_own_and_close_to_the_model(kind, weights):
    """float32, the C loops of the machine's vector path: a row's logits are the same bit for
    bit in a step of 1, 3 or 5 rows (the head is GemvLinear's or QuantLinear's, as bench --quant
    runs it), and close to the model's: float weights within float32's rounding; quantized ones
    within a hundredth, since the products round their inputs to int8 steps, and a last-bit
    difference in the norm can move an input across a step's boundary."""
    model = make_tiny(seed=5, head_dim=40, n_heads=6, n_kv_heads=2, d_model=72, d_ff=96)
    model = FLOAT32_MODELS[weights](model.float())
    prompts = [[1 + i, 5, 9, 2 + i][: 1 + i % 4] * (1 + i) for i in range(5)]
    fused = FusedDecoder(model)
    assert fused.quantized == (weights != "float")
    batch, _ = decode_step(model, fused, kind, prompts, [0, 1, 2, 3, 4])
    want, _ = decode_step(model, lambda idx, c: model(idx, cache=c), kind, prompts, [0, 1, 2, 3, 4])
    near = 1e-4 if weights == "float" else 1e-2
    torch.testing.assert_close(batch, want, rtol=near, atol=near)
    three, _ = decode_step(model, fused, kind, prompts, [4, 0, 2])
    for i, s in enumerate([4, 0, 2]):
        alone, _ = decode_step(model, fused, kind, prompts, [s])
        assert torch.equal(alone[0], batch[s]) and torch.equal(three[i], batch[s]), f"row {s}"


MODEL = make_tiny(seed=21)
ENGINES = {
    "slots": dict(kv="slots"),
    "paged-tight": dict(kv="paged", block_size=4, kv_blocks=7),  # preemptions
    "paged-prefix-chunked": dict(kv="paged", block_size=4, prefix_cache=True, max_step_tokens=5),
    "speculative": dict(kv="paged", block_size=4, speculate="ngram", spec_tokens=3),
}


def serve(model, reqs, n_slots=2, **kw) -> tuple[list[list[int]], ContinuousEngine]:
    eng = make_engine(model, n_slots, decoder="fused", **kw)
    rids = [eng.add_request(r) for r in reqs]
    while eng.has_work():
        eng.step()
        assert eng.cache.check_integrity() is None
    assert eng.cache.check_integrity(idle=True) is None and not eng._seqs
    assert eng.cache.used_tokens() == 0 and eng.holders() == [None] * n_slots
    return [eng.results.pop(rid).tokens for rid in rids], eng


@pytest.mark.parametrize("kw", ENGINES.values(), ids=ENGINES.keys())
def test_the_fused_engines_give_the_solo_tokens(kw):
    reqs = [r for r in REQS if r.sampling is None] if "speculate" in kw else REQS
    want = [solo(MODEL, r).tokens for r in reqs]
    got, eng = serve(MODEL, reqs, **kw)
    assert got == want, kw
    assert isinstance(eng.decoder, FusedDecoder)
    assert "kv_blocks" not in kw or eng.stats.preemptions > 0, "the tight pool preempts"
    assert "speculate" not in kw or eng.stats.spec_proposed > 0


requests_st = st.lists(
    st.builds(
        Request,
        prompt=st.lists(st.integers(0, 96), min_size=1, max_size=20),
        max_new_tokens=st.integers(1, 16),
        eos_id=st.sampled_from([None, 3, 11, (3, 40)]),
        sampling=st.one_of(
            st.none(), st.builds(Sampling, temperature=st.just(0.9), seed=st.integers(0, 99))
        ),
    ),
    min_size=1,
    max_size=8,
)


RANDOM_ENGINES = {
    "slots": dict(kv="slots"),
    "paged-tight": dict(kv="paged", block_size=4, kv_blocks=10),  # 40 tokens: the longest fits
    "paged-prefix-chunked": ENGINES["paged-prefix-chunked"],
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_st, n_slots=st.integers(1, 4), kind=st.sampled_from(list(RANDOM_ENGINES)))
def test_random_workloads_through_the_fused_engines_are_solo(requests, n_slots, kind):
    """Greedy and seeded sampled requests of random lengths, on slots, a tight paged pool
    (preemptions) and a prefix cache with a token budget: each request's solo tokens."""
    want = [solo(MODEL, r).tokens for r in requests]
    got, _ = serve(MODEL, requests, n_slots, **RANDOM_ENGINES[kind])
    assert got == want


class Spy:
    """The kernels, counting the rows of each call of one of them (`name`)."""

    def __init__(self, name: str):
        self.watched, self.calls, self.real = name, [], cpu_kernels.library()

    def __getattr__(self, name):
        real = getattr(self.real, name)
        if name != self.watched:
            return real

        def counted(x, *rest):
            self.calls.append(len(x))
            return real(x, *rest)

        return counted


@pytest.mark.parametrize("weights", ["int8", "int4", "q8_0"])
def test_a_quantized_engine_gives_each_request_what_it_gets_alone(weights, monkeypatch):
    """float32, quantized weights: an engine of 3 slots on a tight paged pool with a prefix
    cache gives each request the tokens it gets on an engine of its own, every decode step in
    the quantized layers' one call (each row's result is its own)."""
    model = FLOAT32_MODELS[weights](make_tiny(seed=21, d_model=64, d_ff=96).float())
    spy = Spy("decode_layers")
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    alone = [serve(model, [r], 1)[0][0] for r in REQS]
    got, eng = serve(model, REQS, 3, kv="paged", block_size=4, kv_blocks=7, prefix_cache=True)
    assert got == alone
    assert eng.decoder.quantized and eng.stats.preemptions > 0
    assert spy.calls and max(spy.calls) == 3, "the steps of 3 rows run decode_layers"


COPYING = [
    Request([7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], 14, eos_id=None),  # guesses that stand
    Request([3, 5, 3, 5, 3], 10, eos_id=None),
    Request([1, 2, 3, 4], 12, eos_id=None),
]


@pytest.mark.parametrize("weights", ["float64", "int4"])
def test_speculation_verifies_its_guesses_in_the_fused_layers(weights, monkeypatch):
    """The verify pass of a fused engine runs decode_layers with a query row per token (the
    rows' last tokens and their guesses: more rows than slots), and gives every request its
    tokens without speculation: its solo tokens in float64; in float32 with int4 weights the
    fused engine's own (each token's arithmetic is the same in a verify row as in a decode
    row, bit for bit)."""
    model = MODEL if weights == "float64" else quantize(copy.deepcopy(MODEL).float(), "int4")
    plain = (
        [solo(MODEL, r).tokens for r in COPYING]
        if weights == "float64"
        else serve(model, COPYING, 2)[0]
    )
    spy = Spy("decode_layers")
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    got, eng = serve(model, COPYING, 2, kv="paged", block_size=4, speculate="ngram", spec_tokens=3)
    assert got == plain
    assert eng.stats.spec_accepted > 0 and max(spy.calls) > 2, spy.calls


def test_a_step_of_more_rows_than_the_c_loops_take_runs_the_model(monkeypatch):
    """18 slots decoding at once: the steps of 17 and 18 rows are the model's own (the
    library's products), the smaller ones decode_layers'; every request still gets its solo
    tokens."""
    spy = Spy("decode_layers")
    monkeypatch.setattr(cpu_kernels, "library", lambda: spy)
    reqs = [Request([1 + i, 2, 3], 3 + i % 4, eos_id=None) for i in range(18)]
    want = [solo(MODEL, r).tokens for r in reqs]
    got, _ = serve(MODEL, reqs, 18)
    assert got == want
    assert spy.calls and max(spy.calls) <= 16, spy.calls


def test_an_index_outside_the_cache_raises_and_writes_nothing():
    model = make_tiny(seed=3)
    cache = make_cache("slots", model, 2)
    cache.admit(0, 3)
    cache.plan_step([0], [3])
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6]]), cache=cache)
    cache.plan_step([0], [1])
    cos, sin = model.rope(cache.begin_step(1))
    x = torch.randn(1, model.cfg.d_model, dtype=torch.float64)
    keys, values, write, read, stride, mask = kernel_rows(cache, 0, x)
    before = [t.clone() for t in (keys, values)]
    x0 = x.clone()
    for bad_write, bad_read in [(keys.numel() // keys.size(-1), None), (None, -1)]:
        w, r = write.clone(), read.clone()
        if bad_write is not None:
            w[0, -1] = bad_write
        if bad_read is not None:
            r[0, 0] = bad_read
        with pytest.raises(IndexError, match="outside the cache"):
            cpu_kernels.decode_layer(
                x,
                layer_weights(model.layers[0]),
                cos,
                sin,
                keys,
                values,
                w,
                r,
                stride,
                mask,
                model.cfg.n_heads,
                model.cfg.norm_eps,
            )
        assert torch.equal(x, x0) and all(map(torch.equal, (keys, values), before))


def test_bad_weights_are_named():
    model = make_tiny(seed=4)
    w = layer_weights(model.layers[0])
    cache = make_cache("slots", model, 1)
    cache.admit(0, 1)
    cache.plan_step([0], [1])
    cos, sin = model.rope(cache.begin_step(1))
    x = torch.zeros(1, model.cfg.d_model, dtype=torch.float64)
    layout = kernel_rows(cache, 0, x)
    run = lambda x, w: cpu_kernels.decode_layer(x, w, cos, sin, *layout, 4, 1e-5)
    with pytest.raises(RuntimeError, match="9 tensors a layer, got 8"):
        run(x, w[:8])
    with pytest.raises(RuntimeError, match=r"layer 0's w\[2\] must be a contiguous CPU tensor"):
        run(x, w[:2] + [w[2].t().contiguous().t()] + w[3:])
    with pytest.raises(RuntimeError, match="x must be Double as the layers are, not Half"):
        run(x.half(), w)
    with pytest.raises(RuntimeError, match="float32 or float64, not Half"):
        run(x.half(), [t.half() for t in w])


def test_bad_quantized_weights_are_named():
    model = quantize(make_tiny(seed=4, d_model=64).float(), "int4")
    norms, q, scale, zero = quant_weights(model.layers[0])
    cache = make_cache("slots", model, 1)
    cache.admit(0, 1)
    cache.plan_step([0], [1])
    cos, sin = model.rope(cache.begin_step(1))
    x = torch.zeros(1, 64)
    layout = kernel_rows(cache, 0, x)
    run = lambda x, *w: cpu_kernels.decode_layer_q(x, *w, cos, sin, *layout, 4, 1e-5)
    with pytest.raises(RuntimeError, match="23 tensors a layer, got 22"):
        run(x, norms, q[:6], scale, zero)
    with pytest.raises(RuntimeError, match=r"q\[3\] must be uint8 \[64, 2, 16\], got Char"):
        run(x, norms, q[:3] + [q[3].view(torch.int8)] + q[4:], scale, zero)
    with pytest.raises(RuntimeError, match=r"q\[0\] and q\[1\] read the same x"):
        no_zero = torch.empty(0, dtype=torch.float16)
        k8 = torch.zeros(q[1].size(0), 64, dtype=torch.int8)
        run(
            x,
            norms,
            q[:1] + [k8] + q[2:],
            scale[:1] + [scale[1][:, :1].contiguous()] + scale[2:],
            zero[:1] + [no_zero] + zero[2:],
        )
    with pytest.raises(RuntimeError, match="x must be Float as the layers are, not Double"):
        run(x.double(), norms, q, scale, zero)


def mixed_kinds():
    """A quantized model whose k product is int8 in groups of 32 beside int8 q and v products
    of a scale a row."""
    model = quantize(make_tiny(seed=6, d_model=64).float(), "int8")
    attn = model.layers[0].self_attn
    holder = torch.nn.Module()
    holder.k_proj = torch.nn.Linear(64, attn.k_proj.out_features, bias=False)
    holder.k_proj.weight.data = attn.k_proj.dequantized()
    attn.k_proj = q8_0(holder).k_proj
    return model


def test_models_it_cannot_compute_are_refused_by_name():
    cases = [
        (
            quantize(make_tiny(seed=6).float(), "int8", kernel="eager"),
            "its layers are not all quantized with a C product here",
        ),
        (mixed_kinds(), "a layer.s products that read the same x are quantized in different ways"),
        (
            make_tiny(seed=6, dtype=torch.bfloat16),
            "its weights are torch.bfloat16 on cpu, not float32",
        ),
        (make_tiny(seed=6, qkv_bias=True), "its layers have biases"),  # Qwen2's
    ]
    for model, why in cases:
        with pytest.raises(ValueError, match=f"decoder='fused' cannot run this model: {why}"):
            FusedDecoder(model)
        with pytest.raises(ValueError, match=why):
            make_engine(model, 2, decoder="fused")


def test_a_fused_decoder_sent_to_another_process_finds_its_weights_again():
    decoder = FusedDecoder(MODEL)
    copied = pickle.loads(pickle.dumps(decoder))
    assert copied.model is not MODEL
    mine = [w.data_ptr() for w in layer_weights(copied.model.layers[1])]
    assert [w.data_ptr() for w in copied.weights[1]] == mine
    assert all(map(torch.equal, copied.weights[1], decoder.weights[1]))
    assert copy.deepcopy(decoder).weights[0][1].data_ptr() != decoder.weights[0][1].data_ptr()


def test_a_machine_without_the_kernels_is_told_why_in_one_line(tmp_path, monkeypatch):
    """Where the kernels did not build, the refusal says what the compiler said last; `serve
    --decoder fused` with no C compiler (an empty PATH, $CC and $CXX pointing nowhere, a fresh
    cache) ends with that in one line, and what to do, status 2."""
    monkeypatch.setattr(cpu_kernels, "_built", False)
    monkeypatch.setattr(cpu_kernels, "FAILURES", ["-O3: cc: error\nfatal: no such instruction set"])
    assert FusedDecoder.refusal(MODEL) == (
        "the C kernels are not built here: the compiler said, with -O3: fatal: no such "
        "instruction set"
    )
    env = {**os.environ, "PATH": str(tmp_path), "CC": "/nonexistent", "CXX": "/nonexistent"}
    env |= {"TINYLLM_CACHE": str(tmp_path / "c"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "i")}
    cmd = [sys.executable, "-m", "tinyllm", "serve", "--decoder", "fused", "--port", "9"]
    root = Path(__file__).parents[1]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    said = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(said) == 1, said
    assert "--decoder fused" in said[0] and "no C and C++ compilers" in said[0], said
    assert said[0].endswith("or serve with --decoder eager"), said
