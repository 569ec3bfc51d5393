"""Step 13 - matrix-vector kernels in C, for a decode step on a CPU.

A decode step at batch 1 reads each weight once, so its time is the weights' bytes over the
memory's speed, if the loop keeps up. These loops keep up as llama.cpp's do: C with AVX2
(AVX-512 and VNNI where the compiler targets them), plain C elsewhere; the quantized ones
quantize the activations too and multiply integers. The products are `float_gemv` (float32),
`int8_gemv` (int8 per row: torch._int_mm's result, bit for bit), `int4_gemv` (GGUF's 4-bit
groups) and `int8g_gemv` (Q8_0); `decode_attention` is a layer's decode attention, read where
the cache holds the keys (its `layout`, as vLLM's paged attention); `decode_layers` runs the
decoder layers' decode step in one call (fused_layer.py), its weights one `layers(...)` object.
Each product takes the weights that read the same x, so x is read once; every row's result
depends on that row alone, and the integer products give the same bits on every path
(`integer_path()` names the machine's). The loops are csrc/'s C files, a family each (common.h
shares their helpers, as ggml-cpu lays out its sources), made PyTorch operators by ops.cpp;
`library()` compiles them once a machine and loads them (None where nothing compiles).
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from tinyllm.core.config import cache_dir

CSRC = Path(__file__).with_name("csrc")  # the loops' .c files and common.h, ops.cpp (operators)
FAILURES: list[str] = []  # what the compiler said of each build that failed, in this process


def compilers() -> tuple[str, str] | None:
    """The C and C++ compilers: $CC, else cc, gcc or clang, and $CXX, else c++, g++ or
    clang++, on the PATH (None: either is missing). torch.compile needs the C++ one too."""
    found = [next((shutil.which(n) for n in names if n and shutil.which(n)), None)
             for names in ((os.environ.get("CC"), "cc", "gcc", "clang"),
                           (os.environ.get("CXX"), "c++", "g++", "clang++"))]
    return None if None in found else (found[0], found[1])


FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def sources() -> list[Path]:
    """The loops' C sources: every .c file of csrc/ (a family of kernels each: f32.c, int8.c,
    int4.c, attention.c, layer.c) and .h file (common.h, the helpers they share), by name."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def kept(flags: list[str], namespace: str = "tinyllm") -> Path | None:
    """Where the kernels built with these flags are kept in the cache directory, named by a
    hash of the sources (sources()' names and bytes, in their order, then ops.cpp), the flags,
    the compilers and torch's version (None: no compilers)."""
    found = compilers()
    if found is None:
        return None
    key = b"\0".join([*(part for p in sources() for part in (p.name.encode(), p.read_bytes())),
                      (CSRC / "ops.cpp").read_bytes(),
                      *(s.encode() for s in (*found, *flags, namespace, torch.__version__))])
    return cache_dir() / "kernels" / f"{namespace}-{hashlib.sha256(key).hexdigest()[:16]}.so"


def build(flags: list[str], namespace: str = "tinyllm"):
    """The kernels compiled with these C flags and bound as operators of torch.ops.namespace,
    once: each C file of csrc/ to its own object, then their bindings csrc/ops.cpp (C++ against
    torch's headers, about ten seconds) linked with the objects into one library, kept under
    the cache directory by a hash of the sources, the flags, the compilers and torch's version
    (kept()), so a second process loads it in milliseconds -> torch.ops.namespace, or None
    where they do not compile. A namespace is bound once a process."""
    found, path = compilers(), kept(flags, namespace)
    if found is None:
        return None
    cc, cxx = found
    cs, cpp = [p for p in sources() if p.suffix == ".c"], CSRC / "ops.cpp"
    if not path.is_file():
        print(f"tinyllm: compiling the C kernels ({' '.join(flags)}), once for this machine: "
              f"about ten seconds", file=sys.stderr)
        torch_dir = os.path.dirname(torch.__file__)
        openmp = ["-fopenmp"] if "-fopenmp" in flags else []
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            objs = [os.path.join(tmp, f"{c.stem}.o") for c in cs]  # a family's object each
            out = os.path.join(tmp, "kernels.so")
            steps = [[cc, *flags, "-fPIC", "-c", str(c), "-o", obj] for c, obj in zip(cs, objs)]
            steps.append([cxx, "-O2", "-std=c++17", "-w", "-fPIC", "-shared", str(cpp), *objs,
                          "-o", out, *openmp, f"-DTINYLLM_NS={namespace}",
                          f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                          f"-I{torch_dir}/include", f"-L{torch_dir}/lib", "-lc10",
                          "-ltorch_cpu", f"-Wl,-rpath,{torch_dir}/lib", "-lm"])
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True)
                if done.returncode != 0:
                    FAILURES.append(f"{' '.join(flags)}: {done.stderr.strip()[-300:]}")
                    return None
            shutil.move(out, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)  # whole, even with a neighbour
    try:
        torch.ops.load_library(str(path))
    except OSError:
        return None
    for name in OPS:
        torch.library.register_fake(f"{namespace}::{name}")(_fake(name))
    return getattr(torch.ops, namespace)


def turned_off() -> bool:
    """Whether $TINYLLM_NO_C_KERNELS=1 turns the kernels off (PyTorch's operations run)."""
    return os.environ.get("TINYLLM_NO_C_KERNELS") == "1"


@cache
def library():
    """The kernels for this machine, as torch.ops.tinyllm: the first of FLAGS that compiles
    (-march=native: the machine's own vector instructions; OpenMP where the compiler has it),
    or None (no compilers, none compiled: a warning says why; or $TINYLLM_NO_C_KERNELS=1)."""
    if turned_off():
        return None
    ops = next((ops for ops in map(build, FLAGS) if ops is not None), None)
    if ops is None:
        warnings.warn("tinyllm: the C kernels did not compile here, so PyTorch's products run "
                      "instead: " + (FAILURES[-1] if FAILURES else "no C and C++ compilers"),
                      stacklevel=2)
    return ops


def why_not_built() -> str:
    """Why the kernels are not built here, in one line: turned off, what the compiler said
    last (its last line), or that there are no compilers."""
    if turned_off():
        return "$TINYLLM_NO_C_KERNELS=1 turns them off"
    if not FAILURES:
        return "no C and C++ compilers (cc, gcc or clang and c++, g++ or clang++, or $CC, $CXX)"
    flags, _, said = FAILURES[-1].partition(": ")
    return f"the compiler said, with {flags}: {(said.strip().splitlines() or [''])[-1]}"


_built: bool | None = None  # available()'s answer, once known
_building = threading.Lock()  # held while the answer is found (a build takes seconds)
_builder: threading.Thread | None = None  # the thread that builds them for available(False)


def available(wait: bool = True) -> bool:
    """Whether the kernels are built here, built first where they are not (about ten seconds
    of the compilers, once a machine). With wait=False a caller does not wait for the
    compilers: kernels already in the cache load now, else a thread of their own builds them
    and the answer is False until it is done (a step that asks runs PyTorch's operations
    meanwhile). Asked first outside compiled code (a QuantLinear asks when it is made), the
    answer is then a module global that torch.compile reads as a constant, tracing no
    compiler run."""
    global _builder
    if _built is None:
        if not wait and (_builder is not None or not loads_now()):
            if _builder is None:
                _builder = threading.Thread(target=_answer, name="c-kernels", daemon=True)
                _builder.start()
            return False
        _answer()
    return _built


def _answer() -> None:
    global _built
    with _building:
        if _built is None:
            _built = library() is not None


def loads_now() -> bool:
    """Whether library() answers without a compiler: the kernels are in the cache, or turned
    off, or there are no compilers."""
    return turned_off() or (path := kept(FLAGS[0])) is None or path.is_file()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo's first 'flags' line: avx2,
    avx512_vnni, avx_vnni, ...), or an empty set where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def integer_path(flags: set[str] | None = None) -> str:
    """The instructions the integer products (int8_gemv, int4_gemv, int8g_gemv) multiply with
    in the machine's own build (-march=native): 'AVX-512 VNNI' (dpbusd on 256-bit vectors),
    'AVX-VNNI' (the same instruction without AVX-512), 'AVX2' (maddubs and madd) or 'plain C'
    (the loops the compiler vectorizes). Each gives the same integers, so the same outputs bit
    for bit; the paths differ in speed. flags: cpu_flags() by default."""
    flags = cpu_flags() if flags is None else flags
    if not flags:                            # no /proc/cpuinfo: what torch's build says
        return "AVX2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") \
            else "plain C"
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "AVX-512 VNNI"
    if "avx_vnni" in flags:
        return "AVX-VNNI"
    return "AVX2" if {"avx2", "fma", "f16c"} <= flags else "plain C"


def int8_gemv(x: Tensor, q: list[Tensor], scale: list[Tensor], ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32, each W_i = q[i]
    (N_i, K) int8 times scale[i] (N_i, 1) float16: the products of layers that read the same
    x, in one call, with each row of x quantized to int8 once; each one quant.int8_matmul's
    result, bit for bit. CPU tensors, the weights contiguous; ops: a build() of the kernels
    (None: library())."""
    return (ops or library()).int8_gemv(x, q, scale)


def int4_gemv(x: Tensor, q: list[Tensor], scale: list[Tensor], zero: list[Tensor],
              ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32 for 4-bit weights
    W_i held as quant.dequantize reads them (q[i] (N_i, G, h) uint8, K = 2 h G; scale[i] and
    zero[i] (N_i, G) float16), each group of x quantized to int8 once:
    F.linear(quant.rounded_activations(x, 2 h), W_i) up to the order of additions.
    CPU tensors, the weights contiguous; ops: a build() of the kernels (None: library())."""
    return (ops or library()).int4_gemv(x, q, scale, zero)


def int8g_gemv(x: Tensor, q: list[Tensor], scale: list[Tensor], ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32 for 8-bit weights
    in groups (GGUF's Q8_0): W_i = q[i] (N_i, K) int8 times scale[i] (N_i, G) float16, a scale
    per group of K / G, each group of x quantized to int8 once:
    F.linear(quant.rounded_activations(x, K / G), W_i) up to the order of additions.
    CPU tensors, the weights contiguous; ops: a build() of the kernels (None: library())."""
    return (ops or library()).int8g_gemv(x, q, scale)


def float_gemv(x: Tensor, w: list[Tensor], ops=None) -> Tensor:
    """x (M, K) float32 @ [W_1; W_2; ...]^T -> (M, N_1 + N_2 + ...) float32 for float32
    weights W_i (N_i, K): F.linear's product up to the order of additions, the same order for
    any M. CPU tensors, the weights contiguous; ops: a build() of the kernels (None:
    library())."""
    return (ops or library()).float_gemv(x, w)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor,
                     write: Tensor, read: Tensor, head_stride: int, mask: Tensor,
                     ops=None) -> Tensor:
    """A decode step's attention in one layer, reading the cache where it lies: the new keys
    and values k, v (B, n_kv, 1, hd) are written to rows write (B, n_kv) of keys and values
    (a layer's cache: contiguous rows of hd values), then the g query heads of each KV head h,
    q (B, n_kv, g, hd), attend to the W keys at rows read (B, W) + h * head_stride, with the
    additive mask (B, W) (-inf: hidden) -> y (B, n_kv, g, hd): scaled_dot_product_attention's
    result up to the order of additions, each row's the same in any batch. float32 or float64,
    on the CPU; an index outside the cache raises IndexError and writes nothing."""
    return (ops or library()).decode_attention(q, k, v, keys, values, write, read, head_stride,
                                               mask)


def layers(tensors: list[Tensor], quantized: bool, n_heads: int, head_dim: int, eps: float,
           ops=None):
    """The decoder layers as decode_layers reads them, checked once and held: tensors are each
    layer's nine weights in decode_layer's order (float32 or float64, contiguous, on the CPU),
    or with quantized each layer's two norms (float32) and the q, scale and zero of its seven
    products (q, k, v, o, gate, up, down; zero an empty tensor where a weight has none) as
    QuantLinear keeps them, q, k and v of one kind, gate and up of one kind. A wrong dtype,
    shape or layout raises, naming the layer and the weight."""
    ops = ops or library()
    return getattr(torch.classes, ops.name).Layers(list(tensors), quantized, n_heads, head_dim,
                                                    eps)


def decode_layers(x: Tensor, stack, cos: Tensor, sin: Tensor, keys: list[Tensor],
                  values: list[Tensor], write: Tensor, read: Tensor, head_stride: int,
                  mask: Tensor, ops=None) -> Tensor:
    """The decode step of every layer of `stack` (layers()) in one call: the residual stream x
    (M, d) of M rows, one new token each -> the last layer's output (M, d), what the model's
    Blocks compute in turn (each its norms, q, k and v, RoPE by cos and sin (M or 1 rows of
    hd), decode_attention in layer l's cache keys[l] and values[l], the output projection, the
    SwiGLU MLP, both residuals) up to the order of additions. The cache's other arguments are
    decode_attention's, the same for every layer. An index outside the cache raises
    IndexError and writes nothing."""
    return (ops or library()).decode_layers(x, stack, cos, sin, keys, values, write, read,
                                            head_stride, mask)


def decode_layer(x: Tensor, w: list[Tensor], cos: Tensor, sin: Tensor, keys: Tensor,
                 values: Tensor, write: Tensor, read: Tensor, head_stride: int, mask: Tensor,
                 n_heads: int, eps: float, ops=None) -> Tensor:
    """decode_layers for one layer of float weights w: [input norm, q, k, v, o, post-attention
    norm, gate, up, down], contiguous, in x's dtype (float32 or float64, on the CPU)."""
    stack = layers(w, False, n_heads, cos.size(-1), eps, ops)
    return decode_layers(x, stack, cos, sin, [keys], [values], write, read, head_stride, mask,
                         ops)


def decode_layer_q(x: Tensor, norms: list[Tensor], q: list[Tensor], scale: list[Tensor],
                   zero: list[Tensor], cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                   write: Tensor, read: Tensor, head_stride: int, mask: Tensor, n_heads: int,
                   eps: float, ops=None) -> Tensor:
    """decode_layers for one layer of quantized products, in float32: norms [input norm,
    post-attention norm] (d) float32; q, scale, zero: the seven products' (q, k, v, o, gate, up,
    down) as QuantLinear keeps them. Each product is the call a QuantLinear's own C product
    makes (int8_gemv, int4_gemv or int8g_gemv, by its layout), bit for bit."""
    stack = layers([*norms, *q, *scale, *zero], True, n_heads, cos.size(-1), eps, ops)
    return decode_layers(x, stack, cos, sin, [keys], [values], write, read, head_stride, mask,
                         ops)


def _fake(name: str):
    """What an operator returns, for torch.compile and make_fx to trace: (M, N_1 + N_2 + ...)
    for a product, q's shape for attention, x's for a layer."""
    if name in ("decode_attention", "decode_layers"):
        return lambda x, *rest: torch.empty_like(x)
    return lambda x, q, *rest: x.new_empty((x.size(0), sum(t.size(0) for t in q)))


OPS = ("float_gemv", "int8_gemv", "int4_gemv", "int8g_gemv", "decode_attention",
       "decode_layers")
