"""Exercise 13 - quantized weights: a weight matrix kept as small integers, a scale and a zero
point per group, read back as q * scale + zero, and the product that reads the integers without
the float matrix.

Four seams of the reference package, all in `tinyllm.ext.quant`:
- `quantize_int8` gives each output channel (a row of W) one float16 scale, its largest
  magnitude over 127, and each weight the nearest integer step, within -127 .. 127;
- `quantize_int4` cuts each row into groups along the input (32 weights by default), spans
  each group from its minimum (the zero point) to its maximum in 15 steps, and packs the
  values 0 .. 15 two a byte as GGUF's Q4_1 blocks hold them: the first half of a group in the
  low nibbles, the second half in the high;
- `dequantize` reads the float weight back from the integers, q * scale + zero, in the dtype
  the layer computes in;
- `fused_matmul` computes x W^T from the integers directly, group by group: the scale times
  the integers' dot product with x, plus the zero point times the sum of x over the group, so
  that W never exists in float.

The engine calls them through `QuantLinear`. `tinyllm.load(quant="int8" | "int4")` (and
`quant.quantize(model, mode)`) replaces every linear layer by `QuantLinear.from_linear`, which
calls your quantize_int8 or quantize_int4; the layer's "eager" kernel, and its "fused" kernel
for a prefill's many rows, call your dequantize and then the library's product; its "fused"
kernel for a few rows (a decode step, FUSED_ROWS at most) runs your fused_matmul compiled by
torch.compile (`compiled_matmul`, one program per layer shape), or inlined into the step's
compiled pieces with decoder="pieces" (13, `piecewise`). The "int8mm" kernel (int8 per
output channel on a CPU: the activations quantized too, an integer product) is the package's
own and not part of the exercise.

Check your work with `make check EX=13` (or `check_exercise("13")` in notebook 13). The tests
compare your integers and scales with the package's bit for bit (and your 4-bit groups with
what the gguf package reads as Q4_1 blocks), your weights and products with the de-quantized
float ones, eagerly and compiled, then plug your functions into `tinyllm.load` and into
`ContinuousEngine` on a paged pool, and compare every request's tokens with its solo run on
the package's quantized model.
"""

import torch
from torch import Tensor


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (N, K) float -> q (N, K) int8 and scale (N, 1) float16: one scale per output channel
    (row), its largest magnitude over 127 (symmetric, no zero point; at least 1e-4, so that a
    row of zeros has a step), rounded to float16; q = round(w / scale), within -127 .. 127.
    Example: w [[0.5, -1.27, 0.0]] -> scale [[0.01]] (as float16), q [[50, -127, 0]]."""
    scale = (w.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-4).half()    # (N, 1)
    q = torch.round(w / scale.to(w.dtype)).clamp(-127, 127)                  # (N, K)
    return q.to(torch.int8), scale


def quantize_int4(w: Tensor, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """w (N, K) float -> q (N, G, group_size / 2) uint8, scale and zero (N, G) float16, as
    GGUF's Q4_1 blocks hold them: each group of group_size weights along K (G = K / group_size)
    spans its minimum (zero, rounded to float16) to its maximum in 15 steps (scale = (max -
    zero) / 15, at least 1e-4, rounded to float16); a weight's value is
    round((w - zero) / scale), within 0 .. 15; byte j of a group holds value j in its low four
    bits and value j + group_size / 2 in its high four.
    Example: w [[0.0, 1.5, 3.0, 0.75]], group_size 4 -> zero [[0.0]], scale [[0.2]], values
    [0, 8, 15, 4], q [[[0 + 16 * 15, 8 + 16 * 4]]] = [[[240, 72]]]."""
    N, K = w.shape
    wg = w.reshape(N, K // group_size, group_size)                          # (N, G, g)
    zero = wg.amin(-1).half()                                               # (N, G)
    scale = ((wg.amax(-1) - zero.to(w.dtype)) / 15).clamp(min=1e-4).half()  # (N, G)
    steps = (wg - zero.to(w.dtype)[..., None]) / scale.to(w.dtype)[..., None]
    q = torch.round(steps).clamp(0, 15).to(torch.uint8)                     # (N, G, g)
    half = group_size // 2
    return q[..., :half] | (q[..., half:] << 4), scale, zero                 # (N, G, g / 2)


def dequantize(bits: int, q: Tensor, scale: Tensor, zero: Tensor | None, K: int,
               dtype: torch.dtype) -> Tensor:
    """The float weight (N, K) in dtype from a layer's integers: bits 8, q (N, K) int8; bits
    4, q (N, G, g / 2) uint8 as quantize_int4 packs it; scale (N, G) and zero (N, G) or None
    (no zero point), float16 or any float; K = G * g. W[n, k] = q * scale + zero of k's group
    (g = K / G weights each), computed in dtype.
    Example: bits 4, q [[[240, 72]]], scale [[0.2]], zero [[0.0]], K 4 -> [[0.0, 1.6, 3.0, 0.8]]
    (values 0, 8, 15, 4 times 0.2)."""
    N, G = scale.shape
    if bits == 4:
        q = torch.cat([q & 15, q >> 4], dim=-1)                             # (N, G, g)
    values = q.reshape(N, G, -1).to(dtype)                                  # (N, G, g)
    w = values * scale.to(dtype)[..., None]
    if zero is not None:
        w = w + zero.to(dtype)[..., None]
    return w.reshape(N, K)


def fused_matmul(x: Tensor, q: Tensor, scale: Tensor, zero: Tensor | None, bits: int) -> Tensor:
    """x (M, K) @ W^T -> (M, N), for W held as dequantize reads it (q, scale (N, G), zero
    (N, G) or None, bits 8 or 4), without W in float: y[m, n] = sum over groups g of
    scale[n, g] * (x's group g . the integers of row n's group g) + zero[n, g] * (the sum of
    x's group g). Written in whole-tensor operations for torch.compile, which turns them into
    one loop over the weight's bytes; it must equal x @ dequantize(...).T up to rounding.
    Example: x [[1.0, 2.0, 0.0, 1.0]], q and scale, zero as dequantize's example -> [[4.0]]
    (0.2 * (1 * 0 + 2 * 8 + 0 * 15 + 1 * 4) + 0.0 * 4)."""
    M, K = x.shape
    N, G = scale.shape
    xg = x.reshape(M, 1, G, -1)                                            # (M, 1, G, g)
    if bits == 8:
        dots = (xg * q.reshape(1, N, G, -1).to(x.dtype)).sum(-1)           # (M, N, G)
    else:
        half = q.size(-1)
        low, high = (q & 15).to(x.dtype), (q >> 4).to(x.dtype)            # (N, G, g / 2)
        dots = (xg[..., :half] * low + xg[..., half:] * high).sum(-1)     # (M, N, G)
    y = (dots * scale).sum(-1)                                             # (M, N)
    if zero is not None:
        y = y + (xg.sum(-1) * zero).sum(-1)                                # (M, N)
    return y
