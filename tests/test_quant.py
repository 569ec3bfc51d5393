"""Step 13 - quantized weights: int8 and int4 layers de-quantize to within half a step of the
float weights; a GGUF file's Q8_0, Q4_0 and Q4_1 blocks are kept and read back as gguf reads
them, bit for bit; the kernels agree; and every engine on a quantized model gives each request
the tokens of its solo run on that model, with nothing left behind."""

import math

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyllm
from tests.conftest import make_tiny
from tests.test_gguf import (
    arch_metadata,
    bundled_vocabulary,
    gguf_name,
    gguf_tensors,
    tiny_peer,
    write_gguf,
)
from tinyllm.build import load, make_engine
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.core.static import run_static
from tinyllm.ext import cpu_kernels, quant
from tinyllm.ext.quant import (
    GemvLinear,
    QuantLinear,
    int8_matmul,
    quantize,
    quantize_int4,
    quantize_int8,
    weight_bytes,
)

Q = gguf.GGMLQuantizationType


def test_int8_and_int4_are_within_half_a_step_of_the_weights():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, scale = quantize_int8(w)
    layer = QuantLinear(8, q, scale, None, 96, kernel="eager")
    err = (layer.dequantized(torch.float64) - w).abs()
    assert q.dtype == torch.int8 and scale.shape == (48, 1)
    assert (err <= scale.double() / 2 + 1e-12).all(), "int8: more than half a step off"
    q, scale, zero = quantize_int4(w, 32)
    assert q.shape == (48, 3, 16) and q.dtype == torch.uint8 and scale.shape == (48, 3)
    layer = QuantLinear(4, q, scale, zero, 96, kernel="eager")
    steps = scale.double().repeat_interleave(32, 1)
    err = (layer.dequantized(torch.float64) - w).abs()
    assert (err <= steps / 2 + 2e-3 * w.abs().max()).all(), "int4: more than half a step off"
    assert layer.nbytes() == 48 * 48 + 2 * 2 * 48 * 3, "4 bits a weight, 2 float16 per group"


def test_a_row_that_does_not_divide_into_groups_of_32_gets_smaller_groups():
    model = quantize(make_tiny(), "int4", kernel="eager")  # d_ff 160: groups of 32 and of 32
    narrow = quantize(make_tiny(d_ff=144), "int4", kernel="eager")  # 144: groups of 16
    assert model.layers[0].mlp.down_proj.group_size == 32
    assert narrow.layers[0].mlp.down_proj.group_size == 16
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        quantize(make_tiny(), "int4", group_size=24)
    with pytest.raises(ValueError, match="quantize.s mode must be .float., .int8. or .int4."):
        quantize(make_tiny(), "int3")


def test_the_fused_loop_equals_the_de_quantized_product():
    """The compiled loop over the integers (a few rows) against de-quantize-then-multiply, for
    8 and 4 bits, 1 and 3 rows (padded to 4), in float32."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=gen)
    for bits, parts in ((8, quantize_int8(w) + (None,)), (4, quantize_int4(w, 32))):
        q, scale, zero = parts
        fused = QuantLinear(bits, q, scale, zero, 64, kernel="fused")
        eager = QuantLinear(bits, q, scale, zero, 64, kernel="eager")
        for rows in (1, 3, 20):  # 20 rows: past FUSED_ROWS, the de-quantized product
            x = torch.randn(rows, 64, generator=gen)
            torch.testing.assert_close(fused(x), eager(x), rtol=1e-5, atol=1e-5)


def test_a_gemv_layer_is_the_float_layer_read_by_the_c_loop(bundled):
    """quant="float": the same weights (the head still tied), a few rows through the C loop
    (where it compiled) equal to the plain layer's product up to rounding, many through the
    library."""
    model, _ = bundled
    gemv = load(device="cpu", quant="float")[0]
    assert isinstance(gemv.lm_head, GemvLinear) and gemv.quant == "float"
    assert gemv.lm_head.weight is gemv.embed_tokens.weight, "the head stays tied"
    assert weight_bytes(gemv) == weight_bytes(model)
    x = torch.randn(1, 1, model.cfg.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for rows in (x, x.expand(1, 5, -1), x.expand(1, 20, -1)):
            want = model.lm_head(rows)
            torch.testing.assert_close(gemv.lm_head(rows), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("K", [3, 1024, 1025, 4095])
def test_the_integer_product_is_exact_on_either_path(monkeypatch, fast, K):
    """int_matmul: torch._int_mm, or the float32 product EXACT_K columns at a time, give the
    exact integer sums, the largest ones included: 127 against -128 everywhere, and 127 against
    127, whose sum over 4,095 columns is odd and past 2**24, where float32 holds no odd number."""
    gen = torch.Generator().manual_seed(K)
    xq = torch.randint(-127, 128, (20, K), dtype=torch.int8, generator=gen)
    q = torch.randint(-128, 128, (9, K), dtype=torch.int8, generator=gen)
    xq[0], q[0], xq[1], q[1] = 127, -128, -127, 127
    monkeypatch.setattr(quant, "fast_int_mm", lambda: fast)
    want = xq.long() @ q.long().T
    assert torch.equal(quant.int_matmul(xq, q).long(), want)


def test_int8mm_quantizes_each_row_alone():
    """The integer product's rows do not depend on the rows beside them (each row its own
    scale; the integer sums are exact), and it stays near the float product."""
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(50, 64, generator=gen), torch.randn(7, 64, generator=gen)
    q, scale = quantize_int8(w)
    batched = int8_matmul(x, q, scale)
    for i in range(7):
        assert torch.equal(batched[i : i + 1], int8_matmul(x[i : i + 1], q, scale)), i
    want = x @ QuantLinear(8, q, scale, None, 64, kernel="eager").dequantized().T
    assert (batched - want).norm() / want.norm() < 0.02
    with pytest.raises(ValueError, match="kernel 'int8mm' needs 8 bits and one scale per row"):
        QuantLinear(4, *quantize_int4(w, 32), 64, kernel="int8mm")


def test_load_quantizes_and_names_what_it_refuses(bundled):
    model, _ = bundled
    q8, _ = load(device="cpu", quant="int8")
    q4, _ = load(device="cpu", quant="int4")
    assert q8.quant == "int8" and isinstance(q8.lm_head, QuantLinear)
    assert q8.embed_tokens.weight.dtype == torch.float32, "the embeddings stay float"
    full = weight_bytes(model)
    assert weight_bytes(q8) < 0.3 * full and weight_bytes(q4) < weight_bytes(q8)
    with pytest.raises(ValueError, match="quant must be one of float, int8, int4, gguf"):
        load(device="cpu", quant="int3")
    with pytest.raises(ValueError, match="quant='gguf' keeps a GGUF file's own blocks"):
        load(device="cpu", quant="gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_blocks_are_kept_and_read_back_as_gguf_reads_them(tmp_path, arch):
    """A model whose matrices are Q8_0, Q4_0 and Q4_1 blocks (a Llama's q and k rows permuted
    as llama.cpp writes them): with quant="gguf" each linear layer keeps its blocks, and
    de-quantized they equal gguf's own de-quantization, which the float load holds; the logits
    then agree with the float load's (computed by the eager kernel: the CPU's default kernels
    round the activations too)."""
    peer = tiny_peer(arch, hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    floats = gguf_tensors(peer, arch)
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
    mats = [n for n, p in peer.state_dict().items() if p.dim() == 2 and n != "lm_head.weight"]
    stored = {}
    for i, name in enumerate(mats):
        kind = kinds[i % 3]
        stored[gguf_name(name)] = (gguf.quants.quantize(floats[gguf_name(name)], kind), kind)
    meta = {**arch_metadata(arch, peer.config), **bundled_vocabulary()}
    write_gguf(tmp_path / "q.gguf", arch, meta, {**floats, **stored})
    plain, _ = tinyllm.load(tmp_path / "q.gguf", device="cpu")
    kept, _ = load(tmp_path / "q.gguf", device="cpu", quant="gguf")
    assert kept.quant == "gguf"
    layers = {n: m for n, m in kept.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == len(mats), "every matrix but the embeddings, and the head tied to them"
    assert kept.embed_tokens.weight.dtype == torch.float32
    for name, layer in layers.items():
        want = plain.get_submodule(name).weight.detach()
        assert torch.equal(layer.dequantized(torch.float32), want), name
    for layer in layers.values():
        layer.kernel = "eager"
    ids = torch.randint(0, 2048, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids)[0], plain(ids)[0], rtol=1e-4, atol=1e-4)


# ---- the oracle --------------------------------------------------------------------------------
MODELS = {
    "int8": quantize(make_tiny(seed=13), "int8"),  # int8mm on the CPU
    "int4": quantize(make_tiny(seed=13), "int4", kernel="eager"),
}


@st.composite
def workloads(draw):
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        prompt = draw(st.lists(st.integers(1, 96), min_size=1, max_size=20))
        temp = draw(st.sampled_from([0.0, 0.0, 1.0]))
        s = Sampling(temperature=temp, seed=draw(st.integers(0, 99)) if temp else None)
        reqs.append(Request(prompt, draw(st.integers(1, 16)), eos_id=0, sampling=s))
    return reqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(sorted(MODELS)), reqs=workloads(), n_slots=st.integers(1, 4),
       data=st.data())  # fmt: skip
def test_every_engine_on_a_quantized_model_gives_the_solo_tokens(mode, reqs, n_slots, data):
    """Static batching, and the continuous engine on slots or a tight paged pool (preemption),
    with a token budget (chunks), a prefix cache and (greedy) speculation: each request's
    tokens are its solo run's on the same quantized model (float64), nothing left behind."""
    model = MODELS[mode]
    want = [solo(model, r).tokens for r in reqs]
    static, _ = run_static(model, reqs, n_slots)
    assert [r.tokens for r in static] == want, f"{mode}: static batching differs from solo"
    kw = dict(
        kv=data.draw(st.sampled_from(["slots", "paged"])),
        max_step_tokens=data.draw(st.sampled_from([None, n_slots + 3])),
    )
    if all(r.sampling.temperature == 0 for r in reqs):  # sampled: the same law, other draws
        kw["speculate"] = data.draw(st.sampled_from([None, "ngram"]))
    if kw["kv"] == "paged":
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens + 1) / 4) for r in reqs)
        kw.update(block_size=4, kv_blocks=need + data.draw(st.integers(0, 3)),
                  prefix_cache=data.draw(st.booleans()))  # fmt: skip
    eng = make_engine(model, n_slots, **kw)
    rids = [eng.add_request(r) for r in reqs]
    while eng.has_work():
        eng.step()
        assert eng.cache.check_integrity() is None
    assert eng.cache.check_integrity(idle=True) is None and not eng._seqs
    for i, rid in enumerate(rids):
        got = eng.results.pop(rid).tokens
        assert got == want[i], f"{mode} request {i}: {got}, solo {want[i]} ({kw})"


def test_quantized_models_stay_near_the_float_models_distribution(bundled):
    """On text the float model samples (its own distribution; no corpus needed), the mean KL
    divergence of each quantized model's next-token distribution from the float model's:
    small for int8, larger for int4."""
    model, tok = bundled
    prompt = tok.encode("Ham.\n")
    text = solo(model, Request(prompt, 120, sampling=Sampling(temperature=1.0, seed=0))).tokens
    ids = torch.tensor([prompt + text])
    with torch.no_grad():
        ref = model(ids)[0].log_softmax(-1)
        kl = {}
        for mode in ("int8", "int4"):
            q = load(device="cpu", quant=mode)[0]
            kl[mode] = (ref.exp() * (ref - q(ids)[0].log_softmax(-1))).sum(-1).mean().item()
    assert kl["int8"] < 0.01 and kl["int8"] < kl["int4"] < 0.1, kl


@pytest.mark.parametrize("vnni", [True, False])
def test_an_int8_product_compiles_whole(vnni, monkeypatch):
    """int8mm's product of more rows than a decode step's, inside torch.compile with no graph
    break, as a compiled decode step runs it: the same result as eager. With 8-bit integer
    instructions it is int8_matmul's; without, the C loop takes any rows."""
    monkeypatch.setattr(quant, "_integer", vnni)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 8, bias=False), "int8", kernel="int8mm")
    assert (layer.c_kernel(torch.empty(20, 64)) is None) == (vnni or not cpu_kernels.available())
    x = torch.randn(20, 64)  # more rows than FUSED_ROWS
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-4, atol=1e-4)
