"""Step 13 - the decode step compiled in pieces, split at attention.

vLLM compiles its models piecewise: the graph is split at attention, which stays a call of its
own, and each piece between two attentions is compiled. `PiecewiseDecoder(model)` does that here
(the continuous engine's decoder="pieces", on any cache). A decode step runs three kinds of
compiled piece: `before` (a layer's norm, q, k and v projections, RoPE), `between` (the rest of
a layer, then the next layer's `before`) and `last` (the rest of the last layer, the final norm,
the head). The cache's update and the attention stay eager between them (`Attention.decode`).
A piece is compiled once for all the layers, their weights as inputs: one program for each
power of two of rows (a batch is padded up), on first use or ahead with `warm_up(max_rows)`. A
server compiles the buckets in a thread while it serves (`compile_next`), and with
`eager_until_compiled` a step whose bucket is not compiled yet runs the model's eager step. A
step of more than one token a row runs the model as it is. A program is traced with make_fx
and compiled by TorchInductor directly (`program`), without torch.compile's guards. The pieces
compute what the layer computes, up to the order of additions in the fused loops.
"""

import time
import weakref
from itertools import chain

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from tinyllm.core.model import Transformer, apply_rope
from tinyllm.core.parts import DecodeStep
from tinyllm.ext.quant import padded_rows, projections


def before(block, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The first piece of a layer: x (B, 1, d) -> q (B, H, 1, hd), k and v (B, n_kv, 1, hd),
    RoPE applied."""
    attn, B = block.self_attn, x.size(0)
    h, hd = block.input_layernorm(x), attn.head_dim
    q, k, v = projections(h, [attn.q_proj, attn.k_proj, attn.v_proj])   # one call in C
    q = q.view(B, 1, attn.n_heads, hd).transpose(1, 2)
    k = k.view(B, 1, attn.n_kv_heads, hd).transpose(1, 2)
    v = v.view(B, 1, attn.n_kv_heads, hd).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def after(block, x: Tensor, y: Tensor) -> Tensor:
    """The rest of a layer: the residual stream x (B, 1, d) and attention's output y
    (B, H, 1, hd) -> the layer's output (B, 1, d). H * hd need not be d: o_proj maps it."""
    y = y.transpose(1, 2).reshape(x.size(0), 1, -1)                         # (B, 1, H * hd)
    x = x + block.self_attn.o_proj(y)
    mlp = block.mlp                                       # SwiGLU, gate and up in one call
    gate, up = projections(block.post_attention_layernorm(x), [mlp.gate_proj, mlp.up_proj])
    return x + mlp.down_proj(F.silu(gate) * up)


def between(block, following, x: Tensor, y: Tensor, cos: Tensor, sin: Tensor):
    """The piece from one layer's attention to the next's: after(block) then before(following)
    -> (the residual stream (B, 1, d), the next q, k, v)."""
    x = after(block, x, y)
    return (x, *before(following, x, cos, sin))


def last(block, norm, head, x: Tensor, y: Tensor) -> Tensor:
    """The piece after the last attention: after(block), the final norm, the head -> logits
    (B, 1, V)."""
    return head(norm(after(block, x, y)))


def padded(t: Tensor, B: int) -> Tensor:
    """t with its rows padded to a power of two when they are the batch's B rows (a (1, ...)
    tensor, shared by the rows, as it is)."""
    return padded_rows(t) if t.size(0) == B else t


def unpadded(attend, B: int):
    """attend(block, q, k, v) on the first B rows of q, k and v (the batch's, the rest padding
    to a power of two), its output y padded back to as many rows."""
    return lambda block, q, k, v: padded_rows(attend(block, q[:B], k[:B], v[:B]))


def tensors(module: nn.Module) -> list[Tensor]:
    """A module's parameters and buffers, in named order, as plain tensors: what a program
    takes for the module."""
    return [t.detach() for _, t in chain(module.named_parameters(), module.named_buffers())]


def layout(t: Tensor) -> tuple:
    """What a compiled program assumes of an input tensor: shape, strides, dtype, device."""
    return t.shape, t.stride(), t.dtype, t.device


class Piece(nn.Module):
    """piece(*modules, *inputs) as a module: what functional_call runs on given tensors."""

    def __init__(self, piece, modules: list[nn.Module]):
        super().__init__()
        self.piece, self.parts = piece, nn.ModuleList(modules)

    def forward(self, *inputs):
        return self.piece(*self.parts, *inputs)


def program(piece, modules: list[nn.Module], args: list[Tensor]):
    """piece(*modules, *args) compiled into a program of tensors alone: program(*tensors(m)
    for each module, *args) -> what the piece returns. make_fx traces the piece on these
    modules and inputs into one graph of PyTorch operations, and TorchInductor compiles the
    graph (a few seconds; a second process finds it in TorchInductor's cache). A call checks
    nothing, neither Dynamo's guards nor TorchInductor's asserts of each input's shape: the
    program serves modules of these shapes and settings (any layer of the model, which
    PiecewiseDecoder checks once) and contiguous inputs of these shapes."""
    held = Piece(piece, modules)
    names = [f"parts.{i}.{name}" for i, m in enumerate(modules)
             for name, _ in chain(m.named_parameters(), m.named_buffers())]

    def run(*flat):
        return functional_call(held, dict(zip(names, flat)), tuple(flat[len(names):]))

    example = [t for m in modules for t in tensors(m)] + list(args)
    graph = make_fx(run)(*example)
    # TorchInductor files a compiled graph in its cache under the graph and the shapes of the
    # tracing context torch.compile would have opened; called directly there is none, and it
    # skips its cache. A context of its own with the inputs as fake tensors of fixed shapes
    # (the same program) lets the next process load the program instead of generating it.
    fake = FakeTensorMode(shape_env=ShapeEnv())
    with tracing(TracingContext(fake)):
        return torch._inductor.compile(graph, [fake.from_tensor(t, static_shapes=True)
                                               for t in example], {"size_asserts": False})


PROGRAMS: "weakref.WeakKeyDictionary[Transformer, dict]" = weakref.WeakKeyDictionary()
"""Each model's compiled programs in this process, (piece, rows) -> program: every decoder of
the model shares them, and they go with the model."""


class PiecewiseDecoder(DecodeStep):
    """A model's decode step in compiled pieces: decoder(idx (B, 1), cache) -> (logits
    (B, 1, V), None), what model(idx, cache=cache) returns. The model itself is not changed:
    its other passes (prefill, chunks, verification) stay eager. The programs are compiled for
    the model as it is at their first use (its layers' kernels included), in the process that
    uses them: a decoder sent to the server's engine process compiles there."""

    compiles = compiles_later = True

    def __init__(self, model: Transformer, max_rows: int = 1):
        self.model, self.max_rows = model, max_rows     # the rows warm_up compiles for
        self.eager_until_compiled = False   # an uncompiled bucket's step: eager, not compiled now
        self._ready = False

    def __getstate__(self):                             # the programs stay in this process
        return {"model": self.model, "max_rows": self.max_rows, "_ready": False,
                "eager_until_compiled": self.eager_until_compiled}

    def buckets(self, max_rows: int | None = None) -> list[int]:
        """The rows a program is compiled for, up to max_rows (default: the decoder's): 1, 2,
        4, ..., the power of two that holds max_rows."""
        max_rows = max_rows or self.max_rows
        return sorted({1 << (b - 1).bit_length() for b in range(1, max_rows + 1)})

    def compiled(self, rows: int) -> bool:
        """Whether the pieces are compiled for this bucket of rows."""
        programs = PROGRAMS.get(self.model, {})
        return all((piece, rows) in programs for piece in (before, between, last))

    def compile_next(self) -> tuple[int, float] | None:
        """Compile the smallest bucket of the decoder's that is not compiled yet -> (its rows,
        the seconds it took), or None when every bucket is (and then the steps stop asking
        whether theirs is: eager_until_compiled goes off)."""
        rows = next((r for r in self.buckets() if not self.compiled(r)), None)
        if rows is None:
            self.eager_until_compiled = False
            return None
        return rows, self.warm_up(rows, only=rows)

    def _prepare(self) -> None:
        m = self.model
        self.programs = PROGRAMS.setdefault(m, {})
        held = [tensors(block) for block in m.layers]
        for i, layer in enumerate(held):               # one program serves every layer
            if [layout(t) for t in layer] != [layout(t) for t in held[0]]:
                raise ValueError(f"layer {i}'s weights differ from layer 0's in shape, dtype "
                                 f"or layout: the pieces compile one program for all layers")
        self.held = {"before": held[0], "last": held[-1] + tensors(m.norm) + tensors(m.lm_head),
                     "between": [a + b for a, b in zip(held, held[1:])]}
        self.layers = list(m.layers)        # a list: a ModuleList's [i] costs microseconds
        self._ready = True

    def _run(self, piece, modules: list[nn.Module], held: list[Tensor], *args: Tensor):
        """piece(*modules, *args) by its program for these rows (compiled now if it is the
        first), the modules' tensors held given."""
        key, args = (piece, args[0].size(0)), [a.contiguous() for a in args]
        run = self.programs.get(key)
        if run is None:
            run = self.programs[key] = program(piece, modules, args)
        return run(*held, *args)

    @torch.no_grad()
    def warm_up(self, max_rows: int | None = None, progress=None, only: int | None = None) -> float:
        """Compile the pieces now for every bucket of rows up to max_rows (default: the
        decoder's, its engine's slots) (1, 2, 4, ...), or for the bucket `only`, on zeros, so
        that no request waits for a compilation -> the seconds it took. progress(rows,
        seconds), if given, hears of each bucket as it is compiled."""
        m, attn = self.model, self.model.layers[0].self_attn
        p = m.embed_tokens.weight
        t0 = time.perf_counter()
        for rows in [only] if only else self.buckets(max_rows):
            t = time.perf_counter()
            x = p.new_zeros(rows, 1, m.cfg.d_model)                              # (B, 1, d)
            cos, sin = (p.new_zeros(rows, 1, 1, attn.head_dim) for _ in "cs")  # (B, 1, 1, hd)
            self.pieces(x, cos, sin, lambda block, q, k, v: torch.zeros_like(q))
            if progress is not None:
                progress(rows, time.perf_counter() - t)
        return time.perf_counter() - t0

    def pieces(self, x: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        """The layers from the embedded tokens x (B, 1, d) to the logits: the compiled pieces
        on the rows padded with zeros to a power of two (a program for 1, 2, 4, 8, ... rows),
        attend(block, q, k, v) -> y on the B rows between them."""
        if not self._ready:
            self._prepare()
        m, B, held, layers = self.model, x.size(0), self.held, self.layers
        x, cos, sin = padded(x, B), padded(cos, B), padded(sin, B)
        if x.size(0) > B:                                 # the padding rows skip attention
            attend = unpadded(attend, B)
        q, k, v = self._run(before, [layers[0]], held["before"], x, cos, sin)
        for i, pair in enumerate(held["between"]):
            y = attend(layers[i], q, k, v)
            x, q, k, v = self._run(between, [layers[i], layers[i + 1]], pair, x, y, cos, sin)
        y = attend(layers[-1], q, k, v)
        logits = self._run(last, [layers[-1], m.norm, m.lm_head], held["last"], x, y)
        return logits[:B]

    @torch.no_grad()
    def __call__(self, idx: Tensor, cache) -> tuple[Tensor, None]:
        m = self.model
        if self.eager_until_compiled and not self.compiled(1 << (idx.size(0) - 1).bit_length()):
            return m(idx, cache=cache)                  # (B, 1, V), None: the eager step
        cos, sin = m.rope(cache.begin_step(1).to(idx.device))             # (B, 1, 1, hd)
        logits = self.pieces(m.embed_tokens(idx), cos, sin,
                             lambda block, q, k, v: block.self_attn.decode(q, k, v, cache))
        cache.end_step()
        return logits, None                                               # (B, 1, V)
