"""Step 13 - quantized weights: a linear layer that keeps its weight in 8 or 4 bits.

A decode step's time is about the weights' bytes over the memory's bandwidth: fewer bytes per
weight, fewer bytes per token. A weight is stored as a small integer q and read back as
q * scale + zero, its group's scale and zero point (as gpt-fast and llama.cpp do it).
`QuantLinear` holds W (N, K) in groups of `group_size` along K: int8 per output channel
(`quantize_int8`), int4 in groups of 32 with their minimum and step (`quantize_int4`, in GGUF's
nibble layout), and GGUF's Q8_0, Q4_0 and Q4_1 blocks as the file has them (`from_gguf`).
`QuantLinear.kernel` is one of five ways to compute y = x W^T: "int8mm", "int4a8" and "int8a8"
(on a CPU) quantize the activations too and multiply integers, as llama.cpp's products do
(cpu_kernels' C loops for a few rows); "fused" (elsewhere) reads each weight once, as its
integer (torch.compile of `fused_matmul`), or de-quantizes once for many rows; "eager"
de-quantizes every time, the reference the others are checked against. Each row's result
depends on that row alone in all five. The embeddings stay in float; a head tied to them gets a
quantized copy of its own.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from tinyllm.ext import cpu_kernels

MODES = ("float", "int8", "int4", "gguf")
FUSED_ROWS = 16         # rows (tokens in a step) up to which the fused loop runs
KERNELS = ("auto", "int8mm", "int4a8", "int8a8", "fused", "eager")
_compiled: dict = {}    # a function -> compiled (compiled(fn)), one program per shape it meets


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (N, K) float -> q (N, K) int8 and scale (N, 1) float16: one scale per output channel
    (row), its largest magnitude over 127 (symmetric, no zero point; at least 1e-4, so that a
    row of zeros has a step), rounded to float16; q = round(w / scale), within -127 .. 127.
    Example: w [[0.5, -1.27, 0.0]] -> scale [[0.01]] (as float16), q [[50, -127, 0]]."""
    scale = (w.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-4).half()
    return torch.round(w / scale.to(w.dtype)).clamp(-127, 127).to(torch.int8), scale


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
    wg = w.reshape(N, K // group_size, group_size)
    zero = wg.amin(-1).half()
    scale = ((wg.amax(-1) - zero.to(w.dtype)) / 15).clamp(min=1e-4).half()
    steps = (wg - zero.to(w.dtype)[..., None]) / scale.to(w.dtype)[..., None]
    q = torch.round(steps).clamp(0, 15).to(torch.uint8)
    half = group_size // 2
    return q[..., :half] | (q[..., half:] << 4), scale, zero


def unpack_int4(q: Tensor) -> Tensor:
    """(N, G, g / 2) uint8 -> (N, G, g) uint8 values 0 .. 15: the low nibbles, then the high."""
    return torch.cat([q & 15, q >> 4], dim=-1)


def dequantize(bits: int, q: Tensor, scale: Tensor, zero: Tensor | None, K: int,
               dtype: torch.dtype) -> Tensor:
    """The float weight (N, K) in dtype from a layer's integers: bits 8, q (N, K) int8; bits
    4, q (N, G, g / 2) uint8 as quantize_int4 packs it; scale (N, G) and zero (N, G) or None
    (no zero point), float16 or any float; K = G * g. W[n, k] = q * scale + zero of k's group
    (g = K / G weights each), computed in dtype.
    Example: bits 4, q [[[240, 72]]], scale [[0.2]], zero [[0.0]], K 4 -> [[0.0, 1.6, 3.0, 0.8]]
    (values 0, 8, 15, 4 times 0.2)."""
    N, G = scale.shape
    values = (q if bits == 8 else unpack_int4(q)).reshape(N, G, -1).to(dtype)
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
    if bits == 4:                   # each half-group's weights made in registers, then used
        half, qi = q.size(-1), q.to(torch.int32)        # int32: the nibbles' shifts vectorize
        low, high = (qi & 15).to(x.dtype), (qi >> 4).to(x.dtype)          # (N, G, g / 2)
        if zero is not None:
            low = low * scale[..., None] + zero[..., None]
            high = high * scale[..., None] + zero[..., None]
            return (xg[..., :half] * low + xg[..., half:] * high).sum((-1, -2))    # (M, N)
        dots = (xg[..., :half] * low + xg[..., half:] * high).sum(-1)     # (M, N, G)
    else:
        dots = (xg * q.reshape(1, N, G, -1).to(x.dtype)).sum(-1)           # (M, N, G)
    y = (dots * scale).sum(-1)                                             # (M, N)
    if zero is not None:
        y = y + (xg.sum(-1) * zero).sum(-1)
    return y


def compiled(fn):
    """fn compiled by torch.compile for fixed shapes (a loop specialised to its sizes is the
    fast one), once per process and function, with room for a program per shape it meets (a
    model's layer shapes times its row buckets: torch.compile's default of 8 would fall back
    to eager without saying so)."""
    if fn not in _compiled:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), 256))
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


def tracing() -> bool:
    """Whether the code runs to be traced into a compiled program (by torch.compile, or by
    make_fx for the piecewise decoder's programs), where a compiled loop is written inline: a
    compiled function cannot be called from inside another's tracing."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def padded_rows(t: Tensor) -> Tensor:
    """t with its rows (first dimension) padded with zeros to the next power of two: a
    compiled program for 1, 2, 4, 8, ... rows serves every batch."""
    rows = 1 << (t.size(0) - 1).bit_length()
    return t if rows == t.size(0) else torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


def compiled_matmul(x: Tensor, q: Tensor, scale: Tensor, zero: Tensor | None, bits: int):
    """fused_matmul compiled (an exercise's own too), x's rows padded to a power of two: a
    model compiles a program per layer shape for 1, 2, 4, 8 and 16 rows at most, each on first
    use (a second or two)."""
    return compiled(fused_matmul)(padded_rows(x), q, scale, zero, bits)[:x.size(0)]


def c_kernels(x2: Tensor, any_rows: bool = False) -> bool:
    """Whether the C kernels (cpu_kernels) compute a product of x2 (M, K): a few rows
    (FUSED_ROWS at most, or any number with any_rows) of float32 on a CPU, the kernels
    compiled."""
    return (0 < x2.size(0) and (any_rows or x2.size(0) <= FUSED_ROWS)
            and x2.dtype == torch.float32 and x2.device.type == "cpu" and cpu_kernels.available())


def rounded_activations(x: Tensor, group_size: int) -> Tensor:
    """x (M, K) with each group of group_size along K rounded to 255 steps: its largest
    magnitude over 127 (at least 1e-30) is the step, a value becomes round(x / step) * step,
    what the int4a8 kernel computes with (an int8 and the group's step).
    Example: x [[1.27, -0.5, 0.004]], group_size 3 -> step 0.01: [[1.27, -0.5, 0.0]]."""
    M, K = x.shape
    xg = x.reshape(M, K // group_size, group_size)
    step = xg.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
    return (torch.round(xg / step) * step).reshape(M, K)


# float32 holds every integer up to 2**24 exactly, so a float32 product of int8 values is
# exact while each sum of |products| stays within it: K of 1,024 at most (1024 * 127 * 128)
EXACT_K = 1024


def int_matmul(xq: Tensor, q: Tensor) -> Tensor:
    """xq (M, K) int8 @ q (N, K)^T int8 -> (M, N) int32, exact. torch._int_mm where the
    machine multiplies 8-bit integers fast (a GPU; a CPU with VNNI or AMX); on other CPUs its
    fallback is a plain loop (on a 2-core AMD EPYC with AVX2, 15 times slower than float32's
    product), so there the library's float32 product computes it, EXACT_K columns at a time:
    every partial sum is an integer within 2**24, exact in any order of additions, and the
    slices add in int32. The same integers either way. Traced into a compiled program, it is
    torch._int_mm: the precision setting that decides the other path cannot be read there."""
    if xq.device.type != "cpu" or tracing() or fast_int_mm():
        return torch._int_mm(xq, q.T)
    acc = None
    for k in range(0, xq.size(1), EXACT_K):
        part = (xq[:, k:k + EXACT_K].float() @ q[:, k:k + EXACT_K].float().T).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def fast_int_mm() -> bool:
    """Whether torch._int_mm is the CPU's integer product: the CPU multiplies 8-bit integers
    in one instruction (VNNI's dpbusd, AMX's tiles), or the library's float32 products may
    round (a precision below the default "highest")."""
    return integer_instructions() or torch.get_float32_matmul_precision() != "highest"


_integer: bool | None = None  # integer_instructions(), read once


def integer_instructions() -> bool:
    """Whether this CPU has VNNI or AMX's 8-bit integer instructions: the CPU's flags, read once
    (a QuantLinear reads them when it is made)."""
    global _integer
    if _integer is None:
        flags = cpu_kernels.cpu_flags()
        _integer = cpu_kernels.integer_path(flags) in ("AVX-512 VNNI", "AVX-VNNI") or (
            "amx_int8" in flags
        )
    return _integer


def int8_matmul(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (M, K) @ W^T for an int8 weight of one scale per row (q (N, K), scale (N, 1)), with
    x quantized too, row by row (its largest magnitude over 127): an integer matrix product
    (int_matmul, exact in int32), then both scales. llama.cpp's Q8_0 products quantize the
    activations the same way. Each row's result depends on that row alone."""
    sx = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127                # (M, 1)
    xq = torch.round(x / sx).to(torch.int8)                                   # (M, K)
    return int_matmul(xq, q).to(x.dtype) * (sx * scale.to(x.dtype).T)          # (M, N)


class QuantLinear(nn.Module):
    """y = x W^T (+ bias), W (out_features, in_features) kept quantized (see the module's
    docstring for the layouts). kernel: "int8mm" (8 bits, one scale per row: the activations
    quantized too, an integer product), "int4a8" (4 bits: the activations rounded to int8 by
    group, an integer product), "int8a8" (the same for 8 bits in groups), "fused" (a few
    rows: the compiled loop over the bytes; more: de-quantize, then the library's product),
    "eager" (de-quantize every time), or "auto": int8mm, int4a8 or int8a8 where they apply on
    a CPU, else fused."""

    def __init__(self, bits: int, q: Tensor, scale: Tensor, zero: Tensor | None,
                 in_features: int, bias: Tensor | None = None, kernel: str = "auto"):
        super().__init__()
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.bits, self.in_features, self.kernel = bits, in_features, kernel
        self.out_features, groups = scale.shape
        self.group_size = in_features // groups
        if kernel == "int8mm" and (bits != 8 or groups != 1):
            raise ValueError("kernel 'int8mm' needs 8 bits and one scale per row (int8 per "
                             "output channel), not groups")
        if kernel == "int4a8" and (bits != 4 or zero is None):
            raise ValueError("kernel 'int4a8' needs 4 bits with zero points")
        if kernel == "int8a8" and (bits != 8 or zero is not None):
            raise ValueError("kernel 'int8a8' needs 8 bits without zero points")
        cpu_kernels.available()        # built (or found wanting) now, not inside a compile
        integer_instructions()         # the CPU's flags read now, not inside a compile
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", None if bias is None else bias.detach())

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, group_size: int = 32,
                    kernel: str = "auto") -> "QuantLinear":
        """A float layer quantized: mode "int8" (per output channel) or "int4" (groups of
        group_size along the input, halved until they divide its width)."""
        w = linear.weight.detach()
        if mode == "int8":
            q, scale = quantize_int8(w)
            return cls(8, q, scale, None, w.size(1), linear.bias, kernel)
        if group_size < 2 or group_size & (group_size - 1):
            raise ValueError(f"group_size must be a power of two, at least 2, got {group_size}")
        while w.size(1) % group_size:                   # a row of 688 weights: groups of 16
            group_size //= 2
        q, scale, zero = quantize_int4(w, group_size)
        return cls(4, q, scale, zero, w.size(1), linear.bias, kernel)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The de-quantized weight (N, K) in dtype."""
        return dequantize(self.bits, self.q, self.scale, self.zero, self.in_features, dtype)

    def nbytes(self) -> int:
        """The bytes a product reads: the integers, the scales and the zero points."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero)
                   if t is not None)

    def kernel_for(self, x: Tensor) -> str:
        """The kernel that computes this layer's product of x: self.kernel, or the one "auto"
        picks for x's device."""
        if self.kernel != "auto":
            return self.kernel
        if x.device.type != "cpu":
            return "fused"
        if self.bits == 8 and self.zero is None:
            return "int8mm" if self.group_size == self.in_features else "int8a8"
        return "int4a8" if self.bits == 4 and self.zero is not None else "fused"

    def c_kernel(self, x2: Tensor) -> str | None:
        """Which C kernel (cpu_kernels) computes the product of x2 (M, K), or None: int8mm's,
        int4a8's and int8a8's up to FUSED_ROWS rows, in float32 on a CPU, the kernels
        compiled; int8mm's for any rows where the CPU has no 8-bit integer instructions
        (integer_instructions): there the C loop's tiles of rows (AVX2's madd) outrun the library's
        float32 product at every row count, a prefill's too."""
        kernel = {"int8mm": "int8_gemv", "int4a8": "int4_gemv",
                  "int8a8": "int8g_gemv"}.get(self.kernel_for(x2))
        any_rows = kernel == "int8_gemv" and not integer_instructions()
        return kernel if kernel is not None and c_kernels(x2, any_rows) else None

    def forward(self, x: Tensor) -> Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)                                              # (M, K)
        c_kernel = self.c_kernel(x2)
        if c_kernel is not None:
            return c_product(c_kernel, x2, [self])[0].reshape(*lead, self.out_features)
        kernel, rows = self.kernel_for(x2), x2.size(0)
        zero = None if self.zero is None else self.zero.to(x.dtype)
        if kernel == "int8mm":
            y = int8_matmul(x2, self.q, self.scale)
        elif kernel in ("int4a8", "int8a8"):   # a prefill, or no C: the same product, the library's
            y = F.linear(rounded_activations(x2, self.group_size), self.dequantized(x.dtype))
        elif kernel == "fused" and tracing():                    # inlined in a compiled step
            y = fused_matmul(x2, self.q, self.scale.to(x.dtype), zero, self.bits)
        elif kernel == "fused" and 0 < rows <= FUSED_ROWS:
            y = compiled_matmul(x2, self.q, self.scale.to(x.dtype), zero, self.bits)
        else:
            y = F.linear(x2, self.dequantized(x.dtype))
        y = y if self.bias is None else y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, kernel={self.kernel}")


def c_product(kernel: str, x2: Tensor, layers: list[nn.Module]) -> list[Tensor]:
    """x2 (M, K) through layers whose c_kernel is kernel, in one call of it -> each layer's
    output (M, N_i), biases added (else views of one (M, N_1 + N_2 + ...))."""
    if kernel == "float_gemv":
        lists = [[m.weight for m in layers]]
    elif kernel == "int4_gemv":
        lists = [[m.q for m in layers], [m.scale for m in layers], [m.zero for m in layers]]
    else:
        lists = [[m.q for m in layers], [m.scale for m in layers]]
    y = getattr(torch.ops.tinyllm, kernel)(x2, *lists)           # a strided x2: copied there
    ys = y.split([m.out_features for m in layers], dim=-1)
    return [y if m.bias is None else y + m.bias for y, m in zip(ys, layers)]


def projections(x: Tensor, layers: list[nn.Module]) -> list[Tensor]:
    """Layers that read the same x (..., K) (q, k and v; gate and up) -> their outputs: in one
    call of a C kernel when they all run the same one (x read, and quantized, once; one
    call's cost instead of several: vLLM merges such layers into one weight), else one layer
    at a time."""
    x2 = x.reshape(-1, x.size(-1))                                        # (M, K)
    kernels = {m.c_kernel(x2) if isinstance(m, (QuantLinear, GemvLinear)) else None
               for m in layers}
    groups = {getattr(m, "group_size", None) for m in layers}           # a GemvLinear: None
    if None in kernels or len(kernels) > 1 or len(groups) > 1:
        return [m(x) for m in layers]
    return [y.reshape(*x.shape[:-1], y.size(-1)) for y in c_product(kernels.pop(), x2, layers)]


GGUF_BLOCKS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}     # bytes per block of 32 weights


def from_gguf(kind: str, blocks: Tensor, bias: Tensor | None = None,
              kernel: str = "auto") -> QuantLinear:
    """A GGUF tensor's blocks, kept as they are: blocks (N, G * block bytes) uint8, the rows
    of a (N, K = 32 G) weight. Q8_0: a float16 scale d and 32 int8, W = d q; Q4_0: d and 16
    bytes of nibbles, W = d (q - 8); Q4_1: d, a float16 minimum m and the nibbles, W = d q + m.
    The float weight is then what llama.cpp (and the gguf package) de-quantize, bit for bit."""
    N = blocks.size(0)
    b = blocks.reshape(N, -1, GGUF_BLOCKS[kind])                           # (N, G, bytes)
    d = b[..., :2].contiguous().view(torch.float16)[..., 0]                # (N, G)
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(N, -1)        # (N, K)
        return QuantLinear(8, q, d, None, q.size(1), bias, kernel)
    if kind == "Q4_0":
        return QuantLinear(4, b[..., 2:].contiguous(), d, -8 * d, b.size(1) * 32, bias, kernel)
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
    return QuantLinear(4, b[..., 4:].contiguous(), d, m, b.size(1) * 32, bias, kernel)


class GemvLinear(nn.Linear):
    """A float linear layer whose product of a few rows (a decode step, FUSED_ROWS at most, in
    float32 on a CPU) is cpu_kernels' C loop instead of the math library's, which reads
    float32 at a fraction of the memory's speed there: one weight row at a time, each row of
    x summed in one order, so a row's result does not depend on the rows beside it. More rows
    (a prefill), another dtype or device, or no C compiler: the library's product."""

    def c_kernel(self, x2: Tensor) -> str | None:
        """"float_gemv" where the C loop computes the product of x2 (M, K), else None."""
        if c_kernels(x2) and self.weight.is_contiguous():
            return "float_gemv"
        return None

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))                                    # (M, K)
        if self.c_kernel(x2) is None:
            return super().forward(x)
        return c_product("float_gemv", x2, [self])[0].reshape(*x.shape[:-1], self.out_features)


def linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every (parent, attribute name, nn.Linear) of a model: its projections and its head."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def quantize(model: nn.Module, mode: str, group_size: int = 32, kernel: str = "auto"):
    """Replace every linear layer of the model, in place: by its QuantLinear (mode "int8" or
    "int4"; a head tied to the embeddings gets its own quantized copy), or (mode "float") by a
    GemvLinear sharing its weight. Returns the model."""
    if mode not in ("float", "int8", "int4"):
        raise ValueError(f"quantize's mode must be 'float', 'int8' or 'int4' (a GGUF file's "
                         f"own blocks load with tinyllm.build.load(path, quant='gguf')), got "
                         f"{mode!r}")
    for parent, name, linear in linears(model):
        if mode == "float":
            gemv = GemvLinear(linear.in_features, linear.out_features, linear.bias is not None,
                              device="meta")
            gemv.weight, gemv.bias = linear.weight, linear.bias
            setattr(parent, name, gemv)
        else:
            setattr(parent, name, QuantLinear.from_linear(linear, mode, group_size, kernel))
    model.quant = mode
    return model


def weight_bytes(model: nn.Module) -> int:
    """The bytes of weights a decode step reads: every product's weight (quantized or not)
    and the norms; of the embeddings only a row per token, so none of the table."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes()
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif not isinstance(module, nn.Embedding):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total
