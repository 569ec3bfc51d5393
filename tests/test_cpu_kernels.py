"""Step 13 - the C kernels: the float32 one gives F.linear's product up to rounding, the int8
one torch._int_mm's bit for bit, the grouped ones the library's product of the rounded
activations and the same bits on every build, on the machine's vector path (and AVX2's beside
AVX-512's or VNNI's) and on the portable one; a row's result is the same in any batch and with
any number of threads; the layers pick them on a CPU in float32; and every engine on a float
or quantized model still gives each request its solo tokens in float32, where they run."""

import threading
import time
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import MIXED_REQUESTS, make_tiny
from tinyllm.build import make_engine
from tinyllm.core.generate import solo
from tinyllm.ext import cpu_kernels
from tinyllm.ext.quant import (
    GemvLinear,
    QuantLinear,
    dequantize,
    int8_matmul,
    projections,
    quantize,
    quantize_int4,
    quantize_int8,
    rounded_activations,
)

pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None, reason="no C compiler: the kernels cannot be built"
)
PORTABLE = cpu_kernels.build(["-O3"], "tinyllm_portable")  # no -march: the plain C loops
# Where the machine's own build has AVX-512's 16-float vectors or VNNI's integer products,
# AVX2's 8-float vectors and maddubs too
AVX2 = (
    cpu_kernels.build(["-O3", "-mavx2", "-mfma", "-mf16c"], "tinyllm_avx2")
    if torch.backends.cpu.get_cpu_capability() == "AVX512"
    or cpu_kernels.integer_path() in ("AVX-512 VNNI", "AVX-VNNI")
    else None
)
BUILDS = (None, PORTABLE) + ((AVX2,) if AVX2 is not None else ())  # None: the machine's own


def weights(seed: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.1
    w[0] = 0.0  # a row of zeros: the smallest scale
    return w, torch.randn(4, K, generator=g) * 3


@pytest.mark.parametrize("K", [576, 1000])
def test_float_gemv_over_many_tiles_is_the_float_product_and_each_row_its_own(K):
    """A weight of several tiles (about 64 KB of rows each: 29 rows of 576, 17 of 1000), with
    its last tile short and the next tile asked for while each is multiplied: for 1 to 16
    rows of x, and two weights side by side, every row equals F.linear up to rounding and,
    bit for bit, the row computed alone."""
    g = torch.Generator().manual_seed(K)
    ws = [torch.randn(N, K, generator=g) * 0.1 for N in (100, 37)]
    x = torch.randn(16, K, generator=g)
    alone = torch.cat([cpu_kernels.float_gemv(x[i : i + 1].contiguous(), ws) for i in range(16)])
    want = F.linear(x.double(), torch.cat(ws).double())
    torch.testing.assert_close(alone.double(), want, rtol=1e-5, atol=1e-5)
    for M in range(1, 17):
        got = cpu_kernels.float_gemv(x[:M].contiguous(), ws)
        assert torch.equal(got, alone[:M]), f"{M} rows: a row depends on the rows beside it"


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    N=st.integers(1, 70),
    K=st.integers(1, 200),  # K % 16 and K % 8 left over too
    M=st.integers(1, 16),
    threads=st.sampled_from([1, 2]),
)
def test_float_gemv_is_the_float_product_and_each_row_its_own(seed, N, K, M, threads):
    """float_gemv equals F.linear up to rounding; each row's result, bit for bit, is the one
    it gets alone, in a tile of 4 or 2 rows or 1, on any number of threads."""
    w, _ = weights(seed, N, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1))
    want = F.linear(x.double(), w.double())
    alone = torch.cat([cpu_kernels.float_gemv(x[i : i + 1].contiguous(), [w]) for i in range(M)])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for ops in BUILDS:
            got = cpu_kernels.float_gemv(x, [w], ops)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            if ops is None:
                assert torch.equal(got, alone), f"{N}x{K}: a row depends on the {M} rows"
    finally:
        torch.set_num_threads(old)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    N=st.integers(1, 70),
    # torch._int_mm gets K = 1 wrong for N > 1 (torch 2.13); multiples of 16: AVX2's tiles
    K=st.integers(2, 200) | st.sampled_from([16, 48, 96, 176]),
    M=st.integers(1, 16) | st.integers(17, 70),  # a decode step's rows, a prefill's
    threads=st.sampled_from([1, 2]),
)
def test_int8_gemv_is_int_mm_bit_for_bit(seed, N, K, M, threads):
    """int8_gemv equals int8_matmul bit for bit on every build, any rows, any threads: one
    row at a time, by tiles of rows (AVX2 without VNNI), or the portable loop."""
    w, _ = weights(seed, N, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1))
    q, scale = quantize_int8(w)
    want = int8_matmul(x, q, scale)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for ops in BUILDS:
            got = cpu_kernels.int8_gemv(x, [q], [scale], ops)
            assert torch.equal(got, want), f"{N}x{K}, {M} rows, ops {ops}"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("bits", [4, 8])
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    N=st.integers(1, 70),
    groups=st.integers(1, 20),  # 8 and more: the 8-group loops of the AVX2 path
    group_size=st.sampled_from([2, 8, 16, 32, 64]),
    M=st.integers(1, 16),
)
def test_grouped_kernels_are_the_product_of_the_rounded_activations(
    bits, seed, N, groups, group_size, M
):
    """int4_gemv (GGUF's Q4_1 layout) and int8g_gemv (8 bits in groups, GGUF's Q8_0 at 32; any
    int8 value, -128 too) equal the library's product of the rounded activations and the
    de-quantized weight, a row's result does not depend on the batch, and every build the
    machine can run (its own vector path, AVX2's, the plain C loops) gives the same bits."""
    K = groups * group_size
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, K, generator=g)
    if bits == 4:
        q, scale, zero = quantize_int4(weights(seed, N, K)[0], group_size)

        def kernel(x, ops=None):
            return cpu_kernels.int4_gemv(x, [q], [scale], [zero], ops)
    else:
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
        scale, zero = (torch.rand(N, groups, generator=g) * 0.01).half(), None

        def kernel(x, ops=None):
            return cpu_kernels.int8g_gemv(x, [q], [scale], ops)

    rounded = rounded_activations(x, group_size).double()  # rounded in float32, as the kernel does
    want = F.linear(rounded, dequantize(bits, q, scale, zero, K, torch.float64))
    rows = torch.cat([kernel(x[i : i + 1].contiguous()) for i in range(M)])
    mine = kernel(x)
    torch.testing.assert_close(mine.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(mine, rows), "a row's result depends on the batch"
    for ops in BUILDS[1:]:
        assert torch.equal(kernel(x, ops), mine), f"{ops} and {cpu_kernels.integer_path()} part"


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    Ns=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    M=st.integers(1, 16),
    bias=st.booleans(),
)
def test_layers_that_read_the_same_x_in_one_call_give_each_its_own_product(seed, Ns, M, bias):
    """projections: q, k and v (or gate and up) in one call of a kernel equal each layer alone,
    bit for bit (the same loop for each output), biases included; a plain layer among them
    sends all of them one at a time."""
    K = 64
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    for mode in ("float", "int8", "int4", "q8_0"):
        layers = []
        for N in Ns:
            linear = torch.nn.Linear(K, N, bias=bias)
            linear.weight.data.copy_(torch.randn(N, K, generator=g) * 0.1)
            if mode == "float":  # the float32 kernel
                layers.append(quantize(torch.nn.Sequential(linear), "float")[0])
            elif mode == "q8_0":  # 8 bits in groups of 32 (GGUF's Q8_0): the int8a8 kernel
                q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
                scale = (torch.rand(N, K // 32, generator=g) * 0.01).half()
                layers.append(QuantLinear(8, q, scale, None, K, linear.bias))
            else:
                layers.append(QuantLinear.from_linear(linear, mode))
        got = projections(x, layers)
        assert [y.shape for y in got] == [(M, N) for N in Ns]
        for y, layer in zip(got, layers):
            assert torch.equal(y, layer(x)), f"{mode}, {Ns}"
        assert isinstance(layers[0], GemvLinear) == (mode == "float")
        mixed = projections(x, [*layers, _linear(torch.randn(5, K, generator=g))])
        assert all(torch.equal(a, b) for a, b in zip(mixed, got))


def test_rounded_activations_round_each_group_to_its_own_step():
    x = torch.tensor([[1.27, -0.5, 0.004, 100.0, 1.0, -50.0]])
    got = rounded_activations(x, 3)
    torch.testing.assert_close(got[0, :3], torch.tensor([1.27, -0.5, 0.0]))
    step = 100.0 / 127
    torch.testing.assert_close(got[0, 3:], torch.round(x[0, 3:] / step) * step)


def attention_case(seed: int, B: int, n_kv: int, g: int, hd: int, W: int, dtype):
    """A layer's cache of 64 + 2 B rows (a head's rows 32 apart), a decode step's q, k and v,
    each row's write rows (past 64: new) and read rows (random, one of them its new token),
    and a mask that hides random keys but never the new one."""
    gen = torch.Generator().manual_seed(seed)
    rows, hs = 64 + 2 * B * n_kv, 32
    keys, values = (torch.randn(rows, hd, generator=gen, dtype=dtype) for _ in "kv")
    q = torch.randn(B, n_kv, g, hd, generator=gen, dtype=dtype)
    k, v = (torch.randn(B, n_kv, 1, hd, generator=gen, dtype=dtype) for _ in "kv")
    write = 64 + torch.arange(B * n_kv).view(B, n_kv) * 2  # head h: + h * 2
    read = torch.randint(0, hs, (B, W), generator=gen)
    mine = torch.randint(0, W, (B,), generator=gen)  # the new key's j
    read[torch.arange(B), mine] = write[:, 0]
    hidden = torch.rand(B, W, generator=gen) < 0.3
    hidden[torch.arange(B), mine] = False
    mask = torch.zeros(B, W, dtype=dtype).masked_fill(hidden, float("-inf"))
    return keys, values, q, k, v, write, read, 2 if n_kv > 1 else hs, mask


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    B=st.integers(1, 5),
    n_kv=st.integers(1, 3),
    g=st.integers(1, 3),
    hd=st.sampled_from([4, 8, 20, 64, 72, 128]),  # the vector loops' leftovers too
    W=st.integers(1, 40),  # 4 keys at a time, 8 weights at a time: leftovers too
    dtype=st.sampled_from([torch.float32, torch.float64]),
    threads=st.sampled_from([1, 2]),
)
def test_decode_attention_is_sdpa_over_the_rows_it_reads_and_each_row_its_own(
    seed, B, n_kv, g, hd, W, dtype, threads
):
    """decode_attention writes each row's new key and value where write says, then equals
    scaled_dot_product_attention over the keys read says (mask added) up to rounding, on both
    builds, any thread count; each row's result, bit for bit, is the one it gets alone, with
    only its own keys."""
    keys, values, q, k, v, write, read, hs, mask = attention_case(seed, B, n_kv, g, hd, W, dtype)
    want_k, want_v = keys.clone(), values.clone()
    want_k[write.view(-1)], want_v[write.view(-1)] = k.reshape(-1, hd), v.reshape(-1, hd)
    heads = read[:, None, :] + hs * torch.arange(n_kv)[None, :, None]  # (B, n_kv, W)
    K, V, M = want_k[heads].double(), want_v[heads].double(), mask[:, None, None].double()
    want = F.scaled_dot_product_attention(q.double(), K, V, attn_mask=M)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for ops in BUILDS:
            ck, cv = keys.clone(), values.clone()
            got = cpu_kernels.decode_attention(q, k, v, ck, cv, write, read, hs, mask, ops)
            assert torch.equal(ck, want_k) and torch.equal(cv, want_v), "the new rows"
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
            for b in range(B):  # alone: its own keys, up to its last visible one
                n = int((mask[b] == 0).nonzero().max()) + 1
                alone = cpu_kernels.decode_attention(
                    *(t[b : b + 1].contiguous() for t in (q, k, v)), ck, cv, write[b : b + 1],
                    read[b : b + 1, :n].contiguous(), hs, mask[b : b + 1, :n].contiguous(), ops,
                )  # fmt: skip
                assert torch.equal(alone, got[b : b + 1]), f"row {b} depends on the batch"
    finally:
        torch.set_num_threads(old)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    B=st.integers(1, 6),
    n_kv=st.integers(1, 2),
    g=st.integers(1, 3),
    hd=st.sampled_from([8, 18, 40, 64]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_decode_layer_is_the_same_layer_on_every_build(seed, B, n_kv, g, hd, dtype):
    """decode_layer on the portable loops (and AVX2's) computes the machine build's layer up to
    rounding: the layer's output, and the keys and values it writes into the cache."""
    keys, values, _, _, _, write, read, hs, mask = attention_case(seed, B, n_kv, g, hd, 9, dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    d, ff, H = 24, 40, n_kv * g
    shapes = [(d,), (H * hd, d), (n_kv * hd, d), (n_kv * hd, d), (d, H * hd), (d,), (ff, d),
              (ff, d), (d, ff)]  # fmt: skip
    w = [torch.randn(s, generator=gen, dtype=dtype) * 0.3 for s in shapes]
    x = torch.randn(B, d, generator=gen, dtype=dtype)
    angle = torch.rand(B, hd // 2, generator=gen, dtype=dtype) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # (B, hd)
    out = []
    for ops in BUILDS:
        ck, cv = keys.clone(), values.clone()
        y = cpu_kernels.decode_layer(x, w, cos, sin, ck, cv, write, read, hs, mask, H, 1e-5, ops)
        out.append((y, ck, cv))
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    for got in out[1:]:
        for a, b in zip(got, out[0]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("where", ["write", "read"])
def test_decode_attention_refuses_a_row_outside_the_cache_and_writes_nothing(where):
    keys, values, q, k, v, write, read, hs, mask = attention_case(5, 2, 2, 3, 64, 9, torch.float32)
    bad = {"write": write.clone(), "read": read.clone()}
    bad[where][1, 0] = keys.size(0) if where == "write" else keys.size(0) - 1  # head 1: past
    before = keys.clone(), values.clone()
    with pytest.raises(IndexError, match="outside the cache's 72 rows"):
        cpu_kernels.decode_attention(q, k, v, keys, values, bad["write"], bad["read"], hs, mask)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])


def test_the_operators_refuse_what_their_loops_cannot_read():
    """A wrong dtype, shape or layout is an error naming the argument, not a crash or a
    result read from the wrong bytes; an x with other strides is copied, not refused."""
    w, x = weights(1, 8, 64)
    q, scale = quantize_int8(w)
    bad = [
        ((x, [w.double()]), "float_gemv", r"w\[0\] must be Float"),
        ((x, [w.t()]), "float_gemv", r"w\[0\] must be a contiguous CPU tensor"),
        ((x[:, :32].contiguous(), [w]), "float_gemv", r"w\[0\] must hold 8 rows of 32"),
        ((x.long(), [w]), "float_gemv", r"x must be \(M, K\) float32"),
        ((x, [q], [scale.float()]), "int8_gemv", r"scale\[0\] must be Half"),
        ((x, [q, q], [scale]), "int8_gemv", r"scale: 2 tensors expected, got 1"),
        ((x, []), "float_gemv", "the list of weights is empty"),
    ]
    for args, name, message in bad:
        with pytest.raises(RuntimeError, match=message):
            getattr(torch.ops.tinyllm, name)(*args)
    wide = torch.stack([x, x], -1)[..., 0]  # x, every other value of a wider tensor
    assert torch.equal(cpu_kernels.float_gemv(wide, [w]), cpu_kernels.float_gemv(x, [w]))
    keys, values, q, k, v, write, read, hs, mask = attention_case(2, 2, 2, 3, 8, 5, torch.float32)
    with pytest.raises(RuntimeError, match=r"write must be \(B, n_kv\) int64"):
        cpu_kernels.decode_attention(q, k, v, keys, values, write.int(), read, hs, mask)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.decode_attention(q.double(), k, v, keys, values, write, read, hs, mask)


def test_the_sources_ship_with_the_package_and_are_what_build_compiles(tmp_path, monkeypatch):
    """The C and C++ sources and the C files' header are files of the installed package, which
    pyproject's package-data ships, and build() hands those files to the compilers (compilers
    that record what they are given: the C one makes each object, the C++ one fails, so
    nothing is kept)."""
    tomllib = pytest.importorskip("tomllib")
    csrc = resources.files("tinyllm") / "ext" / "csrc"
    sources = sorted(f.name for f in csrc.iterdir() if f.name.endswith((".c", ".h", ".cpp")))
    c_files = ["attention.c", "f32.c", "int4.c", "int8.c", "layer.c"]
    assert sources == sorted([*c_files, "common.h", "ops.cpp"])
    assert [p.name for p in cpu_kernels.sources()] == sorted([*c_files, "common.h"])
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["tinyllm"]
    for name in sources:
        assert any(fnmatch(f"ext/csrc/{name}", pattern) for pattern in shipped), (
            f"{name} not shipped"
        )
    monkeypatch.setenv("TINYLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "FAILURES", [])
    for name, variable, status in (("cc", "CC", 0), ("cxx", "CXX", 1)):
        script = tmp_path / name
        script.write_text(
            f'#!/bin/sh\necho "$@" >> {tmp_path / name}.args\n'
            f'while [ $# -gt 0 ]; do [ "$1" = -o ] && touch "$2"; shift; done\nexit {status}\n'
        )
        script.chmod(0o755)
        monkeypatch.setenv(variable, str(script))
    assert cpu_kernels.build(["-O3"], "tinyllm_probe") is None
    given = (tmp_path / "cc.args").read_text().splitlines()  # a line a call
    assert [line.split()[line.split().index("-c") + 1] for line in given] == [
        str(csrc / name) for name in c_files
    ]
    objects = [line.split()[line.split().index("-o") + 1] for line in given]
    linked = (tmp_path / "cxx.args").read_text().split()
    assert str(csrc / "ops.cpp") in linked and all(o in linked for o in objects)
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_a_step_does_not_wait_for_the_kernels_to_compile(tmp_path, monkeypatch):
    """available(wait=False), as attention asks it in a step: where the cache has no kernels,
    a thread of its own builds them and the answer is False until they are built (the step
    attends with the library meanwhile), one thread however often it is asked; then True."""
    monkeypatch.setenv("TINYLLM_CACHE", str(tmp_path))  # nothing built there
    for variable in ("CC", "CXX"):
        monkeypatch.setenv(variable, "/bin/true")
    monkeypatch.setattr(cpu_kernels, "_built", None)
    monkeypatch.setattr(cpu_kernels, "_builder", None)
    built = threading.Event()
    monkeypatch.setattr(cpu_kernels, "library", lambda: built.wait(10) and cpu_kernels)
    assert not cpu_kernels.loads_now()
    t0 = time.perf_counter()
    assert [cpu_kernels.available(wait=False) for _ in range(3)] == [False] * 3
    builder = cpu_kernels._builder
    assert builder.is_alive() and time.perf_counter() - t0 < 1
    built.set()
    builder.join(10)
    assert cpu_kernels.available(wait=False) is True and cpu_kernels._builder is builder


def test_a_machine_where_the_kernels_do_not_compile_is_told_why(tmp_path, monkeypatch):
    """No build compiles (a compiler that fails): library() is None, with a warning that
    names what the compiler said, and nothing is left in the cache."""
    monkeypatch.setenv("TINYLLM_CACHE", str(tmp_path))
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: no such instruction set' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.warns(UserWarning, match="did not compile here.*no such instruction set"):
        assert cpu_kernels.library.__wrapped__() is None
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_the_layers_pick_the_kernels_in_float32_and_agree_across_row_counts():
    """On a CPU in float32, a float layer and auto's int8 per row and int4 take the C kernels
    for a few rows and the library beyond; both are the same product (int8: bit for bit), so a
    row's result does not depend on how many rows came with it."""
    w, x = weights(3, 40, 64)
    x = torch.cat([x] * 5)  # 20 rows: past FUSED_ROWS
    gemv = quantize(torch.nn.Sequential(_linear(w)), "float")[0]
    assert gemv.c_kernel(x[:16]) == "float_gemv" and gemv.c_kernel(x) is None
    assert gemv.c_kernel(x[:1].double()) is None, "float64 goes to the library"
    torch.testing.assert_close(torch.cat([gemv(x[i : i + 1]) for i in range(20)]), gemv(x))
    for mode in ("int8", "int4", "q8_0"):
        layer = QuantLinear.from_linear(_linear(w), mode if mode != "q8_0" else "int8")
        layer = grouped(layer) if mode == "q8_0" else layer
        many, few = layer(x), torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        if mode == "int8":
            assert torch.equal(many, few)
        else:
            torch.testing.assert_close(many, few, rtol=1e-5, atol=1e-5)
        kernel = {"int8": "int8mm", "int4": "int4a8", "q8_0": "int8a8"}[mode]
        assert layer.kernel_for(x) == kernel
        want = QuantLinear(layer.bits, layer.q, layer.scale, layer.zero, 64, kernel=kernel)(
            x.double()
        )
        torch.testing.assert_close(few.double(), want, rtol=1e-5, atol=1e-5)


def grouped(layer: QuantLinear) -> QuantLinear:
    """An int8 layer with one scale per row held in groups of 32, as GGUF's Q8_0 holds them."""
    groups = layer.in_features // 32
    scale = layer.scale.expand(-1, groups).contiguous()
    return QuantLinear(8, layer.q, scale, None, layer.in_features, layer.bias)


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(w.size(1), w.size(0), bias=False)
    linear.weight.data.copy_(w)
    return linear


REQS = MIXED_REQUESTS[:4]


@pytest.mark.parametrize("mode", ["float", "int8", "int4", "q8_0"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(kv="slots"),
        dict(kv="slots", decoder="pieces"),
        dict(kv="paged", block_size=4, kv_blocks=7, decoder="pieces"),
    ],
    ids=["slots", "slots-pieces", "paged-tight-pieces"],
)
def test_engines_on_the_c_kernels_give_the_solo_tokens_in_float32(mode, kw):
    model = quantize(make_tiny(seed=31).float(), "int8" if mode == "q8_0" else mode)
    if mode == "q8_0":  # every layer's int8 in groups of 32: the int8a8 kernel
        for parent, name, layer in [
            (p, n, c) for p in model.modules() for n, c in p.named_children()
        ]:
            if isinstance(layer, QuantLinear):
                setattr(parent, name, grouped(layer))
    want = [solo(model, r).tokens for r in REQS]
    eng = make_engine(model, 2, **kw)
    rids = [eng.add_request(r) for r in REQS]
    while eng.has_work():
        eng.step()
    assert [eng.results.pop(r).tokens for r in rids] == want
    assert eng.cache.check_integrity(idle=True) is None and not eng._seqs
