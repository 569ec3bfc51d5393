"""Exercise 13 - quantized weights: your quantize_int8 and quantize_int4 give the package's
integers, scales and zero points bit for bit (your 4-bit groups are GGUF's Q4_1 blocks, as the
gguf package reads them), your dequantize gives the package's float weight, and your
fused_matmul the de-quantized product, eagerly and compiled; plugged into tinyllm.load and a
ContinuousEngine on a paged pool, every request gets the tokens of its solo run on the
package's quantized model."""

import copy
import random

import gguf
import numpy as np
import pytest
import torch

from tinyllm.build import load, make_engine
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.course import seams
from tinyllm.course.check import divergence, explained, leaks
from tinyllm.ext.quant import QuantLinear, quantize

EXERCISE = "ex13_quantized_weights"
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64], ids=["float32", "float64"]
)
REF = seams.reference("13")  # the package's own four functions
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def first_difference(want: torch.Tensor, got: torch.Tensor) -> str:
    """'at 3 of 512 places, the first at [2, 5]: expected 17, got 16'."""
    diff = want != got
    at = diff.nonzero()[0].tolist()
    e, g = want[tuple(at)].item(), got[tuple(at)].item()
    return (
        f"at {int(diff.sum())} of {want.numel()} places, the first at {at}: expected {e}, got {g}"
    )


def assert_same(what: str, got, want: torch.Tensor, why: str, whose: str = "the package's") -> None:
    """got is want exactly: a tensor of its dtype and shape, equal bit for bit."""
    assert isinstance(got, torch.Tensor), f"{what} should be a tensor, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what} should be {named(want.dtype)}, got {named(got.dtype)}"
    assert got.shape == want.shape, (
        f"{what} should have shape {tuple(want.shape)}, got {tuple(got.shape)}"
    )
    assert torch.equal(got, want), (
        f"{what} differs from {whose} {first_difference(want, got)} ({why})"
    )


def named(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parts(got, n: int, name: str) -> tuple:
    assert isinstance(got, tuple) and len(got) == n, (
        f"{name} should return a tuple of {n} tensors, got {type(got).__name__}"
    )
    return got


def random_weight(gen, N: int, K: int, dtype) -> torch.Tensor:
    """Rows of magnitudes 1e-3 to 10, every third one off zero, the first a row of zeros and
    the second constant: the rows a real layer brings, and the edges."""
    w = torch.randn(N, K, generator=gen, dtype=torch.float64)
    w = w * 10 ** torch.empty(N, 1, dtype=torch.float64).uniform_(-3, 1, generator=gen)
    offset = torch.randn(N, 1, generator=gen, dtype=torch.float64)
    w = w + offset * (torch.arange(N)[:, None] % 3 == 0)  # every third row off zero
    w[0] = 0.0
    if N > 1:
        w[1] = 0.3
    return w.to(dtype)


# ---- quantize_int8 -----------------------------------------------------------------------------
def test_quantize_int8_the_docstrings_example(impl):
    w = torch.tensor([[0.5, -1.27, 0.0]])
    q, scale = parts(impl.quantize_int8(w), 2, "quantize_int8")
    assert_same(
        "scale", scale, torch.tensor([[0.01]], dtype=torch.float16), "1.27 / 127, as float16"
    )
    assert_same("q", q, torch.tensor([[50, -127, 0]], dtype=torch.int8), "round(w / scale), int8")


@DTYPES
def test_quantize_int8_on_random_matrices(impl, dtype):
    """Random matrices (rows of every size, a row of zeros, a constant row): q and scale are
    the package's bit for bit, of its dtypes and shapes, and w is left as it was."""
    gen = torch.Generator().manual_seed(8)
    for N, K in [(1, 7), (5, 3), (16, 64), (48, 96)]:
        w = random_weight(gen, N, K, dtype)
        before = w.clone()
        q, scale = parts(impl.quantize_int8(w), 2, "quantize_int8")
        want_q, want_scale = REF["quantize_int8"](w)
        where = f"a random ({N}, {K}) {named(dtype)} matrix"
        assert torch.equal(w, before), f"quantize_int8 changed its input w ({where})"
        assert_same(
            f"scale of {where}",
            scale,
            want_scale,
            "each row's largest magnitude / 127, at least 1e-4, then rounded to float16",
        )
        assert_same(
            f"q of {where}",
            q,
            want_q,
            "round(w / scale) with the float16 scale, the one dequantize multiplies by",
        )


def test_quantize_int8_small_rows_and_a_row_of_zeros_get_a_step_of_1e_4(impl):
    """A row of zeros, and a row whose largest magnitude over 127 is below 1e-4: the scale is
    1e-4 (as float16), so q = round(w / 1e-4) and no 0 / 0 turns into NaN."""
    w = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.003, -0.006, 0.0, 0.001]])
    q, scale = parts(impl.quantize_int8(w), 2, "quantize_int8")
    step = torch.tensor(1e-4, dtype=torch.float16)
    assert_same("scale", scale, step.expand(2, 1).clone(), "0 / 127 and 0.006 / 127 are below 1e-4")
    assert_same(
        "q", q, torch.tensor([[0, 0, 0, 0], [30, -60, 0, 10]], dtype=torch.int8), "w / 1e-4"
    )


def test_quantize_int8_the_largest_magnitude_is_127_steps_either_sign(impl):
    """Symmetric: each row's largest magnitude is 127 steps, -127 where it is negative (int8's
    -128 is never used), and -w gives -q with the same scale."""
    gen = torch.Generator().manual_seed(127)
    w = torch.randn(32, 40, generator=gen, dtype=torch.float64)
    w[::2, 0] = -10.0  # rows whose largest magnitude is negative
    q, scale = parts(impl.quantize_int8(w), 2, "quantize_int8")
    top = q.abs().amax(-1)
    assert torch.equal(top, torch.full_like(top, 127)), (
        f"each row's largest magnitude should be q = +-127, rows have {top.tolist()[:6]} ..."
    )
    assert q.min() == -127, f"a row whose largest magnitude is -10 should give -127, got {q.min()}"
    nq, nscale = parts(impl.quantize_int8(-w), 2, "quantize_int8")
    assert torch.equal(nscale, scale) and torch.equal(nq, -q), (
        "quantize_int8(-w) should give -q and the same scale (symmetric, no zero point); it "
        f"differs at {int((nq != -q).sum())} weights and {int((nscale != scale).sum())} scales"
    )


def test_quantize_int8_clamps_a_bfloat16_row_that_rounds_to_128(impl):
    """In bfloat16 (8 bits of mantissa) w / scale can round to 128: 0.7 / (0.7 / 127 as float16)
    is 127.5 there, which rounds to 128. int8 stores 128 as -128, so without the clamp to
    -127 .. 127 the row's largest weight changes sign (the bundled model in bfloat16 has over a
    thousand such weights). float32 and float64 never meet it; bfloat16 weights always may."""
    w = torch.tensor([[0.7, -0.35, 0.1]], dtype=torch.bfloat16)
    before = w.clone()
    q, scale = parts(impl.quantize_int8(w), 2, "quantize_int8")
    assert torch.equal(w, before), "quantize_int8 changed its input w (a bfloat16 row)"
    want_q, want_scale = REF["quantize_int8"](w)
    assert_same(
        "scale of the bfloat16 row [0.7, -0.35, 0.1]",
        scale,
        want_scale,
        "0.7 / 127, rounded to float16",
    )
    assert int(q[0, 0]) == 127, (
        f"the bfloat16 row [0.7, -0.35, 0.1]: w / scale is 127.5 in bfloat16, which rounds to 128; "
        f"q must be clamped to 127, got {int(q[0, 0])}"
        + (
            " (128 stored as int8 wraps to -128: the weight's sign flips)"
            if int(q[0, 0]) < 0
            else ""
        )
    )
    assert_same(
        "q of the bfloat16 row [0.7, -0.35, 0.1]", q, want_q, "round(w / scale) within -127 .. 127"
    )


# ---- quantize_int4 -----------------------------------------------------------------------------
def test_quantize_int4_the_docstrings_example(impl):
    w = torch.tensor([[0.0, 1.5, 3.0, 0.75]])
    q, scale, zero = parts(impl.quantize_int4(w, 4), 3, "quantize_int4")
    f16 = lambda v: torch.tensor([[v]], dtype=torch.float16)  # noqa: E731
    assert_same("zero", zero, f16(0.0), "the group's minimum, as float16")
    assert_same("scale", scale, f16(0.2), "(3.0 - 0.0) / 15, as float16")
    assert_same(
        "q",
        q,
        torch.tensor([[[240, 72]]], dtype=torch.uint8),
        "values 0, 8, 15, 4: byte 0 holds 0 low and 15 high, byte 1 holds 8 low and 4 high",
    )


def layouts(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Byte layouts of (..., g) values 0 .. 15, the right one and the usual mistakes."""
    half = values.size(-1) // 2
    lo, hi = values[..., :half], values[..., half:]
    return {
        "right": lo | hi << 4,
        "swapped": hi | lo << 4,
        "neighbours": values[..., 0::2] | values[..., 1::2] << 4,
        "neighbours, swapped": values[..., 1::2] | values[..., 0::2] << 4,
    }


MISTAKES = {
    "swapped": "your nibbles are swapped: value j goes in the low four bits, j + g / 2 in the high",
    "neighbours": "you packed neighbours (values 2j and 2j + 1) into byte j: GGUF's byte j "
    "holds value j and value j + g / 2",
    "neighbours, swapped": "you packed neighbours into byte j, the second in the low nibble: "
    "GGUF's byte j holds value j (low) and value j + g / 2 (high)",
}


def packing_mistake(q, values: torch.Tensor) -> str | None:
    """Which usual mistake q's bytes are, when they are not values' right layout."""
    packed = layouts(values)
    if not isinstance(q, torch.Tensor) or q.shape != packed["right"].shape:
        return None
    if q.dtype != torch.uint8 or torch.equal(q, packed["right"]):
        return None
    return next((why for name, why in MISTAKES.items() if torch.equal(q, packed[name])), None)


def test_quantize_int4_packs_a_group_as_ggufs_q4_1(impl):
    """A row of two groups of 16 whose values are 0 .. 15 and 15 .. 0 (zero 0 and 10, scale 1
    and 2): byte j of a group holds value j in its low nibble and value j + 8 in its high."""
    first = torch.arange(16, dtype=torch.float64)
    w = torch.cat([first, 10 + 2 * first.flip(0)])[None]  # (1, 32)
    q, scale, zero = parts(impl.quantize_int4(w, 16), 3, "quantize_int4")
    assert_same("scale", scale, torch.tensor([[1.0, 2.0]]).half(), "(max - min) / 15 per group")
    assert_same("zero", zero, torch.tensor([[0.0, 10.0]]).half(), "each group's minimum")
    values = torch.stack([torch.arange(16), torch.arange(16).flip(0)])[None].to(torch.uint8)
    want = layouts(values)
    assert isinstance(q, torch.Tensor) and q.shape == (1, 2, 8) and q.dtype == torch.uint8, (
        f"q should be uint8 of shape (1, 2, 8) (N, G, g / 2), got {q.dtype} {tuple(q.shape)}"
    )
    mistake = packing_mistake(q, values)
    assert mistake is None, f"values 0 .. 15 and 15 .. 0: {mistake}"
    assert torch.equal(q, want["right"]), (
        f"group 0's values 0 .. 15 should pack as {want['right'][0, 0].tolist()} (byte j: value "
        f"j | value j + 8 << 4), group 1's 15 .. 0 as {want['right'][0, 1].tolist()}; yours "
        f"{q[0, 0].tolist()} and {q[0, 1].tolist()}"
    )


@pytest.mark.parametrize("group_size", [32, 16])
@DTYPES
def test_quantize_int4_on_random_matrices(impl, group_size, dtype):
    """Random matrices (rows of every size and offset, a row of zeros, a constant row): q,
    scale and zero are the package's bit for bit, of its dtypes and shapes (q (N, G, g / 2)
    uint8, scale and zero (N, G) float16), and w is left as it was."""
    gen = torch.Generator().manual_seed(4 + group_size)
    for N, K in [(2, group_size), (5, 3 * group_size), (48, 128)]:
        w = random_weight(gen, N, K, dtype)
        before = w.clone()
        q, scale, zero = parts(impl.quantize_int4(w, group_size), 3, "quantize_int4")
        want_q, want_scale, want_zero = REF["quantize_int4"](w, group_size)
        where = f"a random ({N}, {K}) {named(dtype)} matrix in groups of {group_size}"
        assert torch.equal(w, before), f"quantize_int4 changed its input w ({where})"
        assert_same(f"zero of {where}", zero, want_zero, "each group's minimum, as float16")
        assert_same(
            f"scale of {where}",
            scale,
            want_scale,
            "(max - zero) / 15 with zero already float16, at least 1e-4, then float16",
        )
        mistake = packing_mistake(q, torch.cat([want_q & 15, want_q >> 4], -1))
        assert mistake is None, f"q of {where}: {mistake}"
        assert_same(
            f"q of {where}",
            q,
            want_q,
            "values round((w - zero) / scale) with the float16 zero and scale, clamped to 0 .. 15",
        )


def q4_1_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> np.ndarray:
    """GGUF's Q4_1 blocks of a weight (N, K) in groups of 32: per group its scale d and
    minimum m as float16 bytes, then its 16 bytes of nibbles; (N, G * 20) uint8."""
    d = scale.contiguous().view(torch.uint8).reshape(*scale.shape, 2)
    m = zero.contiguous().view(torch.uint8).reshape(*zero.shape, 2)
    return torch.cat([d, m, q], -1).reshape(q.size(0), -1).numpy()


def test_quantize_int4_groups_are_blocks_gguf_reads(impl):
    """Your q, scale and zero for groups of 32, written as GGUF's Q4_1 blocks (d, m, then the
    16 bytes): the gguf package (llama.cpp's reader) reads them back as the package's weight."""
    w = random_weight(torch.Generator().manual_seed(41), 24, 96, torch.float32)
    q, scale, zero = parts(impl.quantize_int4(w, 32), 3, "quantize_int4")
    for name, t, dtype in (("q", q, torch.uint8), ("scale", scale, torch.float16)):
        assert isinstance(t, torch.Tensor) and t.dtype == dtype, f"{name} should be {dtype}"
    assert isinstance(zero, torch.Tensor) and zero.dtype == torch.float16, "zero: float16"
    assert q.shape == (24, 3, 16) and scale.shape == zero.shape == (24, 3), (
        f"a (24, 96) weight in groups of 32 gives q (24, 3, 16), scale and zero (24, 3); yours "
        f"{tuple(q.shape)}, {tuple(scale.shape)}, {tuple(zero.shape)}"
    )
    read = torch.from_numpy(gguf.quants.dequantize(q4_1_blocks(q, scale, zero), Q4_1))
    want = REF["dequantize"](4, *REF["quantize_int4"](w, 32), 96, torch.float32)
    assert read.shape == want.shape and torch.equal(read, want), (
        f"gguf reads your blocks as a weight that differs from the package's "
        f"{first_difference(want, read)} (a block is your scale and zero as float16, then the 16 "
        "bytes of its group: byte j holds value j in its low four bits, j + 16 in its high)"
    )


def test_quantize_int4_a_group_of_zeros_gets_a_step_of_1e_4(impl):
    """Groups whose maximum is their minimum: scale 1e-4 (as float16), no 0 / 0 (NaN)."""
    w = torch.zeros(2, 64)
    q, scale, zero = parts(impl.quantize_int4(w, 32), 3, "quantize_int4")
    assert_same("scale", scale, torch.full((2, 2), 1e-4).half(), "(0 - 0) / 15 is below 1e-4")
    assert_same("zero", zero, torch.zeros(2, 2).half(), "each group's minimum")
    assert_same("q", q, torch.zeros(2, 2, 16, dtype=torch.uint8), "every value (0 - 0) / 1e-4")


# ---- dequantize --------------------------------------------------------------------------------
def test_dequantize_the_docstrings_example(impl):
    q = torch.tensor([[[240, 72]]], dtype=torch.uint8)
    got = impl.dequantize(4, q, torch.tensor([[0.2]]), torch.tensor([[0.0]]), 4, torch.float32)
    want = torch.tensor([[0.0, 1.6, 3.0, 0.8]])
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, (
        f"dequantize(..., dtype float32) should give float32, got {got!r}"
    )
    assert got.shape == (1, 4) and torch.allclose(got, want), (
        f"bits 4, q [[[240, 72]]] (values 0, 8, 15, 4: the low nibbles, then the high), scale "
        f"[[0.2]], zero [[0.0]] should give {want.tolist()}, got {got.tolist()}"
    )
    f16 = torch.tensor([[0.2]]).half(), torch.tensor([[0.0]]).half()
    got = impl.dequantize(4, q, *f16, 4, torch.float32)
    assert isinstance(got, torch.Tensor) and torch.allclose(got, want, atol=1e-3), (
        f"with the float16 scale and zero quantize_int4 returns, the same weight to float16's "
        f"precision, {want.tolist()}: got {got}"
    )


def random_layer(gen, bits: int, N: int, K: int, g: int, with_zero: bool, float16: bool = True):
    """Random integers, scales and zero points of a (N, K) layer in groups of g."""
    G = K // g
    if bits == 8:
        q = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 256, (N, G, g // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(N, G, generator=gen) * 0.1 + 1e-4
    zero = torch.randn(N, G, generator=gen) if with_zero else None
    if float16:
        scale, zero = scale.half(), zero if zero is None else zero.half()
    return q, scale, zero


LAYERS = {  # name: bits, N, K, group size, with a zero point
    "int8 per channel": (8, 24, 64, 64, False),
    "int8 in groups of 32 (Q8_0)": (8, 24, 96, 32, False),
    "int8 with a zero point": (8, 8, 64, 16, True),
    "int4 in groups of 32": (4, 24, 96, 32, True),
    "int4 in groups of 16": (4, 16, 64, 16, True),
    "int4 without a zero point": (4, 8, 64, 32, False),
}


@pytest.mark.parametrize("name", list(LAYERS))
@DTYPES
def test_dequantize_on_random_layers(impl, name, dtype):
    """Random integers, scales (float16, and float32) and zero points (or None): the weight is
    the package's bit for bit, (N, K) in dtype, and q is left as it was."""
    bits, N, K, g, with_zero = LAYERS[name]
    gen = torch.Generator().manual_seed(len(name))
    for float16 in (True, False):
        q, scale, zero = random_layer(gen, bits, N, K, g, with_zero, float16)
        before = q.clone()
        got = impl.dequantize(bits, q, scale, zero, K, dtype)
        want = REF["dequantize"](bits, q, scale, zero, K, dtype)
        assert torch.equal(q, before), f"dequantize changed its input q ({name})"
        assert_same(
            f"the {named(dtype)} weight of {name} ({'float16' if float16 else 'float32'} scales)",
            got,
            want,
            "values * scale (+ zero) of each group, every factor converted to dtype first"
            + (", the values 4 bits each: the low nibbles, then the high" if bits == 4 else ""),
        )


def test_dequantize_reads_gguf_blocks_as_gguf_does(impl):
    """GGUF's own Q8_0 and Q4_1 blocks (as the gguf package quantizes), taken apart as
    tinyllm.ext.quant.from_gguf keeps them: your float32 weight is the gguf package's, bit
    for bit."""
    w = random_weight(torch.Generator().manual_seed(32), 16, 128, torch.float32).numpy()
    for kind, bits, size in ((Q8_0, 8, 34), (Q4_1, 4, 20)):
        blocks = torch.from_numpy(gguf.quants.quantize(w, kind)).reshape(16, 4, size)
        d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]  # (N, G)
        if bits == 8:
            q, zero = blocks[..., 2:].contiguous().view(torch.int8).reshape(16, 128), None
        else:
            q, zero = (
                blocks[..., 4:].contiguous(),
                blocks[..., 2:4].contiguous().view(torch.float16)[..., 0],
            )
        got = impl.dequantize(bits, q, d, zero, 128, torch.float32)
        want = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(16, -1).numpy(), kind))
        why = "values * d + m, d and m" if bits == 4 else "values * d, d"
        why += " made float32 first (the products in float32)"
        assert_same(f"the float32 weight of {kind.name} blocks", got, want, why, whose="gguf's")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_then_dequantize_is_within_half_a_step(impl, mode):
    """Your quantize, then your dequantize (float64): every weight comes back within half a
    step of its group (plus float16's rounding of the zero point, for int4)."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    if mode == "int8":
        q, scale = parts(impl.quantize_int8(w), 2, "quantize_int8")
        back = impl.dequantize(8, q, scale, None, 96, torch.float64)
        bound = scale.double().expand(40, 96) / 2 + 1e-12
    else:
        q, scale, zero = parts(impl.quantize_int4(w, 32), 3, "quantize_int4")
        back = impl.dequantize(4, q, scale, zero, 96, torch.float64)
        bound = scale.double().repeat_interleave(32, 1) / 2 + 2e-3 * w.abs().max()
    assert isinstance(back, torch.Tensor) and back.shape == w.shape, (
        f"dequantize should give the (40, 96) weight back, got {back!r}"
    )
    err = (back - w).abs()
    worst = (err / bound).flatten().argmax().item()
    n, k = divmod(worst, 96)
    assert (err <= bound).all(), (
        f"{mode}: {int((err > bound).sum())} weights come back more than half a step off, e.g. "
        f"w[{n}, {k}] = {w[n, k]:.5f} came back as {back[n, k]:.5f}, a step being "
        f"{2 * (bound[n, k] - (1e-12 if mode == 'int8' else 0)):.5f}"
    )


# ---- fused_matmul ------------------------------------------------------------------------------
def test_fused_matmul_the_docstrings_example(impl):
    x = torch.tensor([[1.0, 2.0, 0.0, 1.0]])
    q = torch.tensor([[[240, 72]]], dtype=torch.uint8)
    got = impl.fused_matmul(x, q, torch.tensor([[0.2]]), torch.tensor([[0.0]]), 4)
    assert (
        isinstance(got, torch.Tensor)
        and got.shape == (1, 1)
        and torch.allclose(got, torch.tensor([[4.0]]))
    ), (
        "x [[1, 2, 0, 1]] with the values 0, 8, 15, 4 (scale 0.2, zero 0) should give [[4.0]] "
        f"(0.2 * (0 + 16 + 0 + 4) + 0 * 4), got {got}"
    )


def fused_hint(got, x, q, scale, zero, bits, K, tol) -> str:
    """What a wrong product matches: the usual mistakes, named."""
    deq = REF["dequantize"]
    close = lambda want: torch.allclose(got, want, **tol)  # noqa: E731
    if zero is not None and close(x @ deq(bits, q, scale, None, K, x.dtype).T):
        return (
            "it is the product without the zero points: add zero[n, g] * (the sum of x's group g)"
        )
    if bits == 4 and close(x @ deq(4, q >> 4 | (q & 15) << 4, scale, zero, K, x.dtype).T):
        return "it is the product with the nibbles swapped: the low four bits are value j"
    return (
        "y[m, n] = sum over groups of scale * (x's group . the integers) + zero * (x's group's sum)"
    )


@pytest.mark.parametrize("name", list(LAYERS))
@DTYPES
def test_fused_matmul_equals_the_de_quantized_product(impl, name, dtype):
    """1, 3 and 8 rows of x against random integers (scale and zero in x's dtype, as
    QuantLinear passes them): your fused_matmul, called as it is (not compiled), equals
    x @ dequantize(...).T to rounding, (M, N) in x's dtype; x and q are left as they were."""
    bits, N, K, g, with_zero = LAYERS[name]
    gen = torch.Generator().manual_seed(len(name) + 1)
    q, scale, zero = random_layer(gen, bits, N, K, g, with_zero)
    scale, zero = scale.to(dtype), zero if zero is None else zero.to(dtype)
    for M in (1, 3, 8):
        x = torch.randn(M, K, generator=gen, dtype=dtype)
        before = x.clone(), q.clone()
        got = impl.fused_matmul(x, q, scale, zero, bits)
        want = x @ REF["dequantize"](bits, q, scale, zero, K, dtype).T
        assert torch.equal(x, before[0]) and torch.equal(q, before[1]), (
            f"fused_matmul changed its input x or q ({name})"
        )
        where = f"{name}, {M} row{'s' if M > 1 else ''} of {named(dtype)}"
        ok = isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == (M, N)
        assert ok, f"{where}: fused_matmul should give ({M}, {N}) {named(dtype)}, got " + (
            f"{named(got.dtype)} {tuple(got.shape)}"
            if isinstance(got, torch.Tensor)
            else f"{got!r}"
        )
        eps = 1e-5 if dtype == torch.float32 else 1e-10
        tol = dict(rtol=eps, atol=eps * float(want.abs().max()))
        assert torch.allclose(got, want, **tol), (
            f"{where}: your product differs from x @ dequantize(...).T by up to "
            f"{float((got - want).abs().max()):.3g} (|y| up to {float(want.abs().max()):.3g}): "
            + fused_hint(got, x, q, scale, zero, bits, K, tol)
        )


def test_fused_matmul_compiled_in_a_quantized_layer(impl, plug):
    """QuantLinear(kernel="fused") runs your fused_matmul through torch.compile for a few rows
    (a decode step): an int4 layer on 3 rows (padded to 4) and an int8 layer in groups of 32
    (GGUF's Q8_0) on 1 row give the de-quantized product. torch.compile must work here: the
    engine's fused kernel is this compiled function."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(8, 64, generator=gen)
    q8, s8 = REF["quantize_int8"](w.reshape(16, 32))  # groups of 32: a scale per 32 weights
    cases = [
        ("int4, groups of 32, 3 rows", 4, REF["quantize_int4"](w, 32), 3),
        ("int8, groups of 32, 1 row", 8, (q8.reshape(8, 64), s8.reshape(8, 2), None), 1),
    ]
    plug("fused_matmul")
    for what, bits, (q, scale, zero), rows in cases:
        layer = QuantLinear(bits, q, scale, zero, 64, kernel="fused")
        x = torch.randn(rows, 64, generator=gen)
        want = x @ REF["dequantize"](bits, q, scale, zero, 64, torch.float32).T
        with explained(f"QuantLinear(kernel='fused') ({what}), torch.compile of your fused_matmul"):
            got = layer(x)
        tol = dict(rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert got.shape == want.shape and torch.allclose(got, want, **tol), (
            f"{what}: compiled, your fused_matmul differs from x @ dequantize(...).T by up to "
            f"{float((got - want).abs().max()):.3g}: "
            + fused_hint(
                got, x, q, scale.float(), None if zero is None else zero.float(), bits, 64, tol
            )
        )


# ---- end to end --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_load_with_your_functions_quantizes_as_the_package_does(plug, mode):
    """load(quant=...) on the bundled model (float64), your functions plugged in: every
    linear layer (the projections and the head) holds the package's integers, scales and zero
    points, bit for bit."""
    want, _ = load(device="cpu", dtype=torch.float64, quant=mode)
    plug()
    with explained(f"load(quant={mode!r}) with your functions"):
        got, _ = load(device="cpu", dtype=torch.float64, quant=mode)
    layers = [(n, m) for n, m in want.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 29, "4 layers of 7 projections, and the head"
    for name, ref in layers:
        mine = got.get_submodule(name)
        shape = f"{ref.out_features} x {ref.in_features}, groups of {ref.group_size}"
        for buf in ("q", "scale", "zero"):
            a, b = getattr(ref, buf), getattr(mine, buf)
            if a is None:
                assert b is None, f"{name} ({mode}): int8 has no zero point, yours is {b!r}"
            else:
                assert_same(f"{name}.{buf} ({mode}, {shape})", b, a, f"your quantize_{mode}")


PROMPTS = ["Ham.\n", "Oph.\nMy lord,", "King.\n", "Hor.\nWhat", "Pol.\n"]


def workload(tok, seed: int) -> list[Request]:
    """Seven requests, greedy and seeded, some ending at EOS."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(7):
        temp = rng.choice([0.0, 0.9])
        s = Sampling(temperature=temp, seed=rng.randrange(1000) if temp else None)
        prompt = tok.encode(rng.choice(PROMPTS))
        reqs.append(Request(prompt, rng.randint(10, 28), eos_id=tok.eos_id, sampling=s))
    return reqs


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_engine_on_your_quantized_model_equals_solo(plug, bundled64, mode):
    """The bundled model (float64) quantized by your functions, every layer de-quantized by
    your dequantize each step (kernel "eager"), in a ContinuousEngine on a paged pool tight
    enough to preempt: every request, greedy or seeded, gets the tokens of its solo run on the
    package's quantized model, and nothing is left behind."""
    model, tok = bundled64
    ref = quantize(copy.deepcopy(model), mode, kernel="eager")
    reqs = workload(tok, 13)
    expected = [solo(ref, r).tokens for r in reqs]
    plug()
    with explained(f"quantize(model, {mode!r}) with your functions"):
        mine = quantize(copy.deepcopy(model), mode, kernel="eager")
    eng = make_engine(mine, 3, kv="paged", block_size=4, kv_blocks=8)
    with explained(f"ContinuousEngine on your {mode} model"):
        rids = [eng.add_request(r) for r in reqs]
        while eng.has_work():
            eng.step()
    for i, (r, want, rid) in enumerate(zip(reqs, expected, rids)):
        seeded = f"seed {r.sampling.seed}" if r.sampling.temperature else "greedy"
        name = f"request {i} ({seeded}) on your {mode} model"
        why = divergence(name, want, eng.results.pop(rid).tokens)
        assert why is None, f"{why} (solo generate on the package's {mode} model)"
    assert eng.stats.preemptions > 0, "the test's pool is tight enough to preempt"
    left = leaks(eng)
    assert left is None, f"after every request finished: {left}"
